"""The machine a figure was measured on: recorded in every benchmark's JSON and in a run's
``summary.json``, since the same job's pace differs several-fold between CPUs (the kernel
level torch picked, ``torch.backends.cpu.get_cpu_capability()``, and the env knobs that
change it are part of the record)."""

from __future__ import annotations

import datetime
import functools
import os
import platform
import shlex
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from opentinker.config import ModelConfig

ENV_KNOBS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
"""Environment variables that change which kernels torch uses, or how many threads and how
they wait (``opentinker`` sets ``GOMP_SPINCOUNT`` when imported; see its ``__init__``)."""


@functools.cache
def _cpuinfo(key: str) -> str | None:
    """The first ``key`` line's value in ``/proc/cpuinfo`` (None where there is no such file
    or line); read once per process and key, since the CPU does not change."""
    info = Path("/proc/cpuinfo")
    if not info.exists():
        return None
    return next((ln.split(":", 1)[1].strip() for ln in info.read_text().splitlines() if ln.startswith(key)), None)


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` where there is one: ``platform.processor()``
    is often empty or just the architecture on Linux)."""
    name = _cpuinfo("model name")
    return platform.processor() if name is None else name


BF16_FLAGS = ("avx512_bf16", "amx_bf16")
"""CPU features that make bfloat16 matrix products fast on a CPU (oneDNN uses them: AMX tiles
on Intel Xeons since Sapphire Rapids, AVX-512 BF16 on those and AMD Zen 4); without them
``model.dtype = "bfloat16"`` is slower than float32."""


def cpu_bf16_flags() -> list[str]:
    """Which of :data:`BF16_FLAGS` this CPU has (``/proc/cpuinfo``'s flags; ``[]`` where
    there is no such file)."""
    flags = (_cpuinfo("flags") or "").split()
    return [f for f in BF16_FLAGS if f in flags]


def machine(threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """CPU model, torch's CPU kernel level, the CPU's bfloat16 features (:data:`BF16_FLAGS`),
    cores, torch threads (``threads``; torch's own count when None), device, torch version,
    date, the :data:`ENV_KNOBS` that are set and, on CUDA, the GPU's name."""
    info: dict[str, Any] = {
        "cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16": cpu_bf16_flags(), "cores": os.cpu_count(),
        "torch_threads": threads if threads is not None else torch.get_num_threads(), "device": device,
        "torch": torch.__version__, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "env": {k: os.environ[k] for k in ENV_KNOBS if k in os.environ},
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info


def job_machine(model: ModelConfig) -> dict[str, Any]:
    """:func:`machine` for a job on ``model`` (its ``threads``, all the cores when 0, and its
    ``device``): what a run's, an offline job's, an evaluation's and ``infer``'s records hold."""
    return machine(model.threads or os.cpu_count(), model.device)


VERSIONED = ("torch", "transformers", "peft", "ray", "pyzmq", "msgspec", "numpy", "pettingzoo", "opentinker")
"""Distributions whose versions a result records."""


RESULTS = "benchmarks/results"
"""Where the benchmarks write their committed JSON and plots (relative to the checkout)."""


def git_commit(root: Path | None = None, dirty: bool = True) -> tuple[str, bool]:
    """The checkout's commit (``"unknown"`` outside a git checkout) and whether tracked files
    differ from it (a result from uncommitted code says so); ``dirty=False`` skips that
    question (``git status``) and answers False. Files under :data:`RESULTS` are outputs, not
    code: a benchmark that rewrites its own committed JSON is not dirty for it."""
    root = root or Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], check=False, cwd=root, capture_output=True, text=True, timeout=10)
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                 f":(exclude){RESULTS}"], check=False, cwd=root,
                                capture_output=True, text=True, timeout=10) if dirty else None
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", False
    if commit.returncode != 0:
        return "unknown", False
    return commit.stdout.strip(), status is not None and bool(status.stdout.strip())


def commit_record(at_start: tuple[str, bool]) -> dict[str, Any]:
    """A run's code for its ``summary.json``: ``commit`` and ``dirty`` as they were when it
    started (``at_start``, from :func:`git_commit`), and ``commit_at_end`` when the checkout
    has moved since (a commit made while a long run trained: the run still ran the code it
    started with, a subprocess it started later, such as an evaluation, the newer)."""
    commit, dirty = at_start
    out: dict[str, Any] = {"commit": commit, "dirty": dirty}
    end = git_commit(dirty=False)[0]
    if end != commit:
        out["commit_at_end"] = end
    return out


def provenance(command: str | list[str], config: Any = None, threads: int | None = None,
               device: str = "cpu") -> dict[str, Any]:
    """Where a benchmark's figures come from, recorded in every result JSON: ``commit`` (and
    ``dirty``), the ``command`` line, the ``config`` it ran (a job config or the script's
    arguments), package ``versions``, and the machine: ``cpu``, ``capability``
    (``torch.backends.cpu.get_cpu_capability()``), ``cores``, ``device`` and the rest of
    :func:`machine` (torch threads, env knobs, date, GPU)."""
    from importlib.metadata import PackageNotFoundError, version

    versions = {"python": platform.python_version()}
    for name in VERSIONED:
        try:
            versions[name] = version(name)
        except PackageNotFoundError:
            pass
    commit, dirty = git_commit()
    m = machine(threads, device)
    return {"commit": commit, "dirty": dirty, "command": command if isinstance(command, str) else shlex.join(command),
            "config": config, "versions": versions, "cpu": m.pop("cpu"), "capability": m.pop("cpu_capability"),
            "cores": m.pop("cores"), "device": m.pop("device"), **m}
