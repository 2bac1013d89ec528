"""The benchmark scripts' first import (they run as scripts, so ``benchmarks/`` is on
``sys.path``): it loads ``opentinker`` before anything loads torch, so a benchmark's own
process gets the OpenMP settings the package sets (see ``opentinker/__init__.py``), and gives
them :func:`opentinker.machine.machine`."""

import opentinker  # noqa: F401  # isort: skip  (before torch)
from opentinker.machine import ENV_KNOBS, cpu_model, machine, provenance

__all__ = ["ENV_KNOBS", "cpu_model", "machine", "provenance"]
