"""Per-token policy-gradient losses over the flat vector of loss tokens, registered by name.

The runtime computes the trainer's log-probs only where ``mask == 1`` and flattens them over
the micro-batch, so every loss sees ``logp_N`` (``N`` loss tokens) and the matching flat
``inputs`` (``advantages``, ``sampler_logprobs``, each ``[N]``). A loss returns a plain SUM
over tokens; the caller divides by a normalizer passed in (e.g. the global loss-token count of
the step), never one inferred from the micro-batch, so splitting a batch changes nothing.

The importance ratio is taken against the SAMPLER's log-probs (not a recomputed "old" policy):
it corrects both for off-policy staleness and for sampler-vs-trainer numerical mismatch, and
``logp_diff_mean`` / ``logp_diff_p95`` expose that mismatch. Every loss logs the same
diagnostics (STYLE: clip fraction, approximate KL, entropy proxy, log-prob difference).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch


@dataclasses.dataclass(frozen=True)
class LossOutput:
    """What a loss returns for one micro-batch."""

    loss_sum: torch.Tensor
    """Scalar, differentiable w.r.t. ``logp_N``: the SUM of per-token losses (unnormalised)."""
    metrics: dict[str, float]
    """Diagnostics as plain floats (means over this micro-batch's tokens)."""


LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], LossOutput]
"""``fn(logp_N, inputs, config) -> LossOutput``."""

LOSSES: dict[str, LossFn] = {}
"""Loss name -> function; fill it with :func:`register_loss`."""


def register_loss(name: str) -> Callable[[LossFn], LossFn]:
    """Decorator that adds ``fn`` to :data:`LOSSES` under ``name``.

    Raises:
        ValueError: ``name`` is already registered.
    """

    def decorator(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = fn
        return fn

    return decorator


def _require(
    inputs: Mapping[str, torch.Tensor], key: str, loss: str, logp_N: torch.Tensor
) -> torch.Tensor:
    """``inputs[key]`` as float32 on ``logp_N``'s device, checked to be ``[N]``."""
    if key not in inputs:
        raise ValueError(f"loss {loss!r} needs input {key!r}; got {sorted(inputs)}")
    value_N = torch.as_tensor(inputs[key]).to(device=logp_N.device, dtype=torch.float32)
    if value_N.shape != logp_N.shape:
        raise ValueError(
            f"loss {loss!r}: input {key!r} has shape {tuple(value_N.shape)}, "
            f"logp_N has {tuple(logp_N.shape)}"
        )
    return value_N


def _check_logp(logp_N: torch.Tensor, loss: str) -> torch.Tensor:
    if logp_N.ndim != 1:
        raise ValueError(f"loss {loss!r}: logp_N must be 1-D, got {tuple(logp_N.shape)}")
    # bf16 log-probs lose ~3 digits; the ratio exp(a - b) must be taken in float32.
    return logp_N.float()


@torch.no_grad()
def _diagnostics(
    logp_N: torch.Tensor, sampler_logp_N: torch.Tensor, clipped_N: torch.Tensor
) -> dict[str, float]:
    """Diagnostics shared by every ratio-based loss.

    ``approx_kl`` is the k3 estimator ``(r - 1) - log r`` of KL(sampler || trainer) with
    ``r = p_trainer / p_sampler`` over tokens drawn from the sampler (Schulman 2020,
    "Approximating KL Divergence"): unbiased and never negative.
    """
    n = logp_N.numel()
    if n == 0:
        names = ("clip_frac", "approx_kl", "ratio_mean", "logp_diff_mean", "logp_diff_p95",
                 "entropy_proxy")
        return {**{name: 0.0 for name in names}, "n_tokens": 0.0}
    log_ratio_N = logp_N.detach() - sampler_logp_N
    ratio_N = log_ratio_N.exp()
    diff_N = log_ratio_N.abs()
    return {
        "clip_frac": clipped_N.float().mean().item(),
        "approx_kl": ((ratio_N - 1.0) - log_ratio_N).mean().item(),
        "ratio_mean": ratio_N.mean().item(),
        "logp_diff_mean": diff_N.mean().item(),
        # torch.quantile refuses > 2**24 elements; sorting is exact and has no such limit.
        "logp_diff_p95": _quantile(diff_N, 0.95),
        "entropy_proxy": (-logp_N.detach()).mean().item(),
        "n_tokens": float(n),
    }


def _quantile(values_N: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile (numpy's default method) of a non-empty 1-D tensor."""
    sorted_N = values_N.sort().values
    position = q * (sorted_N.numel() - 1)
    low = int(position)
    high = min(low + 1, sorted_N.numel() - 1)
    weight = position - low
    return (sorted_N[low] * (1.0 - weight) + sorted_N[high] * weight).item()


@register_loss("ppo")
def ppo(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """PPO clipped surrogate, summed over tokens, with asymmetric ("clip-higher") clipping.

    Per token: ``l_t = -min(r_t A_t, clip(r_t, 1 - clip_low, 1 + clip_high) A_t)`` with
    ``r_t = exp(logp_t - sampler_logp_t)`` (Schulman et al. 2017, "Proximal Policy
    Optimization Algorithms", eq. 7; the separate upper bound ``clip_high`` is DAPO's
    clip-higher, Yu et al. 2025, §3.1). Where the clipped term is the minimum the token has
    zero gradient; elsewhere ``d l_t / d logp_t = -A_t r_t``.

    Args:
        logp_N: ``float[N]`` trainer log-probs of the loss tokens (differentiable).
        inputs: ``advantages`` and ``sampler_logprobs``, each ``float[N]``.
        config: ``clip_low`` (default 0.2), ``clip_high`` (default 0.2).

    Returns:
        ``loss_sum = sum_t l_t`` and diagnostics; ``clip_frac`` is the fraction of tokens
        whose clipped term is strictly active (zero gradient).
    """
    logp_N = _check_logp(logp_N, "ppo")
    advantages_N = _require(inputs, "advantages", "ppo", logp_N)
    sampler_logp_N = _require(inputs, "sampler_logprobs", "ppo", logp_N)
    clip_low = float(config.get("clip_low", 0.2))
    clip_high = float(config.get("clip_high", 0.2))
    ratio_N = torch.exp(logp_N - sampler_logp_N)
    unclipped_N = ratio_N * advantages_N
    clipped_N = torch.clamp(ratio_N, 1.0 - clip_low, 1.0 + clip_high) * advantages_N
    loss_N = -torch.minimum(unclipped_N, clipped_N)
    metrics = _diagnostics(logp_N, sampler_logp_N, clipped_N.detach() < unclipped_N.detach())
    return LossOutput(loss_sum=loss_N.sum(), metrics=metrics)


@register_loss("importance_sampling")
def importance_sampling(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """REINFORCE with a truncated importance weight, summed over tokens.

    Per token: ``l_t = -sg[min(r_t, c)] logp_t A_t`` with ``r_t = exp(logp_t -
    sampler_logp_t)``, ``sg`` stop-gradient and ``c = is_truncation`` (the truncated IS
    weight ``ρ = min(ρ̄, π/μ)`` of Espeholt et al. 2018, "IMPALA", V-trace eq. 1, as used in
    the policy-gradient update of §4.2). So ``d l_t / d logp_t = -A_t min(r_t, c)``, which at
    ``r_t < c`` equals the unclipped PPO gradient; unlike PPO it never zeroes a token.

    Args:
        logp_N: ``float[N]`` trainer log-probs of the loss tokens (differentiable).
        inputs: ``advantages`` and ``sampler_logprobs``, each ``float[N]``.
        config: ``is_truncation`` (default 2.0).

    Returns:
        ``loss_sum = sum_t l_t`` and diagnostics; ``clip_frac`` is the fraction of tokens
        whose weight was truncated (``r_t > c``).
    """
    logp_N = _check_logp(logp_N, "importance_sampling")
    advantages_N = _require(inputs, "advantages", "importance_sampling", logp_N)
    sampler_logp_N = _require(inputs, "sampler_logprobs", "importance_sampling", logp_N)
    truncation = float(config.get("is_truncation", 2.0))
    ratio_N = torch.exp(logp_N.detach() - sampler_logp_N)
    weight_N = torch.clamp(ratio_N, max=truncation)
    loss_N = -(weight_N * logp_N * advantages_N)
    metrics = _diagnostics(logp_N, sampler_logp_N, ratio_N > truncation)
    return LossOutput(loss_sum=loss_N.sum(), metrics=metrics)


def compute_loss(
    name: str,
    logp_N: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
) -> LossOutput:
    """Look ``name`` up in :data:`LOSSES` and apply it.

    Raises:
        ValueError: unknown loss (naming the known ones), or an input the loss needs is
            missing (naming the key and the loss).
    """
    if name not in LOSSES:
        raise ValueError(f"unknown loss {name!r}; known: {sorted(LOSSES)}")
    return LOSSES[name](logp_N, inputs, config)
