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
* :class:`~.paged_step.StepAttention` is for serving (the engine's steps): K/V live in a slot
  pool per layer, each row's context is read through its block table; see
  :mod:`.paged_step`.

Hazards:
* A query that may see nothing (a left-pad token, a fully padded row) would make SDPA return
  NaN, and NaN poisons gradients even where the loss masks it out. Every query may therefore
  see its own cache index (dense) or the whole real context (paged pad queries); real tokens
  are unaffected because they always see themselves. (torch 2.13's CPU SDPA already returns 0
  for an all-masked row; the guard keeps every backend and kernel finite.)
* StepAttention writes into the pools in place: run it under ``torch.no_grad()`` or
  ``torch.inference_mode()`` (it refuses inputs that require grad), else each step's graph
  would hang off the pools.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Protocol

import torch
import torch.nn.functional as F

__all__ = ["DenseAttention", "DenseCache", "Attention"]


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
