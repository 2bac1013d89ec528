"""Token-in/token-out assembly of multi-turn trajectories into training datums.

A seat's trajectory is its running token sequence, turn by turn: the observation tokens that
extend it (rendered observation, chat-template tokens, anything the template appended after
the previous reply) and then the reply exactly as sampled. The datum concatenates them as is:

    tokens_T  = obs_0 + sampled_0 + obs_1 + sampled_1 + ...
    mask_T    = 0...0 + 1.......1 + 0...0 + 1.......1 + ...

Nothing is decoded and re-encoded (a round trip can merge or split tokens, which would make
the trainer score different tokens than the sampler drew), and the mask comes from the turn
structure, never from ``ids != pad`` (SmolLM2's pad and end-of-turn are one id).

Advantages come per TURN (:mod:`learners.advantages`): turn ``k``'s advantage goes on turn
``k``'s sampled tokens, so an outcome estimator (one advantage per episode) puts the same value
on every turn and ``turn_returns`` gives each turn its own credit. Zero-advantage datums are
kept, since their tokens still count in the normalizer the caller passes to the loss.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from learners.advantages import EmaState, EpisodeBatch, estimate
from protocols.messages import Datum, Trajectory


def turn_rewards(traj: Trajectory) -> np.ndarray:
    """``float64[K]``: the reward credited to each of the trajectory's turns.

    ``Turn.reward`` is what the seat received right after its own move; whatever else its
    total holds (a reward that arrived after an opponent's move, e.g. a terminal payoff when
    the opponent ended the game) is credited to the LAST turn, so the turn rewards always sum
    to ``total_reward``.
    """
    rewards_K = np.array([t.reward for t in traj.turns], dtype=np.float64)
    if rewards_K.size:
        rewards_K[-1] += traj.total_reward - rewards_K.sum()
    return rewards_K


def episode_batch(ordered: Sequence[Trajectory], role_prefix: str = "") -> EpisodeBatch:
    """What the estimators see of these trajectories (in this order); the role key of a
    trajectory is ``f"{role_prefix}/{seat}"`` (or the seat when there is no prefix)."""
    return EpisodeBatch(
        group_ids_D=np.array([t.group_id for t in ordered], dtype=np.int64),
        turn_rewards=tuple(turn_rewards(t) for t in ordered),
        roles_D=tuple(f"{role_prefix}/{t.seat}" if role_prefix else t.seat for t in ordered),
        rewards_D=np.array([t.total_reward for t in ordered], dtype=np.float64),
    )


def trajectory_to_datum(traj: Trajectory, advantages: float | Sequence[float] | np.ndarray) -> Datum:
    """Concatenate a trajectory's turns into one datum with per-token loss inputs.

    Args:
        traj: one seat's episode; turn ``k`` has ``obs_tokens int32[O_k]``,
            ``sampled_tokens int32[S_k]`` and ``sampler_logprobs float32[S_k]``.
        advantages: ``float[K]``, turn ``k``'s advantage, put on its ``S_k`` sampled tokens;
            or one float for every turn.

    Returns:
        A :class:`Datum` with ``tokens int32[T]`` (``T = sum_k O_k + S_k``) and
        ``loss_inputs``: ``mask``, ``advantages``, ``sampler_logprobs``, each ``float32[T]``,
        nonzero only on sampled tokens.

    Raises:
        ValueError: no turns, or the first turn has no observation tokens (token 0 has no
            prediction and must have mask 0), or a turn's sampled tokens and log-probs differ
            in length, or an array is not 1-D, or ``advantages`` is not finite or has another
            length than the turns; the message names the episode and turn.
    """
    where = f"episode {traj.episode_id} seat {traj.seat!r}"
    if not traj.turns:
        raise ValueError(f"{where}: trajectory has no turns")
    if len(traj.turns[0].obs_tokens) == 0:
        raise ValueError(
            f"{where}: turn 0 has no observation tokens; token 0 cannot be a loss token"
        )
    advantages_K = np.asarray(advantages, dtype=np.float32)
    if advantages_K.ndim == 0:
        advantages_K = np.full(len(traj.turns), advantages_K, np.float32)
    if advantages_K.shape != (len(traj.turns),):
        raise ValueError(f"{where}: {len(traj.turns)} turns but advantages of shape "
                         f"{advantages_K.shape}")
    if not np.all(np.isfinite(advantages_K)):
        raise ValueError(f"{where}: advantages must be finite, got {advantages_K.tolist()}")

    tokens: list[np.ndarray] = []
    mask: list[np.ndarray] = []
    adv: list[np.ndarray] = []
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
        zeros_O = np.zeros(len(obs_O), np.float32)
        tokens += [obs_O.astype(np.int32), sampled_S.astype(np.int32)]
        mask += [zeros_O, np.ones(len(sampled_S), np.float32)]
        adv += [zeros_O, np.full(len(sampled_S), advantages_K[k], np.float32)]
        sampler_logprobs += [zeros_O, logp_S.astype(np.float32)]

    return Datum(
        tokens=np.concatenate(tokens),
        loss_inputs={
            "mask": np.concatenate(mask),
            "advantages": np.concatenate(adv),
            "sampler_logprobs": np.concatenate(sampler_logprobs),
        },
    )


class Assembly(NamedTuple):
    """What :func:`assemble` returns."""

    datums: list[Datum]
    """One datum per trajectory, in ``(episode_id, seat)`` order."""
    metrics: dict[str, float]
    state: EmaState | None
    """The estimator's new state (the input state for stateless estimators)."""


ASSEMBLY_METRICS = ("reward_mean", "adv_mean", "adv_abs_mean", "frac_zero_adv_groups",
                    "n_datums", "n_loss_tokens")


def sort_trajectories(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Sorted by ``(episode_id, seat)``, so results never depend on arrival order.

    Raises:
        ValueError: two trajectories share ``(episode_id, seat)`` (a duplicate delivery would
            double-count an episode and skew its group's baseline).
    """
    ordered = sorted(trajectories, key=lambda t: (t.episode_id, t.seat))
    for a, b in itertools.pairwise(ordered):
        if (a.episode_id, a.seat) == (b.episode_id, b.seat):
            raise ValueError(f"duplicate trajectory for episode {a.episode_id} seat {a.seat!r}")
    return ordered


def assemble(
    trajectories: Sequence[Trajectory],
    estimator: str,
    config: Mapping[str, float],
    state: EmaState | None = None,
    role_prefix: str = "",
) -> Assembly:
    """Advantages and datums for one policy's trajectories of one step.

    Trajectories are first sorted by ``(episode_id, seat)`` (:func:`sort_trajectories`), so
    the datums, the metrics and the new state do not depend on arrival order.

    Args:
        trajectories: ``[D]`` trajectories, all for the same trainable policy.
        estimator: a name in :data:`learners.advantages.ADVANTAGES`.
        config: passed to the estimator.
        state: the estimator's state from the previous step (``None`` at the start).
        role_prefix: prefix of the role keys (the game's name), see :func:`episode_batch`.

    Returns:
        :class:`Assembly`; metrics: ``reward_mean`` (over trajectories), ``adv_mean`` and
        ``adv_abs_mean`` (over turns), ``frac_zero_adv_groups`` (groups whose advantages are
        all exactly 0: no learning signal), ``n_datums``, ``n_loss_tokens``.

    Raises:
        ValueError: duplicates (see :func:`sort_trajectories`), or as the estimator and
            :func:`trajectory_to_datum` do.
    """
    ordered = sort_trajectories(trajectories)
    if not ordered:
        return Assembly([], {name: 0.0 for name in ASSEMBLY_METRICS}, state)
    batch = episode_batch(ordered, role_prefix)
    result = estimate(estimator, batch, state, config)
    datums = [trajectory_to_datum(t, a) for t, a in zip(ordered, result.per_turn)]

    turns_A = np.concatenate(result.per_turn)
    group_ids_D = batch.group_ids_D
    zero_D = np.array([not np.any(a) for a in result.per_turn])
    groups = np.unique(group_ids_D)
    zero_groups = sum(bool(np.all(zero_D[group_ids_D == g])) for g in groups)
    metrics = {
        "reward_mean": float(batch.rewards_D.mean()),
        "adv_mean": float(turns_A.mean()),
        "adv_abs_mean": float(np.abs(turns_A).mean()),
        "frac_zero_adv_groups": zero_groups / len(groups),
        "n_datums": float(len(datums)),
        "n_loss_tokens": float(loss_token_count(datums)),
    }
    return Assembly(datums, metrics, result.state)


def loss_token_count(datums: Sequence[Datum]) -> int:
    """Number of loss tokens (``sum`` of every ``mask``): the usual global normalizer.

    Counted over the whole step's datums, before any split into micro-batches, and passed to
    ``ForwardBackward.normalizer`` so every micro-batch divides by the same number.
    """
    return int(sum(int(np.asarray(d.loss_inputs["mask"]).sum()) for d in datums))
