"""LoRA against full-parameter training: the same job, the same seeds, one run per (kind, seed).

Each run is ``opentinker run`` of the same job: by default a Kuhn poker job (the one
``compare_learners.py`` runs, with one policy); with ``--game`` another game's bundled job
(``--game calculator_v0``: the ``tools`` job, whose flags' values it takes for every flag left
at its default, and a success rate of ``--target 0.5``). Each job runs once with ``kind = "lora"`` (an adapter on the
shared base model) and once with ``kind = "full"`` (a private copy of every base weight on the
same scheduler, AdamW on all of them), each at its own learning rate (``--lora_lr``,
``--full_lr``: full fine-tuning wants a far smaller step). Measured per run, then as ratios
full / LoRA (mean over seeds):

* time to the same evaluation result: the job's training wall-clock (rollout + learning,
  evaluations left out) and its episodes, at the first evaluation with ``<unit>`` against
  random at or above ``--target``; the final ``<unit>`` with its 95% interval;
* seconds per training step, and the learner's own update time per step (``learn_s``);
* peak memory: the sum over the job's processes and the largest process (the scheduler,
  which holds the weights, the optimizer states and the activations), sampled every 0.5 s;
* training throughput: loss tokens per second of the learner's update, and the engine's
  sampling rate (decode tokens per second).

With ``--warm`` (``calculator_v0``), each kind starts from its own SFT on the game's scripted
seat, as a user would run it: the bundled SFT job (``tools_sft``) with that kind (LoRA at its
own rate, full training at ``--sft_full_lr``), then the warm RL job (``tools_warm``) with
``policies[0].init`` at the SFT's saved weights. Time to the target then counts the SFT job's
training time too, and the peaks are the larger of the two jobs'.

The OpenTinker paper reports LoRA about 3x faster and using about 40% less memory than full
training; the script says whether that holds on this machine and model.

    python benchmarks/lora_vs_full.py --json benchmarks/results/lora_vs_full.json
    python benchmarks/lora_vs_full.py --game calculator_v0 --json benchmarks/results/lora_vs_full_tools.json
    python benchmarks/lora_vs_full.py --game calculator_v0 --warm --json benchmarks/results/lora_vs_full_tools_warm.json
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from _args import parse_args

from _machine import provenance  # isort: skip  (first: before torch)
from _jobs import (
    PEAK_KEYS,
    bootstrap_ci,
    eval_curve,
    final_metrics,
    job_phases,
    model_table,
    opponent_mix,
    read_rows,
    run_config,
    to_target,
    write_result,
)

import games
from games.tool_use import find_tool_use
from opentinker.config import JobConfig, load_config

KINDS = ("lora", "full")
PAPER = {"speedup": 3.0, "memory_saving": 0.40}
"""The paper's claim: LoRA ~3x faster than full training and ~40% less memory."""


@dataclass
class Args:
    game: str = "kuhn_poker_v0"
    """Kuhn poker, or a game of ``GAME_JOBS`` (its bundled job)."""
    seeds: str = "0,1"
    full_seeds: str = ""
    """Seeds of the full-training runs, a subset of ``seeds`` (``""``: all of them); the ratios
    are over the seeds that have both kinds."""
    model: str = "smollm2-135m"
    steps: int = 24
    groups_per_step: int = 8
    group_size: int = 4
    lora_lr: float = 1e-3
    full_lr: float = 1e-5
    max_tokens: int = 2
    opponents: str = "random=0.75,self=0.25"
    eval_every: int = 3
    eval_hands: int = 10
    final_hands: int = 20
    target: float = -0.5
    """The evaluation result both kinds are timed to: chips/hand against random (-0.5: half
    the way from the untrained policy's -1 to breaking even, most replies valid)."""
    backend: str = "ray"
    threads: int = 0
    device: str = "cpu"
    out: str = "runs/lora_vs_full"
    json: str = ""
    quick: bool = False
    """A smoke run: the tiny random model, one seed, two steps, local backend (the test's)."""
    note: str = ""
    """Saved with the result (e.g. what else the machine was running)."""
    warm: bool = False
    """Start each kind from its own SFT on the game's scripted seat (``WARM_JOBS``)."""
    sft_full_lr: float = 2e-5
    """The full-training SFT's learning rate (LoRA's SFT keeps its job's)."""


QUICK = {"model": "tiny-random", "seeds": "0", "steps": 2, "groups_per_step": 2, "group_size": 2, "eval_every": 1,
         "eval_hands": 1, "final_hands": 1, "backend": "local", "threads": 1, "max_tokens": 4}
GAME = "kuhn_poker_v0"
GAME_JOBS = {"calculator_v0": ("tools", 0.5)}
"""Other games: (the bundled job this script runs, the target of its unit)."""
WARM_JOBS = {"calculator_v0": ("tools_sft", "tools_warm", 0.95)}
"""Games with a warm start (``--warm``): (the SFT job, the RL job it starts, the target)."""


def rl_job(args: Args) -> tuple[str, float] | None:
    """The bundled RL job ``args`` run and its target (``None``: Kuhn poker's job, built here)."""
    if args.warm:
        if args.game not in WARM_JOBS:
            raise SystemExit(f"--warm: lora_vs_full has a warm start for {', '.join(WARM_JOBS)} only")
        return WARM_JOBS[args.game][1], WARM_JOBS[args.game][2]
    if args.game == GAME:
        return None
    if args.game not in GAME_JOBS:
        raise SystemExit(f"--game {args.game!r}: lora_vs_full knows {GAME} and {', '.join(GAME_JOBS)}")
    return GAME_JOBS[args.game]


def bundled(args: Args) -> dict[str, Any]:
    """The bundled RL job ``args`` run, as a dict (``{}`` for Kuhn poker, whose job is built here)."""
    job = rl_job(args)
    return {} if job is None else msgspec.to_builtins(load_config(job[0]))


def game_defaults(args: Args) -> Args:
    """``args`` with every flag still at its (Kuhn poker) default set from the game's bundled job."""
    job = bundled(args)
    if not job:
        return args
    name, target = rl_job(args)  # type: ignore[misc]
    t, e, p = job["train"], job["eval"], job["policies"][0]
    own = {"steps": t["steps"], "groups_per_step": t["groups_per_step"], "group_size": t["group_size"],
           "lora_lr": t["lr"], "max_tokens": job["sampling"]["max_tokens"], "eval_every": e["every"],
           "eval_hands": e["hands_per_stratum"], "final_hands": e["final_hands_per_stratum"],
           "opponents": ",".join(f"{k}={v:g}" for k, v in p["opponents"].items()), "target": target,
           "out": f"runs/lora_vs_full_{name}"}
    default = Args()
    return replace(args, **{k: v for k, v in own.items() if getattr(args, k) == getattr(default, k)})


def job_config(args: Args, kind: str, seed: int, init: str = "") -> JobConfig:
    """The job of one (kind, seed): one policy ``main`` of that kind (from the saved weights at
    ``init``, if given), all else shared (a bundled job's other settings, e.g. its system prompt
    and exploration, kept)."""
    job = bundled(args)
    return msgspec.convert({
        **job,
        "name": f"lvf_{kind}", "seed": seed, "game": args.game, "out_dir": str(Path(args.out).resolve() / "runs"),
        "model": model_table(args.model, args.device, args.threads),
        "policies": [{"name": "main", "kind": kind, "opponents": opponent_mix(args.opponents), "init": init}],
        "train": {**job.get("train", {}), "steps": args.steps, "groups_per_step": args.groups_per_step,
                  "group_size": args.group_size, "lr": args.lora_lr if kind == "lora" else args.full_lr,
                  "checkpoint_every": 0},
        "sampling": {**job.get("sampling", {}), "max_tokens": args.max_tokens},
        "eval": {**job.get("eval", {}), "every": args.eval_every, "hands_per_stratum": args.eval_hands,
                 "final_hands_per_stratum": args.final_hands, "head_to_head_per_stratum": 0, "ratings": False},
        "runtime": {"backend": args.backend},
    }, JobConfig)


def sft_config(args: Args, kind: str, seed: int) -> JobConfig:
    """The warm start's SFT job of one (kind, seed): the game's bundled SFT job with one policy
    of that kind (full training at ``--sft_full_lr``)."""
    job = msgspec.to_builtins(load_config(WARM_JOBS[args.game][0]))
    policy = {**job["policies"][0], "kind": kind}
    train = {**job["train"], "lr": job["train"]["lr"] if kind == "lora" else args.sft_full_lr}
    return msgspec.convert({
        **job, "name": f"lvf_sft_{kind}", "seed": seed, "out_dir": str(Path(args.out).resolve() / "runs"),
        "model": model_table(args.model, args.device, args.threads), "policies": [policy], "train": train,
        "runtime": {"backend": "local"},
    }, JobConfig)


def run_one(args: Args, kind: str, seed: int, ev: games.GameEval) -> dict[str, Any]:
    """One (kind, seed) run, after its SFT with ``--warm`` (each reused when its folder is
    already finished); its row."""
    sft: dict[str, Any] | None = None
    init = ""
    if args.warm:
        sft_run, sft_job = run_config(sft_config(args, kind, seed), Path(args.out).resolve(), f"{kind} seed {seed} sft")
        summary = json.loads((sft_run / "summary.json").read_text())
        loss = "eval/main/sft/loss"
        sft = {**sft_job, "run": str(sft_run), "train_wall_s": summary["wall_s"],
               "loss_first": summary["first_eval"][loss], "loss_last": summary["last_eval"][loss]}
        init = summary["adapters"]["main"]
    run, job = run_config(job_config(args, kind, seed, init), Path(args.out).resolve(), f"{kind} seed {seed}")
    rows = read_rows(run)
    trains = [r for r in rows if r["kind"] == "train"]
    curve = eval_curve(rows, "main", ev, args.groups_per_step * args.group_size)
    med = lambda k: statistics.median(r[k] for r in trains)
    target = to_target(curve, ev.unit, args.target)
    if sft is not None:  # the SFT's time counts toward the target, and the larger peak is the kind's
        if target["wall_s_to_target"] is not None:
            target["wall_s_to_target"] += sft["train_wall_s"]
        job = {**job, **{k: max(job[k], sft[k]) for k in PEAK_KEYS}}
    return {
        "learner": kind, "kind": kind, "seed": seed, "run": str(run), "curve": curve, "sft": sft,
        "final": final_metrics(next(r for r in reversed(rows) if r["kind"] == "eval"), "main", ev),
        "s_per_step": med("timing_s/rollout") + med("timing_s/learn"),
        "learn_s_per_step": med("train/main/learn_s"),
        "train_tokens_per_s": statistics.median(r["train/main/n_loss_tokens"] / r["train/main/learn_s"] for r in trains),
        "decode_tokens_per_s": med("perf/engine/decode_tokens_per_s"),
        **job_phases(run, {k: job[k] for k in PEAK_KEYS}, job["wall_s"] + (sft or {}).get("wall_s", 0.0)),
        **target,
    }


def scripted_baselines(game: str, n: int = 200) -> dict[str, dict[str, float]]:
    """A one-seat task's scripted seats (its evaluation hook's), each over ``n`` seeded
    episodes: the mean reward with its 95% normal interval, and tool calls per episode."""
    ev = games.evaluation(game)
    if len(games.make(game).possible_agents) != 1:
        return {}
    out = {}
    for name in ev.scripted:
        seat, rng, rewards, calls = games.make_scripted(name), np.random.default_rng(0), [], 0
        for seed in range(n):
            env = games.make(game)
            env.reset(seed=10_000 + seed)
            total = 0.0
            for _ in env.agent_iter(max_iter=100):
                obs, _, term, trunc, info = env.last()
                env.step(None if term or trunc else seat.act(obs["text"], info, rng))
                total += sum(env.rewards.values())
            rewards.append(total)
            box = find_tool_use(env)
            calls += sum(box.tool_calls.values()) if box else 0
        x = np.asarray(rewards)
        out[name] = {ev.unit: float(x.mean()), "ci95": float(1.96 * x.std(ddof=1) / np.sqrt(n)),
                     "tool_calls": calls / n, "episodes": n}
    return out


def ratios(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """full / LoRA of each measure, per seed and as the mean over seeds with its bootstrap
    interval (over the seeds run with both kinds; time to target only where both reached it)."""
    out: dict[str, dict[str, float]] = {}
    keys = ("s_per_step", "learn_s_per_step", "peak_rss_total_mb", "peak_rss_largest_mb", "train_tokens_per_s",
            "decode_tokens_per_s", "wall_s_to_target")
    seeds = sorted({r["seed"] for r in rows})
    both = [s for s in seeds if {r["kind"] for r in rows if r["seed"] == s} >= set(KINDS)]
    for k in keys:
        per_seed = []
        for s in both:
            lora, full = (next(r for r in rows if r["seed"] == s and r["kind"] == kind) for kind in KINDS)
            if lora[k] and full[k] is not None:
                per_seed.append(full[k] / lora[k])
        if per_seed:
            m, lo, hi = bootstrap_ci(per_seed)
            out[k] = {"mean": m, "lo": lo, "hi": hi, "per_seed": per_seed}
    return out


def claim(r: dict[str, dict[str, float]]) -> str:
    """Whether each half of the paper's claim holds here, in words, from the measured ratios."""
    speed = r["s_per_step"]["mean"]
    mem = 1 - 1 / r["peak_rss_largest_mb"]["mean"]
    fast, small = speed >= PAPER["speedup"], mem >= PAPER["memory_saving"]
    parts = [(f"full training takes {speed:.2f}x LoRA's time per step (paper: LoRA ~{PAPER['speedup']:.0f}x faster: "
              f"{'holds' if fast else 'does not hold'} here)"),
             (f"LoRA's scheduler peaks at {abs(100 * mem):.0f}% {'less' if mem >= 0 else 'more'} memory than full "
              f"training's (paper: ~{100 * PAPER['memory_saving']:.0f}% less: {'holds' if small else 'does not hold'} "
              "here)")]
    if "wall_s_to_target" in r:
        n = len(r["wall_s_to_target"]["per_seed"])
        parts.append(f"time to the target result, on the {n} seed(s) where both kinds reached it: full / LoRA = "
                     f"{r['wall_s_to_target']['mean']:.2f}")
    else:
        parts.append("time to the target result: not reached by both kinds on any seed within the budget")
    verdict = ("The paper's claim holds here." if fast and small else
               "The paper's claim holds here in part." if fast or small else "The paper's claim does not hold here.")
    return "; ".join(parts) + ". " + verdict


def main() -> None:
    args = game_defaults(parse_args(Args, __doc__, quick=QUICK)[0])
    seeds = [int(s) for s in args.seeds.split(",")]
    ev = games.evaluation(args.game)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    configs = {k: msgspec.to_builtins(job_config(args, k, seeds[0])) for k in KINDS}
    if args.warm:
        configs.update({f"sft_{k}": msgspec.to_builtins(sft_config(args, k, seeds[0])) for k in KINDS})
    prov = provenance([Path(sys.argv[0]).name, *sys.argv[1:]], configs, args.threads or None, args.device)
    t0 = time.perf_counter()
    full_seeds = [int(s) for s in args.full_seeds.split(",")] if args.full_seeds else seeds
    rows = []
    for seed in seeds:
        for kind in (k for k in KINDS if k == "lora" or seed in full_seeds):
            print(f"{kind}, seed {seed}: {args.steps} steps x {args.groups_per_step * args.group_size} episodes", flush=True)
            rows.append(run_one(args, kind, seed, ev))
    r = ratios(rows)
    words = claim(r)
    result = {"provenance": prov, "args": asdict(args), "game": args.game, "unit": ev.unit, "rows": rows, "ratios": r,
              "claim": words, "paper": PAPER, "scripted": scripted_baselines(args.game),
              "wall_s": time.perf_counter() - t0, "runs_wall_s": sum(row["wall_s"] for row in rows)}
    write_result(result, out / "lora_vs_full.json", args.json)
    print()
    for row in rows:
        f = row["final"]
        reach = "never" if row["wall_s_to_target"] is None else f"{row['wall_s_to_target']:.0f} s"
        ci = "" if f["ci95"] is None else f" ± {f['ci95']:.3f}"  # no interval: every game the same
        print(f"{row['kind']:>4} seed {row['seed']}: {f[ev.unit]:+.3f}{ci} {ev.unit} vs random, "
              f"{row['s_per_step']:.1f} s/step (learn {row['learn_s_per_step']:.1f} s), to {args.target:+g}: {reach}, "
              f"peak RSS {row['peak_rss_largest_mb']:.0f} MB (all processes {row['peak_rss_total_mb']:.0f} MB), "
              f"{row['train_tokens_per_s']:.0f} loss tokens/s")
    print("\nfull / LoRA (mean over seeds [95% bootstrap interval]):")
    for k, v in r.items():
        print(f"  {k}: {v['mean']:.2f} [{v['lo']:.2f}, {v['hi']:.2f}]")
    print(f"\n{words}\nwrote {out}/lora_vs_full.json" + (f" and {args.json}" if args.json else ""))


if __name__ == "__main__":
    main()
