"""Training data from self-play: SFT sequences and preference pairs, from recorded trajectories.

Pure functions of :class:`protocols.messages.Trajectory` lists (as a run records them), giving
datums for the ``sft`` loss and for the ``dpo`` / ``ipo`` losses (:mod:`learners.preferences`).
Tokens and masks are exactly the trajectory's (:func:`learners.assembly.trajectory_to_datum`):
what the policy sampled is what it is trained on.

* SFT warm start: maximum likelihood on the sampled tokens of trajectories whose total reward
  clears a bar (e.g. won games): rejection-sampling fine-tuning / expert iteration (Anthony et
  al. 2017, "Thinking Fast and Slow with Deep Learning and Tree Search"; Touvron et al. 2023,
  "Llama 2", §3.2.3, rejection sampling).
* Preference pairs: two trajectories of the same start (same ``group_id``, ``seed`` and
  ``seat``: the same deal, the same seat, the same opponent) with different total rewards;
  the higher one is chosen. A group of ``G`` gives up to ``G (G - 1) / 2`` pairs. Outcomes
  also vary with the opponent's play, so a pair's label is a noisy preference, as DPO assumes
  (Rafailov et al. 2023, §3, eq. 1, the Bradley-Terry model).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np

from learners.assembly import sort_trajectories, trajectory_to_datum
from protocols.messages import Datum, Trajectory


def sft_datums(trajectories: Sequence[Trajectory], min_reward: float) -> list[Datum]:
    """One datum per trajectory with ``total_reward > min_reward``, in ``(episode_id, seat)``
    order: ``tokens int32[T]`` and ``loss_inputs = {"mask": float32[T]}`` (1 on sampled
    tokens), for the ``sft`` loss (normalise by the loss-token count)."""
    return [_mask_only(t) for t in sort_trajectories(trajectories) if t.total_reward > min_reward]


def _mask_only(traj: Trajectory) -> Datum:
    datum = trajectory_to_datum(traj, 0.0)
    return Datum(tokens=datum.tokens, loss_inputs={"mask": datum.loss_inputs["mask"]})


def preference_pairs(trajectories: Sequence[Trajectory]) -> list[tuple[Trajectory, Trajectory]]:
    """``(chosen, rejected)`` pairs: same ``(group_id, seed, seat)``, different total rewards,
    chosen the higher. Every such pair once, in a deterministic order (by start, then by
    episode ids); trajectories with identical token sequences are not paired (their DPO
    gradient is zero)."""
    by_start: dict[tuple[int, int, str], list[Trajectory]] = {}
    for t in sort_trajectories(trajectories):
        by_start.setdefault((t.group_id, t.seed, t.seat), []).append(t)
    pairs = []
    for start in sorted(by_start):
        for a, b in itertools.combinations(by_start[start], 2):
            if a.total_reward == b.total_reward or _same_tokens(a, b):
                continue
            pairs.append((a, b) if a.total_reward > b.total_reward else (b, a))
    return pairs


def _same_tokens(a: Trajectory, b: Trajectory) -> bool:
    da, db = _mask_only(a), _mask_only(b)
    return np.array_equal(da.tokens, db.tokens) and np.array_equal(
        da.loss_inputs["mask"], db.loss_inputs["mask"])


def pair_datums(pairs: Sequence[tuple[Trajectory, Trajectory]], first_id: int = 0) -> list[Datum]:
    """Two datums per pair, chosen then rejected, for the ``dpo`` / ``ipo`` losses:
    ``loss_inputs`` ``mask``, ``pair_sign`` (+1 on the chosen's sampled tokens, -1 on the
    rejected's) and ``pair_id`` (``first_id + b`` on pair ``b``'s sampled tokens), each
    ``float32[T]``. Keep a pair's two datums in one ``ForwardBackward`` and normalise by the
    number of pairs. Pair ids are exact in float32 up to 2**24."""
    out = []
    for b, (chosen, rejected) in enumerate(pairs):
        for traj, sign in ((chosen, 1.0), (rejected, -1.0)):
            datum = _mask_only(traj)
            mask = datum.loss_inputs["mask"]
            out.append(Datum(tokens=datum.tokens, loss_inputs={
                "mask": mask,
                "pair_sign": (mask * np.float32(sign)).astype(np.float32),
                "pair_id": (mask * np.float32(first_id + b)).astype(np.float32),
            }))
    return out
