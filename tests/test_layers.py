"""The four layers keep their import rules (../shared/DESIGN.md §1, §7)."""

import subprocess
import sys

import pytest


def _imported(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True, timeout=120,
    ).stdout
    return {m.split(".")[0] for m in out.split()}


@pytest.mark.parametrize(
    "module, forbidden",
    [
        ("protocols", {"opentinker", "games", "learners", "torch", "zmq", "ray"}),
        ("games", {"opentinker", "learners", "protocols", "torch", "ray"}),
        ("learners", {"opentinker", "games", "transformers", "ray", "zmq"}),
        # Env runners and the coordinator stay light: no torch in their processes.
        ("opentinker.rollout.env_runner", {"torch", "transformers", "peft"}),
        ("opentinker.control.coordinator", {"torch", "transformers", "peft"}),
    ],
)
def test_layer_imports(module, forbidden):
    assert not (_imported(f"import {module}") & forbidden)
