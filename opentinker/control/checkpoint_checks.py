"""Checkpoints you can trust: a manifest of every file's checksum, written last, and the checks
a checkpoint must pass before ``--resume`` uses it (or rewrites anything of the run).

``manifest.json`` lists every file of ``checkpoints/step_N/`` with its size and SHA-256. A
checkpoint is *verified* when:

* its manifest is there and every file it lists has its size and checksum (a bit flipped on
  disk, a file cut short or deleted);
* ``state.json`` names the folder's own step (``1 <= step``), and its run time so far
  (``wall_s``, where recorded) is a finite number of seconds, not negative, counted from a
  step up to its own (``wall_s_from_step``, where not 0), and ``eval_due``, where recorded, is
  true or false;
* every policy's adapter has a version in ``[0, step x updates per step]``, its weights
  (``*.safetensors``: the adapter, a full policy's weights, the optimizer moments) are finite,
  and the weights are below :data:`MAX_WEIGHT` in magnitude;
* every learner state is the JSON of its policy's learner, with finite moving-average baselines
  below :data:`MAX_BASELINE` in magnitude and at most ``step`` steps trained.

Each problem names the file. :func:`~opentinker.control.checkpoints.latest_checkpoint` skips a
checkpoint that fails for the one before it, and reports why.
"""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from opentinker.files import write_atomic

MANIFEST = "manifest.json"
MAX_WEIGHT = 1e4
"""Largest magnitude a saved weight may have (LoRA and base weights are O(1); 1e30 is damage)."""
MAX_BASELINE = 1e6
"""Largest magnitude of a learner's moving-average baseline (an average of rewards: the bundled
games pay within +-100; a baseline of 1e9 is damage)."""
_CHUNK = 1 << 20


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Write ``folder/manifest.json``: every other file under ``folder`` with its size and
    SHA-256 (written last, to a temporary name, then renamed)."""
    files = {str(p.relative_to(folder)): {"bytes": p.stat().st_size, "sha256": sha256(p)}
             for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}
    return write_atomic(folder / MANIFEST, json.dumps({"files": files}, indent=1))


def _json(path: Path, problems: list[str]) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:
        problems.append(f"{path}: not readable JSON ({e})")
        return None


def _check_files(folder: Path, problems: list[str]) -> bool:
    """The manifest's files against the disk; False when there is no usable manifest."""
    path = folder / MANIFEST
    if not path.is_file():
        problems.append(f"{path}: missing (cut short before it was written, or written by an older version)")
        return False
    manifest = _json(path, problems)
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        if manifest is not None:
            problems.append(f"{path}: not a manifest (no 'files' table)")
        return False
    for rel, want in files.items():
        p = folder / rel
        if not p.is_file():
            problems.append(f"{p}: missing (listed in {MANIFEST})")
        elif p.stat().st_size != want.get("bytes"):
            problems.append(f"{p}: {p.stat().st_size} bytes, {want.get('bytes')} when written")
        elif sha256(p) != want.get("sha256"):
            problems.append(f"{p}: checksum differs from the one written in {MANIFEST}")
    return True


def _check_tensors(path: Path, problems: list[str], bound: float | None) -> None:
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(path))
    except Exception as e:  # noqa: BLE001  (safetensors raises its own error types)
        problems.append(f"{path}: not a readable safetensors file ({e})")
        return
    for name, t in tensors.items():
        if t.dtype.kind != "f" or t.size == 0:
            continue
        if not np.isfinite(t).all():
            problems.append(f"{path}: tensor {name} has non-finite values")
            return
        if bound is not None and float(np.abs(t).max()) > bound:
            problems.append(f"{path}: tensor {name} has a value of magnitude {float(np.abs(t).max()):.3g} "
                            f"(> {bound:g})")
            return


def _check_learner(path: Path, policy: str, step: int, problems: list[str]) -> None:
    state = _json(path, problems)
    if state is None:
        return
    if not isinstance(state, dict) or state.get("policy") not in (None, policy):
        problems.append(f"{path}: not the learner state of policy {policy!r}")
        return
    trained = state.get("steps_trained")
    if not isinstance(trained, int) or not 0 <= trained <= step:
        problems.append(f"{path}: steps_trained {trained!r} is not within [0, {step}]")
    adv = state.get("advantage_state") or {}
    for key, b in (adv.get("baselines") or {}).items() if isinstance(adv, dict) else ():
        if not isinstance(b, (int, float)) or not math.isfinite(b) or abs(b) > MAX_BASELINE:
            problems.append(f"{path}: baseline {key!r} = {b!r} is not a finite value within +-{MAX_BASELINE:g}")


def verify(folder: Path, policies: dict[str, int]) -> list[str]:
    """Problems of checkpoint ``folder`` (``checkpoints/step_N``), each naming its file; empty
    when it checks out. ``policies``: policy -> optimizer updates per step (its version may be
    at most ``step`` times that, or times the number recorded in ``state.json``)."""
    problems: list[str] = []
    _check_files(folder, problems)
    want = int(folder.name.removeprefix("step_"))
    state = _json(folder / "state.json", problems)
    step = want
    if state is not None:
        got = state.get("step") if isinstance(state, dict) else None
        if got != want or not isinstance(got, int) or got < 1:
            problems.append(f"{folder / 'state.json'}: step {got!r} is not its folder's step {want}")
        if not isinstance(state, dict) or not all(isinstance(state.get(k), dict) for k in ("first_eval", "last_eval")):
            problems.append(f"{folder / 'state.json'}: no first_eval / last_eval tables")
        wall = state.get("wall_s") if isinstance(state, dict) else None
        if wall is not None and (isinstance(wall, bool) or not isinstance(wall, (int, float))
                                 or not math.isfinite(wall) or wall < 0):
            problems.append(f"{folder / 'state.json'}: wall_s {wall!r} is not a run time in seconds")
        due = state.get("eval_due", False) if isinstance(state, dict) else False
        if not isinstance(due, bool):
            problems.append(f"{folder / 'state.json'}: eval_due {due!r} is not true or false")
        since = state.get("wall_s_from_step", 0) if isinstance(state, dict) else 0
        if isinstance(since, bool) or not isinstance(since, int) or not 0 <= since <= want:
            problems.append(f"{folder / 'state.json'}: wall_s_from_step {since!r} is not a step up to {want}")
    recorded = state.get("updates_per_step") if isinstance(state, dict) else None
    for policy, per_step in policies.items():
        if isinstance(recorded, dict) and isinstance(recorded.get(policy), int):
            per_step = max(per_step, recorded[policy])  # the run's own, should the config have changed
        adapter = folder / "adapters" / policy
        meta = _json(adapter / "opentinker.json", problems) if (adapter / "opentinker.json").is_file() else None
        if meta is None and not (adapter / "opentinker.json").is_file():
            problems.append(f"{adapter / 'opentinker.json'}: missing")
        elif isinstance(meta, dict):
            v = meta.get("version")
            if not isinstance(v, int) or not 0 <= v <= step * per_step:
                problems.append(f"{adapter / 'opentinker.json'}: version {v!r} is not within [0, {step * per_step}] "
                                f"({step} steps of at most {per_step} updates)")
        for f in sorted(adapter.glob("*.safetensors")):
            _check_tensors(f, problems, None if f.name.startswith("optimizer") else MAX_WEIGHT)
        if (adapter / "learner_state.json").is_file():
            _check_learner(adapter / "learner_state.json", policy, step, problems)
        else:
            problems.append(f"{adapter / 'learner_state.json'}: missing")
    return problems
