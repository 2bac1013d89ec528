"""The machine a figure was measured on: recorded in every benchmark's JSON and in a run's
``summary.json``, since the same job's pace differs several-fold between CPUs (the kernel
level torch picked, ``torch.backends.cpu.get_cpu_capability()``, and the env knobs that
change it are part of the record)."""

from __future__ import annotations

import datetime
import os
import platform
from pathlib import Path
from typing import Any

import torch

ENV_KNOBS = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
             "GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
"""Environment variables that change which kernels torch uses, or how many threads and how
they wait (``opentinker`` sets ``GOMP_SPINCOUNT`` when imported; see its ``__init__``)."""


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` where there is one: ``platform.processor()``
    is often empty or just the architecture on Linux)."""
    cpu = platform.processor()
    if Path("/proc/cpuinfo").exists():
        cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                    if ln.startswith("model name")), cpu)
    return cpu


def machine(threads: int | None = None, device: str = "cpu") -> dict[str, Any]:
    """CPU model, torch's CPU kernel level, cores, torch threads (``threads``; torch's own
    count when None), device, torch version, date, the :data:`ENV_KNOBS` that are set and, on
    CUDA, the GPU's name."""
    info: dict[str, Any] = {
        "cpu": cpu_model(), "cpu_capability": torch.backends.cpu.get_cpu_capability(), "cores": os.cpu_count(),
        "torch_threads": threads if threads is not None else torch.get_num_threads(), "device": device,
        "torch": torch.__version__, "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "env": {k: os.environ[k] for k in ENV_KNOBS if k in os.environ},
    }
    if device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name()
    return info
