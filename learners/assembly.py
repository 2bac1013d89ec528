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

With a critic (``gae``), a turn's state is the sequence up to its DECISION POSITION, the
position of its first sampled token (:func:`decision_positions`): the hidden state there has
read the observation and predicts the reply. The critic's value of turn ``k`` is its value at
that position (the ``values`` operation's entry ``t`` is the value of the state before token
``t``, aligned as log-probs are), and the value loss is trained at the same positions::

    tokens_T      = o o o s s o o s s s
    mask_T        = 0 0 0 1 1 0 0 1 1 1
    value_mask_T  = 0 0 0 1 0 0 0 1 0 0      (V_0 at position 3, V_1 at position 7)
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import NamedTuple

import numpy as np

from learners.advantages import EmaState, EpisodeBatch, estimate, standardize
from learners.move_values import move_width, with_move_inputs
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
    trajectory is ``f"{role_prefix}/{seat}"`` (or the seat when there is no prefix). When every
    turn carries the game's value of its state (``Turn.game_value``), the batch has them as
    ``game_values`` (0 after the last turn: the game is over)."""
    valued = all(t.game_value is not None for traj in ordered for t in traj.turns)
    return EpisodeBatch(
        group_ids_D=np.array([t.group_id for t in ordered], dtype=np.int64),
        turn_rewards=tuple(turn_rewards(t) for t in ordered),
        roles_D=tuple(f"{role_prefix}/{t.seat}" if role_prefix else t.seat for t in ordered),
        rewards_D=np.array([t.total_reward for t in ordered], dtype=np.float64),
        game_values=tuple(np.array([*(t.game_value for t in traj.turns), 0.0], np.float64) for traj in ordered)
        if valued and ordered else None,
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


def trajectory_tokens(traj: Trajectory) -> np.ndarray:
    """``int32[T]``: the trajectory's running sequence, ``obs_0 + sampled_0 + obs_1 + ...``
    (the tokens of :func:`trajectory_to_datum`'s datum)."""
    return np.concatenate([np.concatenate([np.asarray(t.obs_tokens), np.asarray(t.sampled_tokens)])
                           for t in traj.turns]).astype(np.int32)


def decision_positions(traj: Trajectory) -> np.ndarray:
    """``int64[K]``: where each turn's first sampled token lies in :func:`trajectory_tokens`,
    the position whose hidden state (it has read everything before) decides the reply.

    Raises:
        ValueError: a turn sampled no token (its decision has no position).
    """
    positions_K = np.zeros(len(traj.turns), np.int64)
    offset = 0
    for k, turn in enumerate(traj.turns):
        offset += len(turn.obs_tokens)
        if len(turn.sampled_tokens) == 0:
            raise ValueError(f"episode {traj.episode_id} seat {traj.seat!r} turn {k}: no sampled "
                             "tokens, so the turn has no decision position for the critic")
        positions_K[k] = offset
        offset += len(turn.sampled_tokens)
    return positions_K


def with_value_inputs(datum: Datum, positions_K: np.ndarray, old_values_K: np.ndarray,
                      value_targets_K: np.ndarray) -> Datum:
    """``datum`` plus the value loss's inputs, each ``float32[T]`` and nonzero only at the
    ``K`` decision positions: ``value_mask`` (1), ``old_values`` (the critic's values when
    the data was scored) and ``value_targets`` (e.g. GAE's lambda-returns)."""
    T = len(datum.tokens)
    extra = {}
    for key, per_turn in (("value_mask", np.ones(len(positions_K))), ("old_values", old_values_K),
                          ("value_targets", value_targets_K)):
        row = np.zeros(T, np.float32)
        row[positions_K] = per_turn
        extra[key] = row
    return Datum(tokens=datum.tokens, loss_inputs={**datum.loss_inputs, **extra})


class Assembly(NamedTuple):
    """What :func:`assemble` returns."""

    datums: list[Datum]
    """One datum per trajectory, in ``(episode_id, seat)`` order."""
    metrics: dict[str, float]
    state: EmaState | None
    """The estimator's new state (the input state for stateless estimators)."""


ASSEMBLY_METRICS = ("reward_mean", "adv_mean", "adv_abs_mean", "frac_zero_adv_groups",
                    "n_datums", "n_loss_tokens")


def _order(trajectories: Sequence[Trajectory]) -> list[int]:
    """Indices of ``trajectories`` in ``(episode_id, seat)`` order; ``ValueError`` on a duplicate."""
    order = sorted(range(len(trajectories)), key=lambda i: (trajectories[i].episode_id, trajectories[i].seat))
    for i, j in itertools.pairwise(order):
        a, b = trajectories[i], trajectories[j]
        if (a.episode_id, a.seat) == (b.episode_id, b.seat):
            raise ValueError(f"duplicate trajectory for episode {a.episode_id} seat {a.seat!r}")
    return order


def sort_trajectories(trajectories: Sequence[Trajectory]) -> list[Trajectory]:
    """Sorted by ``(episode_id, seat)``, so results never depend on arrival order.

    Raises:
        ValueError: two trajectories share ``(episode_id, seat)`` (a duplicate delivery would
            double-count an episode and skew its group's baseline).
    """
    return [trajectories[i] for i in _order(trajectories)]


def _turn_values(traj: Trajectory, values_T: np.ndarray) -> np.ndarray:
    """``float64[K + 1]``: the critic's value at each turn's decision position, then 0 (the
    episode ended: nothing follows its last turn)."""
    values_T = np.asarray(values_T, dtype=np.float64)
    T = sum(len(t.obs_tokens) + len(t.sampled_tokens) for t in traj.turns)
    if values_T.shape != (T,):
        raise ValueError(f"episode {traj.episode_id} seat {traj.seat!r}: values of shape "
                         f"{values_T.shape} for a sequence of {T} tokens")
    return np.append(values_T[decision_positions(traj)], 0.0)


def assemble(
    trajectories: Sequence[Trajectory],
    estimator: str,
    config: Mapping[str, float],
    state: EmaState | None = None,
    role_prefix: str = "",
    values: Sequence[np.ndarray] | None = None,
    moves: bool = False,
    move_values_against: Mapping[str, float] | None = None,
) -> Assembly:
    """Advantages and datums for one policy's trajectories of one step.

    Trajectories are first sorted by ``(episode_id, seat)`` (:func:`sort_trajectories`), so
    the datums, the metrics and the new state do not depend on arrival order.

    Args:
        trajectories: ``[D]`` trajectories, all for the same trainable policy.
        estimator: a name in :data:`learners.advantages.ADVANTAGES`.
        config: passed to the estimator; ``normalize`` (non-zero): the per-turn advantages
            are then standardised over the batch (:func:`~learners.advantages.standardize`;
            value targets stay those of the raw advantages).
        state: the estimator's state from the previous step (``None`` at the start).
        role_prefix: prefix of the role keys (the game's name), see :func:`episode_batch`.
        values: for a critic estimator (``gae``): per trajectory, in the order of
            ``trajectories``, the ``values`` operation's ``float32[T_d]`` on its
            :func:`trajectory_tokens` (entry ``t``: the value of the state before token
            ``t``). Turn ``k``'s value is read at its decision position; the value after the
            last turn is 0. The datums then carry the value loss's inputs
            (:func:`with_value_inputs`) with the estimator's value targets.
        moves: the datums carry the ``move_values`` term's inputs, ``[T, M]`` with ``M`` the
            most legal moves of a valued decision here
            (:func:`learners.move_values.with_move_inputs`; all empty where no turn has
            ``move_tokens``).
        move_values_against: with ``moves``, weigh each move by this weighted sum of its values
            against the named opponents (``Turn.move_values_by``), not by ``Turn.move_values``.

    Returns:
        :class:`Assembly`; metrics: ``reward_mean`` (over trajectories), ``adv_mean`` and
        ``adv_abs_mean`` (over turns), ``frac_zero_adv_groups`` (groups whose advantages are
        all exactly 0: no learning signal), ``n_datums``, ``n_loss_tokens``; with values also
        ``n_value_positions``; with moves ``n_move_decisions`` (turns with move values).

    Raises:
        ValueError: duplicates (see :func:`sort_trajectories`), values of the wrong length,
            or as the estimator and :func:`trajectory_to_datum` do.
    """
    order = _order(trajectories)
    ordered = [trajectories[i] for i in order]
    if not ordered:
        return Assembly([], {name: 0.0 for name in ASSEMBLY_METRICS}, state)
    batch = episode_batch(ordered, role_prefix)
    if values is not None:
        if len(values) != len(trajectories):
            raise ValueError(f"{len(values)} value arrays for {len(trajectories)} trajectories")
        batch = dataclasses.replace(batch, values=tuple(_turn_values(t, values[i])
                                                        for t, i in zip(ordered, order)))
    result = estimate(estimator, batch, state, config)
    if config.get("normalize"):  # after the value targets were taken from the raw advantages
        result = result._replace(per_turn=tuple(standardize(result.per_turn)))
    datums = [trajectory_to_datum(t, a) for t, a in zip(ordered, result.per_turn)]
    if result.value_targets is not None and batch.values is not None:
        datums = [with_value_inputs(d, decision_positions(t), v[:-1], r)
                  for d, t, v, r in zip(datums, ordered, batch.values, result.value_targets)]
    if moves:
        width = move_width(ordered)
        datums = [with_move_inputs(d, t, decision_positions(t), width, move_values_against)
                  for d, t in zip(datums, ordered)]

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
    if result.value_targets is not None:
        metrics["n_value_positions"] = float(loss_token_count(datums, "value_mask"))
    if moves:
        metrics["n_move_decisions"] = float(sum(t.move_tokens is not None for tr in ordered for t in tr.turns))
    return Assembly(datums, metrics, result.state)


def loss_token_count(datums: Sequence[Datum], key: str = "mask") -> int:
    """Number of loss tokens (``sum`` of every ``mask``): the usual global normalizer; with
    ``key="value_mask"``, the number of value positions (the value term's normalizer).

    Counted over one update's datums (the whole step, or one PPO minibatch), before the
    scheduler splits them into micro-batches, and passed to ``ForwardBackward.normalizer`` so
    every micro-batch divides by the same number.
    """
    return int(sum(int(np.asarray(d.loss_inputs[key]).sum()) for d in datums))
