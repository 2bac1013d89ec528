"""Torch's CPU threads beside other busy processes: the cost of OpenMP's spin-waiting.

Every process of a job shares a small machine's cores. Torch's CPU wheels run their thread
pool on GNU OpenMP, whose idle threads spin (``GOMP_SPINCOUNT``, 300,000 by default) before
they sleep; a thread that spins for a partner the OS has descheduled burns the core the
partner needs. This script times a decode-sized and a prefill-sized linear of SmolLM2-135M
(``[M, 576] x [576, 1536]``) with 1 and 2 threads and several OpenMP settings, on an idle
machine and beside busy processes (``--busy``, see :data:`BUSY`), every measurement in a fresh process (libgomp reads its settings when torch
loads). ``opentinker`` sets ``GOMP_SPINCOUNT=1000`` when it is imported (see
``opentinker/__init__.py``); this script's children import torch alone, so each setting is
exactly what its row says.

    python benchmarks/threads.py --json benchmarks/results/threads.json   # ~1 minute
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

from _args import parse_args

SETTINGS: dict[str, tuple[int, dict[str, str]]] = {
    "1 thread": (1, {}),
    "2 threads, libgomp default": (2, {}),
    "2 threads, GOMP_SPINCOUNT=1000": (2, {"GOMP_SPINCOUNT": "1000"}),
    "2 threads, OMP_WAIT_POLICY=PASSIVE": (2, {"OMP_WAIT_POLICY": "PASSIVE"}),
}
"""Row name -> (torch threads, environment added to the child's)."""
OMP_KNOBS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")


@dataclass
class Args:
    rows: str = "32,512"
    busy: str = "idle,python,torch"
    repeats: int = 3
    flops: float = 2e10
    json: str = ""


def one(threads: int, m: int, flops: float) -> dict[str, float]:
    """Time ``flops`` worth of ``[m, 576] x [576, 1536]`` linears in this process."""
    import torch

    torch.set_num_threads(threads)
    x, w = torch.randn(m, 576), torch.randn(1536, 576)
    n = max(1, int(flops / (2 * m * 576 * 1536)))
    for _ in range(3):
        torch.nn.functional.linear(x, w)
    t, c = time.perf_counter(), time.process_time()
    for _ in range(n):
        torch.nn.functional.linear(x, w)
    wall = time.perf_counter() - t
    return {"ms_per_linear": 1e3 * wall / n, "cpu_per_wall": (time.process_time() - c) / wall, "calls": n}


BUSY = {
    "idle": [],
    "python": ["while True: pass"],
    "torch": [("import torch\ntorch.set_num_threads(2)\nx, w = torch.randn(256, 576), torch.randn(1536, 576)\n"
               "while True: torch.nn.functional.linear(x, w)")],
}
"""What runs beside the measurement: nothing; one process keeping one core busy (an env runner
tokenising); one 2-thread torch process in a loop of linears, with the measured row's OpenMP
settings (a second model process: another job's scheduler, a learner, a test)."""


def child_env(setting: str) -> dict[str, str]:
    """This process's environment without OpenMP knobs, plus ``setting``'s."""
    return {k: v for k, v in os.environ.items() if k not in OMP_KNOBS} | SETTINGS[setting][1]


@contextlib.contextmanager
def competitors(busy: str, setting: str) -> Iterator[None]:
    """Run :data:`BUSY` ``[busy]``'s processes while the block runs."""
    hogs = [subprocess.Popen([sys.executable, "-c", code], env=child_env(setting)) for code in BUSY[busy]]
    try:
        time.sleep(1.0 if hogs else 0)  # let torch load and the loop start
        yield
    finally:
        for h in hogs:
            h.kill()
            h.wait()


def measure(setting: str, m: int, args: Args) -> dict[str, float]:
    out = subprocess.run([sys.executable, __file__, "--one", str(SETTINGS[setting][0]), str(m), str(args.flops)],
                         env=child_env(setting), capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main() -> None:
    args, extra = parse_args(Args, __doc__, hidden={"one": {"nargs": 3}})
    if extra["one"] is not None:
        threads, m, flops = extra["one"]
        print(json.dumps(one(int(threads), int(m), float(flops))))
        return

    from _machine import machine, script_provenance
    from rich.console import Console
    from rich.table import Table

    rows = []
    for busy in args.busy.split(","):
        for m in (int(r) for r in args.rows.split(",")):
            for setting in SETTINGS:
                with competitors(busy, setting):
                    reps = [measure(setting, m, args) for _ in range(args.repeats)]
                rows.append({"setting": setting, "threads": SETTINGS[setting][0], "env": SETTINGS[setting][1],
                             "busy": busy, "rows": m,
                             "ms_per_linear": statistics.median(r["ms_per_linear"] for r in reps),
                             "cpu_per_wall": statistics.median(r["cpu_per_wall"] for r in reps),
                             "repeats": [r["ms_per_linear"] for r in reps]})
    for r in rows:
        ref = next(x for x in rows if x["setting"] == "1 thread" and x["busy"] == r["busy"]
                   and x["rows"] == r["rows"])
        r["vs_1_thread"] = r["ms_per_linear"] / ref["ms_per_linear"]
    table = Table(title="[M, 576] x [576, 1536] linear, ms per call (median of fresh processes)")
    for col in ("beside", "M", "setting", "ms/linear", "vs 1 thread", "CPU/wall"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["busy"], str(r["rows"]), r["setting"], f"{r['ms_per_linear']:.3f}",
                      f"{r['vs_1_thread']:.2f}x", f"{r['cpu_per_wall']:.2f}")
    Console(width=120).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, threads=2), "args": asdict(args), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
