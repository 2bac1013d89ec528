"""Per-token losses over the flat vector of loss tokens, one registry by name.

The runtime computes the trainer's log-probs only where ``mask == 1`` and flattens them over
the micro-batch, so every loss sees ``logp_N`` (``N`` loss tokens) and the matching flat
``inputs`` (``advantages``, ``sampler_logprobs``, ..., each ``[N]``). A loss returns a plain
SUM over tokens (or pairs); the caller divides by a normalizer passed in (e.g. the global
loss-token count of the step), never one inferred from the micro-batch, so splitting a batch
changes nothing.

Every entry of :data:`LOSSES` has the one signature ``fn(first_N, inputs, config) ->
LossOutput`` and a :class:`Loss` record saying what kind of loss it is and which ``inputs``
it reads, so the runtime knows what to compute for it (reference log-probs with the adapter
off, full-vocabulary entropies) and what a job may select:

* :attr:`LossKind.POLICY` (``ppo``, ``importance_sampling``, ``cispo``): policy gradients on
  ``advantages``, with the importance ratio taken against the SAMPLER's log-probs (not a
  recomputed "old" policy): it corrects both for off-policy staleness and for
  sampler-vs-trainer numerical mismatch. Every entry has the REINFORCE gradient ``-A`` at
  ratio 1 and returns the same diagnostics (:func:`policy_diagnostics`).
* :attr:`LossKind.PENALTY` (``kl_k1``, ``kl_k2``, ``kl_k3``, ``entropy``): terms ADDED to
  another loss with a coefficient. A ``ForwardBackward.loss_config`` key that names a penalty
  is that term's coefficient (:func:`split_terms`): ``loss="ppo", loss_config={"clip_low":
  0.2, "kl_k3": 0.05}`` is PPO plus 0.05 x the k3 KL to the reference.
* :attr:`LossKind.VALUE` (``value``): its first argument is the critic's predicted values
  (a value head beside the adapter); main loss of a critic-only step, or a term added to a
  policy loss with ``loss_config={"value": 0.5}``.
* :attr:`LossKind.PREFERENCE` (``dpo``, ``ipo``, in :mod:`learners.preferences`) and
  :attr:`LossKind.SUPERVISED` (``sft``): trained offline on recorded trajectories.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping

import torch

from learners.diagnostics import LOG_RATIO_CLAMP, policy_diagnostics
from learners.diagnostics import mean as _mean


@dataclasses.dataclass(frozen=True)
class LossOutput:
    """What a loss returns for one micro-batch."""

    loss_sum: torch.Tensor
    """Scalar, differentiable w.r.t. ``logp_N``: the SUM of per-token losses (unnormalised)."""
    metrics: dict[str, float]
    """Diagnostics as plain floats (means over this micro-batch's tokens, or pairs)."""


LossFn = Callable[[torch.Tensor, Mapping[str, torch.Tensor], Mapping[str, float]], LossOutput]
"""``fn(logp_N, inputs, config) -> LossOutput``."""


class LossKind(enum.StrEnum):
    """What a loss is for; decides where a job may use it."""

    POLICY = "policy"
    """Policy gradient on ``advantages`` and ``sampler_logprobs`` (``train.loss``)."""
    PENALTY = "penalty"
    """Added to another loss with a coefficient (``train.kl_coef``, ``train.entropy_coef``)."""
    VALUE = "value"
    """Regression of a critic's values (first argument: values, not log-probs)."""
    PREFERENCE = "preference"
    """Sequence-pair loss (normalise by the number of pairs); offline jobs."""
    SUPERVISED = "supervised"
    """Maximum likelihood on target tokens; offline jobs."""


@dataclasses.dataclass(frozen=True)
class Loss:
    """A registered loss: the function, its kind, and the ``inputs`` it reads."""

    name: str
    fn: LossFn
    kind: LossKind
    needs: frozenset[str]
    """Keys of ``inputs`` the loss reads. ``ref_logprobs`` and ``entropy`` the runtime can
    compute itself (reference = the base model with the adapter off); the others come from
    the datums' ``loss_inputs``."""

    def __call__(self, first_N: torch.Tensor, inputs: Mapping[str, torch.Tensor],
                 config: Mapping[str, float]) -> LossOutput:
        return self.fn(first_N, inputs, config)


LOSSES: dict[str, Loss] = {}
"""Loss name -> :class:`Loss`; fill it with :func:`register_loss`."""

_POLICY_INPUTS = frozenset({"advantages", "sampler_logprobs"})


def register_loss(
    name: str, kind: LossKind = LossKind.POLICY, needs: frozenset[str] = _POLICY_INPUTS
) -> Callable[[LossFn], LossFn]:
    """Decorator that registers ``fn`` in :data:`LOSSES` (``fn`` is returned unchanged).

    Raises:
        ValueError: ``name`` is already registered.
    """

    def decorator(fn: LossFn) -> LossFn:
        if name in LOSSES:
            raise ValueError(f"loss {name!r} is already registered")
        LOSSES[name] = Loss(name, fn, LossKind(kind), frozenset(needs))
        return fn

    return decorator


def losses_of_kind(kind: LossKind) -> list[str]:
    """Sorted names of the registered losses of ``kind``."""
    return sorted(n for n, spec in LOSSES.items() if spec.kind is kind)


TERM_KINDS = (LossKind.PENALTY, LossKind.VALUE)
"""Kinds of loss that ride beside a main loss as a term with a coefficient."""


def split_terms(loss_config: Mapping[str, float]) -> tuple[dict[str, float], dict[str, float]]:
    """Split a ``loss_config`` into the main loss's own config and the added terms.

    A key naming a :attr:`LossKind.PENALTY` loss (``kl_k3``, ``entropy``) or the
    :attr:`LossKind.VALUE` loss (``value``: the critic's loss, for an adapter with a value
    head) is that term's coefficient (terms with coefficient 0 are dropped); a key
    ``<term>/<setting>`` is that term's own setting (:func:`term_config`); every other key
    belongs to the main loss (and is passed to the value term too, e.g. ``value_clip``).

    Returns:
        ``(config, {term name: coefficient})``.
    """
    config, terms = {}, {}
    for key, value in loss_config.items():
        spec = LOSSES.get(key)
        if spec is not None and spec.kind in TERM_KINDS:
            if float(value) != 0.0:
                terms[key] = float(value)
        elif not _term_setting(key):
            config[key] = value
    return config, terms


def _term_setting(key: str) -> bool:
    """Whether ``key`` is ``<term>/<setting>``: a setting of a term's own."""
    head, sep, _ = key.partition("/")
    return bool(sep) and head in LOSSES and LOSSES[head].kind in TERM_KINDS


def term_config(loss_config: Mapping[str, float], term: str, coef: float) -> dict[str, float]:
    """A penalty term's config: ``coef`` and its own settings (``loss_config``'s keys
    ``<term>/<setting>``, e.g. ``move_values/settled``), without the prefix."""
    prefix = f"{term}/"
    return {"coef": coef, **{k[len(prefix):]: v for k, v in loss_config.items() if k.startswith(prefix)}}


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
        raise ValueError(f"loss {loss!r}: first argument must be 1-D, got {tuple(logp_N.shape)}")
    # bf16 log-probs lose ~3 digits; the ratio exp(a - b) must be taken in float32.
    return logp_N.float()


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

    Dual clip (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    Reinforcement Learning", eq. 5): for ``A_t < 0`` the surrogate is further bounded as
    ``max(min(r_t A_t, clip(r_t) A_t), c A_t)``, so a token whose ratio has blown up
    (``r_t > c``) contributes at most ``-c A_t`` and no gradient, instead of an unbounded
    ``-r_t A_t``. Tokens with ``A_t >= 0`` are unchanged.

    Args:
        logp_N: ``float[N]`` trainer log-probs of the loss tokens (differentiable).
        inputs: ``advantages`` and ``sampler_logprobs``, each ``float[N]``.
        config: ``clip_low`` (default 0.2), ``clip_high`` (default 0.2), ``dual_clip``
            (``c > 1``; absent or 0 disables it, giving exactly the plain PPO loss).

    The log-ratio ``logp_t - sampler_logp_t`` is clamped to ``[-LOG_RATIO_CLAMP,
    LOG_RATIO_CLAMP]`` before the exponential, so the loss and its gradient stay finite for
    any finite input; within the bound (ratios from ~2e-9 to ~5e8) nothing changes, and a
    token beyond it has no gradient through its ratio.

    Returns:
        ``loss_sum = sum_t l_t`` and diagnostics; ``clip_frac`` is the fraction of tokens
        whose clipped (or dual-clipped) term is strictly active (zero gradient). With dual
        clip on, ``dual_clip_frac`` is the fraction where the dual bound is active.
    """
    logp_N = _check_logp(logp_N, "ppo")
    advantages_N = _require(inputs, "advantages", "ppo", logp_N)
    sampler_logp_N = _require(inputs, "sampler_logprobs", "ppo", logp_N)
    clip_low = float(config.get("clip_low", 0.2))
    clip_high = float(config.get("clip_high", 0.2))
    # Clamped before the exponential (as kl_k3 does): beyond float32's exp range (~88.7) the
    # ratio is inf, inf * 0 is NaN, and one such token made the whole gradient NaN. A clamped
    # token has no gradient through the ratio, as under the dual clip.
    ratio_N = torch.exp((logp_N - sampler_logp_N).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    unclipped_N = ratio_N * advantages_N
    clipped_N = torch.clamp(ratio_N, 1.0 - clip_low, 1.0 + clip_high) * advantages_N
    surrogate_N = torch.minimum(unclipped_N, clipped_N)
    clipped_mask_N = clipped_N.detach() < unclipped_N.detach()
    dual_clip = float(config.get("dual_clip", 0.0))
    if dual_clip == 0.0:
        metrics = policy_diagnostics(logp_N, inputs, clipped_mask_N)
        return LossOutput(loss_sum=-surrogate_N.sum(), metrics=metrics)
    if not dual_clip > 1.0:
        raise ValueError(f"loss 'ppo': dual_clip must be > 1 (or 0 to disable), got {dual_clip}")
    bound_N = dual_clip * advantages_N
    dual_N = (advantages_N < 0) & (bound_N > surrogate_N.detach())
    surrogate_N = torch.where(dual_N, bound_N, surrogate_N)
    metrics = policy_diagnostics(logp_N, inputs, clipped_mask_N | dual_N)
    metrics["dual_clip_frac"] = dual_N.float().mean().item() if dual_N.numel() else 0.0
    return LossOutput(loss_sum=-surrogate_N.sum(), metrics=metrics)


@register_loss("cispo")
def cispo(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """CISPO: REINFORCE on every token with a clipped, stop-gradient importance weight.

    Per token: ``l_t = -sg[clip(r_t, 1 - eps_low, 1 + eps_high)] A_t logp_t`` with ``r_t =
    exp(logp_t - sampler_logp_t)`` (MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute
    Efficiently with Lightning Attention", §3.1, the CISPO objective). Unlike PPO it clips the
    WEIGHT, not the update, so no token loses its gradient: ``d l_t / d logp_t = -A_t
    clip(r_t)``. The paper sets no lower bound, hence the default ``eps_low = 1`` (weight >= 0).

    Args:
        logp_N: ``float[N]`` trainer log-probs of the loss tokens (differentiable).
        inputs: ``advantages`` and ``sampler_logprobs``, each ``float[N]``.
        config: ``eps_low`` (default 1.0), ``eps_high`` (default 0.2).

    Returns:
        ``loss_sum = sum_t l_t`` and diagnostics; ``clip_frac`` is the fraction of tokens
        whose weight was clipped.
    """
    logp_N = _check_logp(logp_N, "cispo")
    advantages_N = _require(inputs, "advantages", "cispo", logp_N)
    sampler_logp_N = _require(inputs, "sampler_logprobs", "cispo", logp_N)
    low = 1.0 - float(config.get("eps_low", 1.0))
    high = 1.0 + float(config.get("eps_high", 0.2))
    ratio_N = torch.exp(logp_N.detach() - sampler_logp_N)
    weight_N = torch.clamp(ratio_N, low, high)
    loss_N = -(weight_N * advantages_N * logp_N)
    metrics = policy_diagnostics(logp_N, inputs, (ratio_N < low) | (ratio_N > high))
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
    metrics = policy_diagnostics(logp_N, inputs, ratio_N > truncation)
    return LossOutput(loss_sum=loss_N.sum(), metrics=metrics)


# ---------------------------------------------------------------------------------------------
# Value, penalty and supervised losses.

_REF = frozenset({"ref_logprobs"})


@register_loss("value", LossKind.VALUE, frozenset({"value_targets", "old_values"}))
def value(
    values_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """Clipped value-regression loss, summed over value positions (one per turn in jobs).

    ``l_t = coef * 0.5 max((v_t - R_t)^2, (clip(v_t, v_old_t - eps, v_old_t + eps) - R_t)^2)``:
    the value clipping of the reference PPO implementation (OpenAI baselines ``ppo2``;
    Engstrom et al. 2020, "Implementation Matters in Deep Policy Gradients", §3, optimization
    1), which keeps a value update inside an ``eps`` trust region around the values at
    sampling time. The ``0.5`` and ``coef`` are the ``c1 L^VF`` term of Schulman et al. 2017,
    "Proximal Policy Optimization Algorithms", eq. 9. Where the clipped error is the larger
    one the position has no gradient; elsewhere ``d l_t / d v_t = coef (v_t - R_t)``.

    NOTE: the first argument is the model output this loss needs, the PREDICTED VALUES, not
    log-probs (same position, so the one signature and :func:`compute_loss` serve).

    Args:
        values_N: ``float[N]`` predicted values (differentiable).
        inputs: ``value_targets`` (``R``, e.g. :func:`learners.advantages.gae`'s
            lambda-returns) and ``old_values`` (values when the data was sampled), each
            ``float[N]``.
        config: ``value_clip`` ``eps`` (default 0.2; 0 disables clipping), ``coef``
            (default 1.0).

    Returns:
        ``loss_sum = sum_t l_t``; metrics ``n_tokens`` (value positions), ``value_mse``
        (unclipped), ``value_clip_frac`` (positions where the clipped error is strictly
        larger: no gradient), ``value_mean`` and ``target_mean``.
    """
    values_N = _check_logp(values_N, "value")
    targets_N = _require(inputs, "value_targets", "value", values_N)
    old_N = _require(inputs, "old_values", "value", values_N)
    eps = float(config.get("value_clip", 0.2))
    coef = float(config.get("coef", 1.0))
    error_N = (values_N - targets_N) ** 2
    if eps > 0:
        clipped_N = (torch.clamp(values_N, old_N - eps, old_N + eps) - targets_N) ** 2
    else:
        clipped_N = error_N
    loss_N = 0.5 * torch.maximum(error_N, clipped_N)
    return LossOutput(loss_sum=coef * loss_N.sum(), metrics={
        "n_tokens": float(values_N.numel()),
        "value_mse": _mean(error_N),
        "value_clip_frac": _mean(clipped_N > error_N),
        "value_mean": _mean(values_N),
        "target_mean": _mean(targets_N),
    })


@register_loss("entropy", LossKind.PENALTY, frozenset({"entropy"}))
def entropy(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """Entropy bonus: ``loss = -coef * sum_t H_t`` (Williams & Peng 1991, "Function
    Optimization using Connectionist Reinforcement Learning Algorithms"; as the ``c2 S``
    term of Schulman et al. 2017, "Proximal Policy Optimization Algorithms", eq. 9).

    ``H_t = -sum_v p(v) log p(v)`` is the full entropy of position ``t``'s next-token
    distribution; it needs the whole vocabulary, so the CALLER computes it from the logits and
    passes it (differentiable) as ``inputs["entropy"]``. ``-logp_t`` of the sampled token is
    only a one-sample estimate of ``H_t`` whose gradient is not the entropy gradient, so it is
    NOT used; ``logp_N`` only fixes ``N`` and the device.

    Args:
        logp_N: ``float[N]`` log-probs of the loss tokens (shape only).
        inputs: ``entropy`` ``float[N]``.
        config: ``coef`` (default 1.0).

    Returns:
        ``loss_sum``; metrics ``n_tokens``, ``entropy_mean``.
    """
    logp_N = _check_logp(logp_N, "entropy")
    entropy_N = _require(inputs, "entropy", "entropy", logp_N)
    coef = float(config.get("coef", 1.0))
    return LossOutput(
        loss_sum=-coef * entropy_N.sum(),
        metrics={"n_tokens": float(logp_N.numel()), "entropy_mean": _mean(entropy_N)},
    )


def _kl_loss(
    name: str,
    estimator: Callable[[torch.Tensor], torch.Tensor],
    logp_N: torch.Tensor,
    inputs: Mapping[str, torch.Tensor],
    config: Mapping[str, float],
) -> LossOutput:
    """KL penalty to a reference policy, ``loss = coef * sum_t k(x_t)``, ``x_t = logp_t - ref_t``,
    with the estimators of Schulman 2020, "Approximating KL Divergence": ``k1 = x`` (unbiased,
    high variance; ``dk/dlogp = 1``), ``k2 = x^2 / 2`` (biased, low variance; ``x``), ``k3 =
    exp(-x) + x - 1 = exp(ref - logp) - (ref - logp) - 1`` (unbiased, never negative;
    ``1 - exp(-x)``). Tokens come from the sampler, so this estimates KL(policy || ref) only
    on-policy.

    Args: ``logp_N`` ``float[N]`` (differentiable); inputs ``ref_logprobs`` ``float[N]``;
    config ``coef`` (default 1.0). Returns ``loss_sum`` and metrics ``n_tokens``, ``kl_mean``.
    """
    logp_N = _check_logp(logp_N, name)
    ref_N = _require(inputs, "ref_logprobs", name, logp_N)
    k_N = estimator(logp_N - ref_N)
    coef = float(config.get("coef", 1.0))
    metrics = {"n_tokens": float(logp_N.numel()), "kl_mean": _mean(k_N)}
    return LossOutput(loss_sum=coef * k_N.sum(), metrics=metrics)


@register_loss("kl_k1", LossKind.PENALTY, _REF)
def kl_k1(logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor],
          config: Mapping[str, float]) -> LossOutput:
    """KL penalty ``loss = coef * sum_t (logp_t - ref_t)``: the k1 estimator of Schulman 2020,
    "Approximating KL Divergence" (unbiased, high variance); see :func:`_kl_loss`."""
    return _kl_loss("kl_k1", lambda x: x, logp_N, inputs, config)


@register_loss("kl_k2", LossKind.PENALTY, _REF)
def kl_k2(logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor],
          config: Mapping[str, float]) -> LossOutput:
    """KL penalty ``loss = coef * sum_t (logp_t - ref_t)^2 / 2``: the k2 estimator of Schulman 2020,
    "Approximating KL Divergence" (biased, low variance); see :func:`_kl_loss`."""
    return _kl_loss("kl_k2", lambda x: 0.5 * x**2, logp_N, inputs, config)


@register_loss("kl_k3", LossKind.PENALTY, _REF)
def kl_k3(logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor],
          config: Mapping[str, float]) -> LossOutput:
    """KL penalty ``loss = coef * sum_t [exp(ref_t - logp_t) - (ref_t - logp_t) - 1]``: the k3
    estimator of Schulman 2020, "Approximating KL Divergence" (unbiased, never negative; the
    KL term of GRPO, Shao et al. 2024, "DeepSeekMath", eq. 4); see :func:`_kl_loss`. The log
    ratio is clamped to ``[-K3_CLAMP, K3_CLAMP]`` inside the exponential, so a token far off
    the reference gives a large finite penalty, not ``inf`` (a clamped token has no gradient
    through the exponential, as in verl)."""
    return _kl_loss("kl_k3", lambda x: torch.exp(-x.clamp(-K3_CLAMP, K3_CLAMP)) + x - 1.0, logp_N, inputs, config)


K3_CLAMP = LOG_RATIO_CLAMP
"""Bound on ``|logp - ref|`` inside k3's exponential (``exp(20)`` ~ 5e8 per token)."""


@register_loss("sft", LossKind.SUPERVISED, frozenset())
def sft(
    logp_N: torch.Tensor, inputs: Mapping[str, torch.Tensor], config: Mapping[str, float]
) -> LossOutput:
    """Supervised fine-tuning: token cross-entropy ``loss = -sum_t w_t logp_t``.

    The maximum-likelihood objective (Radford et al. 2018, "Improving Language Understanding
    by Generative Pre-Training", eq. 1, on the target tokens); ``d loss / d logp_t = -w_t``.

    Args:
        logp_N: ``float[N]`` trainer log-probs of the target tokens (differentiable).
        inputs: optional ``weights`` ``float[N]`` (default 1 per token).
        config: unused.

    Returns:
        ``loss_sum``; metrics ``n_tokens``, ``nll_mean`` (unweighted mean of ``-logp_t``).
    """
    del config
    logp_N = _check_logp(logp_N, "sft")
    if "weights" in inputs:
        loss_N = -_require(inputs, "weights", "sft", logp_N) * logp_N
    else:
        loss_N = -logp_N
    return LossOutput(loss_sum=loss_N.sum(), metrics={
        "n_tokens": float(logp_N.numel()), "nll_mean": _mean(-logp_N),
    })


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
