"""Attention backends for the engine's decoder: one interface, two memory layouts.

Every backend is a callable ``attn(layer_idx, q_N_Hq_D, k_N_Hkv_D, v_N_Hkv_D) -> o_N_Hq_D`` on
FLAT tokens (N tokens of all rows concatenated; q and k already rotated). A backend object lives
for one forward: whatever depends only on the batch's shape (masks, gather indices) is built
once in it and shared by all layers.

* :class:`DenseAttention` is for the trainer: a padded batch ``[B, L]`` flattened row-major,
  optionally continuing a :class:`DenseCache` of past K/V ``[B, Hkv, P, D]`` per layer. Its mask
  follows Hugging Face's: query i of the new tokens (cache index P + i) sees cache index j iff
  ``j <= P + i`` and ``attention_mask[b, j] == 1``. Causality is by cache index, not by position
  id, exactly as transformers does, so rows may be left- or right-padded, or have pad holes
  between a padded context and its continuation. The cache keeps the autograd graph: a prefix
  computed with grad and reused (``reorder_cache``/``index_select``) by several continuations
  gets the sum of their gradients.
* :class:`PagedAttention` is for serving: K/V live in a slot pool per layer (``[S, Hkv, D]``,
  slot = block * block_size + offset). Each forward writes the new tokens' K/V into their slots,
  then gathers every row's context with one ``index_select`` per layer over a flat slot list
  (decode rows and prefill rows in separate padded groups, so a decode row is not padded to a
  prefill chunk's length) and runs SDPA with a boolean mask. :class:`PagedLayout` holds all the
  indices, built once per forward. Shortcuts, all decided there: a group whose queries are the
  flat tokens in order (a pure decode step; a prefill of equal chunks) reads q and returns o
  as they are (no gather, no zero-filled output, no scatter); a mask that hides nothing (decode
  rows of one context length) is dropped and one that is plain causal (a fresh prefill of
  equal rows) becomes ``is_causal``; and a decode group folds the query heads that share a KV
  head into SDPA's query axis (``[G, Hkv, Hq/Hkv, D]``), so each KV head is read once (12% off
  SDPA at SmolLM2's 9 on 3 heads).

Hazards:
* A query that may see nothing (a left-pad token, a fully padded row) would make SDPA return
  NaN, and NaN poisons gradients even where the loss masks it out. Every query may therefore
  see its own cache index (dense) or the whole real context (paged pad queries); real tokens
  are unaffected because they always see themselves. (torch 2.13's CPU SDPA already returns 0
  for an all-masked row; the guard keeps every backend and kernel finite.)
* PagedAttention writes into the pools in place: run it under ``torch.no_grad()`` or
  ``torch.inference_mode()`` (it refuses inputs that require grad), else each step's graph
  would hang off the pools.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["DenseAttention", "DenseCache", "PagedAttention", "PagedLayout", "Attention"]


class Attention(Protocol):
    """The backend interface the decoder calls once per layer."""

    def __call__(self, layer_idx: int, q_N_Hq_D: torch.Tensor, k_N_Hkv_D: torch.Tensor,
                 v_N_Hkv_D: torch.Tensor) -> torch.Tensor:
        """Attention output ``o_N_Hq_D`` for the N flat query tokens."""
        ...


def _sdpa(q_B_Hq_L_D: torch.Tensor, k_B_Hkv_T_D: torch.Tensor, v_B_Hkv_T_D: torch.Tensor,
          mask_B_1_L_T: torch.Tensor | None, is_causal: bool = False) -> torch.Tensor:
    gqa = q_B_Hq_L_D.shape[1] != k_B_Hkv_T_D.shape[1]
    return F.scaled_dot_product_attention(
        q_B_Hq_L_D, k_B_Hkv_T_D, v_B_Hkv_T_D, attn_mask=mask_B_1_L_T, is_causal=is_causal, enable_gqa=gqa
    )


class DenseCache:
    """Per-layer past keys and values ``(k_B_Hkv_P_D, v_B_Hkv_P_D)``, the shape of HF's
    DynamicCache as the trainer's shared-prefix code uses it. Index ops keep autograd."""

    def __init__(self, layers: Sequence[tuple[torch.Tensor, torch.Tensor]] = ()) -> None:
        """From a list of per-layer ``(k_B_Hkv_P_D, v_B_Hkv_P_D)``."""
        self.layers: list[tuple[torch.Tensor, torch.Tensor]] = [(k, v) for k, v in layers]

    def __len__(self) -> int:
        return len(self.layers)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        return iter(self.layers)

    def __getitem__(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.layers[layer_idx]

    @property
    def batch_size(self) -> int:
        """B, the number of rows."""
        return self.layers[0][0].shape[0] if self.layers else 0

    @property
    def length(self) -> int:
        """P, the number of cached positions (pads included)."""
        return self.layers[0][0].shape[2] if self.layers else 0

    def reorder_cache(self, index_B: torch.Tensor) -> None:
        """In place: row b becomes old row ``index_B[b]`` (rows may repeat: one prefix, many
        continuations)."""
        self.layers = [(k.index_select(0, index_B), v.index_select(0, index_B)) for k, v in self.layers]

    def index_select(self, index: torch.Tensor) -> DenseCache:
        """A new cache of the rows ``index`` (the original is unchanged)."""
        return DenseCache([(k.index_select(0, index), v.index_select(0, index)) for k, v in self.layers])


class DenseAttention(Attention):
    """Attention over a padded batch ``[B, L]`` flattened row-major (N = B * L), continuing an
    optional :class:`DenseCache`. After the forward, :attr:`cache` holds every layer's
    ``(k, v)`` of shape ``[B, Hkv, P + L, D]`` (past then new)."""

    def __init__(self, batch_size: int, length: int, attention_mask_B_T: torch.Tensor | None = None,
                 past: DenseCache | None = None) -> None:
        """``attention_mask_B_T`` (T = P + L; 1 = real token) as HF's ``attention_mask``; None
        means every position is real."""
        self.B, self.L = batch_size, length
        self.past = past if past is not None and len(past) else None
        self.P = self.past.length if self.past is not None else 0
        if self.past is not None and self.past.batch_size != batch_size:
            raise ValueError(f"past cache has {self.past.batch_size} rows, batch has {batch_size}")
        if attention_mask_B_T is not None and tuple(attention_mask_B_T.shape) != (batch_size, self.P + length):
            raise ValueError(f"attention mask {tuple(attention_mask_B_T.shape)} != (B, P + L) = "
                             f"({batch_size}, {self.P + length})")
        self.attention_mask_B_T = attention_mask_B_T
        self._mask_B_1_L_T: torch.Tensor | None = None
        self.cache = DenseCache()

    def _mask(self, device: torch.device) -> torch.Tensor:
        if self._mask_B_1_L_T is None:
            T = self.P + self.L
            i_L = torch.arange(self.L, device=device)[:, None] + self.P
            j_T = torch.arange(T, device=device)[None, :]
            causal_L_T = j_T <= i_L
            mask = causal_L_T[None].expand(self.B, self.L, T)
            if self.attention_mask_B_T is not None:
                mask = mask & self.attention_mask_B_T.to(device=device, dtype=torch.bool)[:, None, :]
            # Every query sees its own cache index: no all-masked row, hence no NaN (see module doc).
            mask = mask | (j_T == i_L)[None]
            self._mask_B_1_L_T = mask[:, None]
        return self._mask_B_1_L_T

    def __call__(self, layer_idx: int, q_N_Hq_D: torch.Tensor, k_N_Hkv_D: torch.Tensor,
                 v_N_Hkv_D: torch.Tensor) -> torch.Tensor:
        """Output ``o_N_Hq_D``; stores the layer's ``(k, v)`` in :attr:`cache`."""
        B, L = self.B, self.L
        _, Hq, D = q_N_Hq_D.shape
        q = q_N_Hq_D.view(B, L, Hq, D).transpose(1, 2)
        k = k_N_Hkv_D.view(B, L, -1, D).transpose(1, 2)
        v = v_N_Hkv_D.view(B, L, -1, D).transpose(1, 2)
        if self.past is not None:
            pk, pv = self.past[layer_idx]
            k, v = torch.cat([pk, k], 2), torch.cat([pv, v], 2)
        while len(self.cache.layers) <= layer_idx:
            self.cache.layers.append((k, v))
        self.cache.layers[layer_idx] = (k, v)
        if self.attention_mask_B_T is None and self.P == 0:
            o = _sdpa(q, k, v, None, is_causal=True)
        else:
            o = _sdpa(q, k, v, self._mask(q.device))
        return o.transpose(1, 2).reshape(B * L, Hq, D)


@dataclasses.dataclass(frozen=True)
class _Group:
    """Rows attended together, padded to the group's longest query run and context."""

    q_index_GL: torch.Tensor
    """Flat index of each (row, query) pair, ``[G * Lg]`` (pad queries point at token 0)."""
    valid_GL: torch.Tensor
    """Which of the ``G * Lg`` pairs are real queries (bool)."""
    dst_V: torch.Tensor
    """Flat token index of each real query, in ``valid_GL`` order."""
    mask_G_1_L_C: torch.Tensor
    G: int
    Lg: int
    Cg: int
    ctx_offset: int
    """Where this group's slots start in :attr:`PagedLayout.ctx_slots_flat`."""
    in_order: bool = False
    """The group's ``G * Lg`` query slots are flat tokens ``0 .. N-1`` in order, no padding
    (the only group: a pure decode step, or equal prefill chunks): no gather or scatter of q/o."""
    sdpa_mask: torch.Tensor | None = None
    """The mask SDPA gets: ``mask_G_1_L_C``, or None where it hides nothing (every decode row's
    context is ``Cg`` long) or is plain causal (``causal``)."""
    causal: bool = False


class PagedLayout:
    """Everything one paged forward needs that does not depend on the layer: where to write
    the new K/V, which slots hold each row's context, and the masks. Build it once per step."""

    def __init__(self, slot_mapping_N: torch.Tensor, q_start_B: Sequence[int] | torch.Tensor,
                 q_len_B: Sequence[int] | torch.Tensor, ctx_len_B: Sequence[int] | torch.Tensor,
                 ctx_slots_B_C: torch.Tensor) -> None:
        """``slot_mapping_N``: int64 slot of each new token (-1: not written, e.g. a padding
        token outside every row). Row b's queries are flat tokens ``q_start_B[b] ..
        q_start_B[b] + q_len_B[b] - 1``, at absolute positions ``ctx_len_B[b] - q_len_B[b] ..
        ctx_len_B[b] - 1``; its context (cached + new) is ``ctx_slots_B_C[b, :ctx_len_B[b]]``
        (the rest is padding, any value)."""
        device = ctx_slots_B_C.device
        self.N = int(slot_mapping_N.shape[0])
        slot_mapping_N = slot_mapping_N.to(device=device, dtype=torch.long)
        write = slot_mapping_N >= 0
        if bool(write.all()):
            self.write_rows: torch.Tensor | None = None
            self.write_slots = slot_mapping_N
        else:
            self.write_rows = write.nonzero().squeeze(1)
            self.write_slots = slot_mapping_N[self.write_rows]
        q_start = torch.as_tensor(q_start_B, dtype=torch.long).cpu()
        q_len = torch.as_tensor(q_len_B, dtype=torch.long).cpu()
        ctx_len = torch.as_tensor(ctx_len_B, dtype=torch.long).cpu()
        if bool((q_len < 1).any()) or bool((ctx_len < q_len).any()):
            raise ValueError("every row needs q_len >= 1 and ctx_len >= q_len")
        groups: list[_Group] = []
        slot_parts: list[torch.Tensor] = []
        offset = 0
        # Decode rows (one query) and prefill chunks are separate padded groups; building them
        # is the only per-forward Python work, and it loops over the two groups, not over rows.
        for rows in ((q_len == 1).nonzero().squeeze(1), (q_len > 1).nonzero().squeeze(1)):
            if rows.numel() == 0:
                continue
            G = int(rows.numel())
            ql, cl, qs = q_len[rows], ctx_len[rows], q_start[rows]
            Lg, Cg = int(ql.max()), int(cl.max())
            i_L = torch.arange(Lg)
            valid_G_L = i_L[None] < ql[:, None]
            q_index_G_L = torch.where(valid_G_L, qs[:, None] + i_L[None], 0)
            pos_G_L = (cl - ql)[:, None] + i_L[None]
            j_C = torch.arange(Cg)
            # Pad queries (i >= q_len) sit at positions >= ctx_len, so they see the whole real
            # context (never an empty row); pad slots (j >= ctx_len) are never seen.
            mask = (j_C[None, None] <= pos_G_L[:, :, None]) & (j_C[None, None] < cl[:, None, None])
            slots = ctx_slots_B_C[rows.to(device), :Cg].to(torch.long)
            slots = torch.where(j_C.to(device)[None] < cl.to(device)[:, None], slots, 0)
            slot_parts.append(slots.reshape(-1))
            no_pad_q = bool((ql == Lg).all())
            full = no_pad_q and bool((cl == Cg).all())  # no pad query, no pad slot
            in_order = no_pad_q and G * Lg == self.N and bool((q_index_G_L.reshape(-1) == torch.arange(self.N)).all())
            causal = full and Lg == Cg and Lg > 1  # a fresh prefill: the mask is exactly causal
            mask_G_1_L_C = mask[:, None].to(device)
            groups.append(_Group(
                q_index_GL=q_index_G_L.reshape(-1).to(device),
                valid_GL=valid_G_L.reshape(-1).to(device),
                dst_V=q_index_G_L[valid_G_L].to(device),
                mask_G_1_L_C=mask_G_1_L_C,
                G=G, Lg=Lg, Cg=Cg, ctx_offset=offset, in_order=in_order,
                sdpa_mask=None if causal or (full and Lg == 1) else mask_G_1_L_C, causal=causal,
            ))
            offset += G * Cg
        self.groups = groups
        self.ctx_slots_flat = torch.cat(slot_parts)


class PagedAttention(Attention):
    """Attention over K/V slot pools ``k_pool[layer]``, ``v_pool[layer]`` of shape
    ``[S, Hkv, D]``, for the rows described by a :class:`PagedLayout`. Inference only."""

    def __init__(self, k_pool: Sequence[torch.Tensor], v_pool: Sequence[torch.Tensor], layout: PagedLayout) -> None:
        self.k_pool, self.v_pool, self.layout = k_pool, v_pool, layout

    def __call__(self, layer_idx: int, q_N_Hq_D: torch.Tensor, k_N_Hkv_D: torch.Tensor,
                 v_N_Hkv_D: torch.Tensor) -> torch.Tensor:
        """Writes the new ``k``/``v`` into their slots, then returns ``o_N_Hq_D``."""
        if torch.is_grad_enabled() and (k_N_Hkv_D.requires_grad or q_N_Hq_D.requires_grad):
            raise RuntimeError("PagedAttention is inference-only: run it under torch.no_grad()")
        lay = self.layout
        kp, vp = self.k_pool[layer_idx], self.v_pool[layer_idx]
        k_new, v_new = k_N_Hkv_D, v_N_Hkv_D
        if lay.write_rows is not None:
            k_new, v_new = k_new.index_select(0, lay.write_rows), v_new.index_select(0, lay.write_rows)
        kp.index_copy_(0, lay.write_slots, k_new.to(kp.dtype))
        vp.index_copy_(0, lay.write_slots, v_new.to(vp.dtype))
        # One gather per pool for every row of every group.
        k_all = kp.index_select(0, lay.ctx_slots_flat)
        v_all = vp.index_select(0, lay.ctx_slots_flat)
        N, Hq, D = q_N_Hq_D.shape
        Hkv = kp.shape[1]
        out_N_Hq_D: torch.Tensor | None = None
        for g in lay.groups:
            q = q_N_Hq_D if g.in_order else q_N_Hq_D.index_select(0, g.q_index_GL)
            span = slice(g.ctx_offset, g.ctx_offset + g.G * g.Cg)
            k = k_all[span].view(g.G, g.Cg, Hkv, D).transpose(1, 2).to(q.dtype)
            v = v_all[span].view(g.G, g.Cg, Hkv, D).transpose(1, 2).to(q.dtype)
            if g.Lg == 1 and Hq % Hkv == 0:
                # One query per row: fold the Hq / Hkv query heads that share a KV head into
                # SDPA's query axis (head h uses KV head h // (Hq / Hkv), as transformers'
                # repeat_kv), so each KV head is read once, not once per query head.
                o = _sdpa(q.reshape(g.G, Hkv, Hq // Hkv, D), k, v, g.sdpa_mask).reshape(g.G, Hq, D)
            else:
                o = _sdpa(q.reshape(g.G, g.Lg, Hq, D).transpose(1, 2), k, v, g.sdpa_mask, is_causal=g.causal)
                o = o.transpose(1, 2).reshape(g.G * g.Lg, Hq, D)
                if g.Lg > 1 and not g.in_order:
                    o = o[g.valid_GL]
            if g.in_order:
                return o
            if out_N_Hq_D is None:
                out_N_Hq_D = q_N_Hq_D.new_zeros(N, Hq, D)
            out_N_Hq_D.index_copy_(0, g.dst_V, o)
        assert out_N_Hq_D is not None
        return out_N_Hq_D
