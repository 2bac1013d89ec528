"""Every resident adapter's LoRA matrices in one slot-major store: the batched LoRA reads them
where they live, with no stacked copy.

Before this store, batched LoRA (``bgmv``) stacked the adapters of a forward into
``[K, G*r, d_in]`` and ``[K, r, d_out]`` tensors and cached them between forwards: a second
copy of every adapter (59 MB at 16 rank-8 q/k/v/o adapters of SmolLM2-135M), rebuilt whenever
a step's set of adapters changed, as it does under continuous batching. Here each adapter owns
a *slot* of the store and its parameters are views into it (S-LoRA's unified adapter memory,
after punica's layout):

* per layer and input group (q/k/v, o, gate/up, down: the projections that read the same x),
  ``A[(layer, group)]`` is ``[S, G*R, d_in]``: slot s holds its adapter's A of each module of
  the group, rows ``j*R : j*R + r`` (rank r zero-padded to the store's R);
* per layer and module, ``B[(layer, module)]`` is ``[S, d_out, R]``: slot s holds B in its
  first r columns;
* each slot's alpha / r is its adapter's ``scale`` (applied to ``x A^T``, B stays unscaled).

An adapter's ``lora_A`` is ``A[(l, g)][s, j*R : j*R + r]`` (contiguous) and its ``lora_B`` is
``B[(l, m)][s, :, :r]`` (contiguous when r = R): the optimizer, the trainer's gradients, the
file I/O and the sampler all see the same bytes. A forward over adapters in slots ``s0 .. s0 +
K - 1`` (the engine orders rows by slot) reads ``A[(l, g)][s0:s0+K]`` as it is, a view; other
slot sets gather only their own slots.

All tensors are views into one flat buffer per layout, so slots never written are never
touched (on CPU a large ``torch.empty`` is mapped lazily). The layout (R, the modules held, the
capacity S) grows when an adapter needs it: a new buffer, every resident adapter copied into
its same slot, and its parameters re-pointed (``tensor.data = view``, which keeps the
Parameter objects the optimizer holds). Capacity doubles, so adding K adapters copies O(K)
adapters in all.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import torch

from .config import DecoderSpec, module_dims

if TYPE_CHECKING:
    from .lora_weights import LoraWeights

__all__ = ["INPUT_GROUPS", "LoraSlots"]

INPUT_GROUPS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"),
                                        ("down_proj",))
"""Projections of one layer that read the same input, in the decoder's order."""


class LoraSlots:
    """The slot store of one base model copy's LoRA adapters (fp32 masters on one device)."""

    def __init__(self, spec: DecoderSpec, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", budget: Callable[[], int | None] = lambda: None) -> None:
        """``budget()``: the adapters' device budget in bytes (None: unbounded); the capacity
        never grows past what it holds (though always to one more than the adapters resident)."""
        self.spec = spec
        self.budget = budget
        self.dtype = dtype
        self.device = torch.device(device)
        self.rank = 0
        """R: the largest rank the layout holds."""
        self.modules: tuple[str, ...] = ()
        """The projections the layout holds (some adapter targets each)."""
        self.capacity = 0
        self.owners: list[LoraWeights | None] = []
        """Slot -> the adapter in it (None: free)."""
        self.A: dict[tuple[int, tuple[str, ...]], torch.Tensor] = {}
        """``(layer, group) -> [S, G*R, d_in]``; ``group`` is the held modules of one input group."""
        self.B: dict[tuple[int, str], torch.Tensor] = {}
        """``(layer, module) -> [S, d_out, R]``."""
        self.group_of: dict[str, tuple[tuple[str, ...], int]] = {}
        """module -> (its held group, its place j in it)."""
        self.relayouts = 0
        self._buffer = torch.empty(0, dtype=dtype, device=self.device)

    # ---------------------------------------------------------------------------- placement

    @property
    def nbytes(self) -> int:
        """Bytes the current layout reserves (slots never written are not resident on CPU)."""
        return self._buffer.numel() * self._buffer.element_size()

    def __len__(self) -> int:
        return sum(o is not None for o in self.owners)

    def put(self, w: LoraWeights) -> int:
        """Give ``w`` a slot (the lowest free one), copy its matrices in and make its tensors
        views of the slot. Returns the slot."""
        if w.store is self and w.slot is not None:
            return w.slot
        if w.store is not None:
            raise ValueError("the adapter already lives in another store")
        mods = {m for _, m in w.pairs}
        free = [s for s, o in enumerate(self.owners) if o is None]
        if w.rank > self.rank or not mods <= set(self.modules) or not free:
            rank, modules = max(self.rank, w.rank), set(self.modules) | mods
            capacity = self.capacity if free else max(1, 2 * self.capacity)
            budget = self.budget()
            if budget is not None:
                per_slot = self._slot_elems(rank, modules) * torch.empty((), dtype=self.dtype).element_size()
                capacity = max(len(self) + 1, min(capacity, budget // per_slot))
            self._relayout(rank, modules, capacity)
            free = [s for s, o in enumerate(self.owners) if o is None]
        slot = free[0]
        self._place(w, slot)
        return slot

    def release(self, w: LoraWeights) -> None:
        """Free ``w``'s slot. Its tensors keep pointing at the slot's bytes until the caller
        replaces them (a spill to the host) or drops the adapter."""
        if w.store is not self or w.slot is None:
            return
        self.owners[w.slot] = None
        w.slot = None
        w.store = None

    def _place(self, w: LoraWeights, slot: int) -> None:
        R = self.rank
        for t in self._slot_views(slot):
            t.zero_()
        for (layer, module), (A, B) in w.pairs.items():
            group, j = self.group_of[module]
            r = A.shape[0]
            dst_A = self.A[(layer, group)][slot, j * R:j * R + r]
            dst_B = self.B[(layer, module)][slot, :, :r]
            with torch.no_grad():
                dst_A.copy_(A)
                dst_B.copy_(B)
            A.data = dst_A
            B.data = dst_B
        self.owners[slot] = w
        w.slot = slot
        w.store = self

    def _slot_views(self, slot: int) -> list[torch.Tensor]:
        return [t[slot] for t in self.A.values()] + [t[slot] for t in self.B.values()]

    def _layout(self, modules: set[str]) -> tuple[tuple[str, ...], list[tuple[str, ...]]]:
        """``(held modules, held groups)`` in the decoder's order."""
        held = tuple(m for g in INPUT_GROUPS for m in g if m in modules)
        groups = [tuple(m for m in g if m in modules) for g in INPUT_GROUPS]
        return held, [g for g in groups if g]

    def _slot_elems(self, rank: int, modules: set[str]) -> int:
        """Elements one slot takes in a layout of ``rank`` and ``modules``."""
        held, groups = self._layout(modules)
        dims = {m: module_dims(self.spec, m) for m in held}
        per_layer = sum(len(g) * rank * dims[g[0]][0] for g in groups) + sum(dims[m][1] * rank for m in held)
        return self.spec.num_layers * per_layer

    def _relayout(self, rank: int, modules: set[str], capacity: int) -> None:
        """A new buffer for ``rank``, ``modules`` and ``capacity`` slots, every resident adapter
        moved into its same slot."""
        residents = [(s, o) for s, o in enumerate(self.owners) if o is not None]
        s = self.spec
        held, groups = self._layout(modules)
        dims = {m: module_dims(s, m) for m in held}
        S, R = capacity, rank
        buffer = torch.empty(S * self._slot_elems(rank, modules), dtype=self.dtype, device=self.device)
        A: dict[tuple[int, tuple[str, ...]], torch.Tensor] = {}
        B: dict[tuple[int, str], torch.Tensor] = {}
        offset = 0
        for layer in range(s.num_layers):
            for g in groups:
                n = S * len(g) * R * dims[g[0]][0]
                A[(layer, g)] = buffer[offset:offset + n].view(S, len(g) * R, dims[g[0]][0])
                offset += n
            for m in held:
                n = S * dims[m][1] * R
                B[(layer, m)] = buffer[offset:offset + n].view(S, dims[m][1], R)
                offset += n
        self._buffer, self.A, self.B = buffer, A, B
        self.rank, self.modules, self.capacity = R, held, S
        self.group_of = {m: (g, g.index(m)) for g in groups for m in g}
        self.owners = [None] * S
        self.relayouts += 1
        for slot, w in residents:  # read from the old buffer (still referenced by w's tensors)
            w.store = w.slot = None
            self._place(w, slot)

    # ---------------------------------------------------------------------------- reading

    def scale_of(self, slot: int) -> float:
        """alpha / r of the adapter in ``slot``."""
        owner = self.owners[slot]
        if owner is None:
            raise KeyError(f"slot {slot} is free")
        return owner.scale

    def take(self, t: torch.Tensor, slots: Sequence[int], index: torch.Tensor | None = None) -> torch.Tensor:
        """``t`` (``[S, ...]``) at ``slots``: a view where they are consecutive ascending, else
        a gather (``index``: the slots as a long tensor on t's device, if the caller has it)."""
        s0 = slots[0]
        if all(s == s0 + k for k, s in enumerate(slots)):
            return t[s0:s0 + len(slots)]
        if index is None:
            index = torch.tensor(list(slots), dtype=torch.long, device=t.device)
        return t.index_select(0, index)
