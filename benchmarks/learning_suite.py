"""Every bundled job on several seeds: does each one learn, on every seed, and what does it cost?

For each job and seed the suite runs ``opentinker run JOB --set seed=S`` into
``OUT/JOB/seedS/``, then evaluates the trained adapters once more with ``opentinker eval`` against
random, every scripted seat of the game and the untrained base model (``--games-per-stratum``
games per start and seat, fewer for the long dialogue games: 95% stratified intervals, wins /
draws / losses, invalid rate). A seed's result goes to ``OUT/JOB/seedS/result.json``; a seed
whose result exists (with the same job, model and overrides) is reused, a finished run is
evaluated without running it again, and a stopped one goes on from its newest checkpoint
(``resumed_from_step`` in its row; its wall time counts the time up to that checkpoint, its
peak memory is the last attempt's), so the suite can be run a few jobs at a time and stopped at
any point: Ctrl-C (SIGINT) stops the run in progress after its step with a checkpoint of it,
SIGTERM at once with its newest; either way no further seed starts, the results so far are
gathered into the JSON, and the suite exits 130. Invocations may share ``--out``: a seed another one is making
now (its run or its evaluation, under a lock in its folder) fails with an error for that seed and
the others go on. The rows of the JSON at ``--json`` (the committed one by default) that were made
with their job's config as it stands are written back under ``OUT`` first, so a fresh checkout
adds seeds to the committed results instead of running them all again.

Per seed: the curve of every policy's evaluations against random over the run, the final
evaluation by opponent, the run's wall time, the peak resident memory of all its processes
together and of the largest (sampled every 0.5 s), and the scheduler's own peak
(``perf/scheduler_peak_rss_mb``). Per job, the verdict the issue asks for: the trained policy
beats its untrained self (final minus step-0 score against random, lower 95% bound above 0)
and, in a competitive game, beats random (lower bound above 0), on every seed.

The JSON gathers every ``result.json`` under ``OUT`` (not only this invocation's jobs), with
the machine and each job's whole config (TOML, every default written out); the plot draws
each job's curves, one line per seed and policy.

    python benchmarks/learning_suite.py --jobs default,tictactoe --seeds 0,1,2
    python benchmarks/learning_suite.py --quick          # tiny-random, 1 step: the plumbing only
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import math
import tomllib
from pathlib import Path
from typing import Any

from _args import parse_args
from _jobs import (
    PEAK_KEYS,
    Stopped,
    claimed,
    finished_run,
    opentinker,
    read_rows,
    run_commit,
    run_logged,
    run_or_reuse,
    stopped_run,
)
from _machine import script_provenance

import games
from opentinker.config import load_config, to_toml
from opentinker.control.checkpoints import latest_checkpoint
from opentinker.eval.report import rating_history

SUITE = ("default", "tictactoe", "negotiation", "referential", "twenty_questions", "prisoners_dilemma",
         "liars_dice", "connect_four", "negotiation_three", "kuhn_pair")
"""The bundled jobs the suite runs by default, in its table's order."""


EVAL_GAMES = {"twenty_questions": 8, "negotiation": 8, "negotiation_three": 8, "prisoners_dilemma": 8}
"""The suite's final evaluation games per start and seat for jobs whose games are long dialogues
(twenty questions' untrained evaluation took 163 s for 48 games per opponent on 2 cores, so 34 per
stratum would take about half an hour per opponent; the prisoner's dilemma's, 758 s for 120 games
against each of 3 opponents); every other job: :data:`DEFAULT_EVAL_GAMES`."""
DEFAULT_EVAL_GAMES = 34


EVAL_TIMEOUT_S = 3600
"""The final evaluation's longest wait for one batch of games: a batch of connect four games
against the base model took over the run's 900 s on this 2-core machine (seed 2), where seed 1's
had taken about 300."""


def eval_games(args: Args, job: str) -> int:
    """Final evaluation games per start and seat for ``job``: ``--eval-games`` where given, else
    the job's budget."""
    return args.eval_games or EVAL_GAMES.get(job, DEFAULT_EVAL_GAMES)


@dataclasses.dataclass
class Args:
    jobs: str = ",".join(SUITE)
    seeds: str = "0,1,2"
    out: str = "runs/suite"
    json: str = "benchmarks/results/learning_suite.json"
    plot: str = "benchmarks/results/learning_suite.png"
    model: str = ""
    """Another base model for every job (e.g. ``tiny-random``); default: each job's own."""
    steps: int = 0
    """Training steps for every job; 0: each job's own."""
    eval_games: int = 0
    """Final evaluation games per start and seat, for each opponent; 0: each job's budget
    (:data:`EVAL_GAMES`)."""
    threads: int = 0
    backend: str = ""
    """``local`` or ``ray`` for every job; default: each job's own."""
    note: str = ""
    """What these runs are, kept in the JSON (e.g. the machine was shared)."""
    quick: bool = False


QUICK = {"jobs": "default", "seeds": "0", "out": "/tmp/opentinker-suite-quick", "model": "tiny-random", "steps": 1,
         "eval_games": 2, "json": "/tmp/opentinker-suite-quick/learning_suite.json",
         "plot": "/tmp/opentinker-suite-quick/learning_suite.png", "backend": "local"}


def overrides(args: Args, seed: int, out_dir: Path) -> list[str]:
    """The ``--set`` items of a seed's run: its seed and folder, and the suite-wide overrides."""
    sets = [f"seed={seed}", f"out_dir={out_dir}"]
    sets += [f"model.base={args.model}"] if args.model else []
    sets += [f"train.steps={args.steps}"] if args.steps else []
    sets += [f"model.threads={args.threads}"] if args.threads else []
    sets += [f"runtime.backend={args.backend}"] if args.backend else []
    return sets


def final_by_opponent(report: dict[str, Any], policy: str) -> dict[str, dict[str, float]]:
    """``opentinker eval``'s metrics for ``policy``: opponent -> the unit, its 95% interval,
    invalid rate, games, wins / draws / losses where the game has them."""
    out: dict[str, dict[str, float]] = {}
    prefix = f"eval/{policy}/vs_"
    for key, value in report["metrics"].items():
        if key.startswith(prefix) and value is not None:
            opponent, _, metric = key[len(prefix):].partition("/")
            out.setdefault(opponent, {})[metric] = value
    return out


def curves(rows: list[dict[str, Any]], policies: list[str], unit: str) -> dict[str, list[dict[str, float]]]:
    """Policy -> its evaluations against random over the run: step, the unit, its interval."""
    return {p: [{"step": r["step"], unit: r[f"eval/{p}/vs_random/{unit}"], "ci95": r[f"eval/{p}/vs_random/ci95"]}
                for r in rows if r["kind"] == "eval" and f"eval/{p}/vs_random/{unit}" in r]
            for p in policies}


def learned(curve: list[dict[str, float]], final: dict[str, dict[str, float]], unit: str, competitive: bool) -> dict[str, Any]:
    """Whether a policy learned: final minus step-0 score against random with the interval of
    the difference (independent games: the half-widths add in quadrature), and in a competitive
    game the final score against random with its lower bound."""
    first, last = curve[0], curve[-1]
    gain = last[unit] - first[unit]
    half = math.hypot(last["ci95"], first["ci95"])
    out: dict[str, Any] = {"gain_vs_untrained": gain, "gain_ci95": half, "beats_untrained": gain - half > 0}
    rnd = final.get("random")
    if competitive and rnd is not None:
        out["beats_random"] = rnd[unit] - rnd["ci95"] > 0
    return out


@dataclasses.dataclass(frozen=True)
class Target:
    """A job's target (the issue's, with its anchor): every policy's final score against
    random at least ``vs_random`` (the game's exact measure ``exact_vs_random`` of the final
    policy instead of the sampled score where the row has it: the same number without the
    sampling noise); at least ``drawn`` of its games against the scripted seat ``drawn_vs``
    drawn; the run's wall time at most ``minutes``."""

    vs_random: float | None = None
    exact_vs_random: str = ""
    drawn_vs: str = ""
    drawn: float = 0.0
    minutes: float | None = None
    anchor: str = ""


TARGETS = {
    "default": Target(vs_random=0.30, exact_vs_random="value_vs_random",
                      anchor="+0.30 chips/hand against random on every seed"),
    "tictactoe": Target(vs_random=0.6, drawn_vs="tictactoe_minimax", drawn=0.5, minutes=30.0,
                        anchor="tinker-cookbook's recipe draws every game against minimax by step 40 (a 4B "
                               "model); here: +0.6 against random, half drawn against minimax, in 30 minutes"),
}
"""The jobs with a target to meet besides learning, by job name."""


def meets(row: dict[str, Any], target: Target) -> dict[str, Any]:
    """Each of ``target``'s checks on a seed's row (its final evaluation and wall time): the
    value, and ``met`` when every check holds for every policy."""
    checks: dict[str, Any] = {}
    for policy, final in row["final"].items():
        if target.vs_random is not None:
            checks[f"{policy}/vs_random"] = final["random"][row["unit"]]
            exact = row.get("exact", {}).get(policy, {}).get(target.exact_vs_random)
            if exact is not None:
                checks[f"{policy}/vs_random_exact"] = exact
        if target.drawn_vs:
            m = final[target.drawn_vs]
            checks[f"{policy}/drawn_vs_{target.drawn_vs}"] = m["draws"] / (m["wins"] + m["draws"] + m["losses"])
    met = all(checks.get(f"{p}/vs_random_exact", checks[f"{p}/vs_random"]) >= target.vs_random
              for p in row["final"] if f"{p}/vs_random" in checks)
    met &= all(v >= target.drawn for k, v in checks.items() if "/drawn_vs_" in k)
    if target.minutes is not None:  # unknown for a run whose time counts from a resumed step only
        checks["minutes"] = None if row.get("wall_s_from_step") else row["wall_s"] / 60
        met &= checks["minutes"] is not None and checks["minutes"] <= target.minutes
    return {**checks, "met": met}


@functools.cache
def config_sha256(job: str) -> str:
    """The hash of ``job``'s bundled config as it stands (its whole TOML, every default
    written out): a seed run under another config (a default changed since) is neither reused
    nor gathered. A field added since, at a value that does what the code did before it
    (:data:`NEUTRAL_FIELDS`), is left out, so adding it keeps the results made before."""
    table, lines = "", []
    for line in to_toml(load_config(job, {})).decode().splitlines():
        table = line if line.startswith("[") else table
        if (table, line) not in NEUTRAL_FIELDS:
            lines.append(line)
    return hashlib.sha256(("\n".join(lines) + "\n").encode()).hexdigest()


NEUTRAL_FIELDS = {("[train]", 'opponent_draws = "episode"'), ("[train]", "all_actions_decisions = 0"),
                  ("[train]", "move_values = 0.0"), ("[train]", "move_values_settled = 0.0"),
                  ("[train.move_values_against]", "[train.move_values_against]"), ("[train.move_values_against]", "")}
"""(TOML table, line) of the config fields added after suite results were made, at the value
that behaves as the code did before them; add a field here when adding it to the config (an
empty table: its header line and its blank line, ``(table, "")``)."""


def run_seed(args: Args, job: str, seed: int) -> dict[str, Any]:
    """One seed of ``job``: run (or reuse) it, evaluate it, and return its result row."""
    cfg = load_config(job, {})
    sha = config_sha256(job)
    folder = Path(args.out) / job / f"seed{seed}-{sha[:8]}"  # a changed job config runs afresh
    key = {"job": job, "seed": seed, "sets": overrides(args, seed, folder), "eval_games": eval_games(args, job),
           "config_sha256": sha}
    result = folder / "result.json"
    if result.is_file():
        row = json.loads(result.read_text())
        if portable(row.get("key", {})) == portable(key):
            print(f"  [{job} seed {seed}] reused {result}")
            return row
    with claimed(folder / ".seed.lock", f"{job} seed {seed}"):  # its run and its evaluation
        return _run_seed(args, job, seed, cfg.name, folder, key)


def _run_seed(args: Args, job: str, seed: int, name: str, folder: Path, key: dict[str, Any]) -> dict[str, Any]:
    """:func:`run_seed`'s run, evaluation and row, under its lock; the row goes to
    ``folder/result.json``."""
    sets = [x for s in overrides(args, seed, folder) for x in ("--set", s)]
    run, info = run_or_reuse(opentinker("run", job, *sets), folder, name, seed, folder / "run.log", f"{job} seed {seed}")
    mem = {k: info[k] for k in PEAK_KEYS if k in info}
    run_cfg = tomllib.loads((run / "config.toml").read_text())
    game = run_cfg["game"]
    ev = games.evaluation(game)
    vs = ["random", "base", *ev.scripted]
    report_path = folder / "eval.json"
    if not report_path.is_file():
        cmd = opentinker("eval", str(run), "--vs", ",".join(vs), "--games-per-stratum", str(key["eval_games"]),
                         "--json", str(report_path), "--backend", "local", "--timeout", str(EVAL_TIMEOUT_S))
        cmd += ["--threads", str(args.threads)] if args.threads else []
        run_logged(cmd, folder / "eval.log", f"{job} seed {seed} eval")
    report = json.loads(report_path.read_text())
    rows = read_rows(run)
    summary = json.loads((run / "summary.json").read_text())
    policies = [p["name"] for p in run_cfg["policies"]]
    curve = curves(rows, policies, ev.unit)
    final = {p: final_by_opponent(report, p) for p in policies}
    exact = {p: {m.name: report["metrics"][f"eval/{p}/{m.name}"] for m in ev.exact
                 if report["metrics"].get(f"eval/{p}/{m.name}") is not None} for p in policies}
    row = {
        "key": key, "job": job, "seed": seed, "game": game, "unit": ev.unit, "label": ev.label,
        "competitive": ev.competitive, "run": run.name, "steps": run_cfg["train"]["steps"],
        "model": run_cfg["model"]["base"], "wall_s": summary["wall_s"], "machine": summary.get("machine"),
        **{k: v for k, v in (("resumed_from_step", info.get("resumed_from_step")),
                             ("wall_s_from_step", summary.get("wall_s_from_step"))) if v is not None},
        **run_commit(summary), **mem,
        "scheduler_peak_rss_mb": max((r["perf/scheduler_peak_rss_mb"] for r in rows
                                      if "perf/scheduler_peak_rss_mb" in r), default=None),
        "curve": curve, "final": final, "exact": exact, "eval_wall_s": report["wall_s"],
        "learned": {p: learned(curve[p], final[p], ev.unit, ev.competitive) for p in policies if curve[p]},
        "ratings": [{"step": h["step"], "ratings": {p: list(h["ratings"][p]) for p in policies if p in h["ratings"]}}
                    for h in rating_history(rows)],
    }
    (folder / "result.json").write_text(json.dumps(row, indent=1))
    return row


def portable(key: dict[str, Any]) -> dict[str, Any]:
    """A seed's key without the folder it ran in (``out_dir=``), so a result made under another
    ``--out`` (another checkout's, restored by :func:`restore`) is reused as one made here."""
    return {**key, "sets": [s for s in key.get("sets", []) if not s.startswith("out_dir=")]}


def restore(out: Path, earlier: Path) -> list[Path]:
    """Write each row of an earlier suite JSON (the committed one) that was made with its job's
    config as it stands as its seed's ``result.json`` under ``out``, where none is there: a fresh
    checkout then reuses and gathers the seeds already run instead of running them again. Rows
    of another config are left out (they would be neither reused nor gathered). Returns the
    files written."""
    if not earlier.is_file():
        return []
    try:
        rows = [(row, row["job"], row["seed"], row["key"]["config_sha256"])
                for row in json.loads(earlier.read_text())["rows"]]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise SystemExit(f"--json {earlier}: not a learning suite JSON to resume from ({e!r}); "
                         "move it away to start afresh") from e
    written = []
    for row, job, seed, sha in rows:
        if job not in SUITE or sha != config_sha256(job):
            continue
        result = out / job / f"seed{seed}-{sha[:8]}" / "result.json"
        if not result.is_file():
            result.parent.mkdir(parents=True, exist_ok=True)
            result.write_text(json.dumps({k: v for k, v in row.items() if k != "target"}, indent=1))
            written.append(result)
    return written


def unfinished(out: Path) -> list[str]:
    """A line for each seed under ``out`` of its job's config as it stands that has no result
    yet but something to go on from: a run not finished with a checkpoint (stopped, or running
    now; the next invocation for the seed resumes a stopped one) or a finished run whose final
    evaluation is still to run."""
    lines = []
    for job in SUITE:
        cfg, sha = load_config(job, {}), config_sha256(job)
        for folder in sorted((out / job).glob(f"seed*-{sha[:8]}")):
            seed = folder.name.removeprefix("seed").partition("-")[0]
            if (folder / "result.json").is_file() or not seed.isdigit():
                continue
            again = f"--jobs {job} --seeds {seed}"
            if finished_run(folder, cfg.name, int(seed)) is not None:
                lines.append(f"{job} seed {seed}: trained; its final evaluation runs with {again}")
            elif (stopped := stopped_run(folder, cfg.name, int(seed), verified=False)) is not None:
                steps = tomllib.loads((stopped[0] / "config.toml").read_text())["train"]["steps"]
                due = (" (written before its evaluation, which runs first)"
                       if latest_checkpoint(stopped[0]).eval_due else "")
                lines.append(f"{job} seed {seed}: not finished, with the checkpoint of step {stopped[1]} of {steps}"
                             f"{due}; {again} goes on from it")
    return lines


def gather(out: Path) -> list[dict[str, Any]]:
    """Every seed's result under ``out`` made with its job's config as it stands now, in the
    suite's job order, then by seed; a job with a target gets its checks (:func:`meets`)."""
    rows = []
    for p in sorted(out.glob("*/seed*/result.json")):
        row = json.loads(p.read_text())
        if row["job"] in SUITE and row["key"].get("config_sha256") == config_sha256(row["job"]):
            if row["job"] in TARGETS:
                row["target"] = meets(row, TARGETS[row["job"]])
            rows.append(row)
        else:
            print(f"  skipped {p}: made with another config of {row['job']}")
    order = {job: i for i, job in enumerate(SUITE)}
    return sorted(rows, key=lambda r: (order.get(r["job"], len(order)), r["job"], r["seed"]))


def scripted_reference(game: str, game_kwargs: dict[str, Any], n_games: int = 400) -> dict[str, dict[str, float]]:
    """What the game's scripted seats score, the yardstick for a trained policy: each one
    with itself and with random, ``n_games`` games with the seats alternating (the first
    agent's seat the scripted one's in even games), its mean unit per game and a 95% normal
    interval."""
    import numpy as np

    from games.scripted import make_scripted

    out: dict[str, dict[str, float]] = {}
    for name in games.evaluation(game).scripted:
        for partner in (name, "random"):
            env, rng, totals = games.make(game, **game_kwargs), np.random.default_rng(0), []
            for g in range(n_games):
                env.reset(seed=g)
                mine = env.possible_agents[g % len(env.possible_agents)]
                seats = {a: make_scripted(name if a == mine else partner) for a in env.possible_agents}
                total = 0.0
                for agent in env.agent_iter(max_iter=10_000):
                    obs, reward, term, trunc, info = env.last()
                    total += reward if agent == mine else 0.0
                    env.step(None if term or trunc else seats[agent].act(obs["text"], info, rng))
                totals.append(total)
            x = np.asarray(totals)
            out[f"{name} with {partner}"] = {"mean": float(x.mean()), "ci95": float(1.96 * x.std(ddof=1) / math.sqrt(len(x))),
                                             "games": float(len(x))}
    return out


def beside_scripted(rows: list[dict[str, Any]], scripted: dict[str, dict[str, dict[str, float]]]
                    ) -> dict[str, list[dict[str, Any]]]:
    """How close each job's trained policies come to its game's scripted seats: for each
    scripted seat and partner (the seat itself, then random), the trained policies' final
    scores with that partner (one per seed and policy, in the rows' order) beside the scripted
    seat's own score with it (:func:`scripted_reference`). In a cooperative game "with" is
    playing together; in a competitive one, against."""
    out: dict[str, list[dict[str, Any]]] = {}
    for job, refs in scripted.items():
        mine = [r for r in rows if r["job"] == job]
        for pair, ref in refs.items():
            seat, partner = pair.split(" with ")
            trained = [f[partner][r["unit"]] for r in mine for f in r["final"].values() if partner in f]
            if trained:
                out.setdefault(job, []).append({"seat": seat, "partner": partner, "trained": trained,
                                                "trained_mean": sum(trained) / len(trained), "scripted": ref["mean"]})
    return out


SCHEDULER_BUDGET_MB = 4096
"""The issue's bound on a bundled job's scheduler (resident memory, SmolLM2-135M)."""


def settled(history: list[dict[str, Any]]) -> bool | None:
    """Whether every policy's rating has settled: at the last two evaluations its
    Bradley-Terry ratings' 95% intervals (``history``: :func:`rating_history`'s, policies
    only) overlap. None with fewer than two rated evaluations."""
    if len(history) < 2:
        return None
    before, last = history[-2]["ratings"], history[-1]["ratings"]
    return all(p in before and max(before[p][1], last[p][1]) <= min(before[p][2], last[p][2]) for p in last)


def verdicts(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Job -> seeds, whether every policy beat its untrained self (and random, in a
    competitive game) on every seed, whether the ratings of a job with several policies
    settled on every seed (:func:`settled`), whether a job with a target (:data:`TARGETS`)
    met it on every seed, and the scheduler's highest peak over the seeds
    against :data:`SCHEDULER_BUDGET_MB`."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        v = out.setdefault(r["job"], {"seeds": [], "every_seed": True, "scheduler_peak_mb": 0.0})
        v["seeds"].append(r["seed"])
        for ok in r["learned"].values():
            v["every_seed"] &= bool(ok["beats_untrained"]) and ok.get("beats_random", True)
        if "target" in r:
            v["target_every_seed"] = v.get("target_every_seed", True) and bool(r["target"]["met"])
        if len(r["learned"]) > 1 and r.get("ratings"):
            v["ratings_settled"] = v.get("ratings_settled", True) and bool(settled(r["ratings"]))
        v["scheduler_peak_mb"] = max(v["scheduler_peak_mb"], r.get("scheduler_peak_rss_mb") or 0.0)
        v["scheduler_under_budget"] = v["scheduler_peak_mb"] < SCHEDULER_BUDGET_MB
    return out


def plot(rows: list[dict[str, Any]], path: Path) -> list[str]:
    """One panel per job: each seed's and policy's score against random by step, with its
    95% interval as a band; for a job with several policies a second panel of their
    Bradley-Terry ratings (logits against random) by step, with their intervals. Returns the
    panels' titles."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    jobs = list(dict.fromkeys(r["job"] for r in rows))
    panels = [(job, kind) for job in jobs
              for kind in ("curve", "ratings")
              if kind == "curve" or any(r["job"] == job and len(r["curve"]) > 1 and r.get("ratings") for r in rows)]
    cols = min(3, len(panels))
    n_rows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(n_rows, cols, figsize=(4.4 * cols, 3.4 * n_rows), squeeze=False)
    for ax, (job, kind) in zip(axes.flat, panels):
        first = next(r for r in rows if r["job"] == job)
        for r in (r for r in rows if r["job"] == job):
            # (step, value, low, high) per policy: the score with its interval, or the rating
            # with its bootstrap interval (not symmetric)
            series = ({p: [(c["step"], c[r["unit"]], c[r["unit"]] - c["ci95"], c[r["unit"]] + c["ci95"]) for c in curve]
                       for p, curve in r["curve"].items()}
                      if kind == "curve" else
                      {p: [(h["step"], *h["ratings"][p]) for h in r["ratings"] if p in h["ratings"]] for p in r["curve"]})
            for policy, points in series.items():
                x, y, lo, hi = (list(v) for v in zip(*points)) if points else ([], [], [], [])
                label = f"seed {r['seed']}" + (f" {policy}" if len(r["curve"]) > 1 else "")
                (line,) = ax.plot(x, y, marker="o", ms=3, label=label)
                ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.12)
        if kind == "curve":
            ax.set(title=f"{job} ({first['game']})", xlabel="step", ylabel=f"{first['label']} vs random")
        else:
            ax.set(title=f"{job}: ratings", xlabel="step", ylabel="Bradley-Terry logits (random = 0)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    titles = [ax.get_title() for ax in list(axes.flat)[:len(panels)]]
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return titles


def _peaks(row: dict) -> str:
    """A row's peaks as the console says them (a row moved in from another folder may lack the
    run helper's)."""
    parts = [f"{label} {row[k]:.0f} MB" for label, k in (("peak", "peak_rss_total_mb"),
                                                          ("scheduler peak", "scheduler_peak_rss_mb"))
             if row.get(k) is not None]
    return ", ".join(parts) or "peak not recorded"


def main() -> None:
    args, _ = parse_args(Args, __doc__, QUICK)
    jobs = [j for j in args.jobs.split(",") if j]
    unknown = [j for j in jobs if j not in SUITE]
    if unknown:
        raise SystemExit(f"--jobs: not in the suite: {', '.join(unknown)} (the suite: {', '.join(SUITE)})")
    seeds = [int(s) for s in args.seeds.split(",")]
    restored = restore(Path(args.out), Path(args.json))
    if restored:
        print(f"  restored {len(restored)} seeds' results from {args.json} into {args.out}")
    stopped = None
    for job, seed in itertools.product(jobs, seeds):
        try:
            run_seed(args, job, seed)
        except Stopped as e:  # Ctrl-C or SIGTERM: no further seed; what is done is gathered
            stopped = e
            print(f"  [{job} seed {seed}] {e}; no further seed runs, and the results so far are gathered")
            break
        except RuntimeError as e:  # a failed run is reported, and the others go on
            print(f"  [{job} seed {seed}] failed: {e}")
    rows = gather(Path(args.out))
    # Each job's config as the rows were made with it (gather keeps only rows of the config's
    # hash; a row's key adds its --set items), so a row can be checked against a later config.
    configs = {job: load_config(job, {}) for job in dict.fromkeys(r["job"] for r in rows)}
    scripted = {job: scripted_reference(cfg.game, dict(cfg.game_kwargs)) for job, cfg in configs.items()}
    out = {"provenance": script_provenance(args), "note": args.note, "suite": list(SUITE),
           "targets": {job: dataclasses.asdict(t) for job, t in TARGETS.items()},
           "verdicts": verdicts(rows), "rows": rows, "scripted": scripted,
           "beside_scripted": beside_scripted(rows, scripted),
           "configs": {job: to_toml(cfg).decode() for job, cfg in configs.items()}}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(out, indent=1))
    if rows:
        plot(rows, Path(args.plot))
    for r in rows:
        for p, fin in r["final"].items():
            vs = ", ".join(f"{o} {m[r['unit']]:+.3f} ± {m['ci95']:.3f}" for o, m in fin.items())
            ok = r["learned"].get(p, {})
            print(f"{r['job']} seed {r['seed']} {p}: {vs}; gain over untrained {ok.get('gain_vs_untrained', float('nan')):+.3f}"
                  f" ± {ok.get('gain_ci95', float('nan')):.3f}; {r['wall_s']:.0f} s, {_peaks(r)}")
    for line in unfinished(Path(args.out)):
        print(f"not gathered yet: {line}")
    if stopped is not None:
        raise SystemExit(130)


if __name__ == "__main__":
    main()
