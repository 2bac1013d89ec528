"""Which scheduler holds which policy, when a job runs one scheduler per device
(``runtime.devices``).

A policy's adapter, its league snapshots, its training and every request that names one of
them go to one scheduler: a policy is never split. A policy with ``device`` set goes where it
says; the others are placed one by one, heaviest first, on the scheduler that holds the least
so far: first the fewest full-parameter copies (each one a whole model), then the fewest
adapters (a policy with a league counts its kept snapshots too), then the lowest index.
"""

from __future__ import annotations

from opentinker.config import JobConfig


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
