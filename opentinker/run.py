"""The driver of ``opentinker run``: start a job, train with a progress bar (plain lines when
stdout is not a terminal), evaluate, and write ``runs/<name>/`` (resolved config,
``metrics.jsonl`` and TensorBoard events in ``tb/``, adapters in PEFT format, checkpoints,
recorded trajectories, the learning-curve and cross-play PNGs, ``ratings.png`` in a
competitive game, sample transcripts, and ``summary.json``: the first and last evaluations,
the adapter paths, the wall time)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

import games
from opentinker.config import ConfigError, JobConfig, to_toml
from opentinker.control.config_checks import check_config
from opentinker.control import transcripts
from opentinker.control.checkpoints import (
    Checkpoint,
    latest_checkpoint,
    truncate_metrics,
    write_checkpoint,
)
from opentinker.control.runtime import ComponentDied, Job
from opentinker.engine.model_specs import resolve_model
from opentinker.eval.ratings import plot_ratings
from opentinker.eval.report import (
    MetricsLog,
    plot_cross_play,
    plot_learning_curves,
    rating_history,
    ratings_table,
    summary_table,
)
from opentinker.files import write_atomic
from opentinker.interrupt import Interrupted, StopOnInterrupt
from opentinker.machine import git_commit, machine
from opentinker.progress import EpisodeFeed
from opentinker.training import trajectory_log

logger = logging.getLogger(__name__)


@dataclass
class RunResult:
    run_dir: Path
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    rows: list[dict[str, Any]]
    info: dict[str, Any]


LEARNER_STATE = "learner_state.json"
"""Written beside each saved adapter: the learner's :meth:`~opentinker.training.learner.Learner.state_dict`."""


def save_learner_states(states: dict[str, dict[str, Any]], adapters: dict[str, str]) -> None:
    """Write each policy's learner state to ``<adapter folder>/learner_state.json`` (atomically:
    a temporary file, then a rename)."""
    for policy, state in states.items():
        write_atomic(Path(adapters[policy]) / LEARNER_STATE, json.dumps(state, indent=1))


def read_learner_states(adapters_dir: Path, policies: list[str]) -> dict[str, dict[str, Any]]:
    """The learner states saved under ``adapters_dir/<policy>/``, for
    :meth:`opentinker.control.runtime.Job.load_learner_states` (``FileNotFoundError`` naming a missing
    file, ``ValueError`` naming one that is not JSON)."""
    out = {}
    for policy in policies:
        path = Path(adapters_dir) / policy / LEARNER_STATE
        try:
            out[policy] = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is corrupt: {e}") from None
    return out


def run_job(cfg: JobConfig, console: Console | None = None, run_dir: Path | None = None,
            resume: Path | None = None, checkpoint: Checkpoint | None = None, *, restarts: int = 0,
            spent_s: float = 0.0) -> RunResult:
    """Run a job into ``run_dir`` (default ``<out_dir>/<run name>``); with ``resume``, continue
    the run in that folder from its newest checkpoint (``cfg`` may extend ``train.steps``).

    A dead env runner or learner is started again in its step (:meth:`Job.supervised`); a dead
    scheduler or coordinator (or a learner that cannot take over its step) stops the job, which
    then restores its newest checkpoint by itself and goes on, saying so (:func:`_recover`).
    Both count against ``runtime.max_restarts`` (``restarts``: those used before this call;
    ``spent_s``: the wall seconds of the attempts before it, counted in ``summary.json``).

    The config is checked whole (:func:`~opentinker.control.config_checks.check_config`, a
    :class:`~opentinker.config.ConfigError` naming the field) and the base model resolved
    before the run folder is made, so a job that cannot start leaves no folder behind.

    Ctrl-C: the first finishes the step in progress and checkpoints it; the second stops at
    once; either way :class:`~opentinker.interrupt.Interrupted` says what there is to resume
    from (a new run with no checkpoint yet is removed)."""
    console = console or Console()
    state = _Started()
    stop = StopOnInterrupt(lambda text: console.print(f"[yellow]{escape(text)}[/]"))
    try:
        with stop:
            return _run_job(cfg, console, run_dir, resume, checkpoint, restarts, spent_s, stop, state)
    except KeyboardInterrupt:  # a second Ctrl-C where _run_job was not ready for it
        if state.job is not None:
            try:
                state.job.shutdown()
            except Exception as e:  # noqa: BLE001  (shutting down a job being torn down)
                logger.debug("shutdown after Ctrl-C: %s", e)
        if state.run_dir is None:
            raise  # nothing made yet
        if state.fresh and state.saved is None:
            shutil.rmtree(state.run_dir, ignore_errors=True)
            raise Interrupted(state.run_dir, None, removed=True) from None
        raise Interrupted(state.run_dir, state.saved) from None


@dataclass
class _Started:
    """What :func:`_run_job` has made so far, for a Ctrl-C to clean up."""

    run_dir: Path | None = None
    fresh: bool = False
    """The run folder was made by this call (not a resume)."""
    job: Job | None = None
    saved: int | None = None
    """The newest checkpoint's step."""


def _run_job(cfg: JobConfig, console: Console, run_dir: Path | None, resume: Path | None,
             checkpoint: Checkpoint | None, restarts: int, spent_s: float, stop: StopOnInterrupt,
             state: _Started) -> RunResult:
    check_config(cfg)
    t_start = time.perf_counter()
    ckpt = None
    if resume is not None:
        run_dir = Path(resume)
        # Verified before anything of the run is rewritten (by the caller, the CLI, when given).
        ckpt = checkpoint or latest_checkpoint(run_dir, cfg)
        for why in ckpt.skipped:
            console.print(f"[yellow]skipped checkpoint[/] {escape(why)}")
    else:
        run_dir = run_dir or cfg.run_dir()  # inside out_dir (checked)
    policies = [p.name for p in cfg.policies]
    console.print(f"[bold]opentinker[/] run [cyan]{escape(str(run_dir))}[/]  model={escape(cfg.model.base)}  "
                  f"backend={cfg.runtime.backend}")
    with console.status("preparing the base model (first use converts the GGUF, ~20 s)"):
        model_path = resolve_model(cfg.model.base)
    if ckpt is not None:
        rows = truncate_metrics(run_dir / "metrics.jsonl", ckpt.step)
        for path in sorted((run_dir / "trajectories").glob("*.jsonl")):
            trajectory_log.truncate(path, ckpt.step)  # the steps after it are played again
        transcripts.truncate(run_dir / "transcripts.txt", ckpt.step)
        log = MetricsLog(run_dir / "metrics.jsonl", purge_step=ckpt.step + 1)
        log.rows = rows
        state.run_dir, state.saved = run_dir, ckpt.step
    else:
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
            (run_dir / "config.toml").write_bytes(to_toml(cfg))
        except OSError as e:  # /proc, /sys, a read-only disk, root where the permission check passed
            shutil.rmtree(run_dir, ignore_errors=True)
            raise ConfigError("out_dir", f"cannot make the run folder {str(run_dir)!r}: "
                                         f"{e.strerror or type(e).__name__}") from None
        state.run_dir, state.fresh = run_dir, True
        log = MetricsLog(run_dir / "metrics.jsonl")
    if ckpt is not None:  # with any --set of the resume
        (run_dir / "config.toml").write_bytes(to_toml(cfg))
    if cfg.offline_job() is not None:
        return _run_offline(cfg, console, run_dir, model_path, log)
    schedulers = f"{len(cfg.runtime.devices)} schedulers ({', '.join(cfg.runtime.devices)})" \
        if len(cfg.runtime.devices) > 1 else "scheduler"
    with console.status(f"starting {cfg.runtime.env_runners} env runners, {len(policies)} learner(s), {schedulers}, "
                        "coordinator"):
        try:
            job = Job(cfg, model_path, run_dir=str(run_dir.resolve()))
        except (ConfigError, KeyboardInterrupt) as e:  # a new run that cannot start (or Ctrl-C) leaves nothing
            log.close()
            if ckpt is None:
                shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(e, KeyboardInterrupt):
                raise Interrupted(run_dir, None if ckpt is None else ckpt.step, removed=ckpt is None) from None
            raise
    state.job = job
    if stop.asked:  # Ctrl-C while the components started: nothing trained to keep
        job.shutdown()
        log.close()
        if ckpt is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise Interrupted(run_dir, None if ckpt is None else ckpt.step, removed=ckpt is None)
    job.restarts = restarts
    job.said = lambda text: console.print(f"[yellow]{escape(text)}[/]")
    console.print(f"started in {time.perf_counter() - t_start:.1f} s")
    start = 1
    if ckpt is not None:
        try:
            job.coordinator("load_adapters", str(ckpt.adapters.resolve()), ckpt.step)
            job.load_learner_states(read_learner_states(ckpt.adapters, policies))
        except BaseException:
            job.shutdown()
            raise
        start = ckpt.step + 1
        console.print(f"resumed from {ckpt.folder} (step {ckpt.step})")
    ev = cfg.eval
    final_n = ev.final_hands_per_stratum or ev.hands_per_stratum
    game_eval = games.evaluation(cfg.game)
    plain = not console.is_terminal  # a log file, nohup, CI: one plain line per step and evaluation

    def report(step: int, kind: str, m: dict[str, float]) -> str:
        status = _status(m, policies, kind, game_eval)
        if plain:
            console.print(f"step {step}/{cfg.train.steps} {kind}: {status} "
                          f"({time.perf_counter() - t_start:.0f} s)", highlight=False)
        return status

    feed: EpisodeFeed | None = None
    died: ComponentDied | None = None
    now = "the first evaluation"  # what the job was doing, for the message of a component that dies
    interrupted = False

    def save_checkpoint(step: int) -> None:
        write_checkpoint(run_dir, step, lambda folder: job.coordinator("save_adapters", folder),
                         lambda paths: save_learner_states(job.learner_states(), paths), first, last,
                         updates_per_step={p.name: cfg.train_for(p.name).epochs * cfg.train_for(p.name).minibatches
                                           for p in cfg.policies})
        state.saved = step

    try:
        with Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
            console=console, redirect_stdout=True, redirect_stderr=True,
            disable=plain,  # a log file gets the plain lines of report(), not the bars' last frame
        ) as progress:
            task = progress.add_task("eval (untrained)" if ckpt is None else "train", total=cfg.train.steps,
                                     completed=start - 1, status="")
            episodes = progress.add_task("episodes", total=None, status="")

            def on_episodes(done: int, total: int, train: bool) -> None:
                progress.update(episodes, completed=done, total=total,
                                description="  episodes (train)" if train else "  episodes (eval)")

            feed = EpisodeFeed(on_episodes)
            if ckpt is None:
                first = job.supervised("evaluate", 0, True, final_n, feed.endpoint)
                log.write(0, "eval", first)
                report(0, "eval", first)
                last = first
            else:
                first, last = ckpt.first_eval, ckpt.last_eval
            progress.update(task, description="train", status=_status(last, policies, "eval", game_eval))
            for step in range(start, cfg.train.steps + 1):
                if stop.asked:  # Ctrl-C during the first evaluation: nothing trained to keep
                    interrupted = True
                    break
                now = f"step {step}"
                m = job.supervised("train_step", step, feed.endpoint)
                m["runtime/restarts"] = float(job.restarts)
                log.write(step, "train", m)
                progress.update(task, advance=1, status=report(step, "train", m))
                final = step == cfg.train.steps
                if final or (ev.every and step % ev.every == 0):
                    progress.update(task, description="eval")
                    last = job.supervised("evaluate", step, final, final_n if final else ev.hands_per_stratum,
                                           feed.endpoint)
                    log.write(step, "eval", last)
                    progress.update(task, description="train", status=report(step, "eval", last))
                if final or (cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0) or stop.asked:
                    save_checkpoint(step)
                if stop.asked and not final:  # Ctrl-C: this step is done and saved
                    interrupted = True
                    break
        if not interrupted:
            adapters = job.coordinator("save_adapters", str((run_dir / "adapters").resolve()))
            save_learner_states(job.learner_states(), adapters)
            info = job.info()
    except ComponentDied as e:
        e.run_dir = str(run_dir)  # where --resume continues
        died = e
    except KeyboardInterrupt:  # a second Ctrl-C: at once, the newest checkpoint stands
        interrupted = True
    finally:
        if feed is not None:
            feed.close()
        job.shutdown()
        log.close()
    if interrupted:
        if state.saved is None and resume is None:  # nothing to continue from: leave no half-made folder
            shutil.rmtree(run_dir, ignore_errors=True)
            raise Interrupted(run_dir, None, removed=True)
        raise Interrupted(run_dir, state.saved)
    if died is not None:
        return _recover(cfg, console, run_dir, died, now, job.restarts, spent_s + time.perf_counter() - t_start)
    plot_learning_curves(log.rows, policies, run_dir / "learning_curve.png", cfg.game, game_eval)
    plot_cross_play([("step 0", first), (f"step {cfg.train.steps}", last)], policies, run_dir / "cross_play.png",
                    game_eval)
    console.print(summary_table(first, last, policies, cfg.train.steps, game_eval))
    history = rating_history(log.rows)
    if history:
        plot_ratings(history, run_dir / "ratings.png")
    table = ratings_table(last, cfg.train.steps)
    if table is not None:
        console.print(table)
    total = spent_s + time.perf_counter() - t_start  # the attempts a restore replaced included
    (run_dir / "summary.json").write_text(json.dumps({"first_eval": first, "last_eval": last, "adapters": adapters,
                                                      "wall_s": total, "restarts": job.restarts,
                                                      "machine": machine(cfg.model.threads or os.cpu_count(), cfg.model.device),
                                                      "commit": git_commit()[0]},
                                                     indent=1))
    console.print(f"adapters: {adapters}\nwrote {run_dir} in {total:.0f} s")
    return RunResult(run_dir=run_dir, first_eval=first, last_eval=last, rows=log.rows, info=info)


def _recover(cfg: JobConfig, console: Console, run_dir: Path, died: ComponentDied, now: str,
             restarts: int, spent_s: float) -> RunResult:
    """After ``died`` stopped the job during ``now`` (its components shut down): restore the
    newest checkpoint and go on, as ``--resume`` would, when ``runtime.max_restarts`` allows one
    more restart (``restarts`` used so far) and a checkpoint exists; else raise ``died``, which
    names the component (:class:`~opentinker.control.runtime.ComponentDied`)."""
    if restarts + 1 > cfg.runtime.max_restarts:
        raise died
    try:
        ckpt = latest_checkpoint(run_dir, cfg)
    except (ValueError, OSError) as e:  # none written yet, or none that checks out
        logger.warning("no checkpoint to restore after %s: %s", died, e)
        raise died from None
    text = (f"{died} during {now}: restoring the checkpoint of step {ckpt.step} and going on (restart "
            f"{restarts + 1} of at most {cfg.runtime.max_restarts})")
    logger.warning("%s", text)
    console.print(f"[yellow]{escape(text)}[/]")
    return run_job(cfg, console, resume=run_dir, checkpoint=ckpt, restarts=restarts + 1, spent_s=spent_s)


def _run_offline(cfg: JobConfig, console: Console, run_dir: Path, model_path: str, log: MetricsLog) -> RunResult:
    from opentinker.training.offline import run_offline

    oc = cfg.offline_job()
    assert oc is not None
    try:
        with console.status(f"offline {oc.kind} on {oc.source()}: {oc.steps} steps"):
            job = Job(cfg, model_path, run_dir=str(run_dir.resolve()), scheduler_only=True)
            try:
                summary = run_offline(cfg, run_dir, job.scheduler_endpoint, job.scheduler_credentials, log)
            finally:
                job.shutdown()
    finally:
        log.close()
    name = cfg.policies[0].name
    key = f"eval/{name}/{oc.kind}/loss"
    console.print(f"offline {oc.kind}: {summary['units']} {'pairs' if oc.kind != 'sft' else 'sequences'} from "
                  f"{summary['trajectories']} trajectories; loss on the data {summary['first_eval'][key]:.4f} -> "
                  f"{summary['last_eval'][key]:.4f}; adapter {summary['adapters'][name]}")
    return RunResult(run_dir=run_dir, first_eval=summary["first_eval"], last_eval=summary["last_eval"],
                     rows=log.rows, info={})


def _status(m: dict[str, float], policies: list[str], kind: str, game_eval: games.GameEval) -> str:
    """One line about the first policy: its training reward, or its evaluation against random
    (and the game's exact measures)."""
    p = policies[0]
    if kind == "train":
        line = f"reward {m.get(f'train/{p}/reward', float('nan')):+.2f} invalid {m.get(f'train/{p}/invalid_rate', float('nan')):.0%}"
        if f"train/{p}/tool_calls" in m:  # a game with tools
            line += f" tool calls {m[f'train/{p}/tool_calls']:.2f} ({m[f'train/{p}/invalid_tool_calls']:.2f} invalid)"
        return line
    unit = game_eval.unit
    line = f"eval vs random {m.get(f'eval/{p}/vs_random/{unit}', float('nan')):+.3f} {game_eval.label}"
    for x in game_eval.exact:
        if f"eval/{p}/{x.name}" in m:
            line += f", {x.name} {m[f'eval/{p}/{x.name}']:.3f}"
    return line


def start(config: JobConfig | dict[str, Any] | str | Path = "default", overrides: dict[str, Any] | None = None,
          **kwargs: Any) -> RunResult:
    """Run a job from Python: ``config`` a :class:`~opentinker.config.JobConfig`, a dict of its
    TOML tables, or a TOML file or bundled job's name (with ``overrides``, a nested dict as
    ``--set`` makes); ``kwargs`` go to :func:`run_job` (``run_dir``, ``console``). Returns its
    :class:`RunResult`; a bad config raises :class:`~opentinker.config.ConfigError` naming the
    field, before anything starts. ``opentinker.run(config)`` is this function."""
    from opentinker.config import _merge, config_from_dict, load_config

    if isinstance(config, JobConfig):
        if overrides:
            raw = msgspec.to_builtins(config)
            _merge(raw, overrides)
            config = config_from_dict(raw)
        cfg = config
    elif isinstance(config, dict):
        raw = dict(config)
        if overrides:
            _merge(raw, overrides)
        cfg = config_from_dict(raw)
    else:
        cfg = load_config(config, overrides)
    return run_job(cfg, **kwargs)


class _CallableModule(types.ModuleType):
    """This module, callable: ``opentinker.run(config)`` is :func:`start` even where
    ``opentinker.run`` names the module (after ``import opentinker.run``)."""

    def __call__(self, config: JobConfig | dict[str, Any] | str | Path = "default",
                 overrides: dict[str, Any] | None = None, **kwargs: Any) -> RunResult:
        return start(config, overrides, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
