"""The driver of ``opentinker run``: start a job, train with a progress bar (plain lines when
stdout is not a terminal), evaluate, and write ``runs/<name>/`` (resolved config,
``metrics.jsonl`` and TensorBoard events in ``tb/``, adapters in PEFT format, checkpoints,
recorded trajectories, the learning-curve and cross-play PNGs, ``ratings.png`` in a
competitive game, sample transcripts, and ``summary.json``: the first and last evaluations,
the adapter paths, the wall time)."""

from __future__ import annotations

import json
import logging
import shutil
import sys
import time
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

import games
from opentinker.config import ConfigError, JobConfig
from opentinker.control.checkpoints import (
    Checkpoint,
    latest_checkpoint,
    write_checkpoint,
)
from opentinker.control.component import ComponentDied
from opentinker.control.runtime import Job
from opentinker.eval.ratings import plot_ratings
from opentinker.eval.report import (
    plot_cross_play,
    plot_learning_curves,
    rating_history,
    ratings_table,
    summary_table,
)
from opentinker.files import write_atomic
from opentinker.interrupt import Interrupted, StopOnInterrupt
from opentinker.machine import commit_record, job_machine
from opentinker.progress import EpisodeFeed
from opentinker.run_folder import OpenRun, open_run

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
            spent_s: float | None = None) -> RunResult:
    """Run a job into ``run_dir`` (default ``<out_dir>/<run name>``); with ``resume``, continue
    the run in that folder from its newest checkpoint (``cfg`` may extend ``train.steps``).

    A dead env runner or learner is started again in its step (:meth:`Job.supervised`); a dead
    scheduler or coordinator (or a learner that cannot take over its step) stops the job, which
    then restores its newest checkpoint by itself and goes on, saying so (:func:`_recover`).
    Both count against ``runtime.max_restarts`` (``restarts``: those used before this call;
    ``spent_s``: the wall seconds of the attempts before it, counted in ``summary.json``; None,
    a new call: nothing, or resuming, the run's time up to its checkpoint).

    The config is checked whole (:func:`~opentinker.control.config_checks.check_config`, a
    :class:`~opentinker.config.ConfigError` naming the field) and the base model resolved
    before the run folder is made, so a job that cannot start leaves no folder behind.

    Ctrl-C: the first finishes the step in progress and checkpoints it (an offline job: then
    evaluates and saves its adapter, and the result's ``info["stopped"]`` says so); the second
    stops at once; either way :class:`~opentinker.interrupt.Interrupted` says what there is to resume
    from (a new run with no checkpoint yet is removed)."""
    console = console or Console()
    state = _Started()
    keeps = "then evaluating and saving the adapter trained so far" if cfg.offline_job() else "with a checkpoint"
    stop = StopOnInterrupt(lambda text: console.print(f"[yellow]{escape(text)}[/]"), keeps)
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


@dataclass
class _Ended:
    """How the steps of a run ended."""

    interrupted: bool = False
    """By Ctrl-C (the newest checkpoint stands)."""
    died: ComponentDied | None = None
    adapters: dict[str, str] = field(default_factory=dict)
    """Where the final adapters were saved (when it ran to its end)."""
    info: dict[str, Any] = field(default_factory=dict)


def _run_job(cfg: JobConfig, console: Console, run_dir: Path | None, resume: Path | None,
             checkpoint: Checkpoint | None, restarts: int, spent_s: float | None, stop: StopOnInterrupt,
             state: _Started) -> RunResult:
    run = open_run(cfg, console, run_dir, resume, checkpoint, state, stop)
    _count_time_before(run, spent_s)
    if cfg.offline_job() is not None:
        return _run_offline(cfg, console, run, stop)
    job = _start_job(run, restarts)
    ended = _train(run, job)
    if ended.interrupted:
        if state.saved is None and resume is None:  # nothing to continue from: leave no half-made folder
            shutil.rmtree(run.run_dir, ignore_errors=True)
            raise Interrupted(run.run_dir, None, removed=True)
        raise Interrupted(run.run_dir, state.saved)
    if ended.died is not None:
        return _recover(cfg, console, run.run_dir, ended.died, run.now, job.restarts,
                        _wall_s(run))
    return _finish(run, job, ended)


def _count_time_before(run: OpenRun, spent_s: float | None) -> None:
    """Set ``run.spent_s``: ``spent_s`` where given (a restore's attempts before), else a
    resumed run's time up to its checkpoint (a checkpoint without it: the time counts from its
    step, ``run.wall_from_step``, and the user is told); a checkpoint's own
    ``wall_from_step`` carries on."""
    run.wall_from_step = run.ckpt.wall_from_step if run.ckpt is not None else 0
    if spent_s is not None or run.ckpt is None:
        run.spent_s = spent_s or 0.0
    elif run.ckpt.wall_s is not None:
        run.spent_s = run.ckpt.wall_s
    else:
        run.wall_from_step = run.ckpt.step
        run.console.print(f"[yellow]the checkpoint of step {run.ckpt.step} does not record the run's time before "
                          "it: summary.json's wall_s counts from its step (wall_s_from_step)[/]")


def _wall_s(run: OpenRun) -> float:
    """The run's wall seconds so far: its time before this attempt and this attempt's."""
    return run.spent_s + time.perf_counter() - run.t_start


def _start_job(run: OpenRun, restarts: int) -> Job:
    """Start the job's components (and, resuming, load the checkpoint's adapters and learner
    states); a new run that cannot start, or a Ctrl-C meanwhile, leaves no folder behind."""
    cfg, console, run_dir, ckpt = run.cfg, run.console, run.run_dir, run.ckpt
    schedulers = f"{len(cfg.runtime.devices)} schedulers ({', '.join(cfg.runtime.devices)})" \
        if len(cfg.runtime.devices) > 1 else "scheduler"
    with console.status(f"starting {cfg.runtime.env_runners} env runners, {len(run.policies)} learner(s), "
                        f"{schedulers}, coordinator"):
        try:
            job = Job(cfg, run.model_path, run_dir=str(run_dir.resolve()))
        except (ConfigError, KeyboardInterrupt) as e:  # a new run that cannot start (or Ctrl-C) leaves nothing
            run.log.close()
            if ckpt is None:
                shutil.rmtree(run_dir, ignore_errors=True)
            if isinstance(e, KeyboardInterrupt):
                raise Interrupted(run_dir, None if ckpt is None else ckpt.step, removed=ckpt is None) from None
            raise
    run.state.job = job
    if run.stop.asked:  # Ctrl-C while the components started: nothing trained to keep
        job.shutdown()
        run.log.close()
        if ckpt is None:
            shutil.rmtree(run_dir, ignore_errors=True)
        raise Interrupted(run_dir, None if ckpt is None else ckpt.step, removed=ckpt is None)
    job.restarts = restarts
    job.said = lambda text: console.print(f"[yellow]{escape(text)}[/]")
    console.print(f"started in {time.perf_counter() - run.t_start:.1f} s")
    if ckpt is not None:
        try:
            job.coordinator("load_adapters", str(ckpt.adapters.resolve()), ckpt.step)
            job.load_learner_states(read_learner_states(ckpt.adapters, run.policies))
        except BaseException:
            job.shutdown()
            raise
        due = "; its evaluation, stopped before it ended, runs first" if ckpt.eval_due else ""
        console.print(f"resumed from {ckpt.folder} (step {ckpt.step}{due})")
    return job


def _train(run: OpenRun, job: Job) -> _Ended:
    """The first evaluation (a new run), then each step with its evaluations and checkpoints,
    on a progress bar (plain lines when the console is not a terminal: a log file, nohup, CI),
    and the final adapters; the job is shut down at the end, however it ends."""
    cfg, ckpt = run.cfg, run.ckpt
    start = 1 if ckpt is None else ckpt.step + 1
    plain = not run.console.is_terminal
    ended = _Ended()
    feed: EpisodeFeed | None = None
    try:
        with Progress(
            TextColumn("[progress.description]{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
            console=run.console, redirect_stdout=True, redirect_stderr=True,
            disable=plain,  # a log file gets the plain lines of report(), not the bars' last frame
        ) as progress:
            task = progress.add_task("eval (untrained)" if ckpt is None else "train", total=cfg.train.steps,
                                     completed=start - 1, status="")
            episodes = progress.add_task("episodes", total=None, status="")

            def on_episodes(done: int, total: int, train: bool) -> None:
                progress.update(episodes, completed=done, total=total,
                                description="  episodes (train)" if train else "  episodes (eval)")

            feed = EpisodeFeed(on_episodes)
            steps = _Steps(run, job, progress, task, feed.endpoint, plain)
            ended.interrupted = steps.run_all(start)
        if not ended.interrupted:
            ended.adapters = job.coordinator("save_adapters", str((run.run_dir / "adapters").resolve()))
            save_learner_states(job.learner_states(), ended.adapters)
            ended.info = job.info()
    except ComponentDied as e:
        e.run_dir = str(run.run_dir)  # where --resume continues
        ended.died = e
    except KeyboardInterrupt:  # a second Ctrl-C: at once, the newest checkpoint stands
        ended.interrupted = True
    finally:
        if feed is not None:
            feed.close()
        job.shutdown()
        run.log.close()
    return ended


class _Steps:
    """The evaluations and steps of a run, each logged to ``metrics.jsonl`` and reported on
    the progress bar's ``task`` (and in a plain line when ``plain``)."""

    def __init__(self, run: OpenRun, job: Job, progress: Progress, task: TaskID, feed: str, plain: bool) -> None:
        self.run, self.job, self.progress, self.task, self.feed, self.plain = run, job, progress, task, feed, plain

    def report(self, step: int, kind: str, m: dict[str, float]) -> str:
        """The status line of ``m``; printed as a plain line when there are no bars."""
        run = self.run
        status = _status(m, run.policies, kind, run.game_eval)
        if self.plain:
            run.console.print(f"step {step}/{run.cfg.train.steps} {kind}: {status} "
                              f"({time.perf_counter() - run.t_start:.0f} s)", highlight=False)
        return status

    def run_all(self, start: int) -> bool:
        """The first evaluation (a new run), then the steps from ``start``; True when a Ctrl-C
        stopped them (after the first evaluation, or after a step it saved)."""
        run, ev = self.run, self.run.cfg.eval
        if run.ckpt is None:
            run.first = self.job.supervised("evaluate", 0, True, ev.final_hands_per_stratum or ev.hands_per_stratum,
                                            self.feed)
            run.log.write(0, "eval", run.first)
            self.report(0, "eval", run.first)
            run.last = run.first
        else:
            run.first, run.last = run.ckpt.first_eval, run.ckpt.last_eval
            if run.ckpt.eval_due:  # stopped during the step's evaluation: it runs again, then the steps
                self.evaluate(run.ckpt.step)
                self.save_checkpoint(run.ckpt.step)
                if run.stop.asked:
                    return True
        self.progress.update(self.task, description="train", status=_status(run.last, run.policies, "eval",
                                                                            run.game_eval))
        for step in range(start, run.cfg.train.steps + 1):
            if run.stop.asked:  # Ctrl-C during the first evaluation: nothing trained to keep
                return True
            if self.step(step):
                return True
        return False

    def step(self, step: int) -> bool:
        """Train ``step``, evaluate and checkpoint it when due (a step with both is checkpointed
        before its evaluation too, so a stop during a long evaluation keeps its training); True
        when a Ctrl-C asks to stop after it (it is saved)."""
        run, job, progress, task = self.run, self.job, self.progress, self.task
        cfg, ev = run.cfg, run.cfg.eval
        run.now = f"step {step}"
        m = job.supervised("train_step", step, self.feed)
        m["runtime/restarts"] = float(job.restarts)
        run.log.write(step, "train", m)
        progress.update(task, advance=1, status=self.report(step, "train", m))
        final = step == cfg.train.steps
        checkpoint = final or bool(cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0)
        if final or (ev.every and step % ev.every == 0):
            if checkpoint or run.stop.asked:
                self.save_checkpoint(step, eval_due=True)
            self.evaluate(step)
        if checkpoint or run.stop.asked:
            self.save_checkpoint(step)
        return run.stop.asked and not final  # Ctrl-C: this step is done and saved

    def evaluate(self, step: int) -> None:
        """Evaluate the policies after ``step`` (with the final evaluation's games at the last
        step) into ``run.last`` and the log."""
        run, progress, task, ev = self.run, self.progress, self.task, self.run.cfg.eval
        final = step == run.cfg.train.steps
        run.now = f"the evaluation of step {step}"
        progress.update(task, description="eval")
        hands = (ev.final_hands_per_stratum or ev.hands_per_stratum) if final else ev.hands_per_stratum
        run.last = self.job.supervised("evaluate", step, final, hands, self.feed)
        run.log.write(step, "eval", run.last)
        progress.update(task, description="train", status=self.report(step, "eval", run.last))

    def save_checkpoint(self, step: int, eval_due: bool = False) -> None:
        """Write the checkpoint of ``step``: ``eval_due`` before its evaluation, with the
        evaluation before it as ``last_eval``."""
        run, job, cfg = self.run, self.job, self.run.cfg
        write_checkpoint(run.run_dir, step, lambda folder: job.coordinator("save_adapters", folder),
                         lambda paths: save_learner_states(job.learner_states(), paths), run.first, run.last,
                         updates_per_step={p.name: cfg.train_for(p.name).epochs * cfg.train_for(p.name).minibatches
                                           for p in cfg.policies}, wall_s=_wall_s(run),
                         wall_from_step=run.wall_from_step, eval_due=eval_due)
        run.state.saved = step


def _finish(run: OpenRun, job: Job, ended: _Ended) -> RunResult:
    """A finished run's learning curves, cross-play and rating plots, its tables, and
    ``summary.json``; its :class:`RunResult`."""
    cfg, console, run_dir, policies, game_eval = run.cfg, run.console, run.run_dir, run.policies, run.game_eval
    first, last, adapters = run.first, run.last, ended.adapters
    plot_learning_curves(run.log.rows, policies, run_dir / "learning_curve.png", cfg.game, game_eval)
    plot_cross_play([("step 0", first), (f"step {cfg.train.steps}", last)], policies, run_dir / "cross_play.png",
                    game_eval)
    console.print(summary_table(first, last, policies, cfg.train.steps, game_eval))
    history = rating_history(run.log.rows)
    if history:
        plot_ratings(history, run_dir / "ratings.png")
    table = ratings_table(last, cfg.train.steps)
    if table is not None:
        console.print(table)
    total = _wall_s(run)  # the attempts a restore replaced, or the time up to a resumed checkpoint, included
    since = {"wall_s_from_step": run.wall_from_step} if run.wall_from_step else {}
    (run_dir / "summary.json").write_text(json.dumps({"first_eval": first, "last_eval": last, "adapters": adapters,
                                                      "wall_s": total, **since, "restarts": job.restarts,
                                                      "machine": job_machine(cfg.model),
                                                      **commit_record(run.commit)},
                                                     indent=1))
    console.print(f"adapters: {adapters}\nwrote {run_dir} in {total:.0f} s")
    return RunResult(run_dir=run_dir, first_eval=first, last_eval=last, rows=run.log.rows, info=ended.info)


def _recover(cfg: JobConfig, console: Console, run_dir: Path, died: ComponentDied, now: str,
             restarts: int, spent_s: float) -> RunResult:
    """After ``died`` stopped the job during ``now`` (its components shut down): restore the
    newest checkpoint and go on, as ``--resume`` would, when ``runtime.max_restarts`` allows one
    more restart (``restarts`` used so far) and a checkpoint exists; else raise ``died``, which
    names the component (:class:`~opentinker.control.component.ComponentDied`)."""
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


def _run_offline(cfg: JobConfig, console: Console, run: OpenRun, stop: StopOnInterrupt) -> RunResult:
    """An offline job (SFT, DPO, IPO) on a scheduler of its own; the first Ctrl-C ends its
    steps after the one in progress, and the adapter so far is evaluated and saved."""
    from opentinker.training.offline import run_offline

    oc = cfg.offline_job()
    assert oc is not None
    run_dir, log = run.run_dir, run.log
    try:
        with console.status(f"offline {oc.kind} on {oc.source()}: {oc.steps} steps"):
            job = Job(cfg, run.model_path, run_dir=str(run_dir.resolve()), scheduler_only=True)
            try:
                summary = run_offline(cfg, run_dir, job.scheduler_endpoint, job.scheduler_credentials, log,
                                      lambda: stop.asked, run.commit)
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
                     rows=log.rows,
                     info={"stopped": summary["stopped"], "steps": summary["steps"], "of": oc.steps,
                           "adapter": summary["adapters"][name]})


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
