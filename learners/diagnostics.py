"""Diagnostics logged with every policy loss (STYLE: the ones that catch the known bugs).

They are computed under ``no_grad`` from the same tensors as the loss, and returned as plain
floats in ``LossOutput.metrics``; the runtime forwards them to ``metrics.jsonl``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch


@torch.no_grad()
def logprob_mismatch(logp_N: torch.Tensor, sampler_logp_N: torch.Tensor) -> dict[str, float]:
    """``|logp - sampler_logp|`` over the tokens: ``logp_diff_mean``, ``logp_diff_p95`` and
    ``logp_diff_max`` (zeros when empty). On-policy these measure the sampler-vs-trainer
    numerical mismatch (batching, kernels, dtype); a p95 that grows flags a sampler bug."""
    if logp_N.numel() == 0:
        return {"logp_diff_mean": 0.0, "logp_diff_p95": 0.0, "logp_diff_max": 0.0}
    diff_N = (logp_N.detach().float() - sampler_logp_N.float()).abs()
    return {
        "logp_diff_mean": diff_N.mean().item(),
        # torch.quantile refuses > 2**24 elements; sorting is exact and has no such limit.
        "logp_diff_p95": _quantile(diff_N, 0.95),
        "logp_diff_max": diff_N.max().item(),
    }


LOG_RATIO_CLAMP = 20.0
"""Bound on ``|log ratio|`` inside an exponential that carries a gradient (``ppo``'s ratio,
``kl_k3``'s ``exp(ref - logp)``): ``exp(20)`` ~ 4.9e8, far past any clip bound a job can set
(``1 + train.clip_high`` <= 11, ``train.dual_clip`` <= 1e3) and far below float32's overflow
(``exp(88.7)``), so the ratio times a finite advantage stays finite. A token the trainer gives
e^20 times the sampler's probability is a numerical accident or another policy's data; its
gradient through the ratio would swamp the batch, so past the bound it has none (as under
PPO's dual clip). :func:`policy_diagnostics` clamps its ratios the same way, so its metrics
stay finite too."""


@torch.no_grad()
def policy_diagnostics(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], clipped_N: torch.Tensor
) -> dict[str, float]:
    """Diagnostics shared by every policy loss (STYLE: the ones that catch the known bugs).

    * ``clip_frac``: fraction of tokens whose clipped term (or weight) is active.
    * ``approx_kl``: the k3 estimator ``(r - 1) - log r`` of KL(sampler || trainer) with
      ``r = p_trainer / p_sampler`` over tokens drawn from the sampler (Schulman 2020,
      "Approximating KL Divergence"): unbiased and never negative.
    * ``ratio_mean``; ``logp_diff_mean`` / ``_p95`` / ``_max`` (:func:`logprob_mismatch`).
    * ``entropy``: mean full-vocabulary entropy ``H_t = -sum_v p log p`` of the trainer's
      next-token distributions, when the runtime passes ``inputs["entropy"]`` (it does: the
      logits at loss positions are computed anyway); ``entropy_proxy``: mean ``-logp_t`` of
      the sampled tokens, a one-sample estimate of the same on-policy at temperature 1.
    * ``n_tokens``.
    """
    sampler_logp_N = _input(inputs, "sampler_logprobs", logp_N)
    out = logprob_mismatch(logp_N, sampler_logp_N)
    n = logp_N.numel()
    if n == 0:
        out.update(clip_frac=0.0, approx_kl=0.0, ratio_mean=0.0, entropy_proxy=0.0)
        if "entropy" in inputs:
            out["entropy"] = 0.0
        return {**out, "n_tokens": 0.0}
    log_ratio_N = (logp_N.detach() - sampler_logp_N).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio_N = log_ratio_N.exp()
    out.update(
        clip_frac=clipped_N.float().mean().item(),
        approx_kl=((ratio_N - 1.0) - log_ratio_N).mean().item(),
        ratio_mean=ratio_N.mean().item(),
        entropy_proxy=(-logp_N.detach()).mean().item(),
        n_tokens=float(n),
    )
    if "entropy" in inputs:
        out["entropy"] = mean(_input(inputs, "entropy", logp_N))
    return out


@torch.no_grad()
def explained_variance(values_N: torch.Tensor, targets_N: torch.Tensor) -> float:
    """``1 - Var(R - V) / Var(R)`` of a critic's values ``V`` against its targets ``R``
    (population variances over the ``N`` positions): 1 is a perfect critic, 0 one no better
    than a constant, negative one worse than a constant. The PPO implementations' critic
    diagnostic (e.g. OpenAI baselines ``explained_variance``). 0.0 when ``R`` is constant or
    there are fewer than 2 positions (nothing to explain)."""
    if values_N.numel() < 2:
        return 0.0
    targets = targets_N.detach().double()
    var_r = targets.var(unbiased=False)
    if var_r.item() == 0.0:
        return 0.0
    return (1.0 - (targets - values_N.detach().double()).var(unbiased=False) / var_r).item()


def _quantile(values_N: torch.Tensor, q: float) -> float:
    """Linear-interpolation quantile (numpy's default method) of a non-empty 1-D tensor."""
    sorted_N = values_N.sort().values
    position = q * (sorted_N.numel() - 1)
    low = int(position)
    high = min(low + 1, sorted_N.numel() - 1)
    weight = position - low
    return (sorted_N[low] * (1.0 - weight) + sorted_N[high] * weight).item()


def _input(inputs: Mapping[str, torch.Tensor], key: str, logp_N: torch.Tensor) -> torch.Tensor:
    if key not in inputs:
        raise ValueError(f"policy diagnostics need input {key!r}; got {sorted(inputs)}")
    value_N = torch.as_tensor(inputs[key]).to(device=logp_N.device, dtype=torch.float32)
    if value_N.shape != logp_N.shape:
        raise ValueError(f"input {key!r} has shape {tuple(value_N.shape)}, logp_N has "
                         f"{tuple(logp_N.shape)}")
    return value_N


@torch.no_grad()
def mean(values_N: torch.Tensor) -> float:
    """Mean as a float; 0.0 for an empty tensor (``mean`` would give nan)."""
    return values_N.float().mean().item() if values_N.numel() else 0.0
