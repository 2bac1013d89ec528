"""What one decode step of the engine dispatches and how long it takes, by batch and adapters.

For each model, batch B and adapter count K (row i on adapter i % K, LoRA rank 8 on all seven
projections, B of each adapter drawn from N(0, 0.01)), the engine prefills B distinct random
prompts, runs a few decode steps, then measures decode steps in which every row decodes:

* ``ops``: ATen ops dispatched in one step (a ``TorchDispatchMode``; the engine's fused ops,
  ``torch.ops.opentinker.*``, count once: on CUDA each is one triton kernel);
* ``aten_ops``: every ATen op the step runs on the CPU, the fused ops' composites included
  (torch profiler, ops under another ATen op not counted twice);
* ``step_ms``: median wall time of a decode step (``--steps`` steps), and decode tokens/s = B
  / step time;
* on CUDA also ``kernels`` (CUDA kernels launched per step, profiler) and ``device_ms`` (their
  summed device time per step), with graphs on and off.

Baseline in the same run: ``lora_method = "bgmv"``, the stacked-copy batched LoRA the engine
used before the fused ops (its ops grow with the adapters mixed in a step).

    python benchmarks/engine_overhead.py --json benchmarks/results/engine_overhead.json
    python benchmarks/engine_overhead.py --models tiny-random --batches 4,64 --quick
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from _args import parse_args
from _device_rows import ALL_PROJECTIONS, decode_profile
from _machine import script_provenance
from opentinker.engine.host import ModelHost
from opentinker.engine.model_specs import resolve_model
from protocols.messages import LoraSpec, SamplingParams



@dataclass
class Args:
    models: str = "tiny-random,smollm2-135m"
    batches: str = "4,64,256"
    adapters: str = "1,16"
    methods: str = "slots,bgmv"
    prompt_tokens: int = 32
    steps: int = 5
    threads: int = 2
    device: str = "cpu"
    dtype: str = "float32"
    kv_budget_mb: int = 1024
    quick: bool = False
    json: str = ""


def _host(args: Args, model: str, method: str, K: int, graphs: bool) -> ModelHost:
    host = ModelHost(resolve_model(model), threads=args.threads, device=args.device, engine="own",
                     engine_options={"lora_method": method, "max_rows": 256, "dtype": args.dtype,
                                     "cuda_graphs": graphs, "kv_budget_bytes": args.kv_budget_mb << 20})
    gen = torch.Generator().manual_seed(0)
    for k in range(K):
        host.create_adapter(f"a{k}", LoraSpec(rank=8, alpha=16.0, target_modules=ALL_PROJECTIONS, seed=k))
        for name, t in host.registry.adapters[f"a{k}"].named.items():
            if ".lora_B." in name:
                t.data.copy_(torch.randn(t.shape, generator=gen).to(t.device) * 0.01)
    return host


def measure(args: Args, model: str, method: str, B: int, K: int, graphs: bool = True) -> dict:
    """One row: ops, ATen ops, step time (and CUDA kernels) of a decode step of B rows, K adapters."""
    host = _host(args, model, method, K, graphs)
    rng = np.random.default_rng(B * 100 + K)
    params = SamplingParams(max_tokens=args.steps + 8, temperature=1.0)
    seqs = [host.engine.add(f"a{i % K}", rng.integers(5, 20000, size=args.prompt_tokens), params, i) for i in range(B)]
    row = {"model": model, "method": method, "batch": B, "adapters": K, **decode_profile(host, seqs, args.steps)}
    if host.engine.device.type == "cuda":
        row["graphs"] = graphs
    return row


def main() -> None:
    args, _ = parse_args(Args, __doc__, quick={"models": "tiny-random", "batches": "4,64", "steps": 2})
    torch.set_num_threads(args.threads)
    cases = [(m, meth, int(b), int(k)) for m in args.models.split(",") for meth in args.methods.split(",")
             for b in args.batches.split(",") for k in args.adapters.split(",")]
    rows = []
    with Progress(transient=True) as bar:
        task = bar.add_task("decode steps", total=len(cases))
        for m, meth, b, k in cases:
            rows.append(measure(args, m, meth, b, k))
            if args.device.startswith("cuda") and meth == "slots":
                rows.append(measure(args, m, meth, b, k, graphs=False))
            bar.advance(task)
    base = {(r["model"], r["batch"], r["adapters"]): r for r in rows if r["method"] == "bgmv"}
    for r in rows:
        b = base.get((r["model"], r["batch"], r["adapters"]))
        if b is not None:
            r["speedup_vs_bgmv"] = b["step_ms"] / r["step_ms"]
    table = Table(title=f"one decode step, {args.device}, {args.threads} threads")
    for col in ("model", "LoRA", "B", "K", "ops", "ATen ops", "step ms", "tokens/s", "vs bgmv"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(r["model"], r["method"] + ("" if r.get("graphs", True) else " eager"), str(r["batch"]),
                      str(r["adapters"]), str(r["ops"]), str(r["aten_ops"]), f"{r['step_ms']:.1f}",
                      f"{r['decode_tokens_per_s']:.0f}", f"{r.get('speedup_vs_bgmv', 1.0):.2f}x")
    Console().print(table)
    if args.json:
        extra = {}
        if args.device.startswith("cuda"):
            extra = {"device_name": torch.cuda.get_device_name(), "cuda": torch.version.cuda}
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, args.threads, args.device, **extra), "rows": rows}, f,
                      indent=1)


if __name__ == "__main__":
    main()
