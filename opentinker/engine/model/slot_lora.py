"""Batched LoRA for the engine's steps: every token's adapter read in place from the slot store
(:class:`~.lora_slots.LoraSlots`), with a fixed number of ops whatever the batch and however
many adapters share it.

The decoder calls ``apply(layer, module, x_N_in, y_N_out)`` after each base projection, as it
calls :class:`~.lora.LoraBatch` (the trainer's path, with gradients). Per LoRA layer that is
one :func:`.ops.lora_shrink` per input group (q/k/v and gate/up read x once) and one
:func:`.ops.lora_expand_` per projection: one op each to the dispatcher. Two layouts, chosen
per forward by the model runner:

* **per token** (CUDA with triton): ``u_N_GR = scale[slot_n] * x_n A[slot_n]^T`` over the
  group's stacked A ``[S, G*R, d_in]``, then ``y_n += u_n B[slot_n]^T``, reading the fp32
  masters where they live through a per-token slot index (punica's / vLLM's sgmv
  shrink-expand; :mod:`.triton_ops`): no gather, no cast copy, no per-adapter loop; a token
  with slot -1 (the bare base) adds nothing. Captured in the decode step's CUDA graph.
* **chunks** (CPU, or CUDA without triton): bgmv after punica: the tokens, grouped by slot
  (the runner orders rows by slot), form a ``[C, Lt, d]`` batch (each chunk of ``Lt`` tokens of
  one adapter; ``Lt`` chosen on the host by :func:`chunk_plan` so that short and long runs pad
  little), read as a view when the tokens are in order; per group ONE ``bmm`` by the chunks'
  A (a view of consecutive slots, else one ``index_select``), scaled, then per projection one
  ``bmm`` by B added back into y.

Both compute PEFT's ``lora_B(lora_A(x)) * alpha / r`` (no dropout) in x's dtype (chunks) or with
fp32 accumulation (triton): ``tests/test_triton_ops.py`` compares the kernels with
:class:`~.lora.LoraBatch`, ``tests/test_engine_ops.py`` the engine's draws on both layouts.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from . import ops
from .lora import chunk_length
from .lora_slots import LoraSlots

__all__ = ["ChunkPlan", "SlotLora", "chunk_plan"]

@dataclass(frozen=True)
class ChunkPlan:
    """Host-side layout of one forward's LoRA tokens for the torch backend."""

    index_T: np.ndarray
    """``int64[C * Lt]``: flat token of each entry of the ``[C, Lt]`` batch (-1: padding)."""
    chunk_slot_C: np.ndarray
    """``int64[C]``: the store slot of each chunk."""
    C: int
    Lt: int
    s0: int
    """The first chunk's slot when the chunks' slots are ``s0, s0 + 1, ...`` (read as a view),
    else -1."""
    in_order: bool = False
    """The entries are the flat tokens ``0 .. N-1`` in order, no padding (x and y as views)."""


def chunk_plan(token_slot_N: np.ndarray, rank: int) -> ChunkPlan:
    """Cut the tokens with a slot (>= 0; tokens of one slot contiguous) into chunks of ``Lt``.

    ``Lt`` is the longest slot's token count unless shorter chunks pad much less (a long
    prefill chunk beside decode rows). A batch with no LoRA token gets one chunk of one padding
    entry (slot 0, weight 0), so the op count stays the same."""
    has = token_slot_N >= 0
    if not has.any():
        return ChunkPlan(np.array([-1], dtype=np.int64), np.zeros(1, dtype=np.int64), 1, 1, 0)
    tok = np.nonzero(has)[0]
    slot = token_slot_N[tok]
    cut = np.nonzero(np.diff(slot))[0] + 1
    starts = np.concatenate(([0], cut))
    ends = np.concatenate((cut, [len(tok)]))
    n_k = ends - starts
    Lt = chunk_length(n_k.tolist(), rank)
    chunks_k = -(-n_k // Lt)
    C = int(chunks_k.sum())
    index = np.full(C * Lt, -1, dtype=np.int64)
    chunk_slot = np.repeat(slot[starts], chunks_k)
    offset = 0
    for s, e, c in zip(starts, ends, chunks_k):
        index[offset:offset + (e - s)] = tok[s:e]
        offset += int(c) * Lt
    s0 = int(chunk_slot[0])
    consecutive = bool((chunk_slot == s0 + np.arange(C)).all())
    in_order = len(index) == len(token_slot_N) and bool((index == np.arange(len(index))).all())
    return ChunkPlan(index, chunk_slot, C, Lt, s0 if consecutive else -1, in_order)


class SlotLora:
    """Which store slot each token of one forward uses, and the LoRA terms it adds: per LoRA
    layer one :func:`.ops.lora_shrink` per input group and one :func:`.ops.lora_expand_` per
    projection, whatever the rows and adapters."""

    def __init__(self, store: LoraSlots, scale: torch.Tensor, slot_N: torch.Tensor,
                 index_T: torch.Tensor, chunk_slot_C: torch.Tensor, s0: int = -1, Lt: int = 1,
                 in_order: bool = False) -> None:
        """Per token (triton): ``slot_N`` and ``scale`` = ``float32[S]``, ``index_T`` and
        ``chunk_slot_C`` empty. In chunks (composite): :class:`ChunkPlan`'s ``index_T``
        (clamped), ``chunk_slot_C``, ``s0``, ``Lt`` and ``scale`` = ``[C, Lt, 1]`` weights
        (see :mod:`.ops`)."""
        self.store, self.scale, self.slot_N = store, scale, slot_N
        self.index_T, self.chunk_slot_C, self.s0, self.Lt = index_T, chunk_slot_C, s0, Lt
        self.in_order = in_order
        self._shared: tuple[int, tuple[str, ...], torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def per_token(cls, store: LoraSlots, scale_S: torch.Tensor, slot_N: torch.Tensor) -> SlotLora:
        """The triton layout: each token's slot."""
        empty = slot_N.new_empty(0)
        return cls(store, scale_S, slot_N, empty, empty)

    @classmethod
    def chunked(cls, store: LoraSlots, scale_S: torch.Tensor, plan: ChunkPlan, index_T: torch.Tensor,
                chunk_slot_C: torch.Tensor, dtype: torch.dtype) -> SlotLora:
        """The composite layout from a host :class:`ChunkPlan` whose ``index_T`` and
        ``chunk_slot_C`` are on the device: padding entries read token 0 at weight 0."""
        weight = (index_T >= 0).view(plan.C, plan.Lt, 1).to(dtype) * scale_S.index_select(0, chunk_slot_C).to(
            dtype)[:, None, None]
        return cls(store, weight, index_T.new_empty(0), index_T.clamp(min=0), chunk_slot_C, plan.s0, plan.Lt,
                   plan.in_order)

    def touches(self, layer: int, module: str) -> bool:
        """The store holds LoRA for ``module`` (the same answer for every layer and batch)."""
        return module in self.store.group_of

    def apply(self, layer: int, module: str, x_N_in: torch.Tensor, y_N_out: torch.Tensor) -> torch.Tensor:
        """``y_N_out`` plus every token's LoRA term, in place. The projections of one input
        group (q/k/v, gate/up) called in turn on the same ``x`` share one shrink."""
        found = self.store.group_of.get(module)
        if found is None:
            return y_N_out
        group, j = found
        sh = self._shared
        if sh is not None and sh[0] == layer and sh[1] == group and sh[2] is x_N_in:
            u = sh[3]
        else:
            u = ops.lora_shrink(x_N_in, self.store.A[(layer, group)], self.slot_N, self.scale, self.index_T,
                                self.chunk_slot_C, self.s0, self.Lt, self.in_order)
            self._shared = (layer, group, x_N_in, u)
        ops.lora_expand_(y_N_out, u, self.store.B[(layer, module)], self.slot_N, self.index_T, self.chunk_slot_C,
                         self.s0, j * self.store.rank, self.in_order)
        return y_N_out
