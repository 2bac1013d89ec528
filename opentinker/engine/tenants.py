"""Jobs sharing one scheduler (``opentinker serve``): each job a tenant with its own adapter
names, folders and credentials.

A job is opened by the scheduler's own user (the service's owner, :class:`OpenJob`) and gets
a bus account: a user name (the job id) and a secret. Its components present them, so every
request the scheduler serves carries the job it came from (the peer's principal, set by
ZeroMQ's handshake, :meth:`opentinker.bus.server.Server.principal`), whatever names the
components give themselves. Requests are then read in the job's namespace:

=====================  ========================================================================
a job names            means
=====================  ========================================================================
``main`` (no ``/``)    its own adapter ``main``; stored as ``<job>__main`` in the registry
``other/main``         job ``other``'s adapter ``main``: it may sample, score and snapshot it
                       (given its name, as for evaluating against another job's agent), never
                       create, train, save, load over or drop it
nothing (``None``)     the bare base model
=====================  ========================================================================

Replies and listings name a job's adapters as the job does (``main``), and a job lists only
its own. The scheduler's own user sees every adapter, a job's as ``<job>/<adapter>`` (what the
HTTP endpoint offers as model names). A job's adapter paths must lie in its own folders
(``OpenJob.roots``). Closing a job drops its adapters and refuses its credentials from then on.
"""

from __future__ import annotations

import itertools
import re
import time
from dataclasses import dataclass, field

import msgspec

from opentinker.bus.auth import run_user
from protocols.messages import (
    AdapterInfo,
    AdapterList,
    CreateAdapter,
    DiscardGradients,
    DropAdapter,
    ForwardBackward,
    JobInfo,
    LoadAdapter,
    LogprobsRequest,
    Message,
    OptimStep,
    SampleRequest,
    SaveAdapter,
    SnapshotAdapter,
    ValuesRequest,
)

SEP = "/"
"""Between a job id and an adapter name in an adapter's full name."""
INTERNAL = "__"
"""The same in the registry's key (adapter names there are identifiers)."""

_READS: dict[type, tuple[str, ...]] = {
    SampleRequest: ("adapter",), LogprobsRequest: ("adapter",), ValuesRequest: ("adapter",),
    SnapshotAdapter: ("adapter",),
}
"""Fields naming an adapter a request only reads."""
_WRITES: dict[type, tuple[str, ...]] = {
    CreateAdapter: ("name",), DropAdapter: ("name",), SnapshotAdapter: ("name",), LoadAdapter: ("name",),
    ForwardBackward: ("adapter",), OptimStep: ("adapter",), SaveAdapter: ("adapter",),
    DiscardGradients: ("adapter",),
}
"""Fields naming an adapter a request makes, changes, drops or copies out."""


@dataclass
class Tenant:
    """One job on a shared scheduler."""

    job: str
    name: str
    secret: bytes
    roots: list[str]
    """Folders its ``SaveAdapter`` and ``LoadAdapter`` paths may lie in (resolved)."""
    read_roots: list[str]
    """Further folders its ``LoadAdapter`` may read."""
    priority: float = 1.0
    opened_at: float = field(default_factory=time.time)
    state: str = "running"


class Tenants:
    """The jobs of a shared scheduler, and the name mapping of their requests.

    ``accounts`` (user -> secret of every running job) is what the scheduler's bus server
    accepts besides its own user; it changes as jobs open and close. With ``owner_curve`` (the
    owner's CURVE public key, Z85: a scheduler on CURVE, reachable from other machines), each
    job gets a CURVE key pair too, and ``curve_users`` (public key -> user: the owner's, then
    every running job's) is what the server accepts instead."""

    def __init__(self, owner_priority: float = 1.0, owner_curve: str = "") -> None:
        self.owner_priority = owner_priority
        """The weight of the scheduler's own user (a service's HTTP endpoint) against the jobs."""
        self.jobs: dict[str, Tenant] = {}
        """Every job opened so far, by id (closed ones stay, for listings)."""
        self.accounts: dict[str, bytes] = {}
        self.curve_users: dict[str, str] | None = {owner_curve: run_user()} if owner_curve else None
        self._ids = itertools.count(1)

    def open(self, name: str, secret: bytes, roots: list[str], read_roots: list[str], priority: float) -> Tenant:
        """A new job named ``name``; its id is ``j<n>_<name's letters and digits>``."""
        if not (priority > 0 and priority <= 1e6):
            raise ValueError(f"OpenJob.priority must be in (0, 1e6], got {priority}")
        clean = re.sub(r"[^A-Za-z0-9]", "", name)[:32]
        job = f"j{next(self._ids)}" + (f"_{clean}" if clean else "")
        t = self.jobs[job] = Tenant(job, name, secret, roots, read_roots, priority)
        self.accounts[job] = secret
        return t

    def curve_pair(self, job: str) -> tuple[str, str]:
        """A fresh CURVE key pair for running ``job`` (Z85 public, secret), accepted as it."""
        import zmq

        assert self.curve_users is not None
        public, secret = (k.decode() for k in zmq.curve_keypair())
        self.curve_users[public] = self.running(job).job
        return public, secret

    def close(self, job: str) -> Tenant:
        t = self.running(job)
        t.state = "closed"
        self.accounts.pop(job, None)
        if self.curve_users is not None:  # its key, refused from now on
            for key in [k for k, user in self.curve_users.items() if user == job]:
                del self.curve_users[key]
        return t

    def running(self, job: str) -> Tenant:
        t = self.jobs.get(job)
        if t is None or t.state != "running":
            raise KeyError(f"no running job {job!r}")
        return t

    # ------------------------------------------------------------------------------- names

    def internal(self, name: str, tenant: str | None, write: bool) -> str:
        """The registry's key for adapter ``name`` as ``tenant`` (a job id; ``None``: the
        scheduler's own user) means it; ``ValueError`` for a write to another job's adapter,
        ``KeyError`` for an unknown job."""
        if SEP in name:
            job, _, short = name.partition(SEP)
            if job not in self.jobs:
                raise KeyError(f"unknown adapter {name!r}: no job {job!r} on this scheduler")
            if write and tenant is not None and job != tenant:
                raise ValueError(f"adapter {name!r} belongs to job {job!r}: job {tenant!r} may sample, score and "
                                 "snapshot it, not make, train, save, load over or drop it")
            return f"{job}{INTERNAL}{short}"
        if tenant is None:
            if self.owner_of(name) is not None:
                raise ValueError(f"adapter name {name!r} is in job {self.owner_of(name)!r}'s namespace: "
                                 f"name it {self.external(name, None)!r}")
            return name
        return f"{tenant}{INTERNAL}{name}"

    def owner_of(self, internal: str) -> str | None:
        """The job whose adapter the registry key ``internal`` is, or None (the owner's own)."""
        job, sep, _ = internal.partition(INTERNAL)
        return job if sep and job in self.jobs else None

    def external(self, internal: str, tenant: str | None) -> str:
        """The registry key ``internal`` named as ``tenant`` names it."""
        job = self.owner_of(internal)
        if job is None:
            return internal
        short = internal[len(job) + len(INTERNAL):]
        return short if job == tenant else f"{job}{SEP}{short}"

    def visible(self, internal: str, tenant: str | None) -> bool:
        """Whether ``tenant`` lists the adapter (a job lists its own; the owner, all)."""
        return tenant is None or self.owner_of(internal) == tenant

    def adapters_of(self, job: str, internals: list[str]) -> list[str]:
        return [n for n in internals if self.owner_of(n) == job]

    def qualify(self, msg: Message, tenant: str | None) -> Message:
        """``msg`` with every adapter name mapped to its registry key (see the module's table)."""
        changes = {}
        for fields, write in ((_READS.get(type(msg), ()), False), (_WRITES.get(type(msg), ()), True)):
            for f in fields:
                name = getattr(msg, f)
                if name:  # None or "": the base model
                    changes[f] = self.internal(name, tenant, write)
        return msgspec.structs.replace(msg, **changes) if changes else msg

    def unqualify(self, reply: Message, tenant: str | None) -> Message:
        """``reply`` with adapter names as ``tenant`` names them."""
        if isinstance(reply, AdapterInfo):
            return msgspec.structs.replace(reply, name=self.external(reply.name, tenant))
        if isinstance(reply, AdapterList):
            return AdapterList(adapters=[AdapterInfo(name=self.external(a.name, tenant), version=a.version)
                                         for a in reply.adapters if self.visible(a.name, tenant)])
        return reply

    def error_text(self, text: str, tenant: str | None) -> str:
        """An error message as ``tenant`` may read it: its own keys named as it names them,
        other jobs' adapters not listed."""
        if tenant is None:
            return text
        text = re.sub(r"; known: \[.*\]$", "", text)
        return text.replace(f"{tenant}{INTERNAL}", "")

    def info(self, t: Tenant, internals: list[str], compute_ms: float, contended_ms: float) -> JobInfo:
        return JobInfo(job=t.job, name=t.name, priority=t.priority, state=t.state,
                       adapters=[self.external(n, t.job) for n in self.adapters_of(t.job, internals)],
                       compute_ms=int(compute_ms), contended_ms=int(contended_ms), opened_at=t.opened_at)
