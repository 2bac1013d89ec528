"""Triton kernels for the engine's CUDA path: multi-LoRA shrink/expand and paged decode attention.

Layouts (what the kernels read in place, never copied, gathered or cast as tensors):

* LoRA (:mod:`.lora_slots`): per layer and input group, ``A`` is ``[S, G*R, d_in]`` (slot s =
  one adapter, the G projections that read the same x stacked on the rank axis); per layer and
  module, ``B`` is ``[S, d_out, R]``; fp32 masters; each slot has a scale alpha / r applied to
  ``x A^T``. A projection's LoRA term is two launches, after punica's SGMV/BGMV and vLLM's
  ``lora_shrink``/``lora_expand`` Triton ops: :func:`lora_shrink` ``u = scale * x A[s]^T`` (once
  per input group, all G projections together) and :func:`lora_expand_` ``y += u_j B[s]^T``
  (per projection, ``u_j`` a column slice of u). Every token n carries its slot ``slot_N[n]``
  (-1: no adapter). The grid tiles tokens (``BLOCK_N``) and the output columns; a tile loops
  over the distinct slots among its tokens in ascending order (one ``tl.dot`` per slot, rows of
  other slots masked to zero), so tokens may come in any order and a tile of one adapter (the
  engine sorts rows by slot) is a plain tiled matmul. fp32 masters are cast in registers to
  the activation dtype for bf16/fp16 (tensor cores, as :mod:`.lora` casts them for a bf16
  forward); an fp32 forward uses IEEE fp32 dots (no TF32). Accumulation is always fp32.
* KV (:mod:`.attention`, :mod:`..kv_cache`): the pool of a layer is ``[S_slots, Hkv, D]``, slot
  = block * block_size + offset, and row b's position p lives in slot ``block_table[b, p //
  block_size] * block_size + p % block_size``. :func:`paged_decode_attention` follows vLLM's
  paged attention and nano-vllm's/vLLM's Triton decode kernel: one program per (row, KV head)
  holds the ``Hq / Hkv`` query heads that share the KV head (GQA; padded to >= 16 rows for
  ``tl.dot``), walks the row's context in tiles of ``BLOCK_T`` positions (a tile may span
  several blocks; each position's block id is read from the block table) with an fp32 online
  softmax (FlashAttention's running max and sum). The loop bound is ``ctx_len`` loaded inside
  the kernel and the grid depends on shapes only: no host sync, so a decode step can be
  captured in a CUDA graph and replayed with new contexts. A row of ctx_len 0 (a graph
  bucket's padding) writes zeros.

Interpreter: with ``TRITON_INTERPRET=1`` the kernels run on CPU tensors in Triton's
interpreter. Triton builds its standard library (``tl.max``, ``tl.sum``, ...) in one mode when
it is first imported, so the variable must be set before then (tests run the kernels in a
subprocess started with it); the kernels here are wrapped at first use in that same mode. The
interpreter's ``tl.dot`` mishandles 16-bit operands (triton 3.9), so there the operands are
rounded to the activation dtype and multiplied in fp32 (the products of a 16-bit MMA).
Without Triton the module still imports: :func:`available` is False and the kernels raise
``RuntimeError``; the ``*_ref`` functions are plain torch references (the tests' ground truth,
usable as a CPU fallback).

Limits: tile sizes are heuristics, not tuned on a GPU (this was written and tested on CPU
under the interpreter, and compiled ahead of time for sm_90 by the tests); ``R`` (expand) is
held whole in one tile (fine for LoRA ranks up to a few hundred); ``Hq`` must be a multiple of
``Hkv``; head_dim, d_in, d_out, R and block_size may be any size (tiles are padded powers of
two, masked).
"""

from __future__ import annotations

import os
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
    from triton.runtime.jit import JITFunction
except ImportError:  # the module imports without triton; the kernels then refuse to run
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = ["available", "lora_shrink", "lora_expand_", "paged_decode_attention", "lora_shrink_ref",
           "lora_expand_ref", "paged_decode_attention_ref"]


def _interpreted() -> bool:
    """Triton runs in interpreter mode: ``TRITON_INTERPRET=1`` was set when it was first
    imported (its standard library was built as interpreted functions then)."""
    return triton is not None and not isinstance(tl.zeros, JITFunction)


def available(device: torch.device | str) -> bool:
    """Whether the kernels can run on ``device``: Triton imports, and the device is CUDA or
    Triton is in interpreter mode (``TRITON_INTERPRET=1`` before triton was imported; then any
    device, CPU included)."""
    return triton is not None and (torch.device(device).type == "cuda" or _interpreted())


# ------------------------------------------------------------------------------------ kernels
# Plain functions, wrapped at first use (see _kernel), so the module imports without triton.


def _lora_shrink_kernel(x_ptr, a_ptr, slot_ptr, scale_ptr, u_ptr, N, R, DIN,
                        sxn, sxd, sas, sar, sad, sun, sur,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr,
                        F32_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    k0 = tl.arange(0, BLOCK_K)
    slot = tl.load(slot_ptr + n, mask=n < N, other=-1)
    valid = (n < N) & (slot >= 0)
    acc = tl.zeros([BLOCK_N, BLOCK_R], dtype=tl.float32)
    s = tl.min(tl.where(valid, slot, 2147483647), axis=0)
    while s < 2147483647:  # the tile's distinct slots, ascending
        rows = valid & (slot == s)
        a_base = a_ptr + s.to(tl.int64) * sas
        for k in range(0, DIN, BLOCK_K):
            kk = k + k0
            x = tl.load(x_ptr + n[:, None].to(tl.int64) * sxn + kk[None, :] * sxd,
                        mask=rows[:, None] & (kk[None, :] < DIN), other=0.0)
            a = tl.load(a_base + r[None, :] * sar + kk[:, None] * sad,
                        mask=(r[None, :] < R) & (kk[:, None] < DIN), other=0.0)  # [BLOCK_K, BLOCK_R]
            if F32_DOT:
                acc = tl.dot(x.to(tl.float32), a.to(x.dtype).to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, a.to(x.dtype), acc)
        s = tl.min(tl.where(valid & (slot > s), slot, 2147483647), axis=0)
    scale = tl.load(scale_ptr + slot, mask=valid, other=0.0).to(tl.float32)
    tl.store(u_ptr + n[:, None].to(tl.int64) * sun + r[None, :] * sur, acc * scale[:, None],
             mask=(n[:, None] < N) & (r[None, :] < R))


def _lora_expand_kernel(y_ptr, u_ptr, b_ptr, slot_ptr, N, R, DOUT,
                        syn, syd, sun, sur, sbs, sbd, sbr,
                        BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr,
                        F32_DOT: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_d = tl.program_id(1)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    r = tl.arange(0, BLOCK_R)
    slot = tl.load(slot_ptr + n, mask=n < N, other=-1)
    valid = (n < N) & (slot >= 0)
    y_ptrs = y_ptr + n[:, None].to(tl.int64) * syn + d[None, :] * syd
    y_mask = valid[:, None] & (d[None, :] < DOUT)
    y = tl.load(y_ptrs, mask=y_mask, other=0.0)
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    s = tl.min(tl.where(valid, slot, 2147483647), axis=0)
    while s < 2147483647:  # the tile's distinct slots, ascending
        rows = valid & (slot == s)
        u = tl.load(u_ptr + n[:, None].to(tl.int64) * sun + r[None, :] * sur,
                    mask=rows[:, None] & (r[None, :] < R), other=0.0)
        b = tl.load(b_ptr + s.to(tl.int64) * sbs + d[None, :] * sbd + r[:, None] * sbr,
                    mask=(r[:, None] < R) & (d[None, :] < DOUT), other=0.0)  # [BLOCK_R, BLOCK_D]
        if F32_DOT:
            acc = tl.dot(u.to(y.dtype).to(tl.float32), b.to(y.dtype).to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(u.to(y.dtype), b.to(y.dtype), acc)
        s = tl.min(tl.where(valid & (slot > s), slot, 2147483647), axis=0)
    tl.store(y_ptrs, (y.to(tl.float32) + acc).to(y.dtype), mask=y_mask)


def _paged_decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, ctx_ptr, o_ptr, sm_scale, HQ, HKV, D,
                         sqb, sqh, sqd, sks, skh, skd, svs, svh, svd, sbb, sbm, sob, soh, sod,
                         GROUP: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_T: tl.constexpr, BLOCK_SIZE: tl.constexpr, F32_DOT: tl.constexpr):
    b = tl.program_id(0)
    hk = tl.program_id(1)
    h = hk * GROUP + tl.arange(0, BLOCK_H)  # the query heads sharing KV head hk (padded)
    h_ok = tl.arange(0, BLOCK_H) < GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    ctx = tl.load(ctx_ptr + b)
    q = tl.load(q_ptr + b.to(tl.int64) * sqb + h[:, None] * sqh + d[None, :] * sqd,
                mask=h_ok[:, None] & d_ok[None, :], other=0.0)
    qk_scale = sm_scale * 1.4426950408889634  # exp(x) = exp2(x * log2(e))
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    t0 = tl.arange(0, BLOCK_T)
    for start in range(0, ctx, BLOCK_T):
        p = start + t0
        p_ok = p < ctx
        blk = tl.load(bt_ptr + b.to(tl.int64) * sbb + (p // BLOCK_SIZE) * sbm, mask=p_ok, other=0)
        slot = blk.to(tl.int64) * BLOCK_SIZE + p % BLOCK_SIZE
        kv_mask = p_ok[:, None] & d_ok[None, :]
        k = tl.load(k_ptr + slot[:, None] * sks + hk * skh + d[None, :] * skd, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + slot[:, None] * svs + hk * svh + d[None, :] * svd, mask=kv_mask, other=0.0)
        if F32_DOT:
            qk = tl.dot(q.to(k.dtype).to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            qk = tl.dot(q.to(k.dtype), tl.trans(k))
        qk = tl.where(p_ok[None, :], qk * qk_scale, float("-inf"))
        m_new = tl.maximum(m, tl.max(qk, axis=1))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(qk - m_new[:, None])
        l = l * alpha + tl.sum(w, axis=1)
        if F32_DOT:
            acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype).to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(w.to(v.dtype), v)
        m = m_new
    o = acc / tl.where(l > 0.0, l, 1.0)[:, None]  # ctx 0: acc = 0, so zeros
    tl.store(o_ptr + b.to(tl.int64) * sob + h[:, None] * soh + d[None, :] * sod, o.to(o_ptr.dtype.element_ty),
             mask=h_ok[:, None] & d_ok[None, :])


_FUNCS = {"shrink": _lora_shrink_kernel, "expand": _lora_expand_kernel, "decode": _paged_decode_kernel}
_JITTED: dict[str, Any] = {}


def _require_triton() -> None:
    if triton is None:
        raise RuntimeError("opentinker.engine.model.triton_ops needs the `triton` package, which is not "
                           "installed; use the torch paths (or the *_ref functions) instead")


def _kernel(name: str) -> Any:
    """The kernel ``name`` wrapped (once) in Triton's mode: interpreted or JIT-compiled."""
    _require_triton()
    if name not in _JITTED:
        if _interpreted():
            from triton.runtime.interpreter import InterpretedFunction

            _JITTED[name] = InterpretedFunction(_FUNCS[name])
        else:
            _JITTED[name] = JITFunction(_FUNCS[name])
    return _JITTED[name]


def _check_device(*ts: torch.Tensor) -> None:
    _require_triton()
    device = ts[0].device
    if not available(device):
        late = os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")
        raise RuntimeError(f"triton kernels need a CUDA device or Triton's interpreter (got {device}): "
                           + ("TRITON_INTERPRET=1 was set after triton was imported; set it before" if late
                              else "set TRITON_INTERPRET=1 before triton is imported"))
    if any(t.device != device for t in ts):
        raise ValueError("all tensors must be on one device")


def _pow2(n: int, lo: int = 16, hi: int | None = None) -> int:
    p = max(lo, 1 << max(n - 1, 0).bit_length())
    return p if hi is None else min(p, hi)


def _f32_dot(dtype: torch.dtype) -> bool:
    """Dots on fp32 operands with IEEE precision: for fp32 activations (the default would be
    TF32, ~1e-3 relative error), and in the interpreter, whose ``tl.dot`` mishandles 16-bit
    operands (triton 3.9): there operands are rounded to the activation dtype first, so the
    products are those of the GPU's 16-bit MMA."""
    return dtype not in (torch.float16, torch.bfloat16) or _interpreted()


# ------------------------------------------------------------------------------------ LoRA


def lora_shrink(x_N_Din: torch.Tensor, A_S_R_Din: torch.Tensor, slot_N: torch.Tensor, scale_S: torch.Tensor,
                out_N_R: torch.Tensor | None = None) -> torch.Tensor:
    """``u[n] = scale_S[s] * x[n] @ A[s].T`` for ``s = slot_N[n] >= 0``; rows of slot -1 are zero.

    ``x_N_Din``: activations (bf16/fp16/fp32, any strides); ``A_S_R_Din``: a slot store's A
    (``R`` = G*rank for an input group of G projections; fp32, any strides, read in place);
    ``slot_N``: int32/int64 (-1: no adapter); ``scale_S``: each slot's alpha / r (float). Returns ``u_N_R``
    float32 (into ``out_N_R`` when given: ``[N, R]`` float32, any strides). One launch."""
    _check_device(x_N_Din, A_S_R_Din, slot_N, scale_S)
    N, Din = x_N_Din.shape
    S, R, Din_a = A_S_R_Din.shape
    if Din_a != Din or tuple(slot_N.shape) != (N,) or scale_S.shape[0] != S:
        raise ValueError(f"shapes: x {tuple(x_N_Din.shape)}, A {tuple(A_S_R_Din.shape)}, slot "
                         f"{tuple(slot_N.shape)}, scale {tuple(scale_S.shape)}")
    if out_N_R is None:
        out_N_R = torch.empty(N, R, dtype=torch.float32, device=x_N_Din.device)
    elif tuple(out_N_R.shape) != (N, R) or out_N_R.dtype != torch.float32:
        raise ValueError(f"out must be float32 [{N}, {R}], got {out_N_R.dtype} {tuple(out_N_R.shape)}")
    if N == 0:
        return out_N_R
    slot_N, scale_S = slot_N.contiguous(), scale_S.contiguous()  # no-ops as the engine builds them
    BLOCK_N, BLOCK_R, BLOCK_K = 16, _pow2(R, hi=64), _pow2(Din, hi=64)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(R, BLOCK_R))
    _kernel("shrink")[grid](
        x_N_Din, A_S_R_Din, slot_N, scale_S, out_N_R, N, R, Din,
        *x_N_Din.stride(), *A_S_R_Din.stride(), *out_N_R.stride(),
        BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, BLOCK_K=BLOCK_K, F32_DOT=_f32_dot(x_N_Din.dtype))
    return out_N_R


def lora_expand_(y_N_Dout: torch.Tensor, u_N_R: torch.Tensor, B_S_Dout_R: torch.Tensor,
                 slot_N: torch.Tensor) -> torch.Tensor:
    """In place ``y[n] += u[n] @ B[s].T`` for ``s = slot_N[n] >= 0`` (summed in fp32, rounded
    once to y's dtype); rows of slot -1 are untouched. Returns ``y_N_Dout``.

    ``u_N_R``: :func:`lora_shrink`'s output or a column slice of it (``u[:, j*R:(j+1)*R]`` for
    projection j of a group), any strides; ``B_S_Dout_R``: a slot store's B (fp32, read in
    place); ``y_N_Dout``: any strides (e.g. a column block of a fused qkv output). One launch."""
    _check_device(y_N_Dout, u_N_R, B_S_Dout_R, slot_N)
    N, Dout = y_N_Dout.shape
    S, Dout_b, R = B_S_Dout_R.shape
    if tuple(u_N_R.shape) != (N, R) or Dout_b != Dout or tuple(slot_N.shape) != (N,):
        raise ValueError(f"shapes: y {tuple(y_N_Dout.shape)}, u {tuple(u_N_R.shape)}, B "
                         f"{tuple(B_S_Dout_R.shape)}, slot {tuple(slot_N.shape)}")
    if N == 0:
        return y_N_Dout
    slot_N = slot_N.contiguous()
    BLOCK_N, BLOCK_R, BLOCK_D = 16, _pow2(R), _pow2(Dout, hi=64)
    grid = (triton.cdiv(N, BLOCK_N), triton.cdiv(Dout, BLOCK_D))
    _kernel("expand")[grid](
        y_N_Dout, u_N_R, B_S_Dout_R, slot_N, N, R, Dout,
        *y_N_Dout.stride(), *u_N_R.stride(), *B_S_Dout_R.stride(),
        BLOCK_N=BLOCK_N, BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, F32_DOT=_f32_dot(y_N_Dout.dtype))
    return y_N_Dout


def lora_shrink_ref(x_N_Din: torch.Tensor, A_S_R_Din: torch.Tensor, slot_N: torch.Tensor,
                    scale_S: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`lora_shrink`, in fp32: ``u_N_R``."""
    u = torch.zeros(x_N_Din.shape[0], A_S_R_Din.shape[1], dtype=torch.float32, device=x_N_Din.device)
    rows = (slot_N >= 0).nonzero().squeeze(1)
    s = slot_N[rows].long()
    xA = torch.einsum("nd,nrd->nr", x_N_Din[rows].float(), A_S_R_Din[s].float())
    u[rows] = scale_S[s].float()[:, None] * xA
    return u


def lora_expand_ref(y_N_Dout: torch.Tensor, u_N_R: torch.Tensor, B_S_Dout_R: torch.Tensor,
                    slot_N: torch.Tensor) -> torch.Tensor:
    """Torch reference of :func:`lora_expand_` (in place on ``y_N_Dout``, which it returns)."""
    rows = (slot_N >= 0).nonzero().squeeze(1)
    s = slot_N[rows].long()
    uB = torch.einsum("nr,ndr->nd", u_N_R[rows].float(), B_S_Dout_R[s].float())
    y_N_Dout[rows] = (y_N_Dout[rows].float() + uB).to(y_N_Dout.dtype)
    return y_N_Dout


# ------------------------------------------------------------------------------------ attention


def paged_decode_attention(q_B_Hq_D: torch.Tensor, k_pool_S_Hkv_D: torch.Tensor, v_pool_S_Hkv_D: torch.Tensor,
                           block_table_B_M: torch.Tensor, ctx_len_B: torch.Tensor, block_size: int,
                           sm_scale: float, out: torch.Tensor | None = None, *, block_t: int = 64) -> torch.Tensor:
    """One query token per row over its paged context: ``o_B_Hq_D`` in q's dtype.

    Row b attends to its first ``ctx_len_B[b]`` positions (int32; 0: the row's output is zeros);
    position p is in pool slot ``block_table_B_M[b, p // block_size] * block_size + p %
    block_size`` (int32; entries past the context are never read). Query head h reads KV head
    ``h // (Hq // Hkv)``. ``out``: an optional ``[B, Hq, D]`` output (any strides). ``block_t``:
    positions per tile (a power of two >= 16). One launch, grid ``(B, Hkv)``, no host sync:
    CUDA-graph capturable."""
    _check_device(q_B_Hq_D, k_pool_S_Hkv_D, v_pool_S_Hkv_D, block_table_B_M, ctx_len_B)
    B, Hq, D = q_B_Hq_D.shape
    _, Hkv, Dk = k_pool_S_Hkv_D.shape
    if (Dk != D or v_pool_S_Hkv_D.shape != k_pool_S_Hkv_D.shape or Hq % Hkv or block_table_B_M.shape[0] != B
            or tuple(ctx_len_B.shape) != (B,)):
        raise ValueError(f"shapes: q {tuple(q_B_Hq_D.shape)}, k/v pool {tuple(k_pool_S_Hkv_D.shape)}/"
                         f"{tuple(v_pool_S_Hkv_D.shape)}, block table {tuple(block_table_B_M.shape)}, "
                         f"ctx_len {tuple(ctx_len_B.shape)} (Hq must be a multiple of Hkv)")
    if block_t < 16 or block_t & (block_t - 1):
        raise ValueError(f"block_t must be a power of two >= 16, got {block_t}")
    if out is None:
        out = torch.empty_like(q_B_Hq_D)
    elif tuple(out.shape) != (B, Hq, D):
        raise ValueError(f"out must be [{B}, {Hq}, {D}], got {tuple(out.shape)}")
    if B == 0:
        return out
    group, ctx_len_B = Hq // Hkv, ctx_len_B.contiguous()
    _kernel("decode")[(B, Hkv)](
        q_B_Hq_D, k_pool_S_Hkv_D, v_pool_S_Hkv_D, block_table_B_M, ctx_len_B, out, float(sm_scale), Hq, Hkv, D,
        *q_B_Hq_D.stride(), *k_pool_S_Hkv_D.stride(), *v_pool_S_Hkv_D.stride(), *block_table_B_M.stride(),
        *out.stride(), GROUP=group, BLOCK_H=_pow2(group), BLOCK_D=_pow2(D), BLOCK_T=block_t,
        BLOCK_SIZE=block_size, F32_DOT=_f32_dot(k_pool_S_Hkv_D.dtype))
    return out


def paged_decode_attention_ref(q_B_Hq_D: torch.Tensor, k_pool_S_Hkv_D: torch.Tensor, v_pool_S_Hkv_D: torch.Tensor,
                               block_table_B_M: torch.Tensor, ctx_len_B: torch.Tensor, block_size: int,
                               sm_scale: float) -> torch.Tensor:
    """Torch reference of :func:`paged_decode_attention` (fp32 softmax; a loop over rows that
    reads ``ctx_len_B`` on the host, so not graph-capturable)."""
    B, Hq, D = q_B_Hq_D.shape
    Hkv = k_pool_S_Hkv_D.shape[1]
    out = torch.zeros(B, Hq, D, dtype=torch.float32, device=q_B_Hq_D.device)
    for b in range(B):
        L = int(ctx_len_B[b])
        if L == 0:
            continue
        p = torch.arange(L, device=q_B_Hq_D.device)
        slots = block_table_B_M[b, p // block_size].long() * block_size + p % block_size
        k = k_pool_S_Hkv_D[slots].float().repeat_interleave(Hq // Hkv, dim=1)  # [L, Hq, D]
        v = v_pool_S_Hkv_D[slots].float().repeat_interleave(Hq // Hkv, dim=1)
        w = torch.softmax(torch.einsum("hd,lhd->hl", q_B_Hq_D[b].float(), k) * sm_scale, dim=-1)
        out[b] = torch.einsum("hl,lhd->hd", w, v)
    return out.to(q_B_Hq_D.dtype)
