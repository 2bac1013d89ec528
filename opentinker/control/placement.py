"""Where a job's components run: Ray started or joined (:func:`init_ray`), CPU components dealt
to the live nodes in turn, each scheduler on a node with the resources it asks for; and which
scheduler holds which policy, when a job runs one scheduler per device
(``runtime.devices``).

A policy's adapter, its league snapshots, its training and every request that names one of
them go to one scheduler: a policy is never split. A policy with ``device`` set goes where it
says; the others are placed one by one, heaviest first, on the scheduler that holds the least
so far: first the fewest full-parameter copies (each one a whole model), then the fewest
adapters (a policy with a league counts its kept snapshots too), then the lowest index.
"""

from __future__ import annotations

import os
from typing import Any

from opentinker.bus.common import is_loopback
from opentinker.config import ConfigError, JobConfig


def scheduler_devices(cfg: JobConfig) -> list[str]:
    """The job's schedulers' devices, one per scheduler: ``runtime.devices``, else
    ``[model.device]``."""
    return list(cfg.runtime.devices) or [cfg.model.device]


def adapters_of(cfg: JobConfig, policy: str) -> int:
    """Adapters ``policy`` keeps on its scheduler at once: its own and its league's."""
    return 1 + (cfg.league.keep if cfg.league.snapshot_every else 0)


def place(cfg: JobConfig) -> dict[str, int]:
    """Policy name -> index of its scheduler in :func:`scheduler_devices`."""
    n = len(scheduler_devices(cfg))
    copies, adapters = [0] * n, [0] * n
    out: dict[str, int] = {}

    def put(name: str, full: bool, i: int) -> None:
        out[name] = i
        copies[i] += full
        adapters[i] += adapters_of(cfg, name)

    for p in cfg.policies:
        if p.device >= 0:
            put(p.name, p.kind == "full", p.device)
    free = sorted((p for p in cfg.policies if p.device < 0),
                  key=lambda p: (p.kind != "full", -adapters_of(cfg, p.name)))  # stable: config order breaks ties
    for p in free:
        put(p.name, p.kind == "full", min(range(n), key=lambda i: (copies[i], adapters[i], i)))
    return out


def init_ray(address: str = "") -> bool:
    """Start Ray here on 127.0.0.1 (no dashboard, a small object store: data goes over the
    bus), or join the cluster at ``address``, unless this process already did; True when this
    call did. ``""`` always starts a private instance: neither ``RAY_ADDRESS`` nor the cluster
    a ``ray start`` (or a test's ``ray.cluster_utils.Cluster``) last wrote to
    ``/tmp/ray/ray_current_cluster`` is joined, which a plain ``ray.init()`` would do (and then
    refuse ``num_cpus``), so a stale file or a cluster beside the job cannot take it over."""
    import ray

    if ray.is_initialized():
        return False
    if address:  # a cluster on this machine (a test's) is joined on 127.0.0.1, not a guessed interface
        loopback = address != "auto" and is_loopback("tcp://" + address.removeprefix("ray://"))
        ray.init(address=address, log_to_driver=False, configure_logging=False,
                 **({"_node_ip_address": "127.0.0.1"} if loopback else {}))
    else:
        ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
                 num_cpus=os.cpu_count(), object_store_memory=200 * 1024 * 1024, log_to_driver=False,
                 configure_logging=False)
    return True


def dealer(actor_cls: Any) -> Any:
    """A function ``i -> actor class`` that deals the ``i``-th CPU component (env runners, then
    learners) to the cluster's live nodes in turn, asked at each call (a restarted component goes
    to a node alive then). The affinity is hard: a soft one let Ray put every actor on one node
    when the other did not yet look ready to it. On one node, ``actor_cls`` as it is."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    def placed(i: int) -> Any:
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n.get("Alive"))
        if len(nodes) < 2:
            return actor_cls
        return actor_cls.options(scheduling_strategy=NodeAffinitySchedulingStrategy(nodes[i % len(nodes)], soft=False))

    return placed


def scheduler_resources(cfg: JobConfig, device: str | None = None) -> dict[str, float]:
    """The Ray resources a scheduler of the job asks for: ``runtime.scheduler_resources``, else
    one GPU when its device (``device``; by default ``model.device``) is ``cuda``, else none
    (``cuda:N``, a device chosen by hand, is left alone)."""
    if cfg.runtime.scheduler_resources:
        return dict(cfg.runtime.scheduler_resources)
    return {"GPU": 1.0} if (device or cfg.model.device) == "cuda" else {}


def scheduler_name(i: int) -> str:
    """The job's ``i``-th scheduler's component name: ``scheduler``, ``scheduler1``, ..."""
    return f"scheduler{i}" if i else "scheduler"


def placed_on_resources(actor_cls: Any, wanted: dict[str, float], nodes: list[dict[str, Any]]) -> Any:
    """``actor_cls`` asking Ray for ``wanted`` (``CPU``, ``GPU`` and custom resources), which
    places it on a node that has them; :class:`~opentinker.config.ConfigError` naming what each
    live node has when none of ``nodes`` (``ray.nodes()``) does, rather than an actor that
    waits forever."""
    if not wanted:
        return actor_cls
    alive = [n for n in nodes if n.get("Alive")]
    if not any(all(n.get("Resources", {}).get(k, 0.0) >= v for k, v in wanted.items()) for n in alive):
        have = "; ".join(f"{n.get('NodeManagerAddress')}: {dict(sorted(n.get('Resources', {}).items()))}"
                         for n in alive if n.get("Resources"))
        raise ConfigError("runtime.scheduler_resources", f"no live Ray node has {wanted} for the scheduler "
                                                         f"(nodes: {have or 'none'})")
    custom = {k: v for k, v in wanted.items() if k not in ("CPU", "GPU")}
    return actor_cls.options(num_cpus=wanted.get("CPU", 0), num_gpus=wanted.get("GPU", 0),
                             **({"resources": custom} if custom else {}))
