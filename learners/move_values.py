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
the weights sum to 0; these weights move no other token's logit). A move better than the decision's average
gains by how much better, however unlikely it is now, so a policy collapsed onto a few
favourite cells still learns to take a winning cell or block one. ``Q`` is the value of best
play after the move (a policy-improvement target, as ``exact_gae``'s critic), not of the
policy's own play: the target is the best response to the opponent, which the gradient of the
sampled episodes estimates only slowly.

Those weights move the legal moves against each other only; what the model says that is no
legal move (an occupied cell, a word) keeps its probability, and a group whose every game
forfeits that way gets no signal from its outcomes (a probe said an occupied "1" in every
game for steps on end). So the term also raises the legal moves' total probability at each
decision, ``log sum_m p_m`` (the gradient of saying a legal move at all, which leaves the mix
between them alone), with the same coefficient.

A move is its whole reply, not its first token: a policy whose first token learns the best
cell but goes on with another token than the stop token says "55", which the game refuses,
and a group that all says it gets no signal from its outcomes. So after the decision the term
also raises the rest of the sampled move's canonical reply, one token a position, with weight
1, where the reply so far is that move's (the runner records each legal move's canonical
reply, :class:`protocols.messages.Turn`'s ``move_tokens``, only where no two start with the
same token). Rows whose weights sum to 0 are decisions; the others are these continuations.

Against which opponent is a move valued? By default the episode's own: a policy that plays a
random opponent three games in four and minimax in one is taught the best response to each in
its own games, two targets that differ at the same kind of state. ``train.move_values_against``
gives one target for every decision instead, a weighted sum of the values against each named
opponent (the runner records them all, ``Turn.move_values_by``): ``{tictactoe_minimax = 1,
random = 0.5}`` ranks a move that loses against best play below every move that does not (the minimax
values step by 1, the random ones are worth at most 1 apart at that weight), and among those
prefers the one that wins most against random: play that draws against minimax and wins
against random.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch

from learners.diagnostics import mean as _mean
from learners.losses import LossKind, LossOutput, register_loss
from protocols.messages import MOVE_INPUTS, Datum, Trajectory, Turn

__all__ = ["MOVE_INPUTS", "move_values", "move_weights", "move_width", "settled_weights", "turn_move_values",
           "with_move_inputs"]


def move_weights(values_M: np.ndarray) -> np.ndarray:
    """``float32[M]``: each move's value minus the mean over the ``M`` legal moves (NeuRD's
    advantage; they sum to 0)."""
    values_M = np.asarray(values_M, dtype=np.float64)
    return (values_M - values_M.mean()).astype(np.float32)


def move_width(trajectories: Sequence[Trajectory]) -> int:
    """The most legal moves a valued decision of ``trajectories`` has (at least 1: the width
    of the datums' move inputs)."""
    return max([1, *(len(t.move_tokens) for tr in trajectories for t in tr.turns if t.move_tokens is not None)])


def turn_move_values(turn: Turn, against: Mapping[str, float] | None = None) -> np.ndarray:
    """``float32[M]``: the values ``turn``'s legal moves are moved by: ``Turn.move_values``
    (against the episode's own opponent), or with ``against`` the weighted sum
    ``sum_o against[o] * Turn.move_values_by[o]``.

    Raises:
        ValueError: ``against`` names an opponent the turn has no values against, or their
            shapes differ from ``move_values``'.
    """
    if not against:
        return np.asarray(turn.move_values)
    total = np.zeros(np.shape(turn.move_values), np.float64)
    for o, w in against.items():
        if o not in turn.move_values_by:
            raise ValueError(f"move values against {o!r} wanted, the turn has them against "
                             f"{', '.join(turn.move_values_by) or 'no opponent'}")
        v = np.asarray(turn.move_values_by[o], np.float64)
        if v.shape != total.shape:
            raise ValueError(f"move values against {o!r} of shape {v.shape}, want {total.shape}")
        total += w * v
    return total.astype(np.float32)


def with_move_inputs(datum: Datum, traj: Trajectory, positions_K: np.ndarray, width: int,
                     against: Mapping[str, float] | None = None) -> Datum:
    """``datum`` (``traj``'s, :func:`~learners.assembly.trajectory_to_datum`) plus the term's
    inputs, each ``[T, width]``: at each valued turn's decision position ``positions_K[k]``
    the legal moves' first tokens (``move_tokens``, ``int32``; -1 pads) and their
    :func:`move_weights` (``move_weights``, ``float32``); at the positions after it, while the
    sampled reply follows a legal move's canonical reply, that reply's next token with weight
    1; -1 and 0 elsewhere. The moves' values are :func:`turn_move_values` (``against``).

    Raises:
        ValueError: a turn's move tokens are not ``[M, L]`` with ``M`` values, exceed
            ``width``, have a move without tokens, or its values are not finite; the message
            names the episode and turn.
    """
    T = len(datum.tokens)
    tokens_T_M = np.full((T, width), -1, np.int32)
    weights_T_M = np.zeros((T, width), np.float32)
    for k, turn in enumerate(traj.turns):
        if turn.move_tokens is None:
            continue
        where = f"episode {traj.episode_id} seat {traj.seat!r} turn {k}"
        try:
            replies_M_L, val_M = np.asarray(turn.move_tokens), turn_move_values(turn, against)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        if replies_M_L.ndim != 2 or val_M.shape != replies_M_L.shape[:1] or not 0 < len(val_M) <= width:
            raise ValueError(f"{where}: move_tokens of shape {replies_M_L.shape} and move_values of shape "
                             f"{val_M.shape} (want [M, L] and [M], M at most {width})")
        if replies_M_L.shape[1] == 0 or np.any(replies_M_L[:, 0] < 0):
            raise ValueError(f"{where}: a legal move without reply tokens in move_tokens")
        if not np.all(np.isfinite(val_M)):
            raise ValueError(f"{where}: move_values must be finite, got {val_M.tolist()}")
        at = int(positions_K[k])
        tokens_T_M[at, : len(val_M)] = replies_M_L[:, 0]
        weights_T_M[at, : len(val_M)] = move_weights(val_M)
        sampled = np.asarray(turn.sampled_tokens)
        chosen = np.nonzero(replies_M_L[:, 0] == sampled[0])[0] if len(sampled) else []
        if len(chosen) == 0:
            continue  # not a legal move's reply: the sampled loss alone judges it
        reply = replies_M_L[chosen[0]][replies_M_L[chosen[0]] >= 0]
        for j in range(1, min(len(reply), len(sampled))):  # position at + j predicts reply[j]
            if sampled[j - 1] != reply[j - 1]:
                break
            tokens_T_M[at + j, 0], weights_T_M[at + j, 0] = reply[j], 1.0
    return Datum(tokens=datum.tokens,
                 loss_inputs={**datum.loss_inputs, "move_tokens": tokens_T_M, "move_weights": weights_T_M})


@register_loss("move_values", LossKind.PENALTY, frozenset({"move_logprobs", "move_weights", "move_tokens"}))
def move_values(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """Neural Replicator Dynamics (Hennes et al. 2020: each action's logit moves by its
    advantage) on the decisions played, with the legal moves' total probability raised:
    ``loss = -coef * (sum_{n,m} w_{n,m} lp_{n,m} + sum_{decisions n} log sum_{legal m}
    exp(lp_{n,m}))`` (the module docstring).

    Args:
        logp_N: ``float[N]`` log-probs of the loss tokens (shape only).
        inputs: ``move_logprobs`` ``float[N, M]`` (differentiable: the log-probs of the moves'
            first tokens at each loss position, 0 where there is no move; the caller computes
            them from the full vocabulary), ``move_weights`` ``float[N, M]`` and
            ``move_tokens`` ``[N, M]`` (-1: no move).
        config: ``coef`` (default 1.0); ``settled`` (default 0: off): moves the policy
            already agrees with are left alone, every move of a decision whose best moves
            hold more than ``1 - settled`` of the legal moves' probability, and elsewhere a
            worse-than-average move below ``settled`` (:func:`settled_weights`).

    Returns:
        ``loss_sum``; metrics ``decisions`` (rows whose weights sum to 0), ``legal_mass`` (the
        mean total probability of the legal moves there), ``best_share`` (the mean share of the
        best moves, those of the largest weight, in that total: 1 for a policy that plays only
        best moves), ``continuations`` (the other rows: a sampled move's canonical reply going
        on), ``continuation_prob`` (the mean probability of its next token there) and, with
        ``settled``, ``settled_share`` (the share of the decisions' weighted moves left alone).
    """
    lp = inputs["move_logprobs"].float()
    w = torch.as_tensor(inputs["move_weights"], dtype=torch.float32, device=lp.device)
    valid = torch.as_tensor(inputs["move_tokens"], device=lp.device) >= 0
    if lp.shape != w.shape or w.shape != valid.shape or lp.shape[:1] != logp_N.shape:
        raise ValueError(f"loss 'move_values': move_logprobs {tuple(lp.shape)}, move_weights {tuple(w.shape)} and "
                         f"move_tokens {tuple(valid.shape)} must be [N, M] with N = {logp_N.shape[0]}")
    coef = float(config.get("coef", 1.0))
    metrics = {"n_tokens": float(logp_N.numel())}
    used = valid.any(dim=1)
    decision = used & ((w * valid).sum(dim=1).abs() < 1e-4)
    rest = used & ~decision
    legal = lp[decision].masked_fill(~valid[decision], -torch.inf).logsumexp(dim=1)  # log of the legal mass
    with torch.no_grad():
        p, v, wd = lp[decision].exp() * valid[decision], valid[decision], w[decision]
        best = v & (wd == wd.masked_fill(~v, -torch.inf).amax(dim=1, keepdim=True))
        mass = p.sum(dim=1)
        metrics.update(decisions=float(decision.sum()), legal_mass=_mean(mass),
                       best_share=_mean((p * best).sum(dim=1) / mass.clamp_min(1e-30)),
                       continuations=float(rest.sum()), continuation_prob=_mean(lp[rest][:, 0].exp()))
    settled = float(config.get("settled", 0.0))
    if not settled:
        return LossOutput(loss_sum=-coef * ((w * lp * valid).sum() + legal.sum()), metrics=metrics)
    # The moves' log-shares of the legal mass: only the mix between them moves, so leaving a
    # move alone (its weight 0, the rest no longer summing to 0) moves nothing else.
    log_q = lp[decision] - legal[:, None]
    with torch.no_grad():
        kept = settled_weights(w[decision], log_q.exp(), v, settled)
        weighted = v & (w[decision] != 0)
        metrics["settled_share"] = float(((kept == 0) & weighted).sum() / weighted.sum().clamp_min(1))
    moves = (kept * log_q * v).sum() + (w[rest] * lp[rest] * valid[rest]).sum()
    return LossOutput(loss_sum=-coef * (moves + legal.sum()), metrics=metrics)


def settled_weights(w_D_M: torch.Tensor, q_D_M: torch.Tensor, valid_D_M: torch.Tensor, settled: float
                    ) -> torch.Tensor:
    """``float[D, M]``: the decisions' move weights with those the policy already agrees with
    set to 0: every move of a decision whose best moves (the largest weight) hold more than
    ``1 - settled`` of the legal moves' probability ``q``, and elsewhere each move worse than
    the decision's average (``w < 0``) whose share is below ``settled``.

    NeuRD moves a logit by its advantage however far the policy has gone already, so a
    decision the policy plays right keeps pushing its bad moves down as hard as a decision it
    plays wrong pushes them; leaving settled moves alone (NeuRD's logit thresholding, Hennes
    et al. 2020, here on the moves' shares) spends the update on the decisions still wrong.
    """
    best = valid_D_M & (w_D_M == w_D_M.masked_fill(~valid_D_M, -torch.inf).amax(dim=1, keepdim=True))
    right = (q_D_M * best).sum(dim=1, keepdim=True) > 1 - settled
    done = right | ((w_D_M < 0) & (q_D_M < settled))
    return w_D_M.masked_fill(done | ~valid_D_M, 0.0)
