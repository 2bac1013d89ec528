"""The benchmark scripts' first import (they run as scripts, so ``benchmarks/`` is on
``sys.path``): it loads ``opentinker`` before anything loads torch, so a benchmark's own
process gets the OpenMP settings the package sets (see ``opentinker/__init__.py``), and gives
them :func:`opentinker.machine.machine`."""

import opentinker  # noqa: F401  # isort: skip  (before torch)
from opentinker.machine import ENV_KNOBS, cpu_model, machine, provenance

__all__ = ["ENV_KNOBS", "cpu_model", "machine", "provenance", "script_provenance"]


def script_provenance(args: object, threads: int | None = None, device: str = "cpu", **extra: object) -> dict:
    """:func:`provenance` of this script's run: its command line as typed (script name and
    flags), its ``Args`` dataclass as the config, and ``extra`` fields (e.g. a measured
    matmul rate)."""
    import dataclasses
    import json
    import sys
    from pathlib import Path

    config = dataclasses.asdict(args) if dataclasses.is_dataclass(args) and not isinstance(args, type) else vars(args)
    config = json.loads(json.dumps(config, default=str))  # paths and the like as text
    return {**provenance([Path(sys.argv[0]).name, *sys.argv[1:]], config, threads, device), **extra}
