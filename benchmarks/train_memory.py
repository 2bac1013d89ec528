"""Peak memory of one learning step against the number and length of its episodes, with and
without the trainer's token budget, and the same loss and gradient either way.

A step's datums are built as a dialogue game's trajectories are: every sequence starts with
the same system prompt and game header (``--header`` tokens), a group's episodes share their
first observation (``--obs`` tokens), then each plays ``--turns`` turns of a reply
(``--reply`` tokens, the loss tokens) and the next observation. Each row runs in a fresh
process: it loads the model, creates a LoRA adapter (the job's default: rank 8 on q/k/v/o),
trims the heap, resets the kernel's peak-RSS mark (``/proc/self/clear_refs``), runs one
``forward_backward`` (importance-sampling loss) and reads ``VmHWM``: ``step_peak_bytes`` is
that peak minus the RSS just before the step. ``budget_tokens`` 0 is the step as it ran
before the budget (parts of 64 datums); ``auto`` is the trainer's own budget for the model
(:func:`opentinker.engine.trainer.part_tokens`, from ``model.train_memory_mb``).

    python benchmarks/train_memory.py --json benchmarks/results/train_memory.json
    python benchmarks/train_memory.py --quick
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from _args import parse_args
from _machine import script_provenance


@dataclass
class Args:
    model: str = "smollm2-135m"
    groups: str = "1,4"
    """Groups per step (4 episodes each), one row per value."""
    group_size: int = 4
    turns: str = "3,6"
    """Turns per episode, one row per value."""
    header: int = 60
    obs: int = 70
    reply: int = 6
    budgets: str = "0,auto"
    """Token budgets per part: 0 (unbounded: parts of 64 datums), ``auto`` or a number."""
    large: str = "16x6,1x30"
    """``GROUPSxTURNS`` steps run with the ``auto`` budget only (unbounded, they would not fit
    this machine: the 4-group, 6-turn step already peaks near 11 GB); 30 turns make datums
    longer than the budget, trained with checkpointed layers."""
    threads: int = 2
    quick: bool = False
    json: str = ""


QUICK = {"model": "tiny-random", "groups": "2", "turns": "2", "header": 10, "obs": 12, "reply": 3, "large": "4x2"}


def datums(args: Args, groups: int, turns: int, vocab: int, seed: int = 0) -> list:
    """``groups * group_size`` trajectories as a dialogue game's (see the module doc)."""
    from protocols.messages import Datum

    rng = np.random.default_rng(seed)
    header = rng.integers(10, vocab, args.header)
    out = []
    for g in range(groups):
        first = rng.integers(10, vocab, args.obs)
        for e in range(args.group_size):
            toks, mask = [header, first], [np.zeros(args.header), np.zeros(args.obs)]
            for _ in range(turns):
                toks += [rng.integers(10, vocab, args.reply), rng.integers(10, vocab, args.obs)]
                mask += [np.ones(args.reply), np.zeros(args.obs)]
            m = np.concatenate(mask).astype(np.float32)
            out.append(Datum(tokens=np.concatenate(toks).astype(np.int32), loss_inputs={
                "mask": m, "advantages": m * np.float32(1 if (g + e) % 2 else -1),
                "sampler_logprobs": m * np.float32(-3.0)}))
    return out


def vm(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def one(args: Args, groups: int, turns: int, budget: str) -> dict:
    """One row, in this (fresh) process."""
    import torch

    from opentinker.engine.host import ModelHost
    from opentinker.engine.memory import trim_heap
    from opentinker.engine.model_specs import resolve_model
    from protocols.messages import LoraSpec

    # 0: no budget at all (parts of 64 datums, as before the budget); auto: the trainer's own.
    options = {"train_memory_bytes": 1 << 50} if budget == "0" else {}
    host = ModelHost(resolve_model(args.model), threads=args.threads, device="cpu", engine="own",
                     engine_options=options)
    host.create_adapter("main", LoraSpec(seed=0))
    ds = datums(args, groups, turns, host.registry.vocab_size)
    norm = float(sum(d.loss_inputs["mask"].sum() for d in ds))
    limit = host.trainer.part_tokens if budget == "auto" else int(budget)
    trim_heap()
    Path("/proc/self/clear_refs").write_text("5")  # the peak-RSS mark starts again here
    before = vm("VmRSS")
    t0 = time.perf_counter()
    loss, _ = host.forward_backward("main", ds, "importance_sampling", {}, norm, chunk=64 if limit == 0 else 1 << 20,
                                    max_tokens=0 if budget in ("0", "auto") else limit)
    wall = time.perf_counter() - t0
    peak = vm("VmHWM")
    grads = [p.grad.flatten() for p in host.adapters["main"].named.values() if p.grad is not None]
    g = torch.cat(grads)
    return {"groups": groups, "turns": turns, "datums": len(ds), "tokens": int(sum(len(d.tokens) for d in ds)),
            "loss_tokens": int(norm), "seq_len": len(ds[0].tokens), "budget": budget, "budget_tokens": limit,
            "step_peak_bytes": peak - before, "rss_before_bytes": before, "wall_s": wall, "loss": float(loss),
            "grad_norm": float(g.norm()), "grad_head": g[:8].tolist()}


def main() -> None:
    args, extra = parse_args(Args, __doc__, QUICK, {"one": {"nargs": 3, "metavar": ("GROUPS", "TURNS", "BUDGET")}})
    if extra["one"]:
        g, t, b = extra["one"]
        print("RESULT " + json.dumps(one(args, int(g), int(t), b)), flush=True)
        return
    from opentinker.engine.model_specs import resolve_model

    resolve_model(args.model)
    fwd = [x for k, v in asdict(args).items() if k not in ("quick", "json", "large") for x in (f"--{k}", str(v))]
    rows = []
    grid = [(g, t, b) for g in map(int, args.groups.split(",")) for t in map(int, args.turns.split(","))
            for b in args.budgets.split(",")]
    grid += [(*map(int, x.split("x")), "auto") for x in filter(None, args.large.split(","))]
    with Progress(transient=True) as bar:
        task = bar.add_task("learning steps", total=len(grid))
        for g, t, b in grid:  # each in a fresh process: its peak is its own
            proc = subprocess.run([sys.executable, __file__, *fwd, "--one", str(g), str(t), b],
                                  capture_output=True, text=True, env={**os.environ})
            res = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
            rows.append(json.loads(res[-1][7:]) if proc.returncode == 0 and res else
                        {"groups": g, "turns": t, "budget": b, "error": proc.stderr[-800:]})
            bar.advance(task)
    for r in rows:  # the same step, bounded or not: the same loss and gradient
        base = next((x for x in rows if x.get("budget") == "0" and x["groups"] == r["groups"]
                     and x["turns"] == r["turns"] and "error" not in x), None)
        if base is not None and "error" not in r:
            r["grad_rel_diff"] = abs(r["grad_norm"] - base["grad_norm"]) / max(base["grad_norm"], 1e-12)
            r["peak_vs_unbounded"] = r["step_peak_bytes"] / max(base["step_peak_bytes"], 1)
    t = Table(title=f"one learning step's peak memory, {args.model}, {args.threads} threads")
    for c in ("groups", "turns", "datums", "tokens", "budget", "peak MiB", "vs unbounded", "s", "loss", "grad rel diff"):
        t.add_column(c, justify="right")
    for r in rows:
        if "error" in r:
            t.add_row(str(r["groups"]), str(r["turns"]), "", "", r["budget"], "failed", "", "", "", "")
            continue
        t.add_row(str(r["groups"]), str(r["turns"]), str(r["datums"]), str(r["tokens"]),
                  f"{r['budget']} ({r['budget_tokens']})", f"{r['step_peak_bytes'] / 2**20:,.0f}",
                  f"{r['peak_vs_unbounded']:.2f}x" if "peak_vs_unbounded" in r else "", f"{r['wall_s']:.1f}", f"{r['loss']:.5f}",
                  f"{r.get('grad_rel_diff', 0):.1e}")
    Console(width=160).print(t)
    if args.json:
        Path(args.json).write_text(json.dumps({"provenance": script_provenance(args, args.threads), "rows": rows},
                                              indent=1))


if __name__ == "__main__":
    main()
