"""What the engine's decoder needs to know about a checkpoint, read from a Hugging Face config.

Design: one frozen :class:`DecoderSpec` covers the Llama family (SmolLM2 is one), Qwen2 and
Qwen3; the three differ only in which projections carry a bias and whether q and k get a
per-head RMSNorm (Qwen3). :func:`spec_from_hf_config` is the single place that interprets a
transformers config, and it refuses (:class:`UnsupportedArchitecture`) anything it would run
differently from transformers, so the caller can fall back to the PEFT path instead of silently
computing something else.

Hazards:
* transformers 5 keeps RoPE settings in ``config.rope_parameters`` (a dict with ``rope_type``
  and ``rope_theta``); legacy ``rope_scaling``/``rope_theta`` keys in ``config.json`` are moved
  there by the config class, so a raw ``config.json`` dict is first turned into the family's
  config class (which also fills class defaults that ``save_pretrained`` omits, e.g. Qwen3's
  ``head_dim`` of 128, which is not ``hidden_size // num_heads``).
* Qwen2/Qwen3 configs always carry a ``sliding_window`` number; only the layers whose
  ``layer_types`` entry is ``"sliding_attention"`` use it. We refuse only when some layer does.
"""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["DecoderSpec", "RopeScaling", "UnsupportedArchitecture", "spec_from_hf_config", "SUPPORTED"]

SUPPORTED: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}
"""Hugging Face architecture name -> family (the config's ``model_type``)."""


class UnsupportedArchitecture(ValueError):
    """The checkpoint is not one the engine's own forward runs exactly; use the PEFT path."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling, as transformers' ``rope_parameters`` (only the types we run)."""

    rope_type: str
    """``"linear"`` (every inverse frequency divided by ``factor``) or ``"llama3"``."""
    factor: float
    low_freq_factor: float = 1.0
    """llama3 only."""
    high_freq_factor: float = 4.0
    """llama3 only."""
    original_max_position_embeddings: int = 8192
    """llama3 only: the pretraining context length the wavelengths are compared to."""


@dataclasses.dataclass(frozen=True)
class DecoderSpec:
    """Shapes and switches of a pre-norm decoder-only transformer with SiLU-gated MLP and RoPE."""

    family: str
    """``"llama"``, ``"qwen2"`` or ``"qwen3"``."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    """Grouped-query attention: ``num_heads`` is a multiple of it."""
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    """``lm_head.weight`` is ``model.embed_tokens.weight`` (one Parameter)."""
    qkv_bias: bool = False
    """q_proj, k_proj, v_proj have a bias (Qwen2 always; Llama/Qwen3 with ``attention_bias``)."""
    o_bias: bool = False
    """o_proj has a bias (Llama/Qwen3 ``attention_bias``; never Qwen2)."""
    mlp_bias: bool = False
    """gate/up/down projections have a bias (Llama ``mlp_bias``)."""
    qk_norm: bool = False
    """Per-head RMSNorm over head_dim on q and k before RoPE (Qwen3)."""

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim {self.head_dim} must be even for RoPE")


def _as_config(config: Any) -> Any:
    """A transformers config object for ``config`` (a config object or a ``config.json`` dict)."""
    if not isinstance(config, dict):
        return config
    from transformers import AutoConfig

    kwargs = dict(config)
    model_type = kwargs.pop("model_type", None)
    if model_type is None:
        raise UnsupportedArchitecture(f"config has no model_type (architectures={config.get('architectures')})")
    try:
        return AutoConfig.for_model(model_type, **kwargs)
    except ValueError as e:  # unknown model_type
        raise UnsupportedArchitecture(f"architecture {config.get('architectures')} / {model_type!r}: {e}") from None


def _rope(config: Any, arch: str) -> tuple[float, RopeScaling | None]:
    params = dict(getattr(config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        theta = getattr(config, "default_theta", 10000.0)
    if any(isinstance(v, dict) for v in params.values()):
        raise UnsupportedArchitecture(f"{arch}: per-layer-type RoPE parameters are not supported")
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedArchitecture(f"{arch}: partial rotary embeddings are not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return float(theta), None
    if rope_type == "linear":
        return float(theta), RopeScaling("linear", float(params["factor"]))
    if rope_type == "llama3":
        return float(theta), RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings") or config.max_position_embeddings),
        )
    raise UnsupportedArchitecture(f"{arch}: RoPE type {rope_type!r} is not supported (default, linear, llama3 are)")


def spec_from_hf_config(config: Any) -> DecoderSpec:
    """The :class:`DecoderSpec` of a ``LlamaForCausalLM``, ``Qwen2ForCausalLM`` or
    ``Qwen3ForCausalLM`` config (a transformers config object or the ``config.json`` dict).

    Raises :class:`UnsupportedArchitecture` naming the architecture for anything else, and for
    features these families may carry that the engine does not run (sliding-window layers,
    RoPE types other than default/linear/llama3, activations other than SiLU).
    """
    config = _as_config(config)
    archs = list(getattr(config, "architectures", None) or [])
    model_type = getattr(config, "model_type", None)
    family_of_type = {v: k for k, v in SUPPORTED.items()}
    arch = archs[0] if archs else family_of_type.get(str(model_type), f"model_type {model_type!r}")
    if len(archs) > 1 or arch not in SUPPORTED or SUPPORTED[arch] != model_type:
        raise UnsupportedArchitecture(
            f"architecture {archs or model_type!r} is not supported by the engine's forward "
            f"(supported: {', '.join(SUPPORTED)}); use the PEFT fallback"
        )
    family = SUPPORTED[arch]
    act = getattr(config, "hidden_act", "silu")
    if act != "silu":
        raise UnsupportedArchitecture(f"{arch}: activation {act!r} is not supported (silu is)")
    sliding = [t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"]
    if sliding:
        raise UnsupportedArchitecture(
            f"{arch}: {len(sliding)} layers use {sliding[0]!r}; only full attention is supported"
        )
    theta, scaling = _rope(config, arch)
    num_heads = int(config.num_attention_heads)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // num_heads
    attention_bias = bool(getattr(config, "attention_bias", False))
    return DecoderSpec(
        family=family,
        vocab_size=int(config.vocab_size),
        hidden_size=int(config.hidden_size),
        intermediate_size=int(config.intermediate_size),
        num_layers=int(config.num_hidden_layers),
        num_heads=num_heads,
        num_kv_heads=int(getattr(config, "num_key_value_heads", None) or num_heads),
        head_dim=int(head_dim),
        rms_norm_eps=float(config.rms_norm_eps),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
        qkv_bias=True if family == "qwen2" else attention_bias,
        o_bias=False if family == "qwen2" else attention_bias,
        mlp_bias=bool(getattr(config, "mlp_bias", False)) if family == "llama" else False,
        qk_norm=family == "qwen3",
    )


def module_dims(spec: DecoderSpec, module: str) -> tuple[int, int]:
    """``(d_in, d_out)`` of a projection."""
    H, I = spec.hidden_size, spec.intermediate_size
    q, kv = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
    return {"q_proj": (H, q), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (q, H),
            "gate_proj": (H, I), "up_proj": (H, I), "down_proj": (I, H)}[module]
