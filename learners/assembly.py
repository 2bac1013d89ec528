"""Token-in/token-out assembly of multi-turn trajectories into training datums.

A seat's trajectory is its running token sequence, turn by turn: the observation tokens that
extend it (rendered observation, chat-template tokens, anything the template appended after
the previous reply) and then the reply exactly as sampled. The datum concatenates them as is:

    tokens_T  = obs_0 + sampled_0 + obs_1 + sampled_1 + ...
    mask_T    = 0...0 + 1.......1 + 0...0 + 1.......1 + ...

Nothing is decoded and re-encoded (a round trip can merge or split tokens, which would make
the trainer score different tokens than the sampler drew), and the mask comes from the turn
structure, never from ``ids != pad`` (SmolLM2's pad and end-of-turn are one id).

The episode's single advantage is broadcast over all of its sampled tokens (outcome
supervision); zero-advantage datums are kept, since their tokens still count in the
normalizer the caller passes to the loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from learners.advantages import group_advantages
from protocols.messages import Datum, Trajectory


def trajectory_to_datum(traj: Trajectory, advantage: float) -> Datum:
    """Concatenate a trajectory's turns into one datum with per-token loss inputs.

    Args:
        traj: one seat's episode; turn ``k`` has ``obs_tokens int32[O_k]``,
            ``sampled_tokens int32[S_k]`` and ``sampler_logprobs float32[S_k]``.
        advantage: the episode's advantage, put on every sampled token.

    Returns:
        A :class:`Datum` with ``tokens int32[T]`` (``T = sum_k O_k + S_k``) and
        ``loss_inputs``: ``mask``, ``advantages``, ``sampler_logprobs``, each ``float32[T]``,
        nonzero only on sampled tokens.

    Raises:
        ValueError: no turns, or the first turn has no observation tokens (token 0 has no
            prediction and must have mask 0), or a turn's sampled tokens and log-probs differ
            in length, or an array is not 1-D; the message names the episode and turn.
    """
    where = f"episode {traj.episode_id} seat {traj.seat!r}"
    if not traj.turns:
        raise ValueError(f"{where}: trajectory has no turns")
    if len(traj.turns[0].obs_tokens) == 0:
        raise ValueError(
            f"{where}: turn 0 has no observation tokens; token 0 cannot be a loss token"
        )
    if not np.isfinite(advantage):
        raise ValueError(f"{where}: advantage must be finite, got {advantage}")

    tokens: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    sampler_logprobs: list[np.ndarray] = []
    for k, turn in enumerate(traj.turns):
        obs_O = np.asarray(turn.obs_tokens)
        sampled_S = np.asarray(turn.sampled_tokens)
        logp_S = np.asarray(turn.sampler_logprobs)
        if obs_O.ndim != 1 or sampled_S.ndim != 1 or logp_S.ndim != 1:
            raise ValueError(f"{where} turn {k}: token and log-prob arrays must be 1-D")
        if len(sampled_S) != len(logp_S):
            raise ValueError(
                f"{where} turn {k}: {len(sampled_S)} sampled tokens but "
                f"{len(logp_S)} sampler log-probs"
            )
        tokens += [obs_O.astype(np.int32), sampled_S.astype(np.int32)]
        mask += [np.zeros(len(obs_O), np.float32), np.ones(len(sampled_S), np.float32)]
        sampler_logprobs += [np.zeros(len(obs_O), np.float32), logp_S.astype(np.float32)]

    mask_T = np.concatenate(mask)
    return Datum(
        tokens=np.concatenate(tokens),
        loss_inputs={
            "mask": mask_T,
            "advantages": (mask_T * np.float32(advantage)).astype(np.float32),
            "sampler_logprobs": np.concatenate(sampler_logprobs),
        },
    )


def assemble(
    trajectories: Sequence[Trajectory],
    estimator: str,
    config: Mapping[str, float],
) -> tuple[list[Datum], dict[str, float]]:
    """Group-relative advantages and datums for one policy's trajectories of one step.

    Trajectories are first sorted by ``(episode_id, seat)``, so the datums and metrics do not
    depend on arrival order. Advantages come from ``total_reward`` per ``group_id`` with
    :func:`learners.advantages.group_advantages`.

    Args:
        trajectories: ``[D]`` trajectories, all for the same trainable policy.
        estimator: a name in :data:`learners.advantages.ADVANTAGES`.
        config: passed to the estimator.

    Returns:
        ``(datums_D, metrics)``; metrics: ``reward_mean``, ``adv_abs_mean`` (over
        trajectories), ``frac_zero_adv_groups`` (groups whose advantages are all exactly 0:
        no learning signal), ``n_datums``, ``n_loss_tokens``.

    Raises:
        ValueError: two trajectories share ``(episode_id, seat)`` (a duplicate delivery would
            double-count an episode and skew its group's baseline), or as
            :func:`group_advantages` and :func:`trajectory_to_datum` do.
    """
    ordered = sorted(trajectories, key=lambda t: (t.episode_id, t.seat))
    keys = [(t.episode_id, t.seat) for t in ordered]
    for a, b in zip(keys, keys[1:]):
        if a == b:
            raise ValueError(f"duplicate trajectory for episode {a[0]} seat {a[1]!r}")
    if not ordered:
        empty = ("reward_mean", "adv_abs_mean", "frac_zero_adv_groups", "n_datums",
                 "n_loss_tokens")
        return [], {name: 0.0 for name in empty}

    rewards_D = np.array([t.total_reward for t in ordered], dtype=np.float64)
    group_ids_D = np.array([t.group_id for t in ordered], dtype=np.int64)
    advantages_D = group_advantages(rewards_D.tolist(), group_ids_D.tolist(), estimator, config)
    datums = [trajectory_to_datum(t, float(a)) for t, a in zip(ordered, advantages_D)]

    groups = np.unique(group_ids_D)
    zero_groups = sum(bool(np.all(advantages_D[group_ids_D == g] == 0.0)) for g in groups)
    metrics = {
        "reward_mean": float(rewards_D.mean()),
        "adv_abs_mean": float(np.abs(advantages_D).mean()),
        "frac_zero_adv_groups": zero_groups / len(groups),
        "n_datums": float(len(datums)),
        "n_loss_tokens": float(loss_token_count(datums)),
    }
    return datums, metrics


def loss_token_count(datums: Sequence[Datum]) -> int:
    """Number of loss tokens (``sum`` of every ``mask``): the usual global normalizer.

    Counted over the whole step's datums, before any split into micro-batches, and passed to
    ``ForwardBackward.normalizer`` so every micro-batch divides by the same number.
    """
    return int(sum(int(np.asarray(d.loss_inputs["mask"]).sum()) for d in datums))
