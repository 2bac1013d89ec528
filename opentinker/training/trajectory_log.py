"""Recorded training trajectories: ``<run>/trajectories/<policy>.jsonl``.

One JSON object per line, a :class:`TrajectoryRecord`: the job's game and step and one seat's
whole episode, token-in/token-out (observation tokens, the sampled tokens exactly as drawn,
the sampler's log-probs, per-turn rewards and the game's values of the turns' states where it
has them, the group, seed and seat). Decoding is typed
(``msgspec``; a malformed line is an error naming the file and line), and nothing is pickled.
Log-probs are float32 values written as JSON floats, which read back to the same float32.

The learner appends each step's trajectories in ``(episode_id, seat)`` order after the step
has trained; offline jobs (:mod:`opentinker.training.offline`) read them back as
:class:`protocols.messages.Trajectory` for :mod:`learners.offline`.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import numpy as np

from opentinker.files import replaced
from protocols.messages import ParseOutcome, PolicyRef, StopReason, Trajectory, Turn


class TurnRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True, omit_defaults=True):
    obs_tokens: list[int]
    sampled_tokens: list[int]
    sampler_logprobs: list[float]
    policy: PolicyRef
    stop_reason: StopReason
    parse: ParseOutcome
    reward: float
    game_value: float | None = None
    """The game's exact value of the turn's state (``Turn.game_value``), where it has one."""


class TrajectoryRecord(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    game: str
    step: int
    episode_id: int
    group_id: int
    seed: int
    seat: str
    policy: str
    total_reward: float
    turns: list[TurnRecord]


def to_record(traj: Trajectory, game: str) -> TrajectoryRecord:
    """The record of one trajectory (arrays as lists)."""
    return TrajectoryRecord(
        game=game, step=traj.step, episode_id=traj.episode_id, group_id=traj.group_id,
        seed=traj.seed, seat=traj.seat, policy=traj.policy, total_reward=traj.total_reward,
        turns=[TurnRecord(
            obs_tokens=np.asarray(t.obs_tokens).tolist(),
            sampled_tokens=np.asarray(t.sampled_tokens).tolist(),
            sampler_logprobs=np.asarray(t.sampler_logprobs, np.float32).tolist(),
            policy=t.policy, stop_reason=t.stop_reason, parse=t.parse, reward=t.reward, game_value=t.game_value,
        ) for t in traj.turns],
    )


def from_record(rec: TrajectoryRecord) -> Trajectory:
    """The :class:`Trajectory` of a record (``int32`` tokens, ``float32`` log-probs)."""
    return Trajectory(
        episode_id=rec.episode_id, group_id=rec.group_id, seat=rec.seat, seed=rec.seed,
        policy=rec.policy, total_reward=rec.total_reward, step=rec.step,
        turns=[Turn(
            obs_tokens=np.asarray(t.obs_tokens, np.int32),
            sampled_tokens=np.asarray(t.sampled_tokens, np.int32),
            sampler_logprobs=np.asarray(t.sampler_logprobs, np.float32),
            policy=t.policy, stop_reason=t.stop_reason, parse=t.parse, reward=t.reward, game_value=t.game_value,
        ) for t in rec.turns],
    )


def append(path: str | Path, trajectories: Sequence[Trajectory], game: str) -> None:
    """Append one line per trajectory to ``path`` (created with its folder when missing)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    encoder = msgspec.json.Encoder()
    with open(path, "ab") as f:
        f.writelines(encoder.encode(to_record(traj, game)) + b"\n" for traj in trajectories)


def read(path: str | Path) -> list[TrajectoryRecord]:
    """Every record of a ``.jsonl`` file, or of every ``*.jsonl`` file of a folder (sorted by
    name). ``ValueError`` naming the file and line of a malformed record; ``FileNotFoundError``
    when there is nothing to read."""
    path = Path(path)
    files = sorted(path.glob("*.jsonl")) if path.is_dir() else [path]
    if not files or not all(f.is_file() for f in files):
        raise FileNotFoundError(f"no trajectory file at {path}")
    decoder = msgspec.json.Decoder(TrajectoryRecord)
    out = []
    for file in files:
        for n, line in enumerate(file.read_bytes().splitlines(), 1):
            if not line.strip():
                continue
            try:
                out.append(decoder.decode(line))
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                raise ValueError(f"{file}:{n}: not a trajectory record: {e}") from None
    return out


def _records(path: Path) -> Iterator[tuple[int, bytes, TrajectoryRecord | None]]:
    """``(number, line, record)`` per non-empty line of ``path``, a line at a time; a torn
    last line (no newline: a crash cut its write short) that does not decode comes as
    ``None``; any other bad line is a ``ValueError`` naming the file and line."""
    decoder = msgspec.json.Decoder(TrajectoryRecord)
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield n, line.rstrip(b"\n"), decoder.decode(line)
            except (msgspec.DecodeError, msgspec.ValidationError) as e:
                if not line.endswith(b"\n"):
                    yield n, line, None
                    return
                raise ValueError(f"{path}:{n}: not a trajectory record: {e}") from None


def check(path: str | Path) -> int:
    """Decode every record of ``path`` without keeping them (``ValueError`` as :func:`read`,
    but a torn last line is fine); returns the number of records."""
    return sum(rec is not None for _, _, rec in _records(Path(path)))


def truncate(path: str | Path, step: int) -> int:
    """Keep the records of ``path`` from steps up to ``step`` (a resumed run plays the later
    steps again and appends them: no record twice); the file is rewritten atomically, a line
    at a time, lines kept byte for byte. Returns the number of records dropped (a torn last
    line included). ``ValueError`` naming the file and line of a malformed record (nothing is
    rewritten then)."""
    path = Path(path)
    dropped = 0
    with replaced(path, binary=True) as out:
        for _, line, rec in _records(path):
            if rec is not None and rec.step <= step:
                out.write(line + b"\n")
            else:
                dropped += 1
    return dropped
