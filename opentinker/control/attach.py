"""How a job finds a shared scheduler (``opentinker serve``) and opens itself there.

A service writes a *service file* (JSON, mode 0600 in a folder of mode 0700:
``$OPENTINKER_HOME/service.json``, by default ``~/.opentinker/service.json``) with its bus
endpoint, its HTTP address, its model and its owner's bus credentials. A job attached to it
(``opentinker run CONFIG --scheduler ADDRESS``, :func:`attach`) reads the file (only its user
can), opens itself as a job with the owner's credentials and from then on talks to the
scheduler only with the job's own: its adapters, folders and compute are its own, and closing
it (at the job's end, or when it fails) frees its adapters. A job the service's queue started
finds its credentials in ``$OPENTINKER_JOB`` (:func:`job_credentials`).

The service itself (:mod:`opentinker.serve.service`) writes the file; this module reads it,
so that the runtime, the client and the checks of a config reach a service without importing it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from opentinker.bus.auth import Credentials, run_secret, run_user
from opentinker.bus.common import RemoteError
from opentinker.bus.sync import SyncClient
from opentinker.config import ConfigError
from opentinker.files import write_atomic
from opentinker.logs import escape_controls
from protocols.messages import CloseJob, OpenJob

log = logging.getLogger(__name__)

JOB_ENV = "OPENTINKER_JOB"
HOME_ENV = "OPENTINKER_HOME"
SERVICE_FILE = "service.json"


def home() -> Path:
    """The folder of the service file: ``$OPENTINKER_HOME``, else ``~/.opentinker``."""
    return Path(os.environ.get(HOME_ENV) or Path.home() / ".opentinker")


@dataclass
class ServiceInfo:
    """What a job needs to attach to a service (the service file's content)."""

    endpoint: str
    """The scheduler's bus endpoint (``tcp://127.0.0.1:PORT``)."""
    model_path: str
    """The resolved base model folder: an attached job must name the same model."""
    user: str
    secret: str
    """The owner's bus credentials (they open and close jobs)."""
    http: str = ""
    """The OpenAI-compatible endpoint's base URL, ``""`` when not served."""
    pid: int = 0
    device: str = "cpu"
    started_at: float = field(default_factory=time.time)
    curve_server: str = ""
    """The scheduler's CURVE public key when its bus is on CURVE (``serve --bus-host``), with
    the owner's client pair (``curve_public``, ``curve_secret``); ``""``: PLAIN on loopback."""
    curve_public: str = ""
    curve_secret: str = ""
    api_key: str = ""
    """The key HTTP clients send (``Authorization: Bearer <api_key>``): made at start unless
    given, so that another local user, who cannot read this file, cannot reach the endpoint."""

    def credentials(self) -> Credentials:
        """The owner's: PLAIN, or its CURVE pair on a service on CURVE."""
        curve = (self.curve_public, self.curve_secret, self.curve_server) if self.curve_server else None
        return Credentials(self.user, self.secret, curve)

    def write(self, path: Path) -> None:
        """Write atomically, readable by this user only."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomic(path, json.dumps(asdict(self), indent=1), mode=0o600)

    @classmethod
    def read(cls, path: Path) -> ServiceInfo:
        """The service file at ``path``; ``ValueError`` naming the file when it is not one."""
        try:
            raw = json.loads(path.read_text())
            return cls(**{k: raw[k] for k in cls.__dataclass_fields__ if k in raw})
        except (OSError, ValueError, TypeError) as e:
            raise ValueError(f"{path}: not a readable service file ({type(e).__name__}: {e})") from None


def find_service(address: str) -> ServiceInfo:
    """The service at ``address``: a service file's path, or a bus endpoint that the service
    file in :func:`home` names. ``ValueError`` saying what to do when there is none."""
    if not address.startswith(("tcp://", "ipc://")):
        return ServiceInfo.read(Path(address).expanduser())
    path = home() / SERVICE_FILE
    if not path.is_file():
        raise ValueError(f"--scheduler {address}: no service file at {path} (start one with opentinker serve, or "
                         f"give the path of its service file, or set ${HOME_ENV})")
    info = ServiceInfo.read(path)
    if info.endpoint != address:
        raise ValueError(f"--scheduler {address}: the service in {path} is at {info.endpoint}")
    return info


@dataclass
class Attachment:
    """A job attached to a service: where its scheduler is and what its components present."""

    endpoint: str
    job: str
    credentials: Credentials
    owner: Credentials | None
    """Who closes the job (None: the service's queue, which opened it)."""
    closed: bool = False

    def close(self, timeout: float = 30.0) -> None:
        """Close the job on the service (its adapters are dropped); once."""
        if self.closed or self.owner is None:
            return
        self.closed = True
        try:
            with SyncClient(self.endpoint, "attach", credentials=self.owner, connect_timeout=timeout) as c:
                c.request(CloseJob(job=self.job), timeout)
        except Exception as e:  # noqa: BLE001 - the service may be gone; the job's end goes on
            log.warning("could not close job %s on %s: %s", self.job, self.endpoint, escape_controls(str(e)))


def owner_credentials(curve: dict[str, str] | None) -> Credentials | None:
    """What the service's own process presents to its scheduler: its own secret (``None``), or
    on CURVE the owner's pair (``curve``: :attr:`ServiceCore.curve`)."""
    if curve is None:
        return None
    return Credentials(run_user(), run_secret().decode(),
                       (curve["owner_public"], curve["owner_secret"], curve["server_public"]))


def opened_credentials(opened: Any, server_public: str) -> Credentials:
    """A job's credentials from its :class:`~protocols.messages.JobOpened`: its secret, and on
    a scheduler on CURVE (``server_public``) its key pair."""
    curve = (opened.curve_public, opened.curve_secret, server_public) if opened.curve_public else None
    return Credentials(opened.job, opened.secret, curve)


def attach(address: str, name: str, model_path: str, roots: list[str], read_roots: list[str],
           priority: float = 1.0, timeout: float = 30.0) -> Attachment:
    """Open a job named ``name`` on the service at ``address`` (see :func:`find_service`);
    :class:`~opentinker.config.ConfigError` (``runtime.scheduler``) when the service serves
    another model, cannot be reached, does not see the job's folders (a probe file the job
    writes in its first root, which the scheduler reads), or refuses the job."""
    info = find_service(address)
    given = job_credentials()
    if given is not None:  # started by the service's queue, which opened the job and will close it
        return Attachment(info.endpoint, given.user, given, None, closed=True)
    if os.path.realpath(info.model_path) != os.path.realpath(model_path):
        raise ConfigError("runtime.scheduler", f"{address}: the service serves {info.model_path}, this job's model "
                                               f"is {model_path}")
    owner = info.credentials()
    text = secrets.token_hex(16)
    probe = Path(roots[0]) / f".opentinker-probe-{text[:8]}" if roots else None
    try:
        if probe is not None:
            probe.write_text(text)
        with SyncClient(info.endpoint, "attach", credentials=owner, connect_timeout=timeout) as c:
            opened = c.request(OpenJob(name=name, roots=roots, read_roots=read_roots, priority=priority,
                                       probe=str(probe or ""), probe_text=text if probe else ""), timeout)
    except RemoteError as e:
        raise ConfigError("runtime.scheduler", f"{address}: {e.error.message}") from None
    except (TimeoutError, OSError) as e:
        raise ConfigError("runtime.scheduler", f"{address}: {e}") from None
    finally:
        if probe is not None:
            probe.unlink(missing_ok=True)
    return Attachment(info.endpoint, opened.job, opened_credentials(opened, info.curve_server), owner)


def job_credentials() -> Credentials | None:
    """The tenant a queued job's process runs as (``$OPENTINKER_JOB``: its credentials'
    :meth:`~opentinker.bus.auth.Credentials.pair` as JSON), if the queue started it."""
    raw = os.environ.get(JOB_ENV, "")
    if not raw:
        return None
    try:
        return Credentials.of(json.loads(raw))
    except (ValueError, TypeError, IndexError) as e:
        raise ValueError(f"${JOB_ENV}: not a job's credentials ({e})") from None
