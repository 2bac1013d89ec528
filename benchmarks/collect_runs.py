"""Collect finished runs' results into one JSON file, so README figures about whole jobs trace
to a committed file: each run's first and last evaluation, its wall time, its median seconds
per step by phase, its config's seed and model settings, and the machine.

    python benchmarks/collect_runs.py runs/kuhn_poker_v0__default__0__* ... --json benchmarks/results/default_job.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import tomllib
from pathlib import Path

from _jobs import run_commit
from _machine import script_provenance

import games


def eval_curve(rows: list[dict], unit: str) -> list[dict]:
    """Every evaluation of the run: step, and per policy and opponent the unit, its 95%
    interval, the invalid rate and wins / draws / losses where the game counts them."""
    keep = (unit, "ci95", "invalid_rate", "wins", "draws", "losses")
    return [{"step": r["step"], **{k: v for k, v in r.items()
                                   if k.startswith("eval/") and "/vs_" in k and k.rsplit("/", 1)[1] in keep}}
            for r in rows if r.get("kind") == "eval"]


def exact_curve(rows: list[dict], measures: list[str]) -> list[dict]:
    """Per training step, each policy's exact measures at the step's start
    (``train/<policy>/<measure>``, e.g. the exploitability the exact exploiter is computed
    from) and its all-actions payoff and canonical mass where it trains on them; empty for a
    game without exact measures."""
    out = []
    for r in rows:
        if r.get("kind") != "train":
            continue
        kept = {k: v for k, v in r.items() if k.startswith("train/")
                and (k.rsplit("/", 1)[1] in measures or "/all_actions/" in k)}
        if kept:
            out.append({"step": r["step"], **kept})
    return out


def run_row(folder: Path) -> dict:
    """A run's row. A run stopped before its end (no ``summary.json``) is kept as far as it
    went: ``finished`` false, its last evaluation the latest one, no wall time."""
    cfg = tomllib.loads((folder / "config.toml").read_text())
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines() if line.strip()]
    evals = [{k: v for k, v in r.items() if k not in ("step", "kind")} for r in rows if r.get("kind") == "eval"]
    summary_file = folder / "summary.json"
    summary = (json.loads(summary_file.read_text()) if summary_file.is_file()
               else {"first_eval": evals[0] if evals else {}, "last_eval": evals[-1] if evals else {}, "wall_s": None})
    train = [r for r in rows if r.get("kind") == "train"]
    phases = {k: statistics.median(r[k] for r in train) for k in ("timing_s/rollout", "timing_s/learn")
              if train and all(k in r for r in train)}
    game_eval = games.evaluation(cfg["game"])
    unit = game_eval.unit
    peaks = [r["perf/scheduler_peak_rss_mb"] for r in train if "perf/scheduler_peak_rss_mb" in r]
    return {"run": folder.name, "seed": cfg["seed"], "model": cfg.get("model", {}), "steps": len(train),
            "finished": summary_file.is_file(), "game": cfg["game"], "unit": unit,
            "machine": summary.get("machine"),  # the run's own record (runs before it had none)
            **run_commit(summary),
            "config": {"lr": cfg["train"]["lr"], "entropy_coef": cfg["train"].get("entropy_coef", 0.0),
                       "advantage": cfg["train"].get("advantage", "dr_grpo"), "lam": cfg["train"].get("lam", 0.95),
                       "max_tokens": cfg["sampling"]["max_tokens"], "temperature": cfg["sampling"]["temperature"],
                       "explore": cfg["sampling"].get("explore", 0.0),
                       "steps": cfg["train"]["steps"], "lr_schedule": cfg["train"].get("lr_schedule", "constant"),
                       "groups_per_step": cfg["train"]["groups_per_step"], "group_size": cfg["train"]["group_size"],
                       "opponent_draws": cfg["train"].get("opponent_draws", "episode"),
                       "game_kwargs": cfg.get("game_kwargs", {}),
                       "all_actions": cfg["train"].get("all_actions", 0.0),
                       "all_actions_decisions": cfg["train"].get("all_actions_decisions", 0),
                       "move_values": cfg["train"].get("move_values", 0.0),
                       "move_values_against": cfg["train"].get("move_values_against", {}),
                       "move_values_settled": cfg["train"].get("move_values_settled", 0.0),
                       "opponents": {p["name"]: p.get("opponents", {}) for p in cfg.get("policies", [])},
                       "target_modules": {p["name"]: p["target_modules"] for p in cfg.get("policies", [])
                                          if "target_modules" in p}},
            "wall_s": summary["wall_s"],
            # Training and evaluation time by the run's own timers (startup left out): a stopped
            # run's time too.
            "steps_and_evals_s": sum(r.get("timing_s/rollout", 0.0) + r.get("timing_s/learn", 0.0)
                                     + r.get("timing_s/eval", 0.0) for r in rows),
            "median_s_per_step": phases, "curve": eval_curve(rows, unit),
            "exact_curve": exact_curve(rows, [m.name for m in game_eval.exact]),
            "scheduler_peak_rss_mb": max(peaks) if peaks else None,
            "first_eval": summary["first_eval"], "last_eval": summary["last_eval"]}


def plot_exact(runs: list[dict], path: Path) -> bool:
    """One panel per exact measure (e.g. the exploitability): each run's policies over the
    training steps, on a log scale, with the game's reference levels dashed. False (nothing
    written) when no run has an exact curve."""
    measures = sorted({k.rsplit("/", 1)[1] for r in runs for row in r["exact_curve"] for k in row
                       if k != "step" and "/all_actions/" not in k})
    if not measures:
        return False
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(measures), figsize=(6 * len(measures), 4), squeeze=False)
    for ax, name in zip(axes[0], measures):
        refs: dict[str, float] = {}
        for r in runs:
            keys = sorted({k for row in r["exact_curve"] for k in row if k.endswith(f"/{name}")})
            for k in keys:
                pts = [(row["step"], row[k]) for row in r["exact_curve"] if k in row]
                ax.plot(*zip(*pts), label=f"{r['run']} {k.split('/')[1]}")
            if keys:
                refs.update(games.evaluation(r["game"]).measure(name).references)
        for label, level in refs.items():
            if level > 0:  # (a log axis has no 0: the equilibrium's level is the axis' floor)
                ax.axhline(level, ls="--", c="grey", lw=0.8)
                ax.text(0.01, level, label, transform=ax.get_yaxis_transform(), va="bottom", fontsize=8, c="grey")
        ax.set(xlabel="training step", ylabel=f"{name} (at the step's start)", yscale="log", title=name)
        ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--json", type=Path, required=True)
    ap.add_argument("--note", default="", help="what these runs are (stored with them)")
    ap.add_argument("--plot", type=Path, help="a PNG of the runs' exact measures over their steps (e.g. the "
                    "exploitability of a league job)")
    args = ap.parse_args()
    # The collecting process's provenance; each run keeps its own machine (and, since it was
    # recorded, its commit) from its summary.json.
    out = {"provenance": script_provenance(args), "note": args.note, "runs": [run_row(f) for f in args.runs]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(out, indent=1))
    if args.plot is not None and not plot_exact(out["runs"], args.plot):
        print(f"no run has an exact measure: {args.plot} not written")
    for r in out["runs"]:
        ev, p = r["last_eval"], "eval/main/vs_random/"
        print(f"{r['run']}: seed {r['seed']} engine {r['model'].get('engine', 'auto')} {r['config']}: "
              f"{ev[p + r['unit']]:+.3f} ± {ev[p + 'ci95']:.3f} {r['unit']} vs random, "
              f"{100 * ev[p + 'invalid_rate']:.1f}% invalid, "
              + (f"{r['wall_s']:.0f} s" if r["finished"] else f"stopped after step {r['steps']}"))


if __name__ == "__main__":
    main()
