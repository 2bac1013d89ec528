"""The fused Gumbel-max of :mod:`opentinker.engine.sampling` as one Triton kernel (CUDA; CPU
only under ``TRITON_INTERPRET=1``, for tests): per (row, chunk of columns) the hash of (row
key, vocabulary id), the uniform, the Gumbel noise, the first argmax of ``kept + g`` and the
log-sum-exp of ``logits / T``; the chunks are combined by an ``argmax``, a ``gather`` and a
``logsumexp``. It is written to give the torch CUDA path's bits (see the sampling module's
docstring); the module imports without triton.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the module imports without triton; CUDA then takes the torch path
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

__all__ = ["_gumbel_max_fused"]

_CHUNK = 1 << 13
"""Vocabulary columns per program of the fused kernel (a multiple of ``_BLOCK``)."""
_BLOCK = 1 << 10
"""Columns per loop step of a fused-kernel program."""


def _gumbel_max_kernel(logits_ptr, kept_ptr, temp_ptr, key_ptr, best_ptr, arg_ptr, lse_ptr,
                       V, CHUNK, slb, slv, skb, skv,
                       KEPT: tl.constexpr, BLOCK: tl.constexpr, LIBDEVICE: tl.constexpr):
    """Program (row b, chunk s): over columns ``[s * CHUNK, (s + 1) * CHUNK)``, the first
    argmax of ``kept - log(-log(u))`` (``kept`` = ``logits / T`` unless KEPT) and the
    log-sum-exp of ``logits / T``; written to ``[b, s]`` of best/arg/lse."""
    b = tl.program_id(0)
    s = tl.program_id(1)
    row = b.to(tl.int64)
    temp = tl.load(temp_ptr + b)
    key = tl.load(key_ptr + b).to(tl.uint32)  # the torch row key (a uint32 in an int64)
    lanes = tl.arange(0, BLOCK)
    start = s * CHUNK
    best_v = tl.full([BLOCK], float("-inf"), tl.float32)
    best_i = start + lanes  # a lane that only sees -inf keeps its first column
    max_l = tl.full([BLOCK], float("-inf"), tl.float32)
    sum_l = tl.zeros([BLOCK], tl.float32)  # per lane: sum of exp(x - max_l) (online)
    for c0 in range(start, start + CHUNK, BLOCK):
        cols = c0 + lanes
        ok = cols < V
        col = cols.to(tl.int64)
        x = tl.load(logits_ptr + row * slb + col * slv, mask=ok, other=float("-inf"))
        x = tl.math.div_rn(x.to(tl.float32), temp)
        new_l = tl.maximum(max_l, x)
        ref_l = tl.where((new_l == float("-inf")) | (new_l == float("inf")), 0.0, new_l)
        sum_l = sum_l * tl.exp(max_l - ref_l) + tl.exp(x - ref_l)
        max_l = new_l
        # lowbias32 of (v ^ salt 4), then of (row key ^ that): _vocab_keys and _mix32_
        h = cols.to(tl.uint32) ^ 0x165667B1
        h = (h ^ (h >> 16)) * 0x7FEB352D
        h = (h ^ (h >> 15)) * 0x846CA68B
        h = h ^ (h >> 16)
        h = key ^ h
        h = (h ^ (h >> 16)) * 0x7FEB352D
        h = (h ^ (h >> 15)) * 0x846CA68B
        h = h ^ (h >> 16)
        u = ((h >> 8) | 1).to(tl.float32) * 5.9604644775390625e-08  # (2m + 1) / 2**24, exact
        if LIBDEVICE:
            t = libdevice.log(-libdevice.log(u))
        else:  # the interpreter (numpy's log)
            t = tl.log(-tl.log(u))
        if KEPT:
            y = tl.load(kept_ptr + row * skb + col * skv, mask=ok, other=float("-inf"))
        else:
            y = x
        y = y - t
        y = tl.where(y != y, float("inf"), y)
        better = y > best_v  # strict: an earlier column keeps a tie
        best_v = tl.where(better, y, best_v)
        best_i = tl.where(better, cols, best_i)
    top = tl.max(best_v, axis=0)
    arg = tl.min(tl.where(best_v == top, best_i, 2147483647), axis=0)
    mx = tl.max(max_l, axis=0)
    ref = tl.where((mx == float("-inf")) | (mx == float("inf")), 0.0, mx)
    lse = ref + tl.log(tl.sum(sum_l * tl.exp(max_l - ref), axis=0))
    out = row * tl.num_programs(1) + s
    tl.store(best_ptr + out, top)
    tl.store(arg_ptr + out, arg.to(tl.int64))
    tl.store(lse_ptr + out, lse)


if triton is not None:
    try:
        from triton.language.extra import libdevice
    except ImportError:  # pragma: no cover - older Triton
        from triton.language.extra.cuda import libdevice  # type: ignore[no-redef]


def _interpret() -> bool:
    """``TRITON_INTERPRET=1``: Triton runs kernels in numpy (it must be set before triton is
    imported: its own jitted helpers, ``tl.max`` and the like, fix their mode then)."""
    return bool(triton is not None and triton.knobs.runtime.interpret)


@functools.cache
def _kernel() -> Any:
    """:func:`_gumbel_max_kernel`, jitted at first use (not at import)."""
    return triton.jit(_gumbel_max_kernel)


def _gumbel_max_fused(logits_B_V: torch.Tensor, temperature_B: torch.Tensor,
                      keys_B: torch.Tensor, kept_B_V: torch.Tensor | None
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_gumbel_max_torch` as one Triton launch over (row, chunk of ``_CHUNK`` columns),
    plus an ``argmax``, a ``gather`` and a ``logsumexp`` over the chunks. CUDA, or CPU under
    ``TRITON_INTERPRET=1`` (tests)."""
    B, V = logits_B_V.shape
    S = -(-V // _CHUNK)
    best_B_S = torch.empty(B, S, dtype=torch.float32, device=logits_B_V.device)
    arg_B_S = torch.empty(B, S, dtype=torch.int64, device=logits_B_V.device)
    lse_B_S = torch.empty(B, S, dtype=torch.float32, device=logits_B_V.device)
    kept = logits_B_V if kept_B_V is None else kept_B_V  # unread unless KEPT
    if B > 0:
        _kernel()[(B, S)](
            logits_B_V, kept, temperature_B.contiguous(), keys_B.contiguous(), best_B_S, arg_B_S,
            lse_B_S, V, _CHUNK, *logits_B_V.stride(), *kept.stride(), KEPT=kept_B_V is not None,
            BLOCK=_BLOCK, LIBDEVICE=not _interpret(),
            enable_fp_fusion=False, enable_reflect_ftz=False)  # as nvcc builds torch's log
    chunk_B1 = best_B_S.argmax(dim=1, keepdim=True)  # first chunk on ties
    return arg_B_S.gather(1, chunk_B1)[:, 0], torch.logsumexp(lse_B_S, dim=1)


