"""Compare learners on one game at the same budget of episodes, over several seeds.

Each seed is one job (``opentinker run``) whose policies are the learners, one LoRA adapter
each on one shared scheduler, as the design intends: the same base model, the same games, the
same opponents (``--opponents``), the same number of episodes per step. ``dpo`` plays in the
same job as a *frozen* policy (``policies[].frozen``: it plays and records its trajectories at
the same budget but never trains), then an offline DPO job trains it on pairs of those
self-play trajectories (same start, different outcome) and ``opentinker eval`` evaluates it
with the online learners' final evaluation (same games per stratum, same seed).

The output folder holds the runs, ``table.md`` (the table printed at the end), ``curves.png``
(the game's unit and its exact measure against episodes and against training wall-clock, mean
over seeds with the 95% interval as a band) and ``compare_learners.json`` (``provenance``,
``rows``: one per (learner, seed), ``summary``: one per learner). ``--json`` writes the same
JSON elsewhere too (the committed ``benchmarks/results/compare_learners.json``).

What the columns are:

* final ``<unit>`` against random, and the exact measure (Kuhn: exploitability): the mean over
  seeds with a 95% percentile-bootstrap interval of that mean (10,000 resamples of the seeds;
  with 3 seeds it is close to their range, no more);
* episodes / wall-clock to ``--target``: the first evaluation at or above it (median over
  the seeds that got there, and how many did); wall-clock is the job's training time so far
  (rollout + learning, evaluations left out), which the learners of one seed share;
* ``learn s/step``: the learner's own update time per step (its ``learn_s``: advantages,
  forward-backward and optimizer steps through the shared scheduler, queueing included);
* peak RSS of the learner's process; the job's phases (rollout, learning, the rest: transport,
  game code, waits = rollout + learning - scheduler compute) and peak RSS of all its
  processes (sampled every 0.5 s) are per seed, under ``jobs``.

A finished seed is not run again (its run folder is found in the output folder): an
interrupted comparison goes on where it stopped.

    python benchmarks/compare_learners.py --json benchmarks/results/compare_learners.json
    python benchmarks/compare_learners.py --game tictactoe_v3 --learners dr_grpo,rloo --seeds 0,1
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
import numpy as np
from _args import parse_args

from _machine import provenance  # isort: skip  (first: before torch)
from _jobs import (
    PEAK_KEYS,
    Stopped,
    bootstrap_ci,
    eval_curve,
    final_metrics,
    fmt_ci,
    job_phases,
    model_table,
    opentinker,
    opponent_mix,
    read_rows,
    run_config,
    run_logged,
    to_target,
    train_clock,
    write_result,
)

import games
from opentinker.config import JobConfig, OfflineConfig

LEARNERS: dict[str, dict[str, Any]] = {
    "dr_grpo": {"advantage": "dr_grpo"},
    "grpo": {"advantage": "grpo"},
    "rloo": {"advantage": "rloo"},
    "role_ema": {"advantage": "role_ema"},  # REINFORCE with a baseline per game and seat
    "ppo_gae": {"advantage": "gae"},  # PPO with a learned critic (value head on the adapter)
    "cispo": {"advantage": "dr_grpo", "loss": "cispo"},
    "dpo": {},  # frozen in the job; trained offline on its trajectories afterwards
}
"""Learner name -> its ``policies[].train`` overrides of the job's ``[train]``."""
OFFLINE = ("dpo",)


@dataclass
class Args:
    game: str = "kuhn_poker_v0"
    learners: str = ",".join(LEARNERS)
    seeds: str = "0,1,2"
    model: str = "smollm2-135m"
    steps: int = 24
    groups_per_step: int = 8
    group_size: int = 4
    lr: float = 1e-3
    temperature: float = 1.0
    max_tokens: int = 2
    opponents: str = "random=0.75,self=0.25"
    eval_every: int = 6
    eval_hands: int = 10
    """Games per stratum (start x seat) of the evaluations during training."""
    final_hands: int = 20
    """Games per stratum of the first and the final evaluation (dpo's too)."""
    dpo_steps: int = 24
    dpo_batch: int = 16
    dpo_beta: float = 0.1
    target: float = 0.0
    """The game's unit against random that counts as reached (Kuhn: break even, chips/hand)."""
    backend: str = "ray"
    env_runners: int = 2
    threads: int = 0
    device: str = "cpu"
    out: str = "runs/compare_learners"
    json: str = ""
    quick: bool = False
    """A smoke run: a tiny random model, two seeds, two steps, local backend (the test's)."""


QUICK = {"model": "tiny-random", "seeds": "0,1", "steps": 2, "groups_per_step": 2, "group_size": 4, "eval_every": 1,
         "eval_hands": 1, "final_hands": 1, "dpo_steps": 2, "dpo_batch": 4, "backend": "local", "env_runners": 1,
         "threads": 1, "max_tokens": 4}


def parse() -> Args:
    args = parse_args(Args, __doc__, quick=QUICK)[0]
    unknown = [n for n in args.learners.split(",") if n not in LEARNERS]
    if unknown:
        sys.exit(f"compare_learners: unknown learners {unknown}; known: {', '.join(LEARNERS)}")
    return args


def separated(summary: dict[str, dict[str, Any]], metric: str) -> list[tuple[str, str]]:
    """Pairs of learners, each with at least 2 seeds, whose 95% intervals of ``metric`` do not
    overlap, better one first (``summary[learner][metric]`` = ``{"mean", "lo", "hi", "better"}``)."""
    out = []
    names = [n for n in summary if metric in summary[n] and summary[n]["seeds"] >= 2]
    for i, a in enumerate(names):
        for b in names[i + 1:]:
            x, y = summary[a][metric], summary[b][metric]
            if x["lo"] > y["hi"] or y["lo"] > x["hi"]:
                hi_first = (a, b) if x["mean"] > y["mean"] else (b, a)
                out.append(hi_first if x["better"] == "higher" else hi_first[::-1])
    return out


def job_config(args: Args, seed: int, learners: list[str]) -> JobConfig:
    """The seed's job: one policy per learner (``dpo`` frozen), everything else shared."""
    return msgspec.convert({
        "name": "compare", "seed": seed, "game": args.game, "out_dir": str(Path(args.out).resolve() / "runs"),
        "model": model_table(args.model, args.device, args.threads),
        "policies": [{"name": n, "opponents": opponent_mix(args.opponents), "train": LEARNERS[n], "frozen": n in OFFLINE}
                     for n in learners],
        "train": {"steps": args.steps, "groups_per_step": args.groups_per_step, "group_size": args.group_size,
                  "lr": args.lr, "checkpoint_every": 0},
        "sampling": {"temperature": args.temperature, "max_tokens": args.max_tokens},
        "eval": {"every": args.eval_every, "hands_per_stratum": args.eval_hands,
                 "final_hands_per_stratum": args.final_hands, "head_to_head_per_stratum": 0,
                 "cross_play_per_stratum": 0, "ratings": False},
        "runtime": {"backend": args.backend, "env_runners": args.env_runners},
    }, JobConfig)


def online_rows(args: Args, run: Path, learners: list[str], seed: int, ev: games.GameEval) -> list[dict[str, Any]]:
    """One row per online learner of a seed's run: its curve and its final evaluation."""
    rows = read_rows(run)
    per_step = args.groups_per_step * args.group_size
    evals = [r for r in rows if r["kind"] == "eval"]
    trains = [r for r in rows if r["kind"] == "train"]
    out = []
    for name in learners:
        if name in OFFLINE:
            continue
        curve = eval_curve(rows, name, ev, per_step)
        last = evals[-1]
        out.append({
            "learner": name, "seed": seed, "run": str(run), "curve": curve,
            "final": final_metrics(last, name, ev),
            "learn_s_per_step": statistics.median(r[f"train/{name}/learn_s"] for r in trains),
            "peak_rss_mb": max((r.get(f"train/{name}/peak_rss_mb", 0.0) for r in trains), default=0.0),
            **to_target(curve, ev.unit, args.target),
        })
    return out


def summarize(rows: list[dict[str, Any]], learners: list[str], ev: games.GameEval) -> dict[str, dict[str, Any]]:
    """Per learner: each final metric's mean and bootstrap interval over seeds, to-target medians."""
    better = {ev.unit: "higher", "invalid_rate": "lower",
              **{m.name: m.better for m in ev.exact}, "canonical_mass": "higher"}
    out: dict[str, dict[str, Any]] = {}
    for name in learners:
        mine = [r for r in rows if r["learner"] == name and "error" not in r]
        s: dict[str, Any] = {"seeds": len(mine), "errors": [r["error"] for r in rows if r["learner"] == name and "error" in r]}
        if not mine:
            out[name] = s
            continue
        for k, direction in better.items():
            vals = [r["final"][k] for r in mine if r["final"].get(k) is not None]
            if vals:
                m, lo, hi = bootstrap_ci(vals)
                s[k] = {"mean": m, "lo": lo, "hi": hi, "better": direction, "values": vals}
        for k in ("episodes_to_target", "wall_s_to_target"):
            got = [r[k] for r in mine if r[k] is not None]
            s[k] = statistics.median(got) if got else None
        s["reached"] = sum(r["episodes_to_target"] is not None for r in mine)
        s["learn_s_per_step"] = statistics.median(r["learn_s_per_step"] for r in mine)
        s["peak_rss_mb"] = max(r["peak_rss_mb"] for r in mine)
        out[name] = s
    return out


def run_seed(args: Args, seed: int, learners: list[str], ev: games.GameEval) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A seed: the shared online job, then ``dpo``'s offline job and evaluation. Returns the
    (learner, seed) rows and the job's phases."""
    run, job = run_config(job_config(args, seed, learners), Path(args.out).resolve(), f"seed {seed}")
    rows = online_rows(args, run, learners, seed, ev)
    phases = job_phases(run, {k: job[k] for k in PEAK_KEYS}, job["wall_s"])
    if "dpo" in learners:
        rows.append(dpo_row(args, seed, run, ev, phases))
    return rows, {"seed": seed, "run": str(run), **phases}


def dpo_config(args: Args, seed: int, run: Path) -> JobConfig:
    """The offline DPO job on the frozen ``dpo`` policy's trajectories of ``run``."""
    base = job_config(args, seed, ["dpo"])
    return msgspec.structs.replace(
        base, name="compare_dpo", policies=[msgspec.structs.replace(base.policies[0], frozen=False)],
        offline=OfflineConfig(kind="dpo", data=str(run / "trajectories" / "dpo.jsonl"), steps=args.dpo_steps,
                              batch_size=args.dpo_batch, beta=args.dpo_beta))


def dpo_row(args: Args, seed: int, run: Path, ev: games.GameEval, phases: dict[str, float]) -> dict[str, Any]:
    """``dpo``: an offline DPO job on the frozen policy's trajectories of ``run``, then
    ``opentinker eval`` of its adapter with the online learners' final evaluation."""
    out = Path(args.out).resolve()
    try:
        off, job = run_config(dpo_config(args, seed, run), out, f"seed {seed} dpo")
    except Stopped:
        raise  # Ctrl-C or SIGTERM: not a failed learner
    except RuntimeError as e:  # e.g. no pair of trajectories with different outcomes
        log = out / f"compare_dpo_seed{seed}.log"
        lines = log.read_text().splitlines() if log.is_file() else []
        reason = next((ln for ln in reversed(lines) if ln.strip()), str(e))
        print(f"  [seed {seed} dpo] failed: {reason}")
        return {"learner": "dpo", "seed": seed, "error": reason}
    report = off / "eval.json"
    if not report.is_file():
        cmd = opentinker("eval", str(off), "--vs", "random", "--games-per-stratum", str(args.final_hands),
                         "--seed", str(seed), "--backend", args.backend, "--json", str(report),
                         *(["--threads", str(args.threads)] if args.threads else []))
        run_logged(cmd, out / f"compare_dpo_eval_seed{seed}.log", f"seed {seed} dpo eval")
    metrics = json.loads(report.read_text())["metrics"]
    trains = [r for r in read_rows(off) if r["kind"] == "train"]
    first = next(r for r in read_rows(run) if r["kind"] == "eval")
    episodes = args.steps * args.groups_per_step * args.group_size
    end = max(train_clock(read_rows(run)).values())
    curve = [{"step": 0, "episodes": 0, "wall_s": 0.0, ev.unit: first[f"eval/dpo/vs_random/{ev.unit}"],
              **{m.name: first[f"eval/dpo/{m.name}"] for m in ev.exact if f"eval/dpo/{m.name}" in first}},
             {"step": args.steps, "episodes": episodes, "wall_s": end + job["wall_s"],
              ev.unit: metrics[f"eval/dpo/vs_random/{ev.unit}"],
              **{m.name: metrics[f"eval/dpo/{m.name}"] for m in ev.exact if metrics.get(f"eval/dpo/{m.name}") is not None}}]
    return {"learner": "dpo", "seed": seed, "run": str(off), "curve": curve, "final": final_metrics(metrics, "dpo", ev),
            "learn_s_per_step": statistics.median(r["train/dpo/learn_s"] for r in trains),
            "peak_rss_mb": job["peak_rss_total_mb"], "offline_wall_s": job["wall_s"],
            **to_target(curve, ev.unit, args.target)}


def table_md(summary: dict[str, dict[str, Any]], ev: games.GameEval, args: Args) -> str:
    """The comparison as a Markdown table (printed, and saved as ``table.md``)."""
    exact = [m.name for m in ev.exact]
    head = ["learner", f"{ev.unit} vs random", *exact, "invalid", f"episodes to {args.target:+g}",
            f"wall s to {args.target:+g}", "learn s/step", "peak RSS MB"]
    note = ("learn s/step: the learner's update, queueing at the shared scheduler included; peak RSS: the "
            "learner's process (the model lives in the scheduler's); dpo: its offline job's, scheduler included.")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in summary.items():
        n = s["seeds"]
        if not n:
            lines.append(f"| {name} | failed: {s['errors'][0]} |" + " |" * (len(head) - 2))
            continue

        def reach(k: str, s: dict[str, Any] = s, n: int = n) -> str:
            return "never" if s[k] is None else f"{s[k]:.0f} ({s['reached']}/{n})"

        inv = s.get("invalid_rate")
        total = n + len(s["errors"])
        lines.append("| " + " | ".join([
            name if not s["errors"] else f"{name} ({n}/{total} seeds; {len(s['errors'])} failed)", fmt_ci(s.get(ev.unit)), *(fmt_ci(s.get(m)) for m in exact),
            "n/a" if inv is None else f"{100 * inv['mean']:.0f}%", reach("episodes_to_target"), reach("wall_s_to_target"),
            f"{s['learn_s_per_step']:.2f}", f"{s['peak_rss_mb']:.0f}"]) + " |")
    return "\n".join(lines) + "\n\n" + note


def verdict(summary: dict[str, dict[str, Any]], ev: games.GameEval) -> str:
    """Which learners separate (non-overlapping 95% intervals), metric by metric, in words."""
    found = []
    for metric in (ev.unit, *(m.name for m in ev.exact)):
        pairs = separated(summary, metric)
        if pairs:
            found.append(f"{metric}: " + ", ".join(f"{a} better than {b}" for a, b in pairs))
    seeds = max((s["seeds"] for s in summary.values()), default=0)
    pairs = len(summary) * (len(summary) - 1) // 2
    caveat = (f" With {seeds} seeds a bootstrap interval of the mean is about the seeds' range, and the {pairs} "
              "pairs are compared without a correction for multiple comparisons: a separation at this budget "
              "may be chance, more seeds would confirm or undo it." if seeds < 5 else "")
    if not found:
        return "No two learners separate at this budget: every pair's 95% intervals overlap on every metric." + caveat
    return "Separated (non-overlapping 95% intervals): " + "; ".join(found) + "." + caveat


def plot_curves(rows: list[dict[str, Any]], learners: list[str], ev: games.GameEval, path: Path) -> None:
    """Mean over seeds and the 95% bootstrap band of the unit (and each exact measure) against
    episodes and against training wall-clock, one line per learner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    metrics = [ev.unit, *(m.name for m in ev.exact)]
    fig, axes = plt.subplots(len(metrics), 2, figsize=(11, 3.6 * len(metrics)), squeeze=False)
    for name in learners:
        mine = [r for r in rows if r["learner"] == name and "error" not in r]
        steps = sorted({c["step"] for r in mine for c in r["curve"]})
        for i, metric in enumerate(metrics):
            pts = []
            for st in steps:
                cs = [c for r in mine for c in r["curve"] if c["step"] == st and c.get(metric) is not None]
                if cs:
                    m, lo, hi = bootstrap_ci([c[metric] for c in cs])
                    pts.append((statistics.mean(c["episodes"] for c in cs), statistics.mean(c["wall_s"] for c in cs), m, lo, hi))
            if not pts:
                continue
            x_ep, x_wall, m, lo, hi = map(np.array, zip(*pts))
            for j, x in enumerate((x_ep, x_wall)):
                ax = axes[i][j]
                (line,) = ax.plot(x, m, marker="o", ms=3, label=name, ls="--" if name in OFFLINE else "-")
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    for i, metric in enumerate(metrics):
        label = ev.label if metric == ev.unit else metric
        axes[i][0].set(xlabel="episodes per learner", ylabel=f"{label} (vs random)" if metric == ev.unit else label)
        axes[i][1].set(xlabel="training wall-clock, s (shared job)", ylabel=axes[i][0].get_ylabel())
        for ax in axes[i]:
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("mean over seeds, band: 95% bootstrap interval")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    args = parse()
    learners = args.learners.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    ev = games.evaluation(args.game)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Recorded first: the commit and the checkout's state the jobs start from.
    prov = provenance(command=[Path(sys.argv[0]).name, *sys.argv[1:]],
                      config=msgspec.to_builtins(job_config(args, seeds[0], learners)),
                      threads=args.threads or None, device=args.device)
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    jobs: list[dict[str, Any]] = []
    for seed in seeds:
        print(f"seed {seed}: {', '.join(learners)} on {args.game}, {args.steps} steps x "
              f"{args.groups_per_step * args.group_size} episodes", flush=True)
        seed_rows, job = run_seed(args, seed, learners, ev)
        rows += seed_rows
        jobs.append(job)
    summary = summarize(rows, learners, ev)
    table, words = table_md(summary, ev, args), verdict(summary, ev)
    plot_curves(rows, learners, ev, out / "curves.png")
    caption = (f"{args.game}, {len(seeds)} seeds, {args.steps * args.groups_per_step * args.group_size} episodes per learner "
               f"against {args.opponents}; final evaluation {args.final_hands} games per stratum; mean [95% bootstrap "
               f"interval over seeds]")
    (out / "table.md").write_text(f"{caption}\n\n{table}\n\n{words}\n")
    result = {
        "provenance": prov,
        "args": asdict(args), "game": args.game, "unit": ev.unit, "wall_s": time.perf_counter() - t0,
        "rows": rows, "summary": summary, "jobs": jobs, "verdict": words, "table": table,
    }
    write_result(result, out / "compare_learners.json", args.json)
    print(f"\n{caption}\n\n{table}\n\n{words}\n")
    for j in jobs:
        print(f"seed {j['seed']}: per step rollout {j['rollout_s']:.1f} s, learning {j['learn_s']:.1f} s "
              f"(scheduler compute {j['compute_s']:.1f} s, the rest {j['rest_s']:.1f} s); job {j['wall_s']:.0f} s, "
              f"peak RSS {j['peak_rss_total_mb']:.0f} MB over its processes")
    print(f"total {result['wall_s'] / 60:.1f} min; wrote {out}/table.md, curves.png, compare_learners.json"
          + (f" and {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
