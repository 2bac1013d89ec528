"""``opentinker serve``: one long-lived scheduler that many jobs share.

The service is a :class:`~opentinker.engine.service.SchedulerService` with tenants
(:mod:`opentinker.engine.tenants`) and, beside it, the OpenAI-compatible HTTP endpoint
(:mod:`opentinker.serve.openai_api`). It writes a *service file*
(:class:`~opentinker.control.attach.ServiceInfo`) with its bus endpoint, its HTTP address, its
model and its owner's bus credentials; a job attaches to it through
:func:`opentinker.control.attach.attach`.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from opentinker.bus.auth import Credentials, run_secret, run_user
from opentinker.control.attach import (
    SERVICE_FILE,
    ServiceInfo,
    home,
    opened_credentials,
    owner_credentials,
)

log = logging.getLogger(__name__)


class ServiceCore:
    """What a service keeps where its model is: the scheduler with tenants, the saved adapters
    it serves, and the job queue. Made in the serve process, or in a Ray actor (``serve
    --ray``: :class:`~opentinker.control.component.Component` kind ``service``), whose start
    returns the scheduler's endpoint."""

    def __init__(self, model_path: str, device: str = "cpu", service_file: str = "", budget_mb: float = 0.0,
                 adapters: dict[str, str] | None = None, owner_priority: float = 1.0, bus_host: str = "",
                 curve: dict[str, str] | None = None, out_roots: list[str] | None = None, **scheduler: Any) -> None:
        from opentinker.serve.queue import check_budget_mb

        check_budget_mb(budget_mb)
        self.out_roots = out_roots
        """Where queued runs' ``out_dir`` may lie (default: ``runs/`` beside the service file)."""
        self.model_path, self.device = model_path, device
        self.service_file = Path(service_file or home() / SERVICE_FILE)
        self.budget_mb = budget_mb
        self.adapters = dict(adapters or {})
        self.scheduler_args = scheduler
        self.owner_priority = owner_priority
        self.bus_host = bus_host
        """Where the bus binds (``""``: 127.0.0.1); anything but loopback needs ``curve``."""
        self.curve = curve
        """``server_public``, ``server_secret``, ``owner_public``, ``owner_secret`` (Z85): the bus on
        CURVE, accepting the owner's key and each running job's (None: PLAIN)."""
        self.scheduler: Any = None
        self.queue: Any = None

    def start(self) -> str:
        from opentinker.bus import LOOPBACK
        from opentinker.bus.common import CurveKeys, tcp_endpoint
        from opentinker.engine.service import SchedulerService
        from opentinker.engine.tenants import Tenants

        c = self.curve
        keys = CurveKeys(public=c["server_public"].encode(), secret=c["server_secret"].encode()) if c else None
        host = self.bus_host
        endpoint = tcp_endpoint(host) if host else LOOPBACK
        self.scheduler = SchedulerService(self.model_path, device=self.device, endpoint=endpoint, curve_keys=keys,
                                   tenants=Tenants(self.owner_priority, owner_curve=c["owner_public"] if c else ""),
                                   **self.scheduler_args)
        endpoint = self.scheduler.start()
        try:
            self._load_adapters(endpoint)
            self._start_queue()
        except BaseException:
            self.stop()
            raise
        return endpoint

    def _start_queue(self) -> None:
        import asyncio

        from opentinker.serve.queue import JobQueue, read_model_config
        from protocols.messages import (
            CancelQueued,
            CloseJob,
            ListQueue,
            OpenJob,
            QueueList,
            SubmitJob,
        )

        s = self.scheduler

        def open_job(name: str, roots: list[str], read_roots: list[str], priority: float) -> Credentials:
            opened = s.loop.run(s._job_control(OpenJob(name=name, roots=roots, read_roots=read_roots,
                                                       priority=priority), None), 60)
            return opened_credentials(opened, self.curve["server_public"] if self.curve else "")

        def close_job(job: str) -> None:
            s.loop.run(s._job_control(CloseJob(job=job), None), 300)

        budget = self.budget_mb * 2**20 if self.budget_mb > 0 else _half_the_memory()
        q = self.queue = JobQueue(self.service_file.parent / f"jobs-{os.getpid()}", self.service_file,
                                  read_model_config(self.model_path), int(budget), open_job, close_job,
                                  out_roots=self.out_roots)

        def listing() -> QueueList:
            return QueueList(entries=q.listing(), budget_mb=q.budget / 2**20, used_mb=q.used() / 2**20)

        # The queue opens and closes tenants on the scheduler's loop: its calls run in threads.
        s.services = {
            SubmitJob: lambda m: asyncio.to_thread(q.submit, m.config, m.priority, m.memory_mb, m.eval,
                                                   self.model_path, m.infer),
            CancelQueued: lambda m: asyncio.to_thread(q.cancel, m.id),
            ListQueue: lambda _m: asyncio.to_thread(listing),
        }

    def _load_adapters(self, endpoint: str) -> None:
        from opentinker.bus.sync import SyncClient
        from protocols.messages import LoadAdapter

        if not self.adapters:
            return
        with SyncClient(endpoint, "serve", credentials=owner_credentials(self.curve)) as c:
            for name, path in self.adapters.items():
                c.request(LoadAdapter(path=os.path.abspath(path), name=name, trainable=False), 600)

    def stop(self) -> None:
        if self.queue is not None:
            self.queue.stop()
            self.queue = None
        if self.scheduler is not None:
            self.scheduler.stop()
            self.scheduler = None


class Service:
    """A shared scheduler with its HTTP endpoint and service file.

    Args:
        model: a model spec (``smollm2-135m``, ``tiny-random``, a folder, a hub id).
        http_port: the OpenAI-compatible endpoint's port (0: the OS picks; ``None``: no HTTP).
        http_host: where it binds.
        api_key: the key HTTP clients must send; ``None``: one is made at start. Either way it
            is written to the service file (mode 0600), so only this user's processes read it.
        api_keys: further keys, each a client of its own for the endpoint's per-client bounds.
        adapters: saved adapters to load at start, name -> folder (served as model names).
        service_file: where to write the service file (default :func:`home`).
        budget_mb: the memory the job queue may fill with running jobs (estimated per job, its
            processes too, :func:`~opentinker.serve.queue.estimate_bytes`); 0: half of this
            machine's memory. Jobs also start only while the machine's free memory holds them.
        out_roots: the folders a queued run's ``out_dir`` may lie in (default: ``runs/`` beside
            the service file; a relative ``out_dir`` lies in the first).
        ray: run the scheduler and the queue in a Ray actor (``"local"``: a Ray instance
            started here on 127.0.0.1; else the address of a running cluster, ``auto`` or
            ``host:port``), placed on a GPU when ``device`` is CUDA; ``""``: in this process.
        bus_host: where the scheduler's bus binds (default 127.0.0.1); an address other machines
            reach puts the bus on CURVE (keys made at start, in the service file), so that
            jobs on those machines can attach with a copy of the service file.
        bus_curve: CURVE on loopback too.
        scheduler: further :class:`~opentinker.engine.service.SchedulerService` arguments.
    """

    def __init__(self, model: str = "smollm2-135m", *, device: str = "cpu", http_host: str = "127.0.0.1",
                 http_port: int | None = 0, api_key: str | None = None, api_keys: Sequence[str] = (), adapters: dict[str, str] | None = None,
                 service_file: Path | None = None, budget_mb: float = 0.0, ray: str = "", bus_host: str = "127.0.0.1",
                 bus_curve: bool = False, out_roots: Sequence[str] = (), **scheduler: Any) -> None:
        from opentinker.bus.common import is_loopback, tcp_endpoint
        from opentinker.serve.queue import check_budget_mb

        check_budget_mb(budget_mb)

        if bus_host in ("0.0.0.0", "::", "*", ""):  # refused: not an address to connect to
            raise ValueError(f"--bus-host {bus_host!r}: give the address other machines reach this one at (jobs "
                             "connect to the address the service file names)")
        try:
            loopback = is_loopback(tcp_endpoint(bus_host, 1))
        except ValueError as e:
            raise ValueError(f"--bus-host {bus_host!r}: {e}") from None
        self.curve: dict[str, str] | None = None
        if bus_curve or not loopback:
            import zmq

            server, owner = zmq.curve_keypair(), zmq.curve_keypair()
            self.curve = {"server_public": server[0].decode(), "server_secret": server[1].decode(),
                          "owner_public": owner[0].decode(), "owner_secret": owner[1].decode()}
        self.model = model
        self.device = device
        self.http_host, self.http_port, self.api_key, self.api_keys = http_host, http_port, api_key, list(api_keys)
        self.service_file = service_file or home() / SERVICE_FILE
        self.core_args = dict(device=device, service_file=str(self.service_file), budget_mb=budget_mb,
                              adapters=dict(adapters or {}), bus_host="" if bus_host == "127.0.0.1" else bus_host,
                              curve=self.curve, out_roots=[os.path.abspath(r) for r in out_roots] or None, **scheduler)
        self.ray = ray
        self.core: Any = None
        self.actor: Any = None
        self._started_ray = False
        self.http: Any = None
        self.info: ServiceInfo | None = None

    def start(self) -> ServiceInfo:
        from opentinker.engine.model_specs import resolve_model

        model_path = resolve_model(self.model)
        try:
            endpoint = self._start_ray(model_path) if self.ray else self._start_here(model_path)
            url = ""
            if self.http_port is not None:
                from opentinker.serve.openai_api import make_app, start_http

                # A shared service needs a key on loopback too: every local user reaches 127.0.0.1.
                self.api_key = self.api_key or secrets.token_urlsafe(32)
                app = make_app(endpoint, model_path, api_key=self.api_key, api_keys=self.api_keys,
                               credentials=owner_credentials(self.curve))
                self.http = start_http(app, host=self.http_host, port=self.http_port)
                url = self.http.url
            c = self.curve or {}
            self.info = ServiceInfo(endpoint=endpoint, model_path=model_path, user=run_user(),
                                    secret=run_secret().decode(), http=url, pid=os.getpid(), device=self.device,
                                    curve_server=c.get("server_public", ""), curve_public=c.get("owner_public", ""),
                                    curve_secret=c.get("owner_secret", ""), api_key=self.api_key or "")
            self.info.write(self.service_file)
        except BaseException:
            self.stop()
            raise
        return self.info

    def _start_here(self, model_path: str) -> str:
        self.core = ServiceCore(model_path, **self.core_args)
        return self.core.start()

    def _start_ray(self, model_path: str) -> str:
        import ray

        from opentinker.control.component import Component
        from opentinker.control.placement import init_ray

        self._started_ray = init_ray("" if self.ray == "local" else self.ray)
        gpus = 1 if self.device.startswith("cuda") else 0
        actor_cls = ray.remote(num_cpus=0, num_gpus=gpus)(Component)
        self.actor = actor_cls.remote("service", {"model_path": model_path, **self.core_args}, run_secret().decode())
        return ray.get(self.actor.start.remote(), timeout=600)

    def stop(self) -> None:
        if self.http is not None:
            self.http.stop()
            self.http = None
        if self.core is not None:
            self.core.stop()
            self.core = None
        if self.actor is not None:
            import ray

            try:
                ray.get(self.actor.stop.remote(), timeout=120)
            except Exception as e:  # noqa: BLE001 - stopping regardless
                log.warning("stopping the service actor: %s", e)
            ray.kill(self.actor)
            self.actor = None
        if self._started_ray:
            import ray

            ray.shutdown()
            self._started_ray = False
        if self.info is not None:
            try:  # only our own file: another service may have replaced it since
                if ServiceInfo.read(self.service_file).pid == os.getpid():
                    self.service_file.unlink()
            except (ValueError, OSError):
                pass
            self.info = None

    def wait(self) -> None:
        """Serve until SIGINT or SIGTERM."""
        done = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: done.set())
        while not done.wait(1.0):
            pass


def _half_the_memory() -> int:
    """Half of this machine's physical memory, in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
