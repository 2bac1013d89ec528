"""The device memory budget: base weights, KV blocks, and adapters with their optimizer
states; adapters beyond the budget spill to host memory and come back on demand.

The base weights and the KV pool are allocated once (the KV pool takes its own budget,
``kv_budget_bytes``). What remains of ``device_budget_bytes`` holds adapters: each adapter's
bytes are its parameters (LoRA A and B, value head) plus its AdamW moments. When an adapter is
used (sampled, trained, scored, saved) it must be resident; if that puts the resident
adapters over the budget, the least recently used ones that no running row needs are moved
to host memory: every tensor is copied to the host and the device tensor is replaced by an
empty one in place (``param.data = ...``), so the optimizer, the LoRA views and the trainer,
which hold the same Parameter objects, see the weights again, unchanged, when they return.

On a CPU engine the "host" is the same memory: spilling then only exercises the bookkeeping
(tested with a small budget); on a GPU it frees device memory for more adapters than fit.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import sys
from collections.abc import Callable, Iterator

import torch

from opentinker.engine.registry import AdapterState


class OverBudget(ValueError):
    """The adapters that must be resident at once do not fit the budget (the numbers say by how much)."""


def _tensors(state: AdapterState) -> Iterator[tuple[object, str, torch.Tensor]]:
    """(holder, key, tensor) of every tensor an adapter owns: parameters (holder = the
    Parameter, key ``data``) and AdamW moments (holder = the state dict, key its name)."""
    for p in state.named.values():
        yield p, "data", p.data
        if state.optimizer is not None:
            st = state.optimizer.state.get(p)
            if st:
                for k, v in st.items():
                    if isinstance(v, torch.Tensor) and v.dim() > 0:
                        yield st, k, v


def adapter_bytes(state: AdapterState) -> int:
    """Bytes of an adapter's parameters and optimizer moments (when resident)."""
    return sum(t.numel() * t.element_size() for _, _, t in _tensors(state))


class AdapterMemory:
    """Which adapters are resident on the device, in least-recently-used order, within
    ``budget_bytes``."""

    def __init__(self, device: torch.device, budget_bytes: int | None = None,
                 pinned: Callable[[], set[str]] = set) -> None:
        """``budget_bytes``: device bytes for adapters (None: unbounded). ``pinned()``: the
        adapters that may not spill now (rows running on them)."""
        self.device = device
        self.budget_bytes = budget_bytes
        self.pinned = pinned
        self.resident: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Adapter -> its bytes, least recently used first."""
        self.spilled: dict[str, list[tuple[object, str, torch.Tensor]]] = {}
        """Adapter -> its tensors on the host (holder, key, host copy)."""
        self.spills = 0
        self.restores = 0
        self.on_spill: Callable[[str], None] = lambda name: None
        """Called after an adapter's tensors moved to the host (the registry frees its slot)."""
        self.on_restore: Callable[[str], None] = lambda name: None
        """Called after they came back (the registry puts them in a slot again)."""

    @property
    def resident_bytes(self) -> int:
        return sum(self.resident.values())

    def add(self, name: str, state: AdapterState) -> None:
        """A new adapter, resident."""
        self.resident[name] = adapter_bytes(state)
        self._fit(keep=name)

    def remove(self, name: str) -> None:
        self.resident.pop(name, None)
        self.spilled.pop(name, None)

    def resize(self, name: str, state: AdapterState) -> None:
        """Recount an adapter (its AdamW moments appear at its first step)."""
        if name in self.resident:
            self.resident[name] = adapter_bytes(state)
            self._fit(keep=name)

    def use(self, name: str, state: AdapterState) -> None:
        """Make ``name`` resident (bringing it back from the host if spilled) and most
        recently used; spill others to fit. :class:`OverBudget` if it cannot fit."""
        if name in self.spilled:
            for holder, key, host in self.spilled.pop(name):
                dev = host.to(self.device, copy=True)
                if key == "data":
                    holder.data = dev  # type: ignore[attr-defined]
                else:
                    holder[key] = dev  # type: ignore[index]
            self.resident[name] = adapter_bytes(state)
            self.restores += 1
            self.on_restore(name)
        elif name not in self.resident:
            self.resident[name] = adapter_bytes(state)
        self.resident.move_to_end(name)
        self._fit(keep=name)

    def _fit(self, keep: str, states: dict[str, AdapterState] | None = None) -> None:
        if self.budget_bytes is None:
            return
        pinned = self.pinned() | {keep}
        for name in list(self.resident):
            if self.resident_bytes <= self.budget_bytes:
                return
            if name in pinned or self._state_of is None:
                continue
            self._spill(name, self._state_of(name))
        if self.resident_bytes > self.budget_bytes:
            raise OverBudget(
                f"adapters that must stay on the device need {self.resident_bytes} bytes "
                f"({', '.join(sorted(pinned & set(self.resident)))} in use); the adapter budget is "
                f"{self.budget_bytes} bytes: raise model.memory_budget_mb or run fewer adapters at once")

    _state_of: Callable[[str], AdapterState] | None = None
    """Set by the registry: the state of an adapter by name."""

    def _spill(self, name: str, state: AdapterState) -> None:
        saved = []
        for holder, key, t in list(_tensors(state)):
            host = t.to("cpu", copy=True)
            saved.append((holder, key, host))
            empty = torch.empty(0, dtype=t.dtype, device=t.device)
            if key == "data":
                holder.data = empty  # type: ignore[attr-defined]
            else:
                holder[key] = empty  # type: ignore[index]
        self.spilled[name] = saved
        del self.resident[name]
        self.spills += 1
        self.on_spill(name)


# ------------------------------------------------------------------ the host heap (CPU engines)

MALLOC_MMAP_THRESHOLD = 32 << 20
"""Allocations below it come from glibc's heap, not a fresh ``mmap`` (32 MiB: glibc's cap)."""
MALLOC_TRIM_THRESHOLD = 64 << 20
"""Free memory at the heap's top beyond which glibc gives it back to the OS."""
_malloc_tuned = False


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """The C library where it is glibc (it has ``mallopt`` and ``malloc_trim``), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (musl has neither)
    except (OSError, AttributeError):
        return None
    return libc


def tune_malloc() -> bool:
    """Fix glibc's mmap and trim thresholds (once per process; False where not glibc).

    Why: with glibc's dynamic defaults (trim at 2x the largest freed mmap, ~24 MB here) a
    forward's activations (a 2048-token prefill frees ~40 MB at each layer's end) are handed
    back to the OS and faulted in again layer after layer: 280k page faults (1.1 GB) per
    32-row, 16-token SmolLM2 call, 15-20% of its time. With these thresholds they are reused
    from the heap (faults ~0, tokens/s +15-20%); the heap may keep up to 64 MB free, which
    cost ~20 MB of peak RSS on that call. Process-wide: it also applies to whatever else runs
    in the process."""
    global _malloc_tuned
    libc = _glibc()
    if _malloc_tuned or libc is None:
        return _malloc_tuned
    _malloc_tuned = libc.mallopt(-3, MALLOC_MMAP_THRESHOLD) == 1 and libc.mallopt(-1, MALLOC_TRIM_THRESHOLD) == 1
    return _malloc_tuned


def trim_heap() -> bool:
    """Give the heap's free pages back to the OS (glibc's ``malloc_trim``; False where not
    glibc). For events that leave much freed below the mmap threshold (an adapter placed in
    the slot store, the engine going idle: at most once a second), not for every step: pages
    given back are faulted in again when next used."""
    libc = _glibc()
    return bool(libc.malloc_trim(0)) if libc is not None else False

