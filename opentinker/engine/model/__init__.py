"""The engine's own model forward: Llama family, Qwen2, Qwen3 on flat tokens, with batched LoRA
and two attention backends (dense padded batches for training, a paged KV pool for serving).

Build a :class:`Decoder` (``from_pretrained`` a safetensors folder, or ``from_hf_model``), then
per forward an attention backend (:class:`DenseAttention`, or :class:`StepAttention` over the
engine's KV pool) and optionally a :class:`LoraBatch` (or the engine's
:class:`~.slot_lora.SlotLora`); ``decoder(ids_N, pos_N, attn, lora)``
gives final hidden states and ``decoder.logits(h_R_H)`` the vocabulary projection of the rows
needed. :class:`UnsupportedArchitecture` means: use the PEFT path.
"""

from .attention import Attention, DenseAttention, DenseCache
from .paged_step import StepAttention
from .config import DecoderSpec, RopeScaling, UnsupportedArchitecture, spec_from_hf_config
from .decoder import Decoder, layer_checkpointing
from .lora import DEFAULT_METHOD, LoraBatch
from .lora_weights import LoraStackCache, LoraWeights, peft_name

__all__ = [
    "layer_checkpointing",
    "Attention", "DenseAttention", "DenseCache", "StepAttention",
    "DecoderSpec", "RopeScaling", "UnsupportedArchitecture", "spec_from_hf_config",
    "Decoder", "DEFAULT_METHOD", "LoraBatch", "LoraStackCache", "LoraWeights", "peft_name",
]
