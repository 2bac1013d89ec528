"""The tools job from an SFT warm start: ``tools_sft`` (offline SFT on the scripted seat
``calc_tool_user``'s play), then ``tools_warm`` (the RL job started from its adapter), per seed,
one run after another.

Per seed it records the SFT job's loss on its data before and after and its wall time; the
warm RL job's success rate at every evaluation (step 0 is the SFT adapter itself, before any
RL step), its final success with the 95% interval, tool calls and invalid calls per problem,
and its wall time; each with the command line that ran it. Finished runs under ``--out`` are
reused (a JSON can be rewritten from them), so a seed that is done is never run again.

    python benchmarks/tools_warm_start.py --seeds 0,1 --backend local --json benchmarks/results/tools_warm_start.json
"""

from __future__ import annotations

import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from _args import parse_args

from _machine import provenance  # isort: skip  (first: before torch)
from _jobs import (
    eval_curve,
    final_metrics,
    opentinker,
    read_rows,
    run_logged,
    run_or_reuse,
    write_result,
)

import games
from opentinker.config import load_config
from opentinker.training import trajectory_log
from protocols.messages import ParseOutcome

SFT, RL = "tools_sft", "tools_warm"
"""The bundled jobs this script runs, as shipped (only the seed, the folder, the backend and
the warm start's adapter are set)."""


@dataclass
class Args:
    seeds: str = "0,1"
    backend: str = "local"
    out: str = "runs/tools_warm_start"
    json: str = ""
    sft_eval_games: int = 34
    """``opentinker eval`` of each SFT adapter on its own, this many problems per stratum (0: none;
    the RL run's step-0 evaluation measures it too, on 10 per stratum)."""
    note: str = ""
    """Saved with the result (e.g. what else the machine was running)."""


def run_job(args: Args, job: str, seed: int, extra: list[str]) -> tuple[Path, str, float]:
    """Run bundled ``job`` with ``seed`` (reusing a finished run of it); its folder, command
    line and wall time."""
    root = Path(args.out).resolve() / "runs"
    root.mkdir(parents=True, exist_ok=True)
    sets = [f"seed={seed}", f"out_dir={root}", f"runtime.backend={args.backend}", *extra]
    cmd = opentinker("run", job, *(x for s in sets for x in ("--set", s)))
    run, info = run_or_reuse(cmd, root, job, seed, root.parent / f"{job}_seed{seed}.log", f"{job} seed {seed}")
    return run, info["command"], info["wall_s"]


def sft_eval(args: Args, sft: Path, ev: games.GameEval) -> dict[str, Any] | None:
    """``opentinker eval`` of the SFT run's adapter against random (reused when done): its
    metrics, command line and wall time."""
    if not args.sft_eval_games:
        return None
    out = sft / "bench_eval.json"
    cmd = opentinker("eval", str(sft), "--vs", "random", "--games-per-stratum", str(args.sft_eval_games),
                     "--json", str(out))
    shown = shlex.join(["opentinker", *cmd[3:]])
    if not out.is_file():
        run_logged(cmd, sft / "bench_eval.log", f"eval {sft.name}")
    report = json.loads(out.read_text())
    return {**final_metrics(report["metrics"], "main", ev), "command": shown, "wall_s": report["wall_s"]}


def training_failures(run: Path) -> dict[str, int]:
    """The RL run's training problems (its recorded trajectories) and the unsolved ones by
    what went wrong, from each turn's parse outcome: an invalid call made; else no number in
    the last reply (or a call past the limit); else a wrong number after a good call; else a
    wrong number without a call."""
    out = dict.fromkeys(("problems", "failed", "invalid_call", "no_number", "wrong_after_call", "wrong_without_call"), 0)
    for rec in trajectory_log.read(run / "trajectories" / "main.jsonl"):
        out["problems"] += 1
        if rec.total_reward >= 1:
            continue
        out["failed"] += 1
        parses = [t.parse for t in rec.turns]
        kind = ("invalid_call" if ParseOutcome.INVALID_TOOL_CALL in parses else
                "no_number" if parses[-1] is ParseOutcome.INVALID else
                "wrong_after_call" if ParseOutcome.TOOL_CALL in parses else "wrong_without_call")
        out[kind] += 1
    return out


def one_seed(args: Args, seed: int, ev: games.GameEval) -> dict[str, Any]:
    """SFT then RL from its adapter, for ``seed``: the row of the result."""
    sft, sft_cmd, sft_wall = run_job(args, SFT, seed, [])
    summary = json.loads((sft / "summary.json").read_text())
    adapter = summary["adapters"]["main"]
    evaluated = sft_eval(args, sft, ev)
    rl, rl_cmd, rl_wall = run_job(args, RL, seed, [f"policies[0].init={adapter}"])
    rows = read_rows(rl)
    cfg = load_config(rl / "config.toml")
    evals = [r for r in rows if r["kind"] == "eval"]
    key = "eval/main/sft/loss"
    return {
        "seed": seed,
        "sft": {"run": str(sft), "command": sft_cmd, "wall_s": sft_wall, "sequences": summary["units"],
                "loss_before": summary["first_eval"][key], "loss_after": summary["last_eval"][key],
                "steps": load_config(sft / "config.toml").offline_job().steps, "eval": evaluated},
        "rl": {"run": str(rl), "command": rl_cmd, "wall_s": rl_wall, "steps": cfg.train.steps,
               "curve": [{**c, **{m: r[f"eval/main/vs_random/{m}"] for m in ("ci95", "tool_calls", "invalid_tool_calls")}}
                         for c, r in zip(eval_curve(rows, "main", ev, cfg.train.groups_per_step * cfg.train.group_size),
                                         evals, strict=True)],
               "start": final_metrics(evals[0], "main", ev), "final": final_metrics(evals[-1], "main", ev),
               "training_failures": training_failures(rl)},
    }


def main() -> None:
    args = parse_args(Args, __doc__)[0]
    seeds = [int(s) for s in args.seeds.split(",")]
    ev = games.evaluation("calculator_v0")
    prov = provenance([Path(sys.argv[0]).name, *sys.argv[1:]], asdict(args))
    t0 = time.perf_counter()
    rows = []
    for seed in seeds:
        print(f"seed {seed}: {SFT}, then {RL} from its adapter", flush=True)
        rows.append(one_seed(args, seed, ev))
    result = {"provenance": prov, "args": asdict(args), "game": "calculator_v0", "unit": ev.unit, "rows": rows,
              "wall_s": time.perf_counter() - t0}
    write_result(result, Path(args.out) / "tools_warm_start.json", args.json)
    for row in rows:
        s, r = row["sft"], row["rl"]
        curve = ", ".join(f"{c[ev.unit]:.3f} ({c['step']})" for c in r["curve"])
        alone = f" ({ev.unit} {s['eval'][ev.unit]:.3f} ± {s['eval']['ci95']:.3f} alone)" if s.get("eval") else ""
        print(f"seed {row['seed']}: SFT loss {s['loss_before']:.3f} -> {s['loss_after']:.3f} in {s['wall_s'] / 60:.1f} min{alone}; "
              f"RL {ev.unit} {curve}, final {r['final'][ev.unit]:.3f} ± {r['final']['ci95']:.3f}, "
              f"{r['final'].get('tool_calls', 0):.2f} calls ({r['final'].get('invalid_tool_calls', 0):.2f} invalid) "
              f"per problem, {r['wall_s'] / 60:.1f} min")


if __name__ == "__main__":
    main()
