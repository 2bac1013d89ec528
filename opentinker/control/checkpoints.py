"""Checkpoints of a run and ``--resume``.

``runs/<run>/checkpoints/step_N/`` holds what a run needs to continue after step ``N`` exactly
as if it had never stopped: every policy's adapter with its optimizer state and version
(``adapters/<policy>/``, as :class:`~protocols.messages.SaveAdapter` writes them), each
learner's state beside it (``learner_state.json``: moving-average baselines), and
``state.json`` (the step and the evaluations so far). Everything else is a pure function of
the config and the step (episodes, seeds), so nothing more is needed. A checkpoint is written
to a hidden temporary folder and renamed into place: a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

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

    @property
    def adapters(self) -> Path:
        return self.folder / "adapters"


KEEP = 2
"""Checkpoints kept per run (the newest ones): each holds every adapter's optimizer state."""


def write_checkpoint(run_dir: Path, step: int, save_adapters: Any, save_states: Any,
                     first_eval: dict[str, float], last_eval: dict[str, float], keep: int = KEEP) -> Path:
    """Write ``checkpoints/step_<step>`` atomically, then delete all but the ``keep`` newest.
    ``save_adapters(folder) -> {policy: path}`` writes the adapters; ``save_states(paths)``
    writes each learner's state beside its adapter."""
    root = Path(run_dir) / "checkpoints"
    final, tmp = root / f"step_{step}", root / f".step_{step}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    save_states(save_adapters(str((tmp / "adapters").resolve())))
    (tmp / STATE).write_text(json.dumps({"step": step, "first_eval": first_eval, "last_eval": last_eval}))
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    done = sorted((int(p.name.removeprefix("step_")), p) for p in root.iterdir()
                  if p.name.startswith("step_") and p.name.removeprefix("step_").isdigit())
    for _, old in done[:-keep]:
        shutil.rmtree(old)
    return final


def latest_checkpoint(run_dir: Path) -> Checkpoint:
    """The newest complete checkpoint of a run; ``FileNotFoundError`` naming the run when it
    has none, ``ValueError`` naming a corrupt ``state.json``."""
    root = Path(run_dir) / "checkpoints"
    steps = sorted(
        (int(p.name.removeprefix("step_")), p)
        for p in (root.iterdir() if root.is_dir() else [])
        if p.name.startswith("step_") and p.name.removeprefix("step_").isdigit() and (p / STATE).is_file()
    )
    if not steps:
        raise FileNotFoundError(f"{run_dir} has no checkpoint to resume from (checkpoints/step_N/{STATE})")
    folder = steps[-1][1]
    try:
        state = json.loads((folder / STATE).read_text())
        return Checkpoint(step=int(state["step"]), folder=folder, first_eval=state["first_eval"],
                          last_eval=state["last_eval"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{folder / STATE} is corrupt: {e}") from None


def truncate_metrics(path: Path, step: int) -> list[dict[str, Any]]:
    """Keep the rows of ``metrics.jsonl`` up to ``step`` (a resumed run writes the rest
    again); returns them. The file is rewritten atomically."""
    rows = []
    if path.is_file():
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                if row.get("step", 0) <= step:
                    rows.append(row)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
    os.replace(tmp, path)
    return rows
