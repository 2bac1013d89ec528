"""``opentinker eval PATH``: evaluate saved adapters after the fact with the coordinator's own
evaluation: the strata over the game's starts and every seat, the 95% stratified interval,
wins/draws/losses, ratings and the game's exact measures, as in a run's final table.

PATH is a run folder (``config.toml`` and ``adapters/<policy>/``, or its newest checkpoint's
adapters when the run stopped early) or one saved adapter (``--game`` is then required). The
evaluation is a job of its own with no training steps whose policies are the adapters, loaded
the way ``--resume`` loads them (``Coordinator.load_adapters``); opponents are chosen through
its config: scripted seats as the policies' opponent mix, ``base`` through
``eval.head_to_head_per_stratum``, other adapters as extra policies through
``eval.cross_play_per_stratum``. The coordinator always plays random too (and each extra
policy against random); only the pairings asked for are reported. The adapters are copied
into a temporary folder, the one folder the scheduler may read, so nothing is written to PATH.
Reading PATH and building the job are :mod:`opentinker.control.sources`'s, which ``play``,
``infer`` and the service's queue share.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import games
from opentinker.control.checkpoints import LEAGUE_STATE
from opentinker.control.sources import (
    DEFAULT_MODEL,
    CliError,
    base_model,
    job_config,
    read_source,
    source_game,
    stage_adapters,
)

OnEpisodes = Callable[[int, int], None]
"""``on_episodes(done, total)``: evaluation games finished so far, of how many."""


def parse_opponents(spec: str | None, game: str, ev: games.GameEval, taken: set[str]
                    ) -> tuple[list[str], dict[str, Path]]:
    """``--vs`` as opponent labels in order, and the adapters among them (label -> folder).
    Default: ``random`` and the game's scripted seats. :class:`CliError` for an unknown one."""
    items = [s.strip() for s in (spec or ",".join(["random", *ev.scripted])).split(",") if s.strip()]
    labels: list[str] = []
    adapters: dict[str, Path] = {}
    for item in items:
        if item in ("random", "base") or item in ev.scripted:
            labels.append(item)
        elif Path(item).exists():
            src = read_source(item, taken)
            adapters.update(src.adapters)
            labels += list(src.adapters)
        else:
            raise CliError(f"unknown opponent {item!r}: not random, base, a scripted seat of {game} "
                           f"({', '.join(ev.scripted) or 'none'}) or an adapter or run folder")
    return list(dict.fromkeys(labels)), adapters


def evaluate(args: argparse.Namespace, on_episodes: OnEpisodes | None = None) -> dict[str, Any]:
    """Run the evaluation ``args`` describe; returns the report (metrics and provenance).
    ``on_episodes(done, total)`` is called as the env runners finish games."""

    from opentinker.bus.common import RemoteError
    from opentinker.control.runtime import Job
    from opentinker.engine.model_specs import resolve_model
    from opentinker.machine import job_machine
    from opentinker.progress import EpisodeFeed

    t0 = time.perf_counter()
    taken: set[str] = set()
    source = read_source(args.path, taken)
    game, ev = source_game(source, args.game, args.path)
    opponents, opp_adapters = parse_opponents(args.vs, game, ev, taken)
    n = args.games_per_stratum
    scripted = {o: 1.0 for o in opponents if o in ev.scripted}
    policies = [{"name": p, "opponents": scripted or {"random": 1.0}} for p in source.adapters]
    policies += [{"name": p} for p in opp_adapters if p not in source.adapters]
    model = base_model(source, args.model)
    with tempfile.TemporaryDirectory(prefix="opentinker-eval-") as tmp:
        cfg = job_config(source, game, model, args.seed, args.threads, args.device, tmp, args.backend,
                         args.scheduler, timeout_s=args.timeout, policies=policies,
                         eval={"hands_per_stratum": n, "head_to_head_per_stratum": n if "base" in opponents else 0,
                               "cross_play_per_stratum": n if opp_adapters else 0})
        try:
            model_path = resolve_model(cfg.model.base)
        except (OSError, ValueError) as e:
            raise CliError(f"model {cfg.model.base}: {e}") from None
        stage_adapters({**source.adapters, **opp_adapters}, Path(tmp), skip=("learner_state.json",))
        try:
            job = Job(cfg, model_path, run_dir=tmp)
        except ValueError as e:  # a shared scheduler that refuses the job (ConfigError: runtime.scheduler)
            raise CliError(str(e)) from None
        try:
            # A run's own way in (--resume): the coordinator made the policies' adapters and
            # alone may replace them; a fresh league state, as there is no league here.
            (Path(tmp) / LEAGUE_STATE).write_text(json.dumps(job.coordinator("league_state")))
            try:
                versions = job.coordinator("load_adapters", tmp, 0)
            except (RemoteError, ValueError, OSError) as e:  # e.g. an adapter of another base model
                raise CliError(f"cannot load the adapters: {getattr(getattr(e, 'error', None), 'message', e)}") from None
            feed = None if on_episodes is None else EpisodeFeed(lambda done, total, _train: on_episodes(done, total))
            try:
                metrics = job.coordinator("evaluate", 0, True, n, "" if feed is None else feed.endpoint)
            finally:
                if feed is not None:
                    feed.close()
        finally:
            job.shutdown()
    keep = [f"eval/{p}/vs_{o}/" for p in source.adapters for o in opponents]
    keep += [f"eval/{p}/{m}" for p in source.adapters for m in (*(x.name for x in ev.exact), "canonical_mass", "version")]
    kept = {k: None if isinstance(v, float) and not math.isfinite(v) else v  # JSON has no NaN
            for k, v in metrics.items() if k.startswith("ratings/") or any(k.startswith(p) for p in keep)}
    return {
        "path": str(args.path), "kind": source.kind, "game": game, "game_kwargs": dict(cfg.game_kwargs),
        "model": cfg.model.base, "seed": cfg.seed, "games_per_stratum": n, "unit": ev.unit, "label": ev.label,
        "policies": {p: str(source.adapters[p]) for p in source.adapters},
        "versions": {p: versions[p] for p in source.adapters},
        "opponents": {o: str(opp_adapters[o]) if o in opp_adapters else o for o in opponents},
        "metrics": kept, "wall_s": time.perf_counter() - t0,
        "machine": job_machine(cfg.model),
    }


def report_tables(report: dict[str, Any]) -> list[Any]:
    """Rich tables of a report: every (policy, opponent) pairing, the exact measures, ratings."""
    from rich.table import Table

    from opentinker.eval.report import ratings_table

    m, unit = report["metrics"], report["unit"]
    table = Table(title=f"{report['game']}: {report['label']}, {report['games_per_stratum']} games per stratum "
                        f"(start x seat), seed {report['seed']}", caption=f"model {report['model']}")
    for col in ("policy", "opponent", f"{report['label']} (95% CI)", "games", "W / D / L", "invalid"):
        table.add_column(col, justify="left" if col in ("policy", "opponent") else "right")
    theirs: list[str] = []
    for p in report["policies"]:
        for o in report["opponents"]:
            k = f"eval/{p}/vs_{o}/"
            if k + unit not in m:
                continue
            ci = m.get(k + "ci95")
            mean = f"{m[k + unit]:+.3f} ± {ci:.3f}" if ci is not None else f"{m[k + unit]:+.3f} ± n/a"
            wdl = "/".join(str(int(m[k + x])) for x in ("wins", "draws", "losses")) if k + "wins" in m else "-"
            table.add_row(p, "base model" if o == "base" else o, mean, str(int(m[k + "hands"])), wdl,
                          f"{100 * m[k + 'invalid_rate']:.1f}%")
            if m.get(k + "opponent_invalid_rate"):  # an LLM opponent: its invalid reply may end a game
                theirs.append(f"{'the base model' if o == 'base' else o} against {p} "
                              f"{100 * m[k + 'opponent_invalid_rate']:.1f}%")
    if theirs:
        table.caption = (f"{table.caption}; the opponent's invalid replies (one may end a game, counted a win): "
                         + ", ".join(theirs))
    if any(m.get(f"eval/{p}/vs_{o}/ci95", 0.0) is None for p in report["policies"] for o in report["opponents"]):
        table.caption = f"{table.caption}; ± n/a: one game per stratum gives no interval"
    out: list[Any] = [table]
    exact = [(p, k.split("/", 2)[2], v) for p in report["policies"] for k, v in m.items()
             if k.startswith(f"eval/{p}/") and "/vs_" not in k and k != f"eval/{p}/version"]
    if exact:
        t = Table("policy", "measure", "value", title="exact measures")
        for p, name, v in exact:
            t.add_row(p, name, "-" if v is None else f"{v:.4f}")
        out.append(t)
    ratings = ratings_table({k: v for k, v in m.items() if v is not None},
                            title="Ratings over these games (random = 0)")
    if ratings is not None:
        out.append(ratings)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", help="a run folder (config.toml, adapters/) or a saved adapter folder")
    parser.add_argument("--game", help="the game (default: the run's); required for an adapter folder")
    parser.add_argument("--vs", metavar="OPPONENTS", help="comma-separated: random, base, a scripted seat of the "
                        "game, an adapter or run folder (default: random and the game's scripted seats)")
    parser.add_argument("--model", help=f"base model (default: the run's, else the adapter's base if present, else {DEFAULT_MODEL})")
    parser.add_argument("--games-per-stratum", type=int, default=34, metavar="N",
                        help="games per (start, seat) for each opponent (default 34)")
    parser.add_argument("--seed", type=int, help="root seed of the evaluation games (default: the run's, else 0)")
    parser.add_argument("--threads", type=int, help="torch threads of the scheduler (default: every core)")
    parser.add_argument("--device", help="torch device (default: the run's, else cpu)")
    parser.add_argument("--json", metavar="FILE", help="also write the metrics and their provenance as JSON")
    parser.add_argument("--timeout", type=float, metavar="SECONDS",
                        help="longest wait for one batch of games (runtime.timeout_s; default: the run's, else "
                             "900): long games against the base model on a slow machine can need more")
    parser.add_argument("--backend", choices=["local", "ray"], default="local",
                        help="local (default): every component in this process; ray: one actor each")
    parser.add_argument("--scheduler", metavar="ADDRESS", default="",
                        help="evaluate on a shared scheduler (opentinker serve): its bus endpoint or service file")


def _with_progress(console: Any, what: str, work: Callable[[OnEpisodes], Any]) -> Any:
    """``work(on_episodes)`` with its games shown: a progress bar on a terminal; elsewhere (a
    log file, nohup, CI) a plain line at start and at every tenth of the games."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    if not console.is_terminal:
        t0, shown = time.perf_counter(), {"total": 0, "tenth": -1}
        console.print(f"{what}", highlight=False)

        def plain(done: int, total: int) -> None:
            if total != shown["total"]:
                shown.update(total=total, tenth=-1)
            tenth = 10 * done // total if total else 0
            if tenth > shown["tenth"]:
                shown["tenth"] = tenth
                console.print(f"  games {done}/{total} ({time.perf_counter() - t0:.0f} s)", highlight=False)

        return work(plain)
    with Progress(TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), TimeRemainingColumn(), console=console) as progress:
        task = progress.add_task(what, total=None)
        return work(lambda done, total: progress.update(task, completed=done, total=total))


def main(args: argparse.Namespace) -> int:
    """``opentinker eval``: exit 0, or 2 with one line on stderr when it cannot start."""
    from rich.console import Console
    from rich.markup import escape

    from opentinker.logs import escape_controls

    console = Console()
    try:
        if not 1 <= args.games_per_stratum <= 1000:
            raise CliError(f"--games-per-stratum: between 1 and 1000, got {args.games_per_stratum}")
        report = _with_progress(console, f"evaluating {escape(args.path)}", lambda cb: evaluate(args, cb))
    except CliError as e:
        print(f"opentinker eval: {escape_controls(str(e))}", file=sys.stderr)
        return 2
    for table in report_tables(report):
        console.print(table)
    players = [f"{p} = {escape(s)}" for p, s in {**report["policies"], **report["opponents"]}.items() if p != s]
    console.print("players: " + ", ".join(players), highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
        console.print(f"wrote {escape(args.json)} ({report['wall_s']:.0f} s)")
    return 0
