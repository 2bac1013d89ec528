"""Checkpoints of a run and ``--resume``.

``runs/<run>/checkpoints/step_N/`` holds what a run needs to continue after step ``N`` exactly
as if it had never stopped: every policy's adapter with its optimizer state and version
(``adapters/<policy>/``, as :class:`~protocols.messages.SaveAdapter` writes them), each
learner's state beside it (``learner_state.json``: moving-average baselines), and
``state.json`` (the step and the evaluations so far). Everything else is a pure function of
the config and the step (episodes, seeds), so nothing more is needed. A checkpoint is written
to a hidden temporary folder and renamed into place: a reader never sees half of one.

A step that is evaluated is checkpointed before its evaluation (``"eval_due": true`` in
``state.json``: the trained weights are safe while an evaluation of many minutes runs) and
again after it; ``--resume`` from a checkpoint whose evaluation is due runs only that
evaluation before the next step.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from opentinker.control.checkpoint_checks import verify, write_manifest
from opentinker.files import write_atomic

if TYPE_CHECKING:
    from opentinker.config import JobConfig

STATE = "state.json"
LEAGUE_STATE = "league_state.json"
"""Beside the saved adapters (``adapters/`` of a run or a checkpoint): the league's matchmaking
win rates and running ratings (:meth:`~opentinker.control.coordinator.Coordinator.league_state`)."""


@dataclass(frozen=True)
class Checkpoint:
    step: int
    folder: Path
    first_eval: dict[str, float]
    last_eval: dict[str, float]
    skipped: tuple[str, ...] = ()
    """Newer checkpoints that did not check out, each with its problems."""
    wall_s: float | None = None
    """The run's wall seconds when it was written, every attempt before it included since step
    :attr:`wall_from_step` (None: a checkpoint written before this was recorded)."""
    wall_from_step: int = 0
    """The step :attr:`wall_s` counts from: 0, or the step of an older checkpoint (one without
    the time) that the run was resumed from."""
    eval_due: bool = False
    """The step's evaluation had not run when it was written (it was written before it):
    :attr:`last_eval` is the evaluation before, and a resume runs this step's first."""

    @property
    def adapters(self) -> Path:
        return self.folder / "adapters"


KEEP = 2
"""Checkpoints kept per run (the newest ones): each holds every adapter's optimizer state."""


def write_checkpoint(run_dir: Path, step: int, save_adapters: Any, save_states: Any,
                     first_eval: dict[str, float], last_eval: dict[str, float], keep: int = KEEP,
                     updates_per_step: dict[str, int] | None = None, wall_s: float | None = None,
                     wall_from_step: int = 0, eval_due: bool = False) -> Path:
    """Write ``checkpoints/step_<step>`` atomically (replacing one of that step: the same step
    written again after its evaluation), then delete all but the ``keep`` newest.
    ``save_adapters(folder) -> {policy: path}`` writes the adapters; ``save_states(paths)``
    writes each learner's state beside its adapter; ``wall_s`` (the run's time so far, counted
    from step ``wall_from_step``) lets a resumed run count the time before it; ``eval_due``:
    written before the step's evaluation (:attr:`Checkpoint.eval_due`)."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir(parents=True)
        save_states(save_adapters(str((tmp / "adapters").resolve())))
        (tmp / STATE).write_text(json.dumps({"step": step, "first_eval": first_eval, "last_eval": last_eval,
                                             "updates_per_step": updates_per_step or {},
                                             **({"wall_s": wall_s} if wall_s is not None else {}),
                                             **({"wall_s_from_step": wall_from_step} if wall_from_step else {}),
                                             **({"eval_due": True} if eval_due else {})}))
        write_manifest(tmp)  # last: a checkpoint without one was cut short
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)  # e.g. a full disk: the older checkpoints stay as they were
        raise
    aside = root / f".step_{step}.old"
    if os.path.lexists(aside):
        _remove(aside)
    if final.is_dir() and not final.is_symlink():
        os.replace(final, aside)  # set aside, not deleted, so the step is missing only between two renames
    elif os.path.lexists(final):
        _remove(final)
    os.replace(tmp, final)
    if os.path.lexists(aside):
        _remove(aside)
    done = sorted((int(p.name.removeprefix("step_")), p) for p in root.iterdir()
                  if p.name.startswith("step_") and p.name.removeprefix("step_").isdigit())
    for _, old in done[:-keep]:
        _remove(old)
    return final


def _remove(path: Path) -> None:
    """Delete a checkpoint's entry in ``checkpoints/``: a symbolic link (made by someone else)
    is unlinked, never followed, so pruning removes nothing outside the run (before, it crashed
    with a traceback on one)."""
    if path.is_symlink() or not path.is_dir():
        path.unlink()
    else:
        shutil.rmtree(path)


def latest_checkpoint(run_dir: Path, cfg: JobConfig | None = None) -> Checkpoint:
    """The newest checkpoint of a run that checks out; ``FileNotFoundError`` naming the run
    when it has none at all.

    With the run's ``cfg``, each checkpoint is verified first (:func:`checkpoint_checks.verify`:
    checksums, steps, versions, finite weights, learner states); one that fails is skipped for
    the one before it (its problems are in :attr:`Checkpoint.skipped`), and when none checks
    out a ``ValueError`` lists every problem by file. Without ``cfg`` (reading a finished
    run's adapters) only ``state.json`` is read (``ValueError`` naming it when corrupt)."""
    root = Path(run_dir) / "checkpoints"
    steps = sorted(
        (int(p.name.removeprefix("step_")), p)
        for p in (root.iterdir() if root.is_dir() else [])
        if p.name.startswith("step_") and p.name.removeprefix("step_").isdigit() and (p / STATE).is_file()
    )
    if not steps:
        raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from (checkpoints/step_N/{STATE})")
    skipped: list[str] = []
    if cfg is not None:
        updates = {p.name: cfg.train_for(p.name).epochs * cfg.train_for(p.name).minibatches for p in cfg.policies}
        for _, folder in reversed(steps):
            problems = verify(folder, updates)
            if not problems:
                ck = _read(folder, tuple(skipped))
                if ck.step > cfg.train.steps:  # the config, not the checkpoint: never fall back for it
                    raise ValueError(f"{folder}: step {ck.step} is past train.steps = {cfg.train.steps}: nothing "
                                     "to train (--set train.steps=N to train on)")
                return ck
            skipped.append(f"{folder.name}: " + "; ".join(problems))
        raise ValueError(f"{run_dir}: no checkpoint checks out:\n  " + "\n  ".join(skipped))
    return _read(steps[-1][1], ())


def _read(folder: Path, skipped: tuple[str, ...]) -> Checkpoint:
    try:
        state = json.loads((folder / STATE).read_text())
        wall, since = state.get("wall_s"), state.get("wall_s_from_step", 0)
        known = isinstance(wall, (int, float)) and not isinstance(wall, bool) and math.isfinite(wall) and wall >= 0
        return Checkpoint(step=int(state["step"]), folder=folder, first_eval=state["first_eval"],
                          last_eval=state["last_eval"], skipped=skipped, wall_s=float(wall) if known else None,
                          wall_from_step=since if isinstance(since, int) and since >= 0 else 0,
                          eval_due=state.get("eval_due") is True)
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{folder / STATE} is corrupt: {e}") from None


def _lines(path: Path) -> Iterator[tuple[int, bytes, bool]]:
    """``(number, line, torn)`` for each non-empty line of ``path``, read one at a time;
    ``torn``: the last line with no newline (a write cut short by a crash)."""
    with open(path, "rb") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                yield i, line.rstrip(b"\n"), not line.endswith(b"\n")


def metrics_rows(path: Path, step: int, eval_due: bool = False) -> list[dict[str, Any]]:
    """The rows of ``metrics.jsonl`` up to ``step`` (without its evaluation's when
    ``eval_due``: it is run again), read a line at a time (none when there is no file). A line
    that is not a JSON object with a step is a ``ValueError`` naming the file and line, but for
    a torn last line, which is dropped (a crash cut its write short)."""
    rows = []
    if path.is_file():
        for i, line, torn in _lines(path):
            try:
                row = json.loads(line)
                at = int(row.get("step", 0))
                keep = at < step or (at == step and not (eval_due and row.get("kind") == "eval"))
            except (ValueError, AttributeError, TypeError) as e:
                if torn:
                    break
                raise ValueError(f"{path}:{i}: not a metrics row ({e})") from None
            if keep:
                rows.append(row)
    return rows


def truncate_metrics(path: Path, step: int, eval_due: bool = False) -> list[dict[str, Any]]:
    """Keep the rows of ``metrics.jsonl`` up to ``step``, less its evaluation's when
    ``eval_due`` (a resumed run writes the rest again); returns them (:func:`metrics_rows`: a
    bad line is an error and nothing is rewritten). The file is rewritten atomically."""
    rows = metrics_rows(path, step, eval_due)
    write_atomic(path, "".join(json.dumps(r) + "\n" for r in rows))
    return rows


def check_run_files(run_dir: Path, step: int) -> None:
    """Read (without rewriting or keeping them) what a resume from ``step`` rewinds:
    ``metrics.jsonl`` and every ``trajectories/*.jsonl``, a line at a time; ``ValueError``
    naming the file and line of a bad record (a torn last line is fine: it is dropped)."""
    from opentinker.training import trajectory_log

    run_dir = Path(run_dir)
    metrics_rows(run_dir / "metrics.jsonl", step)
    for path in sorted((run_dir / "trajectories").glob("*.jsonl")):
        trajectory_log.check(path)
