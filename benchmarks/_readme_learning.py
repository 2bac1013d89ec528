"""The README's blocks for training results (:mod:`readme` renders them): the default job and its
sweep, its time per machine, the learners compared, LoRA against full fine-tuning, the tools
job and its warm start, the learning suite, the tic-tac-toe runs and the leagues."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _readme_common import ROOT, load, machine_label, pct, table, x

from protocols.messages import LoraSpec

# --- the default job ---------------------------------------------------------------------

EVAL = "eval/main/"
LEARNED = 0.1
"""Chips/hand against random above which a sweep run counts as learned (the failure mode
breaks even); such cells of the chosen config are bold."""
PREVIOUS_DEFAULT = (6, 1e-3)
"""(max_tokens, lr) of the default before the sweep: its row comes first."""


def _chips(ev: dict[str, Any], opponent: str, bold: bool = False) -> str:
    mean = ev.get(f"{EVAL}{opponent}/chips")
    if mean is None:
        return "—"
    cell = f"{mean:+.3f} ± {ev[f'{EVAL}{opponent}/ci95']:.3f}"
    return f"**{cell}**" if bold else cell


def render_default_job(results: Path) -> str:
    """The final table of the default job, seed 0: untrained (first eval) vs trained (last)."""
    run = load(results, "default_job")["runs"][0]
    first, last = run["first_eval"], run["last_eval"]
    hands = {o: int(last[f"{EVAL}{o}/hands"]) for o in ("vs_random", "vs_base")}
    rows = [
        [f"chips/hand vs random (95% CI, {hands['vs_random']} hands)",
         _chips(first, "vs_random"), _chips(last, "vs_random", bold=True)],
        ["invalid replies vs random"]
        + [pct(e[f"{EVAL}vs_random/invalid_rate"]) for e in (first, last)],
        [f"chips/hand vs base model (95% CI, {hands['vs_base']} hands)",
         _chips(first, "vs_base"), _chips(last, "vs_base")],
        ["exploitability (NashConv / 2)"]
        + [f"{e[EVAL + 'exploitability']:.3f}" for e in (first, last)],
        ["probability mass on the canonical replies"]
        + [f"{e[EVAL + 'canonical_mass']:.3f}" for e in (first, last)],
    ]
    header = ["metric", f"untrained (step {first[EVAL + 'version']})",
              f"trained (step {last[EVAL + 'version']})"]
    return table(header, rows)


def _lr(lr: float) -> str:
    """``3e-4``, not ``3e-04``."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def render_default_job_sweep(results: Path) -> str:
    """Every sweep run's chips/hand vs random: a row per config, a column per seed."""
    chosen = load(results, "default_job")["runs"][0]["config"]
    runs = load(results, "default_job_sweep")["runs"]

    def key(config: dict[str, Any]) -> tuple[int, float, float]:
        return config["max_tokens"], config["lr"], config["entropy_coef"]

    configs = sorted({key(r["config"]) for r in runs},
                     key=lambda k: (k[:2] != PREVIOUS_DEFAULT, k[0], -k[1], k[2]))
    seeds = sorted({r["seed"] for r in runs})
    rows = []
    for mt, lr, ent in configs:
        best = (mt, lr, ent) == key(chosen)
        lr_cell = f"**{_lr(lr)}**" if best else _lr(lr)
        if ent:
            lr_cell += f", `entropy_coef = {ent:g}`"
        row = [f"{mt} (the previous default)" if (mt, lr) == PREVIOUS_DEFAULT else str(mt),
               lr_cell]
        for seed in seeds:
            chips = [r["last_eval"][f"{EVAL}vs_random/chips"] for r in runs
                     if r["seed"] == seed and key(r["config"]) == (mt, lr, ent)]
            cells = list(dict.fromkeys(f"{c:+.3f}" for c in chips))
            bold = best and chips and min(chips) > LEARNED
            row.append(" / ".join(f"**{c}**" if bold else c for c in cells))
        rows.append(row)
    return table(["max_tokens", "lr", *(f"seed {s}" for s in seeds)], rows)


# --- whole jobs: the default job's time per machine, learners, LoRA against full --------

DEFAULT_JOB_FILES = ("default_job", "default_job_20261201", "default_job_rerun", "default_job_twins")
"""The default job's runs (its config as shipped at the time), each recording its machine."""




def render_default_job_times(results: Path) -> str:
    """A line per machine: the default job's runs on it and their time from start to summary."""
    by: dict[str, list[tuple[str, int, float]]] = {}
    for name in DEFAULT_JOB_FILES:
        for run in load(results, name)["runs"]:
            by.setdefault(machine_label(run.get("machine")), []).append((name, run["seed"], run["wall_s"]))
    rows = []
    for label, runs in by.items():
        walls = [w for _, _, w in runs]
        files = ", ".join(dict.fromkeys(f"`{n}.json`" for n, _, _ in runs))
        rows.append([label, str(len(runs)), f"{min(walls) / 60:.1f}-{max(walls) / 60:.1f} min",
                     f"{sorted(walls)[len(walls) // 2] / 60:.1f} min", files])
    return table(["machine", "runs", "start to summary", "median", "from"], rows)


def render_compare_learners(results: Path) -> str:
    """The comparison's table (from its per-learner summary), what it ran on, its verdict."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compare_learners as cl

    import games

    r = load(results, "compare_learners")
    args = cl.Args(**{k: v for k, v in r["args"].items() if k in cl.Args.__dataclass_fields__})
    ev = games.evaluation(r["game"])
    p = r["provenance"]
    seeds = len(args.seeds.split(","))
    head = (f"{r['game']}, {seeds} seeds, {args.steps * args.groups_per_step * args.group_size} episodes per "
            f"learner; {machine_label({**p, 'cpu_capability': p['capability']})}; "
            f"{r['wall_s'] / 60:.0f} min in all (commit `{p['commit'][:7]}`: `{p['command']}`)\n\n")
    return head + cl.table_md(r["summary"], ev, args) + "\n\n" + cl.verdict(r["summary"], ev) + "\n"


LVF_COLUMNS = (("s_per_step", "s/step", "{:.2f}"), ("learn_s_per_step", "learn s/step", "{:.2f}"),
               ("peak_rss_largest_mb", "peak RSS, scheduler", "{:.0f} MB"),
               ("peak_rss_total_mb", "peak RSS, all processes", "{:.0f} MB"),
               ("train_tokens_per_s", "loss tokens/s", "{:.0f}"), ("decode_tokens_per_s", "sampled tokens/s", "{:.0f}"))


def lora_vs_full_claim(ratios: dict[str, Any]) -> str:
    """The script's own verdict on the paper's claim, from the ratios (``lora_vs_full.claim``)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import lora_vs_full

    return lora_vs_full.claim(ratios)


def render_lora_vs_full(results: Path, name: str = "lora_vs_full") -> str:
    """Mean over seeds per kind, the full / LoRA ratios, and whether the paper's claim holds."""
    r = load(results, name)
    unit = r["unit"]
    warm = bool(r["args"].get("warm"))
    rows = []
    for kind in ("lora", "full"):
        mine = [row for row in r["rows"] if row["kind"] == kind]
        finals = [f"{row['final'][unit]:+.3f}" + ("" if row["final"]["ci95"] is None else f" ± {row['final']['ci95']:.3f}")
                  for row in mine]
        reach = [row["wall_s_to_target"] for row in mine]
        cells = [kind, ", ".join(finals),
                 ", ".join("never" if w is None else f"{w:.0f} s" for w in reach),
                 ", ".join("never" if row["episodes_to_target"] is None else str(row["episodes_to_target"])
                           for row in mine)]
        cells += [fmt.format(sum(row[k] for row in mine) / len(mine)) for k, _, fmt in LVF_COLUMNS]
        if warm:
            cells.append(", ".join(f"{row['sft']['loss_first']:.3f} -> {row['sft']['loss_last']:.4f} in "
                                   f"{row['sft']['train_wall_s']:.0f} s" for row in mine))
        rows.append(cells)
    ratio = r["ratios"]
    rows.append(["full / LoRA", "", x(ratio["wall_s_to_target"]["mean"]) if "wall_s_to_target" in ratio else "n/a", ""]
                + [x(ratio[k]["mean"]) if k in ratio else "n/a" for k, _, _ in LVF_COLUMNS] + ([""] if warm else []))
    header = ["kind", f"final {unit} vs random (per seed, 95% CI)", f"time to {r['args']['target']:+g}"
              + (" (SFT included)" if warm else ""), "episodes to it", *(label for _, label, _ in LVF_COLUMNS)]
    header += ["SFT: loss on the data, time (per seed)"] if warm else []
    p = r["provenance"]
    seeds = {k: sorted({row["seed"] for row in r["rows"] if row["kind"] == k}) for k in ("lora", "full")}
    said = (f"{len(seeds['lora'])} seeds" if seeds["lora"] == seeds["full"] else
            f"seeds {', '.join(map(str, seeds['lora']))} with LoRA, {', '.join(map(str, seeds['full']))} with full training")
    head = (f"`{r['game']}`, {said}, " + ("each kind from its own SFT job, then " if warm else "")
            + f"{r['args']['steps']} steps of {r['args']['groups_per_step'] * r['args']['group_size']} episodes; "
            f"{machine_label({**p, 'cpu_capability': p['capability']})}; "
            f"{r.get('runs_wall_s', r['wall_s']) / 60:.0f} min in all "
            f"(commit `{p['commit'][:7]}`: `{p['command']}`)\n\n")
    return head + table(header, rows) + "\n" + lora_vs_full_claim(r["ratios"]) + "\n"


def render_tools_job(results: Path) -> str:
    """The bundled ``tools`` job per seed (the LoRA runs of ``lora_vs_full_tools.json``): the
    success rate at every evaluation, at the end with its 95% interval, tool calls and invalid
    calls per problem at the end, the wall time; then the scripted seats on the same task."""
    r = load(results, "lora_vs_full_tools")
    unit = r["unit"]

    def rate(value: float, ci: float | None) -> str:
        return f"{value:.3f}" + ("" if ci is None else f" ± {ci:.3f}")

    rows = []
    for row in (row for row in r["rows"] if row["kind"] == "lora"):
        f = row["final"]
        curve = ", ".join(f"{c[unit]:.3f} ({c['step']})" for c in row["curve"])
        rows.append([str(row["seed"]), curve, rate(f[unit], f["ci95"]), f"{f.get('tool_calls', 0):.2f}",
                     f"{f.get('invalid_tool_calls', 0):.2f}", f"{row['wall_s'] / 60:.1f} min"])
    for name, b in r.get("scripted", {}).items():
        rows.append([f"scripted `{name}`", "", rate(b[unit], b["ci95"]), f"{b['tool_calls']:.2f}", "", ""])
    p = r["provenance"]
    head = (f"`{r['game']}`, {r['args']['steps']} steps of {r['args']['groups_per_step'] * r['args']['group_size']} "
            f"problems, evaluated on {int(r['rows'][0]['final']['hands'])} problems; "
            f"{machine_label({**p, 'cpu_capability': p['capability']})}"
            + (f"; {r['args']['note']}" if r["args"].get("note") else "") + "\n\n")
    header = ["seed", f"{unit} at each evaluation (step)", f"{unit} at the end (95% CI)", "tool calls / problem",
              "invalid calls / problem", "wall time"]
    return head + table(header, rows)


def render_learning_suite(results: Path, name: str = "learning_suite") -> str:
    """``learning_suite.json``: per job, seed and policy, the final evaluation against random,
    the base model and each scripted seat (95% intervals), wins / draws / losses against
    random where the game counts them, the invalid rate, the gain over the untrained policy,
    the run's wall time and the scheduler's peak; then each job's verdict."""
    r = load(results, name)

    def ci(m: dict[str, Any] | None, unit: str) -> str:
        return "—" if m is None else f"{m[unit]:+.3f} ± {m['ci95']:.3f}"

    def vs_base(m: dict[str, Any] | None, unit: str) -> str:  # with the base's invalid rate, where recorded
        theirs = (m or {}).get("opponent_invalid_rate")
        return ci(m, unit) + (f" (its invalid {pct(theirs)})" if theirs else "")

    rows = []
    for row in r["rows"]:
        unit = row["unit"]
        for policy, final in row["final"].items():
            rnd, ok = final.get("random"), row["learned"].get(policy, {})
            scripted = ", ".join(f"`{o}` {ci(m, unit)}" for o, m in final.items() if o not in ("random", "base"))
            wdl = "/".join(f"{int(rnd[k])}" for k in ("wins", "draws", "losses")) if rnd and "wins" in rnd else "—"
            gain = f"{ok['gain_vs_untrained']:+.3f} ± {ok['gain_ci95']:.3f}" if ok else "—"
            rows.append([f"`{row['job']}`" + (f" {policy}" if len(row["final"]) > 1 else ""), str(row["seed"]),
                         ci(rnd, unit), wdl, vs_base(final.get("base"), unit), scripted or "—",
                         pct(rnd["invalid_rate"]) if rnd else "—", gain,
                         f"{row['wall_s'] / 60:.1f} min", f"{row['scheduler_peak_rss_mb']:.0f} MB",
                         machine_label(row.get("machine"))])
    head = (f"{', '.join(sorted({row['model'] for row in r['rows']}))}"
            + (f"; {r['note']}" if r.get("note") else "") + "\n\n")
    header = ["job", "seed", "vs random (95% CI)", "W/D/L vs random", "vs base", "vs scripted seats",
              "invalid", "gain over untrained", "wall time", "scheduler peak", "machine"]
    verdict = "\n".join(
        f"- `{job}` (seed{'s' * (len(v['seeds']) > 1)} {', '.join(map(str, v['seeds']))}): "
        + ("learned on every seed" if v["every_seed"] else "did not learn on every seed")
        + ("" if "target_every_seed" not in v else "; target " + (
            "met on every seed" if v["target_every_seed"] else "not met on every seed"))
        + ("" if "ratings_settled" not in v else "; ratings " + (
            "settled (the last two evaluations' intervals overlap)" if v["ratings_settled"] else "still moving"))
        + f"; scheduler peak {v['scheduler_peak_mb']:.0f} MB ("
        + ("under" if v.get("scheduler_under_budget") else "over") + " 4 GB)"
        for job, v in r["verdicts"].items())
    targets = "\n".join(_suite_target(row, r["targets"][row["job"]]) for row in r["rows"] if "target" in row)
    scripted = "\n".join(
        f"- `{job}`: " + ", ".join(f"`{pair.split(' with ')[0]}` with {pair.split(' with ')[1]} "
                                   f"{m['mean']:+.3f} ± {m['ci95']:.3f}" for pair, m in refs.items())
        for job, refs in r.get("scripted", {}).items() if refs)
    beside = "\n".join(
        f"- `{job}` with `{c['partner']}`: trained {c['trained_mean']:+.3f} ("
        + ", ".join(f"{x:+.3f}" for x in c["trained"]) + f"), `{c['seat']}` in its place {c['scripted']:+.3f}"
        for job, cs in r.get("beside_scripted", {}).items() for c in cs)
    return (head + table(header, rows) + "\n" + verdict + "\n" + (f"\nTargets:\n\n{targets}\n" if targets else "")
            + (f"\nWhat the scripted seats score (with themselves and with random, 400 games each, seats "
               f"alternating):\n\n{scripted}\n" if scripted else "")
            + (f"\nHow close the trained policies come to the scripted seats: their final scores with a partner "
               f"(the mean, then each seed's and policy's) beside the scripted seat's score with the same "
               f"partner:\n\n{beside}\n" if beside else ""))


def _suite_target(row: dict[str, Any], target: dict[str, Any]) -> str:
    """A seed's line of the suite's targets: each check's value beside its threshold."""
    checks = row["target"]
    parts = []
    for key, value in checks.items():
        if key.endswith("/vs_random"):
            parts.append(f"{key.split('/')[0]} {value:+.3f} against random (target {target['vs_random']:+.2f})")
        elif key.endswith("/vs_random_exact"):
            parts.append(f"exactly {value:+.3f} (`{target['exact_vs_random']}`: decides)")
        elif "/drawn_vs_" in key:
            parts.append(f"{pct(value)} of games against `{target['drawn_vs']}` drawn (target {pct(target['drawn'])})")
        elif key == "minutes":
            time = "time unknown (resumed from a checkpoint without it)" if value is None else f"{value:.1f} min"
            parts.append(f"{time} (target {target['minutes']:.0f})")
    return (f"- `{row['job']}` seed {row['seed']}: " + ", ".join(parts) + ": "
            + ("met" if checks["met"] else "not met") + f" ({target['anchor']})")


ATTENTION = set(LoraSpec().target_modules)
"""The default LoRA target modules (a run that adapts others says so in its settings)."""
UNRECORDED_MIX = {"random": 0.75, "tictactoe_minimax": 0.25}
"""The opponents of the tic-tac-toe runs made before a run's config recorded them (the job's mix
then); a run with another mix says so in its settings."""

LR_SCHEDULES = {"constant": "", "linear": " falling linearly"}
"""How a run's ``train.lr_schedule`` reads after its learning rate (a schedule not named here:
" (<name> schedule)")."""


def render_tictactoe_runs(results: Path, name: str = "tictactoe_runs") -> str:
    """Tic-tac-toe runs (``collect_runs.py``, e.g. ``tictactoe_runs.json``): per run its
    settings, the score against random at every evaluation, the last evaluation against random
    (95% CI, invalid rate) and against minimax (games drawn), its steps and time."""
    r = load(results, name)
    rows = []
    for run in r["runs"]:
        c, last = run["config"], run["last_eval"]
        k = "eval/main/vs_random/"
        m = "eval/main/vs_tictactoe_minimax/"
        settings = (f"{c['groups_per_step']}x{c['group_size']} episodes, lr {c['lr']:g}"
                    + LR_SCHEDULES.get(schedule := c.get("lr_schedule", "constant"), f" ({schedule} schedule)")
                    + f", explore {c['explore']:g}, "
                    f"max_tokens {c['max_tokens']}" + (", brief" if c["game_kwargs"].get("brief") else "")
                    + (f", temperature {c['temperature']:g}" if c.get("temperature", 1.0) != 1.0 else "")
                    + (", opponent_draws group" if c["opponent_draws"] == "group" else "")
                    + (f", entropy_coef {c['entropy_coef']:g}" if c.get("entropy_coef") else "")
                    + (f", move_values {c['move_values']:g}" if c.get("move_values") else "")
                    + (" against " + " + ".join(f"{w:g} x {o}" for o, w in c["move_values_against"].items())
                       if c.get("move_values_against") else "")
                    + (f", settled {c['move_values_settled']:g}" if c.get("move_values_settled") else "")
                    + (", LoRA on " + "/".join(m.removesuffix("_proj") for m in mods)
                       if (mods := c.get("target_modules", {}).get("main")) and set(mods) != ATTENTION else "")
                    + ("".join(f", {o} {w:g}" for o, w in mix.items()) + " of the games"
                       if (mix := c.get("opponents", {}).get("main", UNRECORDED_MIX)) != UNRECORDED_MIX else "")
                    + (f", {c['advantage']}" + (f" lam {c['lam']:g}" if "gae" in c["advantage"] else "")
                       if c.get("advantage", "dr_grpo") != "dr_grpo" else ""))
        curve = ", ".join(f"{e[k + 'score']:+.3f} ({e['step']})" for e in run["curve"])
        games = sum(last[m + x] for x in ("wins", "draws", "losses"))
        time = (f"{run['wall_s'] / 60:.1f} min" if run["finished"]
                else f"stopped: {run['steps_and_evals_s'] / 60:.1f} min of steps and evaluations")
        rows.append([settings, curve, f"{last[k + 'score']:+.3f} ± {last[k + 'ci95']:.3f}",
                     pct(last[k + "invalid_rate"]), f"{int(last[m + 'draws'])} of {int(games)}",
                     str(run["steps"]), time])
    machines = sorted({machine_label(run["machine"]) for run in r["runs"] if run.get("machine")})
    machines = machines or ["machine not recorded (a stopped run)"]
    seeds = sorted({run["seed"] for run in r["runs"]})
    head = (f"{'; '.join(machines)}; seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
            + (f"; {r['note']}" if r.get("note") else "") + "\n\n")
    header = ["settings", "score vs random at each evaluation (step)", "last vs random (95% CI)", "invalid",
              "drawn vs minimax", "steps", "time"]
    return head + table(header, rows)


def render_tictactoe_exact(results: Path, name: str = "tictactoe_exact") -> str:
    """Exact tic-tac-toe results of trained adapters (``tictactoe_exact.py``): per policy the
    games drawn against minimax (in all and per seat) and its score there, the score against
    random where it was scored, and the decisions where it puts at least half its probability
    on cells worth less against best play than the best one (a win or a draw given away)."""
    r = load(results, name)
    with_random = any("random" in row["opponents"] for row in r["rows"])
    rows = []
    for row in r["rows"]:
        mm = row["opponents"]["minimax"]
        x_, o_ = mm["seats"]["player_x"], mm["seats"]["player_o"]
        open_ = (x_["unresolved"] + o_["unresolved"]) / 2
        cells = [row["label"], str(row["version"] if row["version"] is not None else "-"),
                 pct(mm["draw"]) + (f" ({pct(open_)} unresolved)" if open_ >= 0.0005 else ""),
                 f"{pct(x_['draw'])} / {pct(o_['draw'])}", f"{mm['score']:+.3f}"]
        if with_random:
            rnd = row["opponents"].get("random")
            cells.append("" if rnd is None else f"{rnd['score']:+.3f}")
        cells.append(f"{x_['blunder_decisions']} / {o_['blunder_decisions']}")
        rows.append(cells)
    p = r["provenance"]
    head = (f"{machine_label(p)}; commit {p['commit'][:7]}; prune {p['config']['prune']:g}"
            + (f"; {r['note']}" if r.get("note") else "") + "\n\n")
    header = ["policy", "step", "drawn vs minimax (exact)", "as X / as O", "score vs minimax",
              *(["score vs random (exact)"] if with_random else []), "decisions giving away value vs minimax, X / O"]
    return head + table(header, rows)


def render_league_runs(results: Path, name: str) -> str:
    """A league job's runs (``collect_runs.py``, e.g. ``leduc_league.json``): per run and
    policy the exact measure (the exploitability) before training, every tenth training step
    and at the final evaluation, the mass on the canonical replies, the final score against
    random, the steps, time, scheduler peak and machine."""
    r = load(results, name)
    rows = []
    for run in r["runs"]:
        first, last = run["first_eval"], run["last_eval"]
        for key in sorted(k for k in last if k.startswith("eval/") and k.endswith("/exploitability")):
            policy = key.split("/")[1]
            steps = [row for row in run["exact_curve"] if row["step"] % 10 == 0 and f"train/{policy}/exploitability" in row]
            curve = ", ".join([f"{first[key]:.3f} (0)"] + [f"{row[f'train/{policy}/exploitability']:.3f} ({row['step']})"
                                                           for row in steps])
            score = f"eval/{policy}/vs_random/{run['unit']}"
            time = f"{run['wall_s'] / 60:.1f} min" if run["finished"] else "stopped"
            peak = f"{run['scheduler_peak_rss_mb']:.0f} MB" if run.get("scheduler_peak_rss_mb") else "—"
            rows.append([f"`{run['game']}` {policy}", curve, f"{last[key]:.3f}",
                         f"{last[f'eval/{policy}/canonical_mass']:.3f}",
                         f"{last[score]:+.3f} ± {last[f'eval/{policy}/vs_random/ci95']:.3f}",
                         str(run["steps"]), time, peak, machine_label(run.get("machine"))])
    head = f"{r['note']}\n\n" if r.get("note") else ""
    header = ["run", "exploitability at the start of a step (step)", "final exploitability", "canonical mass",
              "final vs random (95% CI)", "steps", "time", "scheduler peak", "machine"]
    return head + table(header, rows)


TOOLS_FAILURES = {"invalid_call": "invalid call", "no_number": "no number", "wrong_after_call": "result miscopied",
                  "wrong_without_call": "wrong without a call"}
"""``tools_warm_start.json``'s kinds of unsolved training problem, as the table names them."""


def render_tools_warm_start(results: Path) -> str:
    """``tools_sft`` then ``tools_warm`` per seed (``tools_warm_start.json``): the SFT job's loss
    on its data and time, the RL job's success at every evaluation (step 0: the SFT adapter),
    at the end with its 95% interval, tool and invalid calls per problem at the end, its time;
    then the commands and what they ran on."""
    r = load(results, "tools_warm_start")
    unit = r["unit"]
    rows = []
    for row in r["rows"]:
        s, rl = row["sft"], row["rl"]
        f = rl["final"]
        curve = ", ".join(f"{c[unit]:.3f} ({c['step']})" for c in rl["curve"])
        tf = rl["training_failures"]
        failed = (f"{tf['failed']} of {tf['problems']}: " + ", ".join(
            f"{tf[k]} {label}" for k, label in TOOLS_FAILURES.items() if tf[k]) if tf["failed"] else f"0 of {tf['problems']}")
        alone = "" if not s.get("eval") else f"{s['eval'][unit]:.3f} ± {s['eval']['ci95']:.3f} ({int(s['eval']['hands'])})"
        rows.append([str(row["seed"]), f"{s['loss_before']:.3f} → {s['loss_after']:.4f}", f"{s['wall_s'] / 60:.1f} min",
                     alone, curve, f"{f[unit]:.3f} ± {f['ci95']:.3f}", f"{f.get('tool_calls', 0):.2f}",
                     f"{f.get('invalid_tool_calls', 0):.2f}", failed, f"{rl['wall_s'] / 60:.1f} min"])
    p = r["provenance"]
    first = r["rows"][0]
    head = (f"`{r['game']}`: SFT on {first['sft']['sequences']} of `calc_tool_user`'s problems for "
            f"{first['sft']['steps']} steps, then {first['rl']['steps']} RL steps of "
            f"{first['rl']['curve'][1]['episodes'] // first['rl']['curve'][1]['step']} problems, evaluated on "
            f"{int(first['rl']['final']['hands'])} problems; {machine_label({**p, 'cpu_capability': p['capability']})}"
            f"; commit `{p['commit'][:7]}`" + (f"; {r['args']['note']}" if r["args"].get("note") else "") + "\n\n")
    header = ["seed", "SFT loss on its data", "SFT wall time", f"SFT adapter's {unit} (95% CI, problems)",
              f"RL: {unit} at each evaluation (step; 0: the SFT adapter)",
              f"{unit} at the end (95% CI)", "tool calls / problem", "invalid calls / problem",
              "RL training problems unsolved", "RL wall time"]
    commands = "".join(f"- seed {row['seed']}: `{row['sft']['command']}`; "
                       + (f"`{row['sft']['eval']['command']}`; " if row["sft"].get("eval") else "")
                       + f"`{row['rl']['command']}`\n" for row in r["rows"])
    return head + table(header, rows) + "\n" + commands
