"""Checks of an adapter's spec and an optimizer step's settings, shared by the scheduler (a
request on arrival) and adapter loading (a saved folder's ``opentinker.json``). Torch-free."""

from __future__ import annotations

import math

from protocols.messages import AdamParams, LoraSpec

MAX_LORA_RANK = 4096
"""A rank beyond a layer's width adds nothing; the widest open models are ~16k wide, and
ranks in use are 8-256. The job config's ``policies[].lora_rank`` takes the same bound."""

MAX_TARGET_MODULES = 64


def check_spec(spec: LoraSpec, hidden_size: int | None) -> None:
    """Raise ``ValueError`` naming the field of a :class:`LoraSpec` no adapter should have: a
    rank outside [1, min(4096, hidden size)] (a larger one adds nothing and can exhaust memory:
    rank 10**6 took 24 GB), a non-finite or non-positive alpha, dropout outside [0, 1), no or too
    many target modules."""
    if spec.full:
        return
    top = min(MAX_LORA_RANK, hidden_size or MAX_LORA_RANK)
    if not 1 <= spec.rank <= top:
        raise ValueError(f"LoraSpec.rank must be in [1, {top}] (the model's hidden size bounds it), got {spec.rank}")
    if not (math.isfinite(spec.alpha) and spec.alpha > 0):
        raise ValueError(f"LoraSpec.alpha must be finite and > 0, got {spec.alpha}")
    if not 0 <= spec.dropout < 1:
        raise ValueError(f"LoraSpec.dropout must be in [0, 1), got {spec.dropout}")
    if not 1 <= len(spec.target_modules) <= MAX_TARGET_MODULES:
        raise ValueError(f"LoraSpec.target_modules must name 1 to {MAX_TARGET_MODULES} modules, got {len(spec.target_modules)}")


def check_adam(p: AdamParams) -> None:
    """Raise ``ValueError`` naming the field of :class:`AdamParams` no optimizer step can take
    (every value finite; lr, eps, weight decay and clipping non-negative, eps > 0; betas in [0, 1))."""
    for name in ("lr", "beta1", "beta2", "eps", "weight_decay", "grad_clip"):
        v = getattr(p, name)
        if not math.isfinite(v) or v < 0:
            raise ValueError(f"AdamParams.{name} must be finite and >= 0, got {v}")
    if not (p.beta1 < 1 and p.beta2 < 1 and p.eps > 0):
        raise ValueError(f"AdamParams: betas must be < 1 and eps > 0, got {p.beta1}, {p.beta2}, {p.eps}")
