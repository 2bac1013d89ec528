"""Which thread loads the model: one training step three ways, each in a fresh process.

Torch's CPU thread pool (GNU OpenMP) belongs to the thread that starts parallel work. The
scheduler computes on a thread of its own ("scheduler-compute"); until it also loaded the model
there, the load ran on the caller's thread (a Ray actor's main thread) and left a pool behind,
so the process held two. libgomp then counts more of its threads than cores and lets them spin
only briefly before they sleep, and each small parallel op pays a sleep and a wake.

The step is one ``forward_backward`` of the tic-tac-toe batch of ``shared_forward.py`` (8 groups
of 4 episodes as a step plays them, the learner's replies the loss tokens; LoRA on attention and
MLP as in the bundled job, importance-sampling loss), timed ``--repeats`` times after one
warm-up, in each way, the ways taking turns for ``--rounds`` rounds (this machine's pace drifts
by 10-30% over minutes; the table gives the median of every timing of a way):

* ``main``: loaded and trained on the main thread, as a plain script does (the baseline);
* ``second``: loaded on the main thread, trained on a second thread (the scheduler before);
* ``scheduler``: a ``SchedulerService`` started in the process (it loads the model on its
  compute thread) with the step sent as ``ForwardBackward`` over its bus (the scheduler now).

    python benchmarks/compute_thread.py --json benchmarks/results/compute_thread.json   # ~8 minutes
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass

import _machine  # noqa: F401  # isort: skip  (opentinker before torch)
from _args import parse_args

WAYS = {
    "main": "loaded and trained on the main thread (a plain script)",
    "second": "loaded on the main thread, trained on a second (the scheduler before)",
    "scheduler": "SchedulerService: loads and trains on its compute thread (the scheduler now)",
}
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class Args:
    model: str = "smollm2-135m"
    groups: int = 8
    group_size: int = 4
    repeats: int = 3
    rounds: int = 3
    threads: int = 2
    seed: int = 0
    json: str = ""


def _batch(args: Args, path: str) -> list:
    from shared_forward import tictactoe_batch

    from opentinker.rollout.render import ChatTokenizer

    return tictactoe_batch(ChatTokenizer(path), args.groups, args.group_size, args.seed)


def _times(step, repeats: int) -> dict[str, object]:
    """``repeats`` timings of ``step()`` after one warm-up, with the CPU time per wall second."""
    step()
    times, cpu = [], []
    for _ in range(repeats):
        t, c = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - t)
        cpu.append((time.process_time() - c) / times[-1])
    return {"times_s": times, "median_s": statistics.median(times), "cpu_per_wall": statistics.median(cpu)}


def one(way: str, args: Args) -> dict[str, object]:
    """Measure ``way`` in this (fresh) process."""
    from opentinker.engine.model_specs import resolve_model
    from protocols.messages import LoraSpec

    path = resolve_model(args.model)
    datums = _batch(args, path)
    norm = float(sum(d.loss_inputs["mask"].sum() for d in datums))
    spec = LoraSpec(rank=8, target_modules=TARGETS)
    if way == "scheduler":
        return _through_scheduler(path, datums, norm, spec, args)
    from opentinker.engine.host import ModelHost

    host = ModelHost(path, threads=args.threads, device="cpu")
    host.create_adapter("bench", spec)
    losses: list[float] = []

    def step() -> None:
        loss, _ = host.forward_backward("bench", datums, "importance_sampling", {}, norm)
        losses.append(loss)
        host.discard_gradients("bench")

    if way == "main":
        out = _times(step, args.repeats)
    else:
        box: dict[str, object] = {}
        worker = threading.Thread(target=lambda: box.update(_times(step, args.repeats)), name="second")
        worker.start()
        worker.join()
        out = box
    return {**out, "loss": losses[-1]}


def _through_scheduler(path: str, datums: list, norm: float, spec, args: Args) -> dict[str, object]:
    import asyncio

    import zmq.asyncio

    from opentinker.bus import Client
    from opentinker.engine.service import SchedulerService
    from protocols.messages import CreateAdapter, DiscardGradients, ForwardBackward

    service = SchedulerService(path, threads=args.threads, device="cpu")
    service.start()
    loop = asyncio.new_event_loop()
    ctx = zmq.asyncio.Context()
    client = Client(ctx, service.endpoint, name="compute-thread-bench")
    fb = ForwardBackward(adapter="bench", datums=datums, loss="importance_sampling", normalizer=norm)
    losses: list[float] = []

    async def step() -> None:
        losses.append((await client.request(fb)).loss)
        await client.request(DiscardGradients(adapter="bench"))

    try:
        loop.run_until_complete(asyncio.wait_for(client.request(CreateAdapter(name="bench", spec=spec)), 600))
        out = _times(lambda: loop.run_until_complete(asyncio.wait_for(step(), 1800)), args.repeats)
    finally:
        client.close()
        ctx.destroy(0)
        loop.close()
        service.stop()
    return {**out, "loss": losses[-1]}


def measure(way: str, args: Args) -> dict[str, object]:
    """:func:`one` in a fresh process (each way starts with no thread pool at all)."""
    cmd = [sys.executable, __file__, "--one", way,
           *(f"--{k}={v}" for k, v in asdict(args).items() if k not in ("json", "rounds"))]
    out = subprocess.run(cmd, check=False, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{way}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    args, extra = parse_args(Args, __doc__, hidden={"one": {"choices": list(WAYS)}})
    if extra["one"] is not None:
        print(json.dumps(one(extra["one"], args)))
        return

    from _machine import script_provenance
    from rich.console import Console
    from rich.table import Table

    runs: dict[str, list[dict]] = {way: [] for way in WAYS}
    for i in range(args.rounds):
        for way in WAYS:
            runs[way].append(measure(way, args))
            print(f"round {i + 1}/{args.rounds}, {way}: median {runs[way][-1]['median_s']:.2f} s", flush=True)
    rows = []
    for way, label in WAYS.items():
        times = [t for r in runs[way] for t in r["times_s"]]
        rows.append({"way": way, "label": label, "median_s": statistics.median(times), "times_s": times,
                     "round_medians_s": [r["median_s"] for r in runs[way]],
                     "cpu_per_wall": statistics.median(r["cpu_per_wall"] for r in runs[way]),
                     "loss": runs[way][-1]["loss"]})
    base = rows[0]["median_s"]
    for r in rows:
        r["vs_main"] = r["median_s"] / base
        if abs(r["loss"] - rows[0]["loss"]) > 1e-4 * max(1.0, abs(rows[0]["loss"])):
            raise AssertionError(f"{r['way']} gives loss {r['loss']}, the main thread {rows[0]['loss']}")
    table = Table(title=f"one forward_backward, {args.groups} x {args.group_size} tic-tac-toe episodes, "
                        f"{args.model}, {args.threads} threads (median of {args.rounds} x {args.repeats}, "
                        "fresh process each round)")
    for col in ("way", "median s", "vs main thread", "CPU / wall"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["label"], f"{r['median_s']:.2f}", f"{r['vs_main']:.2f}x", f"{r['cpu_per_wall']:.2f}")
    Console(width=130).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, args.threads), "args": asdict(args), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
