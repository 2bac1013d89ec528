"""Opening a run of ``opentinker run``: its config checked, its base model resolved, its
folder made (or, resuming, cut back to its checkpoint), and what the later phases share."""

from __future__ import annotations

import functools
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.markup import escape

import games
from opentinker.config import ConfigError, JobConfig, to_toml
from opentinker.control import transcripts
from opentinker.control.checkpoints import (
    Checkpoint,
    latest_checkpoint,
    truncate_metrics,
)
from opentinker.control.config_checks import check_config
from opentinker.engine.model_specs import resolve_model
from opentinker.eval.report import MetricsLog
from opentinker.interrupt import StopOnInterrupt
from opentinker.machine import git_commit
from opentinker.training import trajectory_log

if TYPE_CHECKING:
    from opentinker.run import _Started


@dataclass
class OpenRun:
    """A run being made: what the phases of :func:`opentinker.run._run_job` share."""

    cfg: JobConfig
    console: Console
    run_dir: Path
    ckpt: Checkpoint | None
    """The checkpoint it resumes from (None: a new run)."""
    model_path: str
    log: MetricsLog
    t_start: float
    state: _Started
    stop: StopOnInterrupt
    now: str = "the first evaluation"
    """What the job is doing, for the message of a component that dies."""
    commit: tuple[str, bool] = ("unknown", False)
    """The checkout's commit and whether it was dirty when the run opened: the code this
    process imported (a commit made while it runs is not what it trains with)."""
    spent_s: float = 0.0
    """Wall seconds of the run before this attempt (its attempts a restore replaced, or the
    time up to the checkpoint it resumes from), counted in its checkpoints and summary."""
    wall_from_step: int = 0
    """The step the run's recorded time counts from: 0, or the step of a checkpoint resumed
    from that did not record the time before it."""
    first: dict[str, float] = field(default_factory=dict)
    """The evaluation before training."""
    last: dict[str, float] = field(default_factory=dict)
    """The newest evaluation."""

    @property
    def policies(self) -> list[str]:
        return [p.name for p in self.cfg.policies]

    @functools.cached_property
    def game_eval(self) -> games.GameEval:
        return games.evaluation(self.cfg.game)



def open_run(cfg: JobConfig, console: Console, run_dir: Path | None, resume: Path | None,
              checkpoint: Checkpoint | None, state: _Started, stop: StopOnInterrupt) -> OpenRun:
    """Check the config, resolve the base model, and make the run folder (a resumed one: its
    metrics, trajectories and transcripts cut back to its checkpoint's step, its config
    rewritten with any ``--set``); ``state`` records what was made."""
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
    console.print(f"[bold]opentinker[/] run [cyan]{escape(str(run_dir))}[/]  model={escape(cfg.model.base)}  "
                  f"backend={cfg.runtime.backend}")
    with console.status("preparing the base model (first use converts the GGUF, ~20 s)"):
        model_path = resolve_model(cfg.model.base)
    if ckpt is not None:
        rows = truncate_metrics(run_dir / "metrics.jsonl", ckpt.step, ckpt.eval_due)
        for path in sorted((run_dir / "trajectories").glob("*.jsonl")):
            trajectory_log.truncate(path, ckpt.step)  # the steps after it are played again
        transcripts.truncate(run_dir / "transcripts.txt", ckpt.step)
        # A step whose evaluation runs again: TensorBoard drops the step, and its training is kept.
        log = MetricsLog(run_dir / "metrics.jsonl", purge_step=ckpt.step + (0 if ckpt.eval_due else 1))
        log.rows = rows
        if ckpt.eval_due:
            log.rewrite_tensorboard([r for r in rows if r["step"] == ckpt.step])
        state.run_dir, state.saved = run_dir, ckpt.step
        (run_dir / "config.toml").write_bytes(to_toml(cfg))  # with any --set of the resume
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
    return OpenRun(cfg, console, run_dir, ckpt, model_path, log, t_start, state, stop, commit=git_commit())
