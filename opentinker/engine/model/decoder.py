"""The engine's own decoder forward for the Llama family, Qwen2 and Qwen3, on flat tokens.

Design (after nano-vllm's ``models/qwen3.py``): the model sees N flat tokens of all rows with
their positions; everything about how rows are laid out in memory lives in the attention
backend (:mod:`.attention`), everything about which adapter a token uses lives in the
:class:`~.lora.LoraBatch`. Parameters carry the Hugging Face checkpoint's names
(``model.layers.{i}.self_attn.q_proj.weight``, ..., ``lm_head.weight``), so an HF state dict
loads as is and PEFT adapter names map one to one. The vocabulary projection is a separate
call, :meth:`Decoder.logits`, made only for the rows a caller needs (at every position it is
the dominant CPU cost).

Numerics follow transformers exactly: RMSNorm in fp32 then cast back and scaled by the weight;
RoPE inverse frequencies computed once in fp32 on CPU (as transformers does at init, so the
same bits), cos/sin built per forward from ``pos_N`` in fp32 and cast to the compute dtype;
matmuls in the weights' dtype (fp32 or bf16); SiLU-gated MLP.

Speed (CPU, where the engine runs): without autograd, fp32 linears of at least
:data:`ONEDNN_MIN_MACS` multiply-adds run on oneDNN (``torch.ops.mkldnn._linear_pointwise``),
not MKL: on the AVX-512 AMD machine the engine is measured on, MKL's sgemm takes its AVX2 path
and oneDNN is 1.5-2.4x faster on every SmolLM2 shape from 8 rows up (2x on a 32 x 64 prefill,
1.6x on a 32-row decode step); results differ by summation order only (~1e-6 relative), and
with autograd (a trainer) it is F.linear as before. Also without autograd: the residual stream
and the MLP gate are updated in place and RMSNorm runs two of its ops in place (same values,
same bits). RoPE is ``x * cos + roll(x, D/2) * signed_sin`` (four ops instead of six, same
bits as transformers' ``rotate_half`` form).

Hazards: base weights are frozen (``requires_grad=False``) so a trainer's backward reaches only
adapters; a full-parameter policy takes :meth:`Decoder.copy` with ``trainable=True``. With tied
embeddings ``lm_head.weight`` *is* ``model.embed_tokens.weight`` (one Parameter, two names in
the state dict; a checkpoint may store only the embedding).
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from . import ops
from .attention import Attention
from .config import DecoderSpec, spec_from_hf_config
from .lora import LoraBatch

__all__ = ["Decoder", "layer_checkpointing", "rope_inv_freq"]


ONEDNN_MIN_MACS = 1 << 21
"""Smallest ``M * d_out * d_in`` for which a no-grad fp32 CPU linear goes to oneDNN (below it
oneDNN's fixed cost per call loses to MKL; measured break-even 1-2M MACs on AVX-512, 2 cores)."""
_onednn: bool | None = None


def _onednn_ok() -> bool:
    """Whether ``torch.ops.mkldnn._linear_pointwise`` (the oneDNN linear that torch.compile's CPU
    backend emits) exists here and agrees with ``F.linear``; probed once."""
    global _onednn
    if _onednn is None:
        try:  # fixed values: no draw from the global generator
            x = torch.linspace(-1, 1, 80).view(5, 16)
            w, b = torch.linspace(-0.5, 0.7, 112).view(7, 16), torch.linspace(0, 1, 7)
            y = torch.ops.mkldnn._linear_pointwise(x, w, b, "none", [], "")
            _onednn = bool(torch.backends.mkldnn.is_available() and torch.allclose(y, F.linear(x, w, b), atol=1e-5))
        except (AttributeError, RuntimeError, NotImplementedError):
            _onednn = False
    return _onednn and torch.backends.mkldnn.enabled


def _onednn_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, attr: str, scalars: list,
                   algorithm: str) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, w, b, attr, scalars, algorithm)


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)``; without autograd one ``opentinker::linear`` op (:func:`_inference_linear`:
    one kernel, whatever route it takes). With autograd (a trainer's forward) it is F.linear."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad or (b is not None and b.requires_grad)):
        return F.linear(x, w, b)
    return ops.linear(x, w, b)


def _inference_linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, w, b)`` with no autograd; on CPU in fp32, large enough products run on
    oneDNN (unless ``torch.backends.mkldnn`` is disabled): about 2x MKL's speed on this AMD
    AVX-512 CPU, where MKL's sgemm takes its AVX2 path. Results differ from MKL's by summation
    order only (relative ~1e-6)."""
    if (x.dtype == torch.float32 and w.dtype == torch.float32 and x.dim() == 2 and x.device.type == "cpu"
            and x.shape[0] * w.shape[0] * w.shape[1] >= ONEDNN_MIN_MACS and _onednn_ok()):
        return _onednn_linear(x, w, b, "none", [], "")
    return F.linear(x, w, b)


ops.register_linear(_inference_linear)


class _Linear(nn.Module):
    """``y = x W^T + b`` with uninitialised storage (weights are always loaded or set)."""

    def __init__(self, d_in: int, d_out: int, bias: bool, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in, dtype=dtype, device=device))
        self.bias = nn.Parameter(torch.empty(d_out, dtype=dtype, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.weight, self.bias)


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        if dtype == torch.float32 and not torch.is_grad_enabled():
            # The same ops on the same values (so the same bits), two of them in place.
            h = x * torch.rsqrt(x.square().mean(-1, keepdim=True).add_(self.eps))
            return h.mul_(self.weight) if self.weight.dtype == dtype else self.weight * h
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class _Embedding(nn.Module):
    def __init__(self, vocab: int, dim: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab, dim, dtype=dtype, device=device))


class _SelfAttn(nn.Module):
    def __init__(self, s: DecoderSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        q, kv = s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
        self.q_proj = _Linear(s.hidden_size, q, s.qkv_bias, dtype, device)
        self.k_proj = _Linear(s.hidden_size, kv, s.qkv_bias, dtype, device)
        self.v_proj = _Linear(s.hidden_size, kv, s.qkv_bias, dtype, device)
        self.o_proj = _Linear(q, s.hidden_size, s.o_bias, dtype, device)
        if s.qk_norm:
            self.q_norm = _RMSNorm(s.head_dim, s.rms_norm_eps, dtype, device)
            self.k_norm = _RMSNorm(s.head_dim, s.rms_norm_eps, dtype, device)


class _MLP(nn.Module):
    def __init__(self, s: DecoderSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.gate_proj = _Linear(s.hidden_size, s.intermediate_size, s.mlp_bias, dtype, device)
        self.up_proj = _Linear(s.hidden_size, s.intermediate_size, s.mlp_bias, dtype, device)
        self.down_proj = _Linear(s.intermediate_size, s.hidden_size, s.mlp_bias, dtype, device)


class _Layer(nn.Module):
    def __init__(self, s: DecoderSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.self_attn = _SelfAttn(s, dtype, device)
        self.mlp = _MLP(s, dtype, device)
        self.input_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps, dtype, device)


class _Body(nn.Module):
    def __init__(self, s: DecoderSpec, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = _Embedding(s.vocab_size, s.hidden_size, dtype, device)
        self.layers = nn.ModuleList(_Layer(s, dtype, device) for _ in range(s.num_layers))
        self.norm = _RMSNorm(s.hidden_size, s.rms_norm_eps, dtype, device)


def rope_inv_freq(spec: DecoderSpec) -> torch.Tensor:
    """RoPE inverse frequencies ``inv_freq_D2`` (fp32, CPU), as transformers' default, linear
    and llama3 (Llama 3.1) rope initialisers compute them, op for op."""
    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(dtype=torch.float) / dim))
    sc = spec.rope_scaling
    if sc is None:
        return inv_freq
    if sc.rope_type == "linear":
        return inv_freq / sc.factor
    old = sc.original_max_position_embeddings
    low_freq_wavelen = old / sc.low_freq_factor
    high_freq_wavelen = old / sc.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_freq_wavelen, inv_freq / sc.factor, inv_freq)
    smooth = (old / wavelen - sc.low_freq_factor) / (sc.high_freq_factor - sc.low_freq_factor)
    smoothed = (1 - smooth) * inv_freq_llama / sc.factor + smooth * inv_freq_llama
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, inv_freq_llama)


_MLP_SLICE = 512
"""Rows an MLP computes at once in a no-grad forward where no adapter has LoRA in it."""
_MLP_PROJ = ("gate_proj", "up_proj", "down_proj")


def _apply_rope(x_N_H_D: torch.Tensor, cos_N_1_D: torch.Tensor, signed_sin_N_1_D: torch.Tensor) -> torch.Tensor:
    """transformers' ``x * cos + rotate_half(x) * sin``, bit for bit, in four ops: with
    ``signed_sin = cat(-sin1, sin2)``, ``rotate_half(x) * sin == roll(x, D/2) * signed_sin``
    (a negation is exact, so ``(-x2) * s == x2 * (-s)``). The in-place ops touch only fresh
    intermediates whose values no backward needs."""
    return (x_N_H_D * cos_N_1_D).add_(x_N_H_D.roll(x_N_H_D.shape[-1] // 2, -1).mul_(signed_sin_N_1_D))


_checkpointing = threading.local()
_checkpointing.on = False


@contextlib.contextmanager
def layer_checkpointing(on: bool = True) -> Iterator[None]:
    """Inside (this thread), a :class:`Decoder` forward with autograd keeps only each layer's
    input for the backward and computes the layer again there (activation checkpointing:
    ``hidden`` floats a token a layer instead of every activation, for one more forward)."""
    before = getattr(_checkpointing, "on", False)
    _checkpointing.on = on
    try:
        yield
    finally:
        _checkpointing.on = before


class Decoder(nn.Module):
    """A decoder-only transformer built from a :class:`DecoderSpec`, with HF parameter names."""

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu") -> None:
        """Uninitialised weights (load them, or :meth:`init_random_`), frozen."""
        super().__init__()
        device = torch.device(device)
        self.spec = spec
        self.model = _Body(spec, dtype, device)
        self.lm_head = _Linear(spec.hidden_size, spec.vocab_size, False, dtype, device)
        if spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not a buffer: ``.to(torch.bfloat16)`` would round the frequencies (positions of a few
        # thousand then rotate by visibly wrong angles). Kept in fp32, one copy per device.
        self._inv_freq = {device: rope_inv_freq(spec).to(device)}
        self.requires_grad_(False)

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, folder: str | Path, dtype: torch.dtype = torch.float32,
                        device: torch.device | str = "cpu") -> Decoder:
        """Load ``config.json`` and every ``*.safetensors`` file of a checkpoint folder (one file
        or a sharded set) with plain file reads, without building a transformers model. A tensor
        whose parameter is a contiguous CPU tensor of the file's dtype is read straight into
        the parameter's storage (peak memory: the weights, no second copy of anything); any
        other (a dtype cast, a GPU) goes through a buffer of that one tensor.
        :class:`~.config.UnsupportedArchitecture` for a family the engine does not run."""
        folder = Path(folder)
        spec = spec_from_hf_config(json.loads((folder / "config.json").read_text()))
        files = sorted(folder.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {folder}")
        dec = cls(spec, dtype=dtype, device=device)
        own = dict(dec.named_parameters(remove_duplicate=False))

        def into(name: str, file_dtype: torch.dtype, shape: list[int]) -> torch.Tensor | None:
            p = own.get(name)
            if (p is None or p.device.type != "cpu" or p.dtype != file_dtype or list(p.shape) != list(shape)
                    or not p.is_contiguous()):
                return None  # _load_tensors copies (casting) or names the mismatch
            return p.detach()

        seen: set[str] = set()
        for f in files:
            for name, tensor in _read_safetensors(f, into):
                seen |= dec._load_tensors({name: tensor})
        dec._check_complete(seen)
        return dec

    @classmethod
    def from_hf_model(cls, model: Any) -> Decoder:
        """Copy the weights of a loaded transformers ``*ForCausalLM`` (same dtype and device)."""
        spec = spec_from_hf_config(model.config)
        p = next(model.parameters())
        dec = cls(spec, dtype=p.dtype, device=p.device)
        dec._check_complete(dec._load_tensors(dict(model.state_dict())))
        return dec

    @torch.no_grad()
    def _load_tensors(self, tensors: dict[str, torch.Tensor]) -> set[str]:
        own = dict(self.named_parameters(remove_duplicate=False))
        for name, t in tensors.items():
            if name.endswith("rotary_emb.inv_freq"):
                continue  # old checkpoints saved the buffer; ours is recomputed
            if name not in own:
                raise ValueError(f"unexpected tensor {name!r} for a {self.spec.family} decoder")
            if own[name].shape != t.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(t.shape)} != {tuple(own[name].shape)}")
            if t.data_ptr() != own[name].data_ptr():  # else it was read in place
                own[name].copy_(t)
        return set(tensors)

    def _check_complete(self, seen: set[str]) -> None:
        names = {n for n, _ in self.named_parameters(remove_duplicate=False)}
        if self.spec.tie_word_embeddings and "lm_head.weight" not in seen:
            seen = seen | {"lm_head.weight"}
        missing = sorted(names - seen)
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    @torch.no_grad()
    def init_random_(self, seed: int = 0, std: float = 0.02) -> Decoder:
        """Random weights (normal(0, std) matrices, zero biases, unit norms) for tests and
        benchmarks; returns self."""
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith(".bias"):
                p.zero_()
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
        return self

    def copy(self, trainable: bool = False) -> Decoder:
        """An independent deep copy of every weight (ties kept); ``trainable=True`` makes all of
        them ``requires_grad`` (a full-parameter policy's private copy)."""
        dup = copy.deepcopy(self)
        dup.requires_grad_(trainable)
        return dup

    # ---- forward --------------------------------------------------------------------------
    def rope(self, pos_N: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos_N_1_D, sin_N_1_D)`` for positions ``pos_N``, built in fp32, cast to ``dtype``."""
        inv_freq = self._inv_freq.get(pos_N.device)
        if inv_freq is None:
            inv_freq = self._inv_freq[pos_N.device] = rope_inv_freq(self.spec).to(pos_N.device)
        freqs_N_D2 = pos_N[:, None].float() * inv_freq
        emb_N_D = torch.cat((freqs_N_D2, freqs_N_D2), dim=-1)
        return emb_N_D.cos().to(dtype)[:, None], emb_N_D.sin().to(dtype)[:, None]

    def forward(self, ids_N: torch.Tensor, pos_N: torch.Tensor, attn: Attention,
                lora: LoraBatch | None = None) -> torch.Tensor:
        """Hidden states after the final norm, ``h_N_H``, for N flat tokens ``ids_N`` at
        positions ``pos_N``; ``attn`` places them in rows, ``lora`` gives each its adapter."""
        s = self.spec
        x_N_H = F.embedding(ids_N, self.model.embed_tokens.weight)
        cos, sin = self.rope(pos_N, x_N_H.dtype)
        half = s.head_dim // 2
        signed_sin = torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)
        # Without autograd the residual stream and the MLP's gate are updated in place (fresh
        # tensors nobody else holds); with it, out of place (a norm saved its input).
        inplace = not torch.is_grad_enabled()
        recompute = not inplace and getattr(_checkpointing, "on", False)
        for i, layer in enumerate(self.model.layers):
            if recompute:  # keep each layer's input only; its activations are computed again in the backward
                x_N_H = checkpoint(self._layer, i, layer, x_N_H, cos, signed_sin, attn, lora, False,
                                   use_reentrant=False)
            else:
                x_N_H = self._layer(i, layer, x_N_H, cos, signed_sin, attn, lora, inplace)
        return self.model.norm(x_N_H)

    def _layer(self, i: int, layer: nn.Module, x_N_H: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
               attn: Attention, lora: LoraBatch | None, inplace: bool) -> torch.Tensor:
        """Layer ``i`` on the residual stream ``x_N_H``: attention then MLP, each added in."""
        s = self.spec
        N = x_N_H.shape[0]

        def proj(name: str, lin: _Linear, h: torch.Tensor) -> torch.Tensor:
            y = lin(h)
            return y if lora is None else lora.apply(i, name, h, y)

        # Each intermediate is dropped (``del``) as soon as its last reader has run, not when the
        # next layer rebinds its name: a 2048-token prefill then holds about half the
        # activations at once (no q/k/v/o under the MLP's [N, I] pair, no old q beside the new
        # one), and the allocator reuses the same holes layer after layer instead of growing
        # its heap. Autograd keeps its own references, so this is the same with grad.
        a = layer.self_attn
        h = layer.input_layernorm(x_N_H)
        q = proj("q_proj", a.q_proj, h).view(N, s.num_heads, s.head_dim)
        k = proj("k_proj", a.k_proj, h).view(N, s.num_kv_heads, s.head_dim)
        v = proj("v_proj", a.v_proj, h).view(N, s.num_kv_heads, s.head_dim)
        del h
        if s.qk_norm:
            q, k = a.q_norm(q), a.k_norm(k)
        q = _apply_rope(q, cos, signed_sin)
        k = _apply_rope(k, cos, signed_sin)
        o = attn(i, q, k, v).reshape(N, s.num_heads * s.head_dim)
        del q, k, v
        o = proj("o_proj", a.o_proj, o)
        x_N_H = x_N_H.add_(o) if inplace else x_N_H + o
        del o
        m = layer.mlp
        h = layer.post_attention_layernorm(x_N_H)
        if inplace and N > _MLP_SLICE and (lora is None or not any(lora.touches(i, n) for n in _MLP_PROJ)):
            # No LoRA in this MLP and no autograd: it runs on slices of rows, so a long
            # prefill never holds the [N, intermediate] pair (24 MB at 2048 tokens of
            # SmolLM2-135M) but a slice of it. Rows are independent here.
            for s0 in range(0, N, _MLP_SLICE):
                h_s = h[s0:s0 + _MLP_SLICE]
                g = F.silu(m.gate_proj(h_s), inplace=True).mul_(m.up_proj(h_s))
                x_N_H[s0:s0 + _MLP_SLICE].add_(m.down_proj(g))
                del g
            del h
            return x_N_H
        g = proj("gate_proj", m.gate_proj, h)
        u = proj("up_proj", m.up_proj, h)
        del h
        g = F.silu(g, inplace=True).mul_(u) if inplace else F.silu(g) * u
        del u
        d = proj("down_proj", m.down_proj, g)
        del g
        x_N_H = x_N_H.add_(d) if inplace else x_N_H + d
        del d
        return x_N_H

    def logits(self, h_R_H: torch.Tensor) -> torch.Tensor:
        """The vocabulary projection ``logits_R_V`` of the rows a caller needs."""
        return _linear(h_R_H, self.lm_head.weight)


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


def _read_safetensors(path: Path, into: Callable[[str, torch.dtype, list[int]], torch.Tensor | None] | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor of a safetensors file, read one at a time with plain
    file reads (little-endian host). ``into(name, dtype, shape)`` may return a contiguous CPU
    tensor of that dtype and shape: the bytes are read straight into it and it is what is
    yielded (no buffer); else (None) a fresh tensor on its own buffer is yielded.
    ``safetensors.safe_open`` maps the whole file, and the mapped pages of every tensor read
    stay in the process's resident memory until the file closes: loading a 540 MB checkpoint
    peaked at twice the weights."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        base = 8 + size
        for name, info in header.items():
            if name == "__metadata__":
                continue
            if info["dtype"] not in _ST_DTYPES:
                raise ValueError(f"{path}: {name} has dtype {info['dtype']}, which the engine does not read")
            dtype = _ST_DTYPES[info["dtype"]]
            start, end = info["data_offsets"]
            dest = into(name, dtype, info["shape"]) if into is not None else None
            if end == start:
                yield name, dest if dest is not None else torch.empty(info["shape"], dtype=dtype)
                continue
            if dest is not None:
                # A uint8 view of the destination's storage: readinto fills it in place.
                buf = dest.reshape(-1).view(torch.uint8).numpy()
                if buf.nbytes != end - start:
                    raise ValueError(f"{path}: {name} holds {end - start} bytes, its shape needs {buf.nbytes}")
            else:
                buf = bytearray(end - start)
            f.seek(base + start)
            if f.readinto(buf) != end - start:
                raise ValueError(f"{path}: {name} is truncated")
            yield name, dest if dest is not None else torch.frombuffer(buf, dtype=dtype).reshape(info["shape"])
