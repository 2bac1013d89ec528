"""The OpenMP spin count that ``opentinker`` sets before torch loads (``opentinker/__init__.py``;
the measurements behind it: ``benchmarks/threads.py``)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

PROBE = """
import os, sys
class Probe:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            print("at torch import:", os.environ.get("GOMP_SPINCOUNT"))
            sys.meta_path.remove(self)
        return None
sys.meta_path.insert(0, Probe())
import {module}
import torch  # where the module loads torch lazily, it is loaded now
"""


def _probe(module: str, spin: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "GOMP_SPINCOUNT"}
    if spin is not None:
        env["GOMP_SPINCOUNT"] = spin
    out = subprocess.run([sys.executable, "-c", PROBE.format(module=module)], env=env, capture_output=True,
                         text=True, timeout=120, check=True)
    return out.stdout.strip()


@pytest.mark.parametrize("module", ["opentinker.cli", "opentinker.control.runtime", "opentinker.engine.service"])
def test_spin_count_set_before_torch_loads(module: str) -> None:
    # The CLI, the actors' entry module and the scheduler each load torch only after the
    # package has set the spin count (libgomp reads it once, when torch loads it).
    assert _probe(module, None) == "at torch import: 1000"


def test_users_spin_count_wins() -> None:
    assert _probe("opentinker.cli", "42") == "at torch import: 42"
