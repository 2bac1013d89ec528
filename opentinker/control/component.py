"""A job's components: each one held by a :class:`Component`, in a Ray actor (one process per
component) or in the driver's process (``runtime.backend = "local"``), built from its kind and
keyword arguments; :func:`describe` names one in words, with its process and node, for the
:class:`ComponentDied` a dead one raises.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from typing import Any

import msgspec

from opentinker.bus.auth import run_curve, set_run_curve, set_run_secret
from opentinker.config import JobConfig
from protocols.messages import AdamParams

log = logging.getLogger(__name__)

_KINDS = {
    "scheduler": "opentinker.engine.service:SchedulerService",
    "env_runner": "opentinker.rollout.env_runner:EnvRunner",
    "learner": "opentinker.training.learner:Learner",
    "coordinator": "opentinker.control.coordinator:Coordinator",
    "service": "opentinker.serve.service:ServiceCore",
}


class ComponentDied(RuntimeError):
    """A component of the job stopped answering (its process died): the run cannot go on.
    ``names`` are the dead components' names in the job (``env_runner0``, ``learner_main``)."""

    def __init__(self, names: list[str], what: str, cause: BaseException) -> None:
        super().__init__(f"{what} stopped ({type(cause).__name__})")
        self.names = names
        self.run_dir = ""
        """The run's folder (set by :func:`opentinker.run.run_job`)."""


def node() -> tuple[str, str]:
    """The node a component runs on: its Ray node's IP address and id, else this host's name
    and ``""``."""
    try:
        import ray

        if ray.is_initialized():  # the address the node was started with (127.0.0.1 locally)
            node_id = ray.get_runtime_context().get_node_id()
            return next((n["NodeManagerAddress"] for n in ray.nodes() if n["NodeID"] == node_id), node_id), node_id
    except Exception as e:  # noqa: BLE001  (no Ray, or one shutting down: the host name will do)
        log.debug("no Ray node address (%s): using the host name", e)
    return socket.gethostname(), ""


def describe(name: str, where: dict[str, Any] | None = None) -> str:
    """A component's name in words, with its process and node: ``env runner 0 (pid 41, node
    127.0.0.1)``, ``the learner of policy main (...)``."""
    if name.startswith("env_runner"):
        text = f"env runner {name.removeprefix('env_runner')}"
    elif name.startswith("learner_"):
        text = f"the learner of policy {name.removeprefix('learner_')}"
    elif name.startswith("scheduler") and name != "scheduler":
        text = f"scheduler {name.removeprefix('scheduler')}"
    else:
        text = f"the {name}"
    if where:
        text += f" (pid {where.get('pid')}, node {where.get('node')})"
    return text


def _build(kind: str, kwargs: dict[str, Any]) -> Any:
    module, cls = _KINDS[kind].split(":")
    if kind == "coordinator":
        kwargs = dict(kwargs, cfg=msgspec.convert(kwargs["cfg"], JobConfig))
    if kind == "learner":
        kwargs = dict(kwargs, adam=msgspec.convert(kwargs["adam"], AdamParams))
    return getattr(importlib.import_module(module), cls)(**kwargs)


class Component:
    """Holds one component; the Ray actor class and the local backend both use it.

    ``bus_secret``: the driver's bus secret (:mod:`opentinker.bus.auth`), which an actor's
    sockets then present and accept; ``""`` in the driver's own process. ``bus_curve``: on a
    job with ``runtime.curve`` or a cluster, the run's CURVE pair and the host its servers
    bind, ``(public, secret, host)``: the actor's sockets use the pair (``host`` ``""``: its
    node's address)."""

    def __init__(self, kind: str, kwargs: dict[str, Any], bus_secret: str = "",
                 bus_curve: tuple[str, str, str] | None = None) -> None:
        if bus_secret:
            set_run_secret(bus_secret)
        self.pid = os.getpid()
        self.node, self.node_id = node()
        if bus_curve:
            public, secret, host = bus_curve
            set_run_curve((public, secret), host=host or (self.node if self.node_id else "127.0.0.1"))
        self.kind = kind
        self.obj = _build(kind, kwargs)
        self.calls = 0

    def start(self) -> Any:
        self.calls += 1
        return self.obj.start()

    def call(self, method: str, *args: Any) -> Any:
        self.calls += 1
        return getattr(self.obj, method)(*args)

    def info(self) -> dict[str, Any]:
        """Ray calls served so far (this one not counted), process id, node (address and Ray
        id), the bus's mechanism (``curve`` or ``plain``), bus counters."""
        counters = self.obj.counters() if hasattr(self.obj, "counters") and callable(self.obj.counters) else {}
        return {"calls": self.calls, "pid": self.pid, "node": self.node, "node_id": self.node_id,
                "bus": "curve" if run_curve() is not None else "plain", "counters": counters}

    def stop(self) -> None:
        self.obj.stop()
