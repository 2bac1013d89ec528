"""Sequence-level preference losses (DPO, IPO) and chunked token log-probs.

A preference loss compares whole responses: its inputs are SUMMED log-probs per sequence
(``policy_chosen_B`` etc., ``B`` pairs), not per-token values. :func:`dpo` and :func:`ipo` take
those sums directly. The token-level entries ``dpo`` / ``ipo`` in
:data:`learners.losses.LOSSES` adapt them to the runtime's flat ``logp_N``: per loss token
``inputs`` hold ``pair_sign`` (+1 on a chosen response's tokens, -1 on a rejected one's),
``pair_id`` (which pair the token belongs to) and ``ref_logprobs``, and the per-sequence sums are
scatter-adds over ``pair_id`` (see :func:`_pair_sums`). A pair must lie wholly inside one
micro-batch (its loss is not a sum over tokens); the caller's normalizer is then the global
number of pairs, and any split that keeps pairs whole gives the same total and gradient.

:func:`chunked_token_logprobs` computes the log-probs of target tokens from the last hidden
states and the LM head a chunk of positions at a time, so the ``T x V`` logits are never held
at once, not even for the backward pass (each chunk is recomputed there).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from learners.losses import LossKind, LossOutput, _check_logp, _require, register_loss

_PAIR_INPUTS = frozenset({"pair_sign", "pair_id", "ref_logprobs"})


def _margins(
    policy_chosen_B: torch.Tensor,
    policy_rejected_B: torch.Tensor,
    ref_chosen_B: torch.Tensor,
    ref_rejected_B: torch.Tensor,
) -> torch.Tensor:
    """``h_b = (pi_c - ref_c) - (pi_r - ref_r)``: the log-ratio margin of each pair."""
    shapes = {tuple(t.shape) for t in (policy_chosen_B, policy_rejected_B, ref_chosen_B,
                                       ref_rejected_B)}
    if len(shapes) != 1 or len(next(iter(shapes))) != 1:
        raise ValueError(f"preference inputs must be 1-D of one length, got shapes {shapes}")
    ref = (ref_chosen_B - ref_rejected_B).to(policy_chosen_B.device, torch.float32)
    return (policy_chosen_B.float() - policy_rejected_B.float()) - ref


@torch.no_grad()
def _pair_metrics(margin_B: torch.Tensor, scale: float) -> dict[str, float]:
    n = margin_B.numel()
    if n == 0:
        return {"n_pairs": 0.0, "reward_accuracy": 0.0, "reward_margin": 0.0}
    return {
        "n_pairs": float(n),
        "reward_accuracy": (margin_B > 0).float().mean().item(),
        "reward_margin": (scale * margin_B).mean().item(),
    }


def dpo(
    policy_chosen_B: torch.Tensor,
    policy_rejected_B: torch.Tensor,
    ref_chosen_B: torch.Tensor,
    ref_rejected_B: torch.Tensor,
    beta: float,
) -> LossOutput:
    """Direct Preference Optimization, summed over pairs.

    ``l_b = -log sigmoid(beta h_b)`` with ``h_b = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) -
    log ref(y_l))`` (Rafailov et al. 2023, "Direct Preference Optimization: Your Language Model
    is Secretly a Reward Model", eq. 7). ``d l_b / d h_b = -beta sigmoid(-beta h_b)``.

    Args:
        policy_chosen_B, policy_rejected_B: ``float[B]`` summed policy log-probs of the
            chosen and rejected responses (differentiable).
        ref_chosen_B, ref_rejected_B: ``float[B]`` the same under the reference model.
        beta: inverse temperature of the implicit reward, ``> 0``.

    Returns:
        ``loss_sum = sum_b l_b``; metrics ``n_pairs``, ``reward_accuracy`` (fraction with
        ``h_b > 0``), ``reward_margin`` (mean ``beta h_b``).
    """
    if not beta > 0:
        raise ValueError(f"dpo: beta must be > 0, got {beta}")
    margin_B = _margins(policy_chosen_B, policy_rejected_B, ref_chosen_B, ref_rejected_B)
    loss_B = -F.logsigmoid(beta * margin_B)
    return LossOutput(loss_sum=loss_B.sum(), metrics=_pair_metrics(margin_B, beta))


def ipo(
    policy_chosen_B: torch.Tensor,
    policy_rejected_B: torch.Tensor,
    ref_chosen_B: torch.Tensor,
    ref_rejected_B: torch.Tensor,
    tau: float,
) -> LossOutput:
    """Identity Preference Optimization, summed over pairs.

    ``l_b = (h_b - 1 / (2 tau))^2`` with ``h_b`` as in :func:`dpo` (Azar et al. 2023, "A General
    Theoretical Paradigm to Understand Learning from Human Preferences", eq. 17). It regresses
    the margin to a finite target instead of pushing it to infinity, so it does not overfit
    deterministic preferences. ``d l_b / d h_b = 2 (h_b - 1 / (2 tau))``. ``h_b`` uses summed
    log-probs, as in the paper (some implementations average over tokens instead).

    Args:
        policy_chosen_B, policy_rejected_B, ref_chosen_B, ref_rejected_B: as in :func:`dpo`.
        tau: regularisation strength, ``> 0``.

    Returns:
        ``loss_sum = sum_b l_b``; metrics as :func:`dpo` (``reward_margin`` is mean ``h_b``).
    """
    if not tau > 0:
        raise ValueError(f"ipo: tau must be > 0, got {tau}")
    margin_B = _margins(policy_chosen_B, policy_rejected_B, ref_chosen_B, ref_rejected_B)
    loss_B = (margin_B - 1.0 / (2.0 * tau)) ** 2
    return LossOutput(loss_sum=loss_B.sum(), metrics=_pair_metrics(margin_B, 1.0))


def _pair_sums(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], loss: str
) -> tuple[torch.Tensor, ...]:
    """Per-pair summed log-probs from flat token inputs, by scatter-add over ``pair_id``.

    ``pair_id`` values are arbitrary (e.g. global pair numbers); they are mapped to ``0..B-1``
    in sorted order. ``chosen_b = sum_{t: pair_t = b, sign_t = +1} logp_t`` and likewise for
    rejected (``sign_t = -1``) and for the reference log-probs.

    Returns:
        ``(policy_chosen_B, policy_rejected_B, ref_chosen_B, ref_rejected_B)``.

    Raises:
        ValueError: a sign other than +-1, or a pair without chosen or rejected tokens.
    """
    sign_N = _require(inputs, "pair_sign", loss, logp_N)
    pair_N = _require(inputs, "pair_id", loss, logp_N).long()
    ref_N = _require(inputs, "ref_logprobs", loss, logp_N)
    if not bool(((sign_N == 1) | (sign_N == -1)).all()):
        raise ValueError(f"loss {loss!r}: pair_sign must be +1 (chosen) or -1 (rejected)")
    _, index_N = torch.unique(pair_N, sorted=True, return_inverse=True)
    n_pairs = int(index_N.max().item()) + 1 if index_N.numel() else 0
    chosen_N = sign_N > 0
    sums = []
    for values_N in (logp_N, ref_N):
        for side_N in (chosen_N, ~chosen_N):
            zeros_B = torch.zeros(n_pairs, dtype=values_N.dtype, device=values_N.device)
            sums.append(zeros_B.index_add(0, index_N[side_N], values_N[side_N]))
    counts = [torch.bincount(index_N[side_N], minlength=n_pairs) for side_N in
              (chosen_N, ~chosen_N)]
    if n_pairs and not bool((counts[0] > 0).all() and (counts[1] > 0).all()):
        raise ValueError(f"loss {loss!r}: every pair needs chosen and rejected tokens in the "
                         "same micro-batch")
    return sums[0], sums[1], sums[2], sums[3]


@register_loss("dpo", LossKind.PREFERENCE, _PAIR_INPUTS)
def dpo_tokens(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """DPO (Rafailov et al. 2023, eq. 7: ``l_b = -log sigmoid(beta h_b)``, see :func:`dpo`) on
    flat loss tokens (see :func:`_pair_sums`); config ``beta`` (default 0.1).

    Returns ``loss_sum`` summed over pairs (normalise by the global pair count) and metrics
    of :func:`dpo` plus ``n_tokens``.
    """
    logp_N = _check_logp(logp_N, "dpo")
    out = dpo(*_pair_sums(logp_N, inputs, "dpo"), beta=float(config.get("beta", 0.1)))
    return LossOutput(out.loss_sum, {**out.metrics, "n_tokens": float(logp_N.numel())})


@register_loss("ipo", LossKind.PREFERENCE, _PAIR_INPUTS)
def ipo_tokens(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """IPO (Azar et al. 2023, eq. 17: ``l_b = (h_b - 1 / (2 tau))^2``, see :func:`ipo`) on
    flat loss tokens (see :func:`_pair_sums`); config ``tau`` (default 0.1).

    Returns ``loss_sum`` summed over pairs and metrics of :func:`ipo` plus ``n_tokens``.
    """
    logp_N = _check_logp(logp_N, "ipo")
    out = ipo(*_pair_sums(logp_N, inputs, "ipo"), tau=float(config.get("tau", 0.1)))
    return LossOutput(out.loss_sum, {**out.metrics, "n_tokens": float(logp_N.numel())})


def _chunk_logprobs(
    hidden_C_H: torch.Tensor, weight_V_H: torch.Tensor, targets_C: torch.Tensor
) -> torch.Tensor:
    logits_C_V = (hidden_C_H @ weight_V_H.T).float()
    picked_C = logits_C_V.gather(1, targets_C[:, None]).squeeze(1)
    return picked_C - torch.logsumexp(logits_C_V, dim=-1)


def chunked_token_logprobs(
    hidden_T_H: torch.Tensor,
    lm_head_weight_V_H: torch.Tensor,
    targets_T: torch.Tensor,
    chunk: int,
) -> torch.Tensor:
    """``logp_t = log softmax(W h_t)[y_t]``, computed ``chunk`` positions at a time.

    Equal to ``log_softmax(hidden_T_H @ W.T, -1).gather(targets)`` (the negative token
    cross-entropy), but the largest logits tensor is ``chunk x V`` (computed in float32): each
    chunk runs under activation checkpointing, so its logits are freed after the forward and
    recomputed in the backward, and gradients flow to both ``hidden_T_H`` and the weight.

    Args:
        hidden_T_H: ``float[T, H]`` final hidden states at the predicting positions.
        lm_head_weight_V_H: ``float[V, H]`` output embedding (LM head) weight.
        targets_T: ``int[T]`` the token predicted at each position.
        chunk: positions per chunk, ``>= 1``.

    Returns:
        ``float32[T]`` log-probs of the targets.
    """
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if hidden_T_H.ndim != 2 or targets_T.shape != hidden_T_H.shape[:1]:
        raise ValueError(f"need hidden_T_H [T, H] and targets_T [T], got "
                         f"{tuple(hidden_T_H.shape)} and {tuple(targets_T.shape)}")
    targets_T = targets_T.long()
    parts = []
    for start in range(0, hidden_T_H.shape[0], chunk):
        part = slice(start, start + chunk)
        if torch.is_grad_enabled() and (hidden_T_H.requires_grad
                                        or lm_head_weight_V_H.requires_grad):
            parts.append(checkpoint(_chunk_logprobs, hidden_T_H[part], lm_head_weight_V_H,
                                    targets_T[part], use_reentrant=False))
        else:
            parts.append(_chunk_logprobs(hidden_T_H[part], lm_head_weight_V_H, targets_T[part]))
    if not parts:
        return hidden_T_H.new_zeros(0, dtype=torch.float32)
    return torch.cat(parts)
