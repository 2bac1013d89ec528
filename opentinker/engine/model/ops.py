"""The engine's fused operations as torch ops: batched-LoRA shrink and expand, and paged decode
attention (``torch.ops.opentinker.*``).

Each is ONE op to torch's dispatcher whatever the batch and however many adapters it mixes:
on CUDA with triton it is one kernel launch (:mod:`.triton_ops`: punica/vLLM's sgmv
shrink-expand reading each token's adapter by its slot, and a paged decode kernel reading
contexts through block tables); elsewhere a composite of a few torch ops (bgmv over chunks
of tokens grouped by adapter, and a gather of the contexts with SDPA) whose own ops do not
depend on the batch either. Registering them as ops makes a decode step's op count (what
``tests/test_engine_ops.py`` counts with a ``TorchDispatchMode``) the count of kernels it
launches on CUDA; ``benchmarks/engine_overhead.py`` also reports the CPU composites' ops.

Two layouts, chosen by the caller (the model runner) per forward:

* **per token** (triton): ``slot_N`` (int64, -1: no LoRA) and ``scale`` = alpha / r per store
  slot ``[S]``; ``u`` is ``float32[N, G*R]``.
* **chunks** (composite): the tokens gathered into ``[C, Lt]`` chunks of one adapter each
  (:func:`.slot_lora.chunk_plan`): ``index_T`` (clamped flat token per entry), ``chunk_slot_C``,
  ``s0`` (the first chunk's slot when the chunks' slots are consecutive, read as a view; else
  -1), ``in_order`` (the entries are the flat tokens in order, no padding: x and y are read
  and written as views, no gather or scatter) and ``scale`` = ``[C, Lt, 1]`` weights (alpha / r, 0 on padding entries); ``u`` is
  ``[C, Lt, G*R]`` in x's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import triton_ops

__all__ = ["linear", "lora_expand_", "lora_shrink", "paged_decode", "register_linear"]

_LIB = torch.library.Library("opentinker", "DEF")
_LIB.define("lora_shrink(Tensor x, Tensor A, Tensor slot_N, Tensor scale, Tensor index_T, Tensor chunk_slot_C, "
            "int s0, int Lt, bool in_order) -> Tensor")
_LIB.define("lora_expand_(Tensor(a!) y, Tensor u, Tensor B, Tensor slot_N, Tensor index_T, Tensor chunk_slot_C, "
            "int s0, int col, bool in_order) -> ()")
_LIB.define("linear(Tensor x, Tensor w, Tensor? b) -> Tensor")
_LIB.define("paged_decode(Tensor q, Tensor k_pool, Tensor v_pool, Tensor block_table, Tensor ctx_len, "
            "Tensor ctx_slots, Tensor? ctx_mask, int block_size, float sm_scale) -> Tensor")


def _take(t: torch.Tensor, chunk_slot_C: torch.Tensor, s0: int) -> torch.Tensor:
    """``t[S, ...]`` at the chunks' slots: a view where they are consecutive."""
    return t[s0:s0 + chunk_slot_C.shape[0]] if s0 >= 0 else t.index_select(0, chunk_slot_C)


def _lora_shrink(x: torch.Tensor, A: torch.Tensor, slot_N: torch.Tensor, scale: torch.Tensor,
                 index_T: torch.Tensor, chunk_slot_C: torch.Tensor, s0: int, Lt: int, in_order: bool) -> torch.Tensor:
    """``u = scale * x A[slot]^T`` for every token: ``x_N_in``, ``A_S_GR_in`` -> ``u`` (module doc)."""
    if index_T.numel() == 0:
        return triton_ops.lora_shrink(x, A, slot_N, scale)
    C = chunk_slot_C.shape[0]
    x_C_Lt_in = x.view(C, Lt, -1) if in_order else x.index_select(0, index_T).view(C, Lt, -1)
    return torch.bmm(x_C_Lt_in, _take(A, chunk_slot_C, s0).transpose(1, 2).to(x.dtype)).mul_(scale)


def _lora_expand_(y: torch.Tensor, u: torch.Tensor, B: torch.Tensor, slot_N: torch.Tensor, index_T: torch.Tensor,
                  chunk_slot_C: torch.Tensor, s0: int, col: int, in_order: bool) -> None:
    """``y[n] += u[n, col:col+R] B[slot_n]^T`` in place: ``y_N_out``, ``B_S_out_R``."""
    R = B.shape[2]
    if index_T.numel() == 0:
        triton_ops.lora_expand_(y, u[:, col:col + R], B, slot_N)
        return
    u_j = u if u.shape[-1] == R else u[:, :, col:col + R]
    B_C_R_out = _take(B, chunk_slot_C, s0).transpose(1, 2).to(u.dtype)
    if in_order:
        y.view(chunk_slot_C.shape[0], -1, y.shape[1]).baddbmm_(u_j, B_C_R_out)
    else:
        y.index_add_(0, index_T, torch.bmm(u_j, B_C_R_out).view(-1, y.shape[1]))


def _paged_decode(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, block_table: torch.Tensor,
                  ctx_len: torch.Tensor, ctx_slots: torch.Tensor, ctx_mask: torch.Tensor | None, block_size: int,
                  sm_scale: float) -> torch.Tensor:
    """One query per row over its context: ``q_G_Hq_D`` -> ``o_G_Hq_D``. Triton reads the
    contexts through ``block_table``/``ctx_len``; the composite gathers ``ctx_slots_GC``
    (padding entries at slot 0, hidden by ``ctx_mask_G_1_1_C``; None when every context is
    ``C`` long) and folds the query heads that
    share a KV head into SDPA's query axis, so each KV head is read once."""
    if ctx_slots.numel() == 0:
        return triton_ops.paged_decode_attention(q, k_pool, v_pool, block_table, ctx_len, block_size, sm_scale)
    G, Hq, D = q.shape
    Hkv = k_pool.shape[1]
    C = ctx_slots.shape[1]
    k = k_pool.index_select(0, ctx_slots.view(-1)).view(G, C, Hkv, D).transpose(1, 2).to(q.dtype)
    v = v_pool.index_select(0, ctx_slots.view(-1)).view(G, C, Hkv, D).transpose(1, 2).to(q.dtype)
    o = F.scaled_dot_product_attention(q.reshape(G, Hkv, Hq // Hkv, D), k, v, attn_mask=ctx_mask, scale=sm_scale)
    return o.reshape(G, Hq, D)


for _key in ("CPU", "CUDA"):
    _LIB.impl("lora_shrink", _lora_shrink, _key)
    _LIB.impl("lora_expand_", _lora_expand_, _key)
    _LIB.impl("paged_decode", _paged_decode, _key)



def register_linear(fn) -> None:
    """The decoder's no-grad linear (``y = x w^T + b``, one GEMM however it is routed: oneDNN or
    MKL on CPU, cuBLAS on CUDA) as ``opentinker::linear``; :mod:`.decoder` registers it."""
    for key in ("CPU", "CUDA"):
        _LIB.impl("linear", fn, key)


linear = torch.ops.opentinker.linear.default
lora_shrink = torch.ops.opentinker.lora_shrink.default
lora_expand_ = torch.ops.opentinker.lora_expand_.default
paged_decode = torch.ops.opentinker.paged_decode.default
