"""Every legal move at each decision a step played, moved by the game's exact value of it
(``train.move_values``).

A sampled episode teaches one move per decision, by a noisy return. Where a game knows the
exact value of every legal move at a state against the episode's scripted opponent
(``games.StateValues.moves``: tic-tac-toe against random and against minimax, each move's
expected result with best play after it), each decision the step played can teach all of
its moves at once, whatever was sampled there (an invalid reply included): the decision's
state is known, and so is what each move is worth from it.

The term is Neural Replicator Dynamics (Hennes et al. 2020, "Neural Replicator Dynamics:
multiagent learning via hedging policy gradients") on the decisions played, as
:mod:`learners.all_actions` is on every decision of a game small enough to score whole: with
``w_m = Q(s, m) - mean_b Q(s, b)`` over the legal moves ``m`` (:func:`move_weights`, summing
to 0) and ``p_m`` the model's probability of move ``m``'s first reply token at the decision,

    loss = -coef * sum_s sum_m w_m log p_m,    d loss / d z_m = -coef * w_m

for the logit ``z_m`` of each legal move's first token (the softmax's normaliser cancels since
the weights sum to 0; no other token's logit moves). A move better than the decision's average
gains by how much better, however unlikely it is now, so a policy collapsed onto a few
favourite cells still learns to take a winning cell or block one. ``Q`` is the value of best
play after the move (a policy-improvement target, as ``exact_gae``'s critic), not of the
policy's own play: the target is the best response to the opponent, which the gradient of the
sampled episodes estimates only slowly.

The first token stands for the whole reply: the runner records a decision's moves only where
no two legal replies start with the same token (:class:`protocols.messages.Turn`'s
``move_tokens``), and the term leaves the tokens after it to the sampled loss.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from learners.diagnostics import mean as _mean
from learners.losses import LossKind, LossOutput, register_loss
from protocols.messages import MOVE_INPUTS, Datum, Trajectory

__all__ = ["MOVE_INPUTS", "move_values", "move_weights", "move_width", "with_move_inputs"]


def move_weights(values_M: np.ndarray) -> np.ndarray:
    """``float32[M]``: each move's value minus the mean over the ``M`` legal moves (NeuRD's
    advantage; they sum to 0)."""
    values_M = np.asarray(values_M, dtype=np.float64)
    return (values_M - values_M.mean()).astype(np.float32)


def move_width(trajectories: Sequence[Trajectory]) -> int:
    """The most legal moves a valued decision of ``trajectories`` has (at least 1: the width
    of the datums' move inputs)."""
    return max([1, *(len(t.move_tokens) for tr in trajectories for t in tr.turns if t.move_tokens is not None)])


def with_move_inputs(datum: Datum, traj: Trajectory, positions_K: np.ndarray, width: int) -> Datum:
    """``datum`` (``traj``'s, :func:`~learners.assembly.trajectory_to_datum`) plus the term's
    inputs, each ``[T, width]``: ``move_tokens`` (``int32``, the legal moves' first tokens at
    each valued turn's decision position ``positions_K[k]``, -1 elsewhere) and
    ``move_weights`` (``float32``, :func:`move_weights` there, 0 elsewhere).

    Raises:
        ValueError: a turn's move tokens and values differ in length, are not 1-D, exceed
            ``width``, or its values are not finite; the message names the episode and turn.
    """
    T = len(datum.tokens)
    tokens_T_M = np.full((T, width), -1, np.int32)
    weights_T_M = np.zeros((T, width), np.float32)
    for k, turn in enumerate(traj.turns):
        if turn.move_tokens is None:
            continue
        where = f"episode {traj.episode_id} seat {traj.seat!r} turn {k}"
        tok_M, val_M = np.asarray(turn.move_tokens), np.asarray(turn.move_values)
        if tok_M.ndim != 1 or tok_M.shape != val_M.shape or not 0 < len(tok_M) <= width:
            raise ValueError(f"{where}: move_tokens of shape {tok_M.shape} and move_values of shape "
                             f"{val_M.shape} (at most {width} moves)")
        if not np.all(np.isfinite(val_M)):
            raise ValueError(f"{where}: move_values must be finite, got {val_M.tolist()}")
        tokens_T_M[positions_K[k], : len(tok_M)] = tok_M
        weights_T_M[positions_K[k], : len(tok_M)] = move_weights(val_M)
    return Datum(tokens=datum.tokens,
                 loss_inputs={**datum.loss_inputs, "move_tokens": tokens_T_M, "move_weights": weights_T_M})


@register_loss("move_values", LossKind.PENALTY, frozenset({"move_logprobs", "move_weights", "move_tokens"}))
def move_values(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """Neural Replicator Dynamics (Hennes et al. 2020: each action's logit moves by its
    advantage) on the decisions played: ``loss = -coef * sum_{n,m} w_{n,m} lp_{n,m}`` (the
    module docstring).

    Args:
        logp_N: ``float[N]`` log-probs of the loss tokens (shape only).
        inputs: ``move_logprobs`` ``float[N, M]`` (differentiable: the log-probs of the moves'
            first tokens at each loss position, 0 where there is no move; the caller computes
            them from the full vocabulary), ``move_weights`` ``float[N, M]`` and
            ``move_tokens`` ``[N, M]`` (-1: no move).
        config: ``coef`` (default 1.0).

    Returns:
        ``loss_sum``; metrics ``decisions`` (positions with moves), ``legal_mass`` (the mean
        total probability of the legal moves there) and ``best_share`` (the mean share of the
        best moves, those of the largest weight, in that total: 1 for a policy that plays only
        best moves).
    """
    lp = inputs["move_logprobs"].float()
    w = torch.as_tensor(inputs["move_weights"], dtype=torch.float32, device=lp.device)
    valid = torch.as_tensor(inputs["move_tokens"], device=lp.device) >= 0
    if lp.shape != w.shape or w.shape != valid.shape or lp.shape[:1] != logp_N.shape:
        raise ValueError(f"loss 'move_values': move_logprobs {tuple(lp.shape)}, move_weights {tuple(w.shape)} and "
                         f"move_tokens {tuple(valid.shape)} must be [N, M] with N = {logp_N.shape[0]}")
    coef = float(config.get("coef", 1.0))
    rows = valid.any(dim=1)
    metrics = {"n_tokens": float(logp_N.numel()), "decisions": float(rows.sum())}
    with torch.no_grad():
        p = lp[rows].exp() * valid[rows]
        best = valid[rows] & (w[rows] == w[rows].masked_fill(~valid[rows], -torch.inf).amax(dim=1, keepdim=True))
        mass = p.sum(dim=1)
        metrics["legal_mass"] = _mean(mass)
        metrics["best_share"] = _mean((p * best).sum(dim=1) / mass.clamp_min(1e-30))
    return LossOutput(loss_sum=-coef * (w * lp * valid).sum(), metrics=metrics)
