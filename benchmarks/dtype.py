"""float32 against bfloat16 on this machine: the same bundled job on the same seeds, one run per
(dtype, seed).

``model.dtype`` is the type of the engine's base weights and activations (LoRA weights and
optimizer states stay float32). Whether bfloat16 pays on a CPU depends on the CPU: oneDNN runs
bfloat16 matrix products on AMX tiles (Intel Xeons since Sapphire Rapids) or AVX-512 BF16
(those and AMD Zen 4), and without them emulates them more slowly than float32. The machine's
record names the features it has (``cpu_bf16``).

First, in this process, the kernel floor: the base model's widest projection (an ``[M, hidden]``
by ``[hidden, intermediate]`` product, SmolLM2-135M's 576 by 1536) at a decode-sized and a
prefill-sized M, in each type. Then the job, once per (dtype, seed), measured per run:

* seconds per training step (rollout + learning, medians over the steps), each phase, and the
  compute the scheduler did in them; the run's wall time with its evaluations; and each step's
  phases with its prefilled and trained tokens (a job whose games lengthen gains more from
  bfloat16 as its sequences grow);
* the engine's decode rate and the learner's loss tokens per second;
* peak memory (all the job's processes, and the largest), sampled every 0.5 s;
* what it learned: the final score against random with its 95% interval and invalid rate,
  the game's exact measures where it has them, and the gain over the step-0 evaluation.

Then per seed and as the mean over seeds (95% bootstrap interval): float32 / bfloat16 of each
time (above 1: bfloat16 is faster), and bfloat16 minus float32 of the final score, so a speed-up
that costs learning shows beside it.

    python benchmarks/dtype.py --json benchmarks/results/dtype.json          # Kuhn's default job, seeds 0 and 1
    python benchmarks/dtype.py --job liars_dice --seeds 0 --json /tmp/dtype_liars.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import msgspec
from _args import parse_args

from _machine import provenance  # isort: skip  (first: before torch)
from _jobs import (
    PEAK_KEYS,
    bootstrap_ci,
    eval_curve,
    final_metrics,
    job_phases,
    read_rows,
    run_config,
    write_result,
)

import games
from opentinker.config import JobConfig, load_config

DTYPES = ("float32", "bfloat16")


@dataclass
class Args:
    job: str = "default"
    """A bundled job (``opentinker/configs/<job>.toml``), run as it is but for the type."""
    seeds: str = "0,1"
    model: str = ""
    """Another base model (e.g. ``tiny-random``); default: the job's own."""
    steps: int = 0
    """Training steps; 0: the job's own."""
    threads: int = 0
    backend: str = ""
    """``local`` or ``ray``; default: the job's own."""
    rows: str = "32,2048"
    """The kernel floor's M values (rows of the product): a decode-sized and a prefill-sized batch."""
    out: str = "runs/dtype"
    json: str = ""
    note: str = ""
    """Saved with the result (e.g. what else the machine was running)."""
    quick: bool = False
    """A smoke run: the tiny random model, one seed, two steps, local backend (the test's)."""


QUICK = {"model": "tiny-random", "seeds": "0", "steps": 2, "threads": 1, "backend": "local", "rows": "4,64"}


def job_config(args: Args, dtype: str, seed: int) -> JobConfig:
    """The bundled job ``args.job`` at ``dtype`` and ``seed`` (and the run's overrides), its
    output under ``out/runs`` and its name ``<job>_<dtype>``."""
    over: dict[str, Any] = {"name": f"{args.job}_{dtype}", "seed": seed, "out_dir": str(Path(args.out).resolve() / "runs"),
                            "model": {"dtype": dtype}}
    if args.model:
        over["model"]["base"] = args.model
    if args.threads:
        over["model"]["threads"] = args.threads
    if args.steps:
        over["train"] = {"steps": args.steps}
    if args.backend:
        over["runtime"] = {"backend": args.backend}
    return load_config(args.job, over)


def kernel_floor(model: str, rows: list[int], threads: int, repeats: int = 20) -> dict[str, dict[str, float]]:
    """The base model's widest projection (``[M, hidden] @ [hidden, intermediate]``, random
    weights of its shape) in each type: milliseconds per product (median of ``repeats``) and
    GFLOP/s, by type and M."""
    import torch

    from opentinker.engine.model_specs import resolve_model

    spec = json.loads((Path(resolve_model(model)) / "config.json").read_text())
    hidden, inter = spec["hidden_size"], spec["intermediate_size"]
    torch.set_num_threads(threads)
    out: dict[str, dict[str, float]] = {}
    for dtype in DTYPES:
        w = torch.randn(hidden, inter, dtype=getattr(torch, dtype))
        for m in rows:
            x = torch.randn(m, hidden, dtype=w.dtype)
            for _ in range(3):  # warm: oneDNN builds its kernel on the first call
                x @ w
            times = []
            for _ in range(repeats):
                t = time.perf_counter()
                x @ w
                times.append(time.perf_counter() - t)
            s = statistics.median(times)
            out[f"{dtype}/M{m}"] = {"ms": s * 1e3, "gflops": 2 * m * hidden * inter / s / 1e9}
    return out


def run_one(args: Args, dtype: str, seed: int) -> dict[str, Any]:
    """One (dtype, seed) run (a finished run of exactly this config is reused); its row."""
    cfg = job_config(args, dtype, seed)
    run, job = run_config(cfg, Path(args.out).resolve(), f"{dtype} seed {seed}")
    rows = read_rows(run)
    trains = [r for r in rows if r["kind"] == "train"]
    name, ev = cfg.policies[0].name, games.evaluation(cfg.game)
    curve = eval_curve(rows, name, ev, cfg.train.groups_per_step * cfg.train.group_size)
    final = final_metrics(next(r for r in reversed(rows) if r["kind"] == "eval"), name, ev)
    decode = [r["perf/engine/decode_tokens_per_s"] for r in trains if r.get("perf/engine/decode_tokens_per_s")]
    return {
        "dtype": dtype, "seed": seed, "run": str(run), "policy": name, "steps": cfg.train.steps, "curve": curve,
        "final": final, "gain_vs_untrained": curve[-1][ev.unit] - curve[0][ev.unit],
        "s_per_step": statistics.median(r["timing_s/rollout"] + r["timing_s/learn"] for r in trains),
        "steps_s": [{"step": r["step"], "rollout_s": r["timing_s/rollout"], "learn_s": r["timing_s/learn"],
                     "prefill_tokens": r.get("perf/engine/prefill_tokens"),
                     "loss_tokens": r.get(f"train/{name}/n_loss_tokens")} for r in trains],
        "decode_tokens_per_s": statistics.median(decode) if decode else None,
        "train_tokens_per_s": statistics.median(r[f"train/{name}/n_loss_tokens"] / r[f"train/{name}/learn_s"]
                                                for r in trains),
        **job_phases(run, {k: job[k] for k in PEAK_KEYS}, job["wall_s"]),
    }


TIMES = ("s_per_step", "rollout_s", "learn_s", "compute_s", "wall_s")
RATES = ("decode_tokens_per_s", "train_tokens_per_s")


def compare(rows: list[dict[str, Any]], unit: str, exact: list[str]) -> dict[str, dict[str, Any]]:
    """Per measure over the seeds run in both types: float32 / bfloat16 of each time and
    bfloat16 / float32 of each rate (above 1: bfloat16 is faster), bfloat16 minus float32 of
    the final score and exact measures, and bfloat16 / float32 of the peak memory; each per
    seed and as the mean with its 95% bootstrap interval."""
    by = {(r["dtype"], r["seed"]): r for r in rows}
    seeds = sorted({s for _, s in by if all((d, s) in by for d in DTYPES)})
    pick = {**{k: (lambda f, b, k=k: f[k] / b[k]) for k in TIMES},
            **{k: (lambda f, b, k=k: b[k] / f[k] if b[k] and f[k] else None) for k in RATES},
            **{k: (lambda f, b, k=k: b[k] / f[k]) for k in PEAK_KEYS},
            f"final_{unit}": lambda f, b: b["final"][unit] - f["final"][unit],
            **{f"final_{m}": (lambda f, b, m=m: b["final"][m] - f["final"][m]
                              if m in b["final"] and m in f["final"] else None) for m in exact}}
    out: dict[str, dict[str, Any]] = {}
    for key, fn in pick.items():
        per_seed = [v for s in seeds if (v := fn(by[("float32", s)], by[("bfloat16", s)])) is not None]
        if per_seed:
            m, lo, hi = bootstrap_ci(per_seed)
            out[key] = {"mean": m, "lo": lo, "hi": hi, "per_seed": per_seed}
    return out


def main() -> None:
    args = parse_args(Args, __doc__, quick=QUICK)[0]
    try:
        seeds = [int(s) for s in args.seeds.split(",")]
        ms = [int(m) for m in args.rows.split(",")]
    except ValueError as e:
        raise SystemExit(f"--seeds / --rows: comma-separated integers ({e})") from None
    first = {d: job_config(args, d, seeds[0]) for d in DTYPES}
    threads = first["float32"].model.threads
    prov = provenance([Path(sys.argv[0]).name, *sys.argv[1:]], {d: msgspec.to_builtins(c) for d, c in first.items()},
                      threads or None, first["float32"].model.device)
    ev = games.evaluation(first["float32"].game)
    floor = kernel_floor(first["float32"].model.base, ms, threads or prov["cores"])
    print("kernel floor (milliseconds per product, GFLOP/s):")
    for k, v in floor.items():
        print(f"  {k}: {v['ms']:.3f} ms, {v['gflops']:.0f} GFLOP/s")
    t0 = time.perf_counter()
    rows = []
    for seed in seeds:
        for dtype in DTYPES:
            print(f"{dtype}, seed {seed}: the {args.job} job", flush=True)
            rows.append(run_one(args, dtype, seed))
    exact = [m.name for m in ev.exact]
    ratios = compare(rows, ev.unit, exact)
    result = {"provenance": prov, "note": args.note, "args": asdict(args), "job": args.job, "game": first["float32"].game,
              "unit": ev.unit, "kernel_floor": floor, "rows": rows, "ratios": ratios, "wall_s": time.perf_counter() - t0}
    out = Path(args.out)
    write_result(result, out / "dtype.json", args.json)
    print()
    for r in rows:
        f = r["final"]
        ex = "".join(f", {m} {f[m]:+.3f}" for m in exact if m in f)
        print(f"{r['dtype']:>8} seed {r['seed']}: {f[ev.unit]:+.3f} ± {f['ci95'] or 0:.3f} {ev.unit} vs random{ex}; "
              f"{r['s_per_step']:.1f} s/step (rollout {r['rollout_s']:.1f}, learn {r['learn_s']:.1f}), "
              f"{r['wall_s']:.0f} s in all, peak {r['peak_rss_largest_mb']:.0f} MB")
    print("\nfloat32 / bfloat16 of times, bfloat16 / float32 of rates and memory, bfloat16 - float32 of scores "
          "(mean over seeds [95% bootstrap interval]):")
    for k, v in ratios.items():
        print(f"  {k}: {v['mean']:.3f} [{v['lo']:.3f}, {v['hi']:.3f}]")
    print(f"\nwrote {out}/dtype.json" + (f" and {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
