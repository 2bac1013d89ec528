"""Paged attention for one engine step, reading every row's context through its block table.

K/V live in a slot pool per layer (``[S, Hkv, D]``, slot = block * block_size + offset; the
model runner's :class:`~opentinker.engine.kv_cache.KVPool`). Each forward writes its new
tokens' K/V into their slots (one ``index_copy_`` per pool and layer), then attends:

* **decode rows** (one query each): one :func:`.ops.paged_decode` per layer. With triton (CUDA)
  the rows read their keys and values through the block table, block by block, with no gather
  of whole contexts; without (CPU), one ``index_select`` per pool gathers the contexts padded to
  the longest and SDPA runs with a padding mask, the query heads that share a KV head folded
  into SDPA's query axis (``[G, Hkv, Hq/Hkv, D]``), so each KV head is read once.
* **prefill chunks** (several queries): gathered and padded the same way, with a causal and
  padding mask (SDPA's ``is_causal`` for a fresh prefill of equal rows).

Everything that does not depend on the layer (the context slots of each row, the masks, the
query indices) is built once per forward in :class:`StepAttention`'s constructor, with a fixed
number of ops per group: the ops of a decode step do not depend on how many rows it has.

Hazards: the pools are written in place (run under ``torch.no_grad()``); a padded context entry
reads slot 0 at weight 0, which the pool keeps finite (zeroed at creation).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from . import ops
from .attention import Attention

__all__ = ["StepAttention"]


@dataclass
class _Group:
    """Rows attended together, padded to the group's longest query run and context."""

    G: int
    Lg: int
    Cg: int
    q_index_GL: torch.Tensor | None
    """Flat token of each (row, query) pair (pad queries read token 0); None: the flat tokens
    in order (a pure decode step, or equal fresh chunks)."""
    dst_V: torch.Tensor | None
    """Flat token of each real query (None with ``q_index_GL``)."""
    valid_GL: torch.Tensor | None
    """Which of the ``G * Lg`` pairs are real queries, as their indices."""
    slots_GC: torch.Tensor
    """Pool slot of each context entry (pad entries: slot 0): ``[G, Cg]`` for decode rows, flat
    for prefill chunks; empty under the triton decode kernel."""
    mask: torch.Tensor | None
    causal: bool
    block_table_GM: torch.Tensor | None = None
    ctx_len_G: torch.Tensor | None = None
    decode: bool = False


class StepAttention(Attention):
    """Attention over K/V slot pools for the rows of one engine step. Inference only."""

    def __init__(self, k_pool: Sequence[torch.Tensor], v_pool: Sequence[torch.Tensor], block_size: int,
                 slot_mapping_N: torch.Tensor, block_table_B_M: torch.Tensor, ctx_len_B: torch.Tensor,
                 q_len: np.ndarray, ctx_len: np.ndarray, triton: bool = False) -> None:
        """Row b's queries are the next ``q_len[b]`` flat tokens (rows in order), at positions
        ``ctx_len[b] - q_len[b] .. ctx_len[b] - 1``; its context is its first ``ctx_len[b]``
        positions, position p in slot ``block_table_B_M[b, p // block_size] * block_size + p %
        block_size``. ``slot_mapping_N``: the slot each new token's K/V is written to.
        ``q_len``/``ctx_len`` are host copies (int64 numpy) of what ``ctx_len_B`` holds on the
        device: they fix the shapes. ``triton``: decode rows read through the block table with
        the triton kernel (CUDA)."""
        self.k_pool, self.v_pool, self.bs = k_pool, v_pool, block_size
        self.slot_mapping_N = slot_mapping_N
        dev = slot_mapping_N.device
        q_len = np.asarray(q_len, dtype=np.int64)
        ctx_len = np.asarray(ctx_len, dtype=np.int64)
        if (q_len < 1).any() or (ctx_len < q_len).any():
            raise ValueError("every row needs q_len >= 1 and ctx_len >= q_len")
        q_start = np.concatenate(([0], np.cumsum(q_len)[:-1]))
        N = int(q_len.sum())
        self.groups: list[_Group] = []
        decode_rows = np.nonzero(q_len == 1)[0]
        prefill_rows = np.nonzero(q_len > 1)[0]
        for rows, is_decode in ((decode_rows, True), (prefill_rows, False)):
            G = len(rows)
            if G == 0:
                continue
            ql, cl, qs = q_len[rows], ctx_len[rows], q_start[rows]
            Lg, Cg = int(ql.max()), int(cl.max())
            whole = G == len(q_len)
            in_order = whole and bool((ql == Lg).all())
            rows_dev = None if whole else torch.from_numpy(rows).to(dev)
            bt = block_table_B_M if rows_dev is None else block_table_B_M.index_select(0, rows_dev)
            cl_dev = ctx_len_B if rows_dev is None else ctx_len_B.index_select(0, rows_dev)
            q_index = dst = valid = None
            if not in_order:
                i_L = np.arange(Lg)
                valid_np = i_L[None] < ql[:, None]
                q_idx_np = np.where(valid_np, qs[:, None] + i_L[None], 0).reshape(-1)
                q_index = torch.from_numpy(q_idx_np).to(dev)
                dst = torch.from_numpy(q_idx_np[valid_np.reshape(-1)]).to(dev)
                valid = torch.from_numpy(np.nonzero(valid_np.reshape(-1))[0]).to(dev)
            if is_decode and triton:
                empty = bt.new_empty(0)
                self.groups.append(_Group(G, Lg, Cg, q_index, dst, valid, empty, empty, False,
                                          block_table_GM=bt, ctx_len_G=cl_dev, decode=True))
                continue
            Mg = -(-Cg // block_size)
            j_C = torch.arange(Cg, device=dev)
            slots = (bt[:, :Mg].long()[:, :, None] * block_size + torch.arange(block_size, device=dev)).view(G, -1)
            inside = j_C[None] < cl_dev[:, None]
            slots = torch.where(inside, slots[:, :Cg], 0)
            causal = False
            if is_decode:  # [G, 1, 1, Cg]: the real context (None when it hides nothing: SDPA is faster)
                mask = inside[:, None, None]
                mask = None if bool((cl == Cg).all()) else mask
            elif bool((ql == cl).all()) and bool((cl == Cg).all()):
                mask, causal = None, True  # a fresh prefill of equal rows: exactly causal
            else:
                # Pad queries (i >= q_len) sit at positions >= ctx_len, so they see the whole real
                # context (never an empty row); pad slots (j >= ctx_len) are never seen.
                pos_GL = torch.from_numpy((cl - ql)[:, None] + np.arange(Lg)[None]).to(dev)
                mask = ((j_C[None, None] <= pos_GL[:, :, None]) & inside[:, None])[:, None]
            if is_decode:
                self.groups.append(_Group(G, Lg, Cg, q_index, dst, valid, slots, mask, False, bt, cl_dev, True))
            else:
                self.groups.append(_Group(G, Lg, Cg, q_index, dst, valid, slots.reshape(-1), mask, causal))
        self.N = N

    def __call__(self, layer_idx: int, q_N_Hq_D: torch.Tensor, k_N_Hkv_D: torch.Tensor,
                 v_N_Hkv_D: torch.Tensor) -> torch.Tensor:
        """Writes the new ``k``/``v`` into their slots, then returns ``o_N_Hq_D``."""
        if torch.is_grad_enabled() and (k_N_Hkv_D.requires_grad or q_N_Hq_D.requires_grad):
            raise RuntimeError("StepAttention is inference-only: run it under torch.no_grad()")
        kp, vp = self.k_pool[layer_idx], self.v_pool[layer_idx]
        kp.index_copy_(0, self.slot_mapping_N, k_N_Hkv_D.to(kp.dtype))
        vp.index_copy_(0, self.slot_mapping_N, v_N_Hkv_D.to(vp.dtype))
        N, Hq, D = q_N_Hq_D.shape
        Hkv = kp.shape[1]
        out: torch.Tensor | None = None
        for g in self.groups:
            q = q_N_Hq_D if g.q_index_GL is None else q_N_Hq_D.index_select(0, g.q_index_GL)
            if g.decode:
                o = ops.paged_decode(q, kp, vp, g.block_table_GM, g.ctx_len_G, g.slots_GC, g.mask, self.bs, D ** -0.5)
            else:
                k = kp.index_select(0, g.slots_GC).view(g.G, g.Cg, Hkv, D).transpose(1, 2).to(q.dtype)
                v = vp.index_select(0, g.slots_GC).view(g.G, g.Cg, Hkv, D).transpose(1, 2).to(q.dtype)
                o = F.scaled_dot_product_attention(q.reshape(g.G, g.Lg, Hq, D).transpose(1, 2), k, v,
                                                   attn_mask=g.mask, is_causal=g.causal, enable_gqa=Hq != Hkv)
                o = o.transpose(1, 2).reshape(g.G * g.Lg, Hq, D)
            if g.q_index_GL is None:
                return o
            if g.Lg > 1:
                o = o.index_select(0, g.valid_GL)
            if out is None:
                out = q_N_Hq_D.new_zeros(N, Hq, D)
            out.index_copy_(0, g.dst_V, o)
        assert out is not None
        return out
