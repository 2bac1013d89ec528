"""Batched LoRA on the shared base matmuls: rows of many adapters in one forward.

Each LoRA'd projection computes ``y = x W^T (+ b)`` once for all N flat tokens, then adds each
token's own low-rank term ``scale_a * (x A_a^T) B_a^T`` (PEFT's ``lora_B(lora_A(x)) * scaling``
with scaling = alpha / r; no dropout: the engine runs adapters as PEFT in eval mode). Three
methods, all a few large ops and never a Python loop over rows:

* ``"bgmv"`` (the default): batched gather matrix-vector, after punica/vLLM. Once per forward
  the tokens are grouped by adapter (any row order) into a ``[C, Lt, d]`` batch, one row per
  adapter padded to the longest (C = K), or per chunk of ``Lt`` tokens when much shorter chunks
  pad much less (a long prefill chunk beside decode rows). Per LoRA layer: ONE ``torch.bmm`` of
  the batch by the K adapters' A stacked ``[K, G*r, d_in]``, where the G projections that read
  the same x (q/k/v, gate/up) share it, then per projection one ``baddbmm`` by ``scale * B^T``
  stacked ``[K, r, d_out]`` (ranks zero-padded to the largest, a missing projection zeros).
  Rows sorted by adapter with equal token counts (the engine's decode step: it sorts rows by
  adapter) are that batch as they lie, a view: no gather and the output lands in y in place;
  otherwise one ``index_select`` in and one ``index_add_`` out, with indices built once per
  forward.
* ``"segments"``: rows arrive sorted by adapter (the caller sorts; :class:`LoraBatch` asserts
  each adapter's rows are contiguous), so each adapter owns one token slice ``[s, e)``; per LoRA
  layer one ``x[s:e] @ A^T @ B^T`` per distinct adapter (a loop over adapters, not rows).
* ``"stacked"``: the K distinct adapters' A stacked as ``[sum r, d_in]`` and B as
  ``[d_out, sum r]`` (ranks may differ); per LoRA layer ``((x @ A_cat^T) * mask_N_R) @ B_cat^T``
  where ``mask_N_R`` holds each token's scale on its own adapter's rank columns and 0 elsewhere,
  built once per forward.

Where the adapters live in a :class:`~.lora_slots.LoraSlots` store (the engine's registry puts
every adapter in one), a no-grad forward in the store's dtype reads ``bgmv``'s stacks straight
from it: a view of consecutive slots (the engine orders rows by slot), else a gather of the
batch's own slots; the store keeps B unscaled, so ``x A^T`` is scaled per entry. Otherwise
(gradients wanted, a bf16 forward over fp32 masters, adapters outside a store) the stacked
and dtype-cast matrices of ``bgmv`` and ``stacked`` are built from the adapters' tensors and,
with no grad, cached in a :class:`LoraStackCache` keyed on the adapters' identity and versions
(an explicit ``LoraWeights.version`` or else the tensors' ``_version`` counters, which every
in-place optimizer update bumps). A cached set is a copy of its adapters' LoRA matrices (3.7 MB
per rank-8 q/k/v/o adapter of SmolLM2-135M); the cache keeps the 2 most recent sets.

Precision: adapter tensors are fp32 master weights; on a bf16 forward they are cast to the
activation dtype (bf16) and the LoRA term runs in bf16, like the base matmul it is added to: the
sum lands in a bf16 tensor anyway, so an fp32 LoRA term would buy no accuracy on the output and
cost a cast of x. Gradients flow through the cast into the fp32 masters.

Timing. Machine: 2-core AMD EPYC (Zen 5) VM, ``torch.backends.cpu.get_cpu_capability()`` =
AVX512, torch 2.13 (MKL sgemm takes its AVX2 path here; the decoder's linears run on oneDNN,
see :mod:`.decoder`), shared with other work, so every figure is a min over repeats. SmolLM2-
135M's shapes with random weights (30 layers, hidden 576, 9 heads of 64, 3 KV heads,
intermediate 1536, vocabulary 49152), fp32, no grad, rank-8 adapters on q/k/v/o, rows sorted by
adapter. LoRA terms alone (``python benchmarks/lora_methods.py``, one thread's CPU time, min
of 7), 32 rows x 64 tokens (a prefill) and 32 rows x 1 token (a decode step)::

    K    tokens   segments   stacked (cached)   bgmv (cached)   bgmv (uncached)
    1    32x64     72 ms       72 ms              49 ms           54 ms
    4    32x64     76 ms      162 ms              52 ms           58 ms
    16   32x64     93 ms      599 ms              60 ms           68 ms
    1    32x1      2.6 ms      2.4 ms             1.9 ms          3.5 ms
    4    32x1      7.0 ms      5.1 ms             2.7 ms          5.6 ms
    16   32x1     25.9 ms     16.9 ms             7.1 ms         16.5 ms

One engine step (paged attention over a block-size-8 slot pool, LoRA, the
vocabulary projection of the 32 sampled rows), before (``segments``, MKL linears) and after
(``bgmv``, oneDNN linears, the paged shortcuts), ms of wall time, min of 3-6 (1 thread: also
its CPU time)::

    step                     threads   before K=1   before K=16   after K=1   after K=16
    decode 32 x 1 (ctx 71)   1         142          166            86          92
    decode 32 x 1 (ctx 71)   2          96          126            58          63
    prefill 32 x 64          1         4670         4610          2320        2290
    prefill 32 x 64          2         2370         2480          1160        1160

End to end (``benchmarks/multiplex.py --one engine K 32``: 32 prompts of 64 tokens, 16 new
tokens each, 2 threads, 1 prefill + 15 decode steps; best of 4-6 uncontended runs): before 128
(K=1) and 110 (K=16) tokens/s, 0.86x; after 222 (K=1, runs 193-222) and 218 (K=16, runs
193-218), 0.98x.

bgmv does segments' minimum FLOPs (each token meets only its own adapter's r columns) in 2 + G
ops per layer and input group instead of segments' ~3 per adapter and projection; a decode
step at K=16 is 120 x 16 tiny matmuls for segments. What is left at K=16 is reading the K
adapters' matrices (59 MB per step at K=16, 14% of the base weights' bytes). The stack cache
matters at decode (uncached, each step re-stacks those bytes). ``stacked`` does K times the
low-rank FLOPs plus a ``[N, K*r]`` mask product; it and ``segments`` stay behind the method
flag.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .lora_slots import INPUT_GROUPS, LoraSlots
from .lora_weights import LoraStackCache, LoraWeights

__all__ = ["DEFAULT_METHOD", "METHODS", "LoraBatch", "chunk_length"]

METHODS: tuple[str, ...] = ("segments", "stacked", "bgmv")
DEFAULT_METHOD = "bgmv"
_SHARED_INPUT = {m: g for g in INPUT_GROUPS for m in g}
"""Projections of one layer that read the same input (bgmv multiplies x by their A's at once)."""
_CHUNK_COST = 1
"""bgmv's plan: with chunks shorter than the longest adapter's tokens, each chunk costs about
``_CHUNK_COST * max rank`` padded token rows more (the copy of its adapter's A and B into the
chunk batch). Fitted on CPU: a decode step with 17 rows on one adapter and 15 on others runs
2x faster in chunks of 2 than padded to 17; a 500-token prefill chunk beside decode rows, 5x
faster in chunks of 32."""


def chunk_length(n_k: Sequence[int], rank: int) -> int:
    """Tokens per chunk of bgmv's ``[C, Lt, d]`` batch, for adapters of ``n_k`` tokens each:
    the longest adapter's count (one chunk each) unless shorter power-of-two chunks pad much
    less, each costing ``_CHUNK_COST * rank`` padded token rows more."""
    Lmax = max(n_k)
    best: tuple[int, int] | None = None
    for Lt in sorted({Lmax} | {1 << j for j in range(max(Lmax - 1, 1).bit_length()) if 1 << j < Lmax}):
        C = sum(-(-int(n) // Lt) for n in n_k)
        cost = C * Lt + (C * _CHUNK_COST * rank if Lt < Lmax else 0)
        if best is None or cost < best[0]:
            best = (cost, Lt)
    return best[1]


class LoraBatch:
    """Which adapter each token of one forward uses. The flat batch is the rows concatenated in
    order (row b has ``row_tokens[b]`` tokens); ``adapters[b]`` is its adapter or None."""

    def __init__(self, adapters: Sequence[LoraWeights | None], row_tokens: Sequence[int],
                 method: str = DEFAULT_METHOD, stack_cache: LoraStackCache | None = None) -> None:
        if len(adapters) != len(row_tokens):
            raise ValueError(f"{len(adapters)} adapters for {len(row_tokens)} rows")
        if method not in METHODS:
            raise ValueError(f"unknown LoRA method {method!r}")
        self.method, self.stack_cache = method, stack_cache
        self.N = int(sum(row_tokens))
        self.distinct: list[LoraWeights] = []
        index = {}
        row_aid: list[int] = []
        for a in adapters:
            if a is not None and id(a) not in index:
                index[id(a)] = len(self.distinct)
                self.distinct.append(a)
            row_aid.append(-1 if a is None else index[id(a)])
        # Token slices of consecutive rows sharing an adapter (Python ints: B is small).
        runs: list[list[int]] = []
        start = 0
        for k, n in zip(row_aid, row_tokens):
            if k >= 0 and runs and runs[-1][0] == k and runs[-1][2] == start:
                runs[-1][2] += n
            elif k >= 0:
                runs.append([k, start, start + n])
            start += n
        if method == "segments" and len(runs) != len(self.distinct):
            raise AssertionError("segments method: rows must be sorted by adapter (each adapter's rows contiguous)")
        self.segments = [(k, s, e) for k, s, e in runs]
        """``(adapter index, token start, token end)`` per run of rows sharing an adapter."""
        self._row_aid = row_aid
        self._row_tokens = list(row_tokens)
        self._aid_N: torch.Tensor | None = None
        self._masks: dict[tuple, torch.Tensor] = {}
        self._stacks: dict | None = None
        if method == "bgmv":
            self._plan_bgmv(runs)

    def _token_aid(self, device: torch.device) -> torch.Tensor:
        if self._aid_N is None:
            self._aid_N = torch.repeat_interleave(
                torch.tensor(self._row_aid, dtype=torch.long), torch.tensor(self._row_tokens, dtype=torch.long)
            ).to(device)
        return self._aid_N

    def _mask(self, members: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
        """``mask_N_R``: each token's scale on its adapter's rank columns (R = sum of ranks)."""
        key = (members, x.dtype)
        if key not in self._masks:
            col_aid = torch.cat([torch.full((self.distinct[k].rank,), k, dtype=torch.long) for k in members])
            col_scale = torch.cat([torch.full((self.distinct[k].rank,), self.distinct[k].scale) for k in members])
            aid = self._token_aid(x.device)
            self._masks[key] = (aid[:, None] == col_aid.to(x.device)[None]) * col_scale.to(x.device, x.dtype)[None]
        return self._masks[key]

    def touches(self, layer: int, module: str) -> bool:
        """Some row's adapter has LoRA on ``module`` at ``layer`` (else :meth:`apply` adds nothing)."""
        return any((layer, module) in a.pairs for a in self.distinct)

    def apply(self, layer: int, module: str, x_N_in: torch.Tensor, y_N_out: torch.Tensor) -> torch.Tensor:
        """``y_N_out`` plus every token's LoRA term on this projection (``y`` may be updated in
        place: it must be a fresh matmul output). With ``bgmv``, the calls for q/k/v (gate/up)
        of one layer on the same ``x`` tensor, unchanged in between, share one product of x
        with their A's (the decoder's order: q first)."""
        if self.method == "bgmv":
            return self._bgmv(layer, module, x_N_in, y_N_out)
        if self.method == "segments":
            return self._segments(layer, module, x_N_in, y_N_out)
        return self._stacked(layer, module, x_N_in, y_N_out)

    def _segments(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        for k, s, e in self.segments:
            pair = self.distinct[k].pairs.get((layer, module))
            if pair is None:
                continue
            A, B = pair[0].to(x.dtype), pair[1].to(x.dtype)
            if s == 0 and e == self.N:
                return torch.addmm(y, (x @ A.T) * self.distinct[k].scale, B.T)
            y[s:e].addmm_((x[s:e] @ A.T) * self.distinct[k].scale, B.T)
        return y

    def _stacked(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        members = tuple(k for k, a in enumerate(self.distinct) if (layer, module) in a.pairs)
        if not members:
            return y
        if len(members) == 1 and len(self.segments) == 1 and self.segments[0][1:] == (0, self.N):
            A, B = self.distinct[members[0]].pairs[(layer, module)]  # one adapter on every token
            return torch.addmm(y, (x @ A.to(x.dtype).T) * self.distinct[members[0]].scale, B.to(x.dtype).T)
        A_cat, B_cat = self._stack(layer, module, members, x.dtype)
        return torch.addmm(y, (x @ A_cat.T) * self._mask(members, x), B_cat.T)

    def _stack(self, layer: int, module: str, members: tuple[int, ...],
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        pairs = [self.distinct[k].pairs[(layer, module)] for k in members]
        grad = torch.is_grad_enabled() and any(t.requires_grad for p in pairs for t in p)
        # A cached stack built under grad would carry a graph that the first backward frees.
        if self.stack_cache is None or grad:
            return torch.cat([A for A, _ in pairs]).to(dtype), torch.cat([B for _, B in pairs], 1).to(dtype)
        if self._stacks is None:
            self._stacks = self.stack_cache.lookup(self.distinct, dtype)
        key = (layer, module, members)
        if key not in self._stacks:
            self._stacks[key] = (torch.cat([A for A, _ in pairs]).to(dtype),
                                 torch.cat([B for _, B in pairs], 1).to(dtype))
        return self._stacks[key]

    # ---- bgmv ---------------------------------------------------------------------------
    def _plan_bgmv(self, runs: list[list[int]]) -> None:
        """Token layout of the bgmv batch, once per forward (Python ints; no tensor op when the
        rows are sorted by adapter with equal token counts, the engine's usual decode step).

        The tokens of adapter k (in flat order) are cut into chunks of ``Lt`` tokens, the last
        padded; chunk c of adapter ``chunk_aid[c]`` is row c of a ``[C, Lt, d]`` batch. ``Lt`` is
        the longest adapter's token count (C = K: the stacks are used as they are) unless
        shorter chunks pad much less (a long prefill next to a few decode rows)."""
        K = len(self.distinct)
        self._rmax = max((a.rank for a in self.distinct), default=0)
        self._bg_view: tuple[int, int, int] | None = None
        self._bg_dev: dict = {}
        self._bg_shared: tuple | None = None
        self._bg_grad: bool | None = None
        self._bg_chunk_aid: torch.Tensor | None = None
        # Adapters that all live in one slot store are read from it in place (no stacks).
        store = self.distinct[0].store if K else None
        self._store: LoraSlots | None = store if store is not None and all(
            a.store is store and a.slot is not None for a in self.distinct) else None
        self._slots: list[int] = [int(a.slot) for a in self.distinct] if self._store is not None else []  # type: ignore[arg-type]
        self._entry_slots: list[int] = self._slots
        """The store slot of each row of the ``[C, Lt, d]`` batch (K adapters, or C chunks)."""
        if K == 0:
            return
        lengths = [e - s for _, s, e in runs]
        if (len(runs) == K and all(r[0] == k for k, r in enumerate(runs)) and len(set(lengths)) == 1
                and all(runs[k][1] == runs[0][1] + k * lengths[0] for k in range(K))):
            self._bg_view = (runs[0][1], K, lengths[0])  # x[s0 : s0 + K*L] is [K, L, d] as is
            return
        per: list[list[tuple[int, int]]] = [[] for _ in range(K)]
        for k, s, e in runs:
            per[k].append((s, e))
        n_k = [sum(e - s for s, e in r) for r in per]
        Lmax = max(n_k)
        Lt = chunk_length(n_k, self._rmax)
        index: list[torch.Tensor] = []
        chunk_aid: list[int] = []
        padded = False
        for k, r in enumerate(per):
            t = torch.cat([torch.arange(s, e) for s, e in r])
            c = -(-n_k[k] // Lt)
            if c * Lt > n_k[k]:
                padded = True
                t = torch.cat([t, torch.full((c * Lt - n_k[k],), -1, dtype=torch.long)])
            index.append(t)
            chunk_aid += [k] * c
        idx = torch.cat(index)
        self._bg_C, self._bg_Lt = len(chunk_aid), Lt
        self._bg_valid = (idx >= 0).view(-1, Lt, 1) if padded else None
        self._bg_index = idx.clamp(min=0)  # pad rows read token 0 and add exact zeros back
        self._bg_chunk_aid = None if Lt == Lmax else torch.tensor(chunk_aid, dtype=torch.long)
        if self._store is not None and Lt != Lmax:
            self._entry_slots = [self._slots[k] for k in chunk_aid]

    def _bg_tensors(self, x: torch.Tensor) -> tuple:
        """``(index, chunk_aid, valid mask)`` on x's device and dtype (built once per forward)."""
        key = (x.device, x.dtype)
        if key not in self._bg_dev:
            dev = x.device
            self._bg_dev[key] = (
                self._bg_index.to(dev),
                None if self._bg_chunk_aid is None else self._bg_chunk_aid.to(dev),
                None if self._bg_valid is None else self._bg_valid.to(dev, x.dtype),
            )
        return self._bg_dev[key]

    def _bg_info(self, layer: int, module: str) -> tuple[tuple[str, ...], int]:
        """``(group, j)``: the projections of ``module``'s input group that some adapter has at
        ``layer``, and ``module``'s place in it (-1: no adapter has ``module`` there)."""
        group = tuple(m for m in _SHARED_INPUT[module] if any((layer, m) in a.pairs for a in self.distinct))
        return group, group.index(module) if module in group else -1

    def _bg_needs_grad(self) -> bool:
        """Gradients must flow to the adapters' tensors in this forward (then every stack is
        built from them, differentiably, per forward)."""
        if not torch.is_grad_enabled():
            return False
        if self._bg_grad is None:
            self._bg_grad = any(t.requires_grad for a in self.distinct for p in a.pairs.values() for t in p)
        return self._bg_grad

    def _bg_store(self, x: torch.Tensor) -> LoraSlots | None:
        """The slot store to read in place, or None (no common store, a cast to another dtype,
        or gradients wanted)."""
        store = self._store
        if store is None or x.dtype != store.dtype or x.device != store.device or self._bg_needs_grad():
            return None
        return store

    def _bg_take(self, t: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """A store tensor ``[S, ...]`` at the batch's entry slots: ``[C, ...]`` (a view where
        they are consecutive)."""
        key = ("slots", x.device)
        index = self._bg_dev.get(key)
        if index is None:
            index = self._bg_dev[key] = torch.tensor(self._entry_slots, dtype=torch.long, device=x.device)
        assert self._store is not None
        return self._store.take(t, self._entry_slots, index)

    def _bg_scale(self, store: LoraSlots, u: torch.Tensor) -> torch.Tensor | None:
        """``[C, 1, 1]``: each batch entry's alpha / r, or None where all are 1 (once per forward)."""
        key = ("scale", u.device, u.dtype)
        if key not in self._bg_dev:
            scales = [store.scale_of(s) for s in self._entry_slots]
            self._bg_dev[key] = None if all(c == 1.0 for c in scales) else torch.tensor(
                scales, dtype=u.dtype, device=u.device)[:, None, None]
        return self._bg_dev[key]

    def _bg_cache(self, x: torch.Tensor) -> dict | None:
        """The stack cache's dict for this adapter set, or None (no cache, or gradients wanted:
        a cached stack built under grad would carry a graph that the first backward frees)."""
        if self.stack_cache is None or self._bg_needs_grad():
            return None
        if self._stacks is None:
            self._stacks = self.stack_cache.lookup(self.distinct, x.dtype)
        return self._stacks

    def _bg_stack(self, cache: dict | None, kind: str, layer: int, mods: tuple[str, ...],
                  dtype: torch.dtype) -> torch.Tensor:
        """``"A"``: ``[K, len(mods) * rmax, d_in]`` (each adapter's A of every module of the group,
        rank-padded with zeros); ``"B"``: ``[K, rmax, d_out]``, each adapter's ``scale * B^T``.
        A missing pair is zeros (adds nothing). Kept in ``cache`` when there is one."""
        if cache is None:
            return self._bg_build(kind, [[a.pairs.get((layer, m)) for m in mods] for a in self.distinct], dtype)
        key = ("bgmv", kind, layer, mods)
        st = cache.get(key)
        if st is None:
            st = cache[key] = self._bg_build(kind, [[a.pairs.get((layer, m)) for m in mods] for a in self.distinct], dtype)
        return st

    def _bg_build(self, kind: str, pairs: list[list[tuple[torch.Tensor, torch.Tensor] | None]],
                  dtype: torch.dtype) -> torch.Tensor:
        R = self._rmax
        full = all(p is not None and p[0].shape[0] == R for ps in pairs for p in ps)
        if kind == "A":
            if full:
                return torch.stack([ps[0][0] if len(ps) == 1 else torch.cat([p[0] for p in ps]) for ps in pairs]).to(dtype)
            ref = next(p[0] for ps in pairs for p in ps if p is not None)
            out = ref.new_zeros(len(pairs), len(pairs[0]) * R, ref.shape[1], dtype=dtype)
            for k, ps in enumerate(pairs):
                for j, p in enumerate(ps):
                    if p is not None:
                        out[k, j * R:j * R + p[0].shape[0]] = p[0]
            return out
        scales = [a.scale for a in self.distinct]
        if full:
            out = torch.stack([ps[0][1].T for ps in pairs])
        else:
            ref = next(ps[0][1] for ps in pairs if ps[0] is not None)
            out = ref.new_zeros(len(pairs), R, ref.shape[0])
            for k, ps in enumerate(pairs):
                if ps[0] is not None:
                    out[k, :ps[0][1].shape[1]] = ps[0][1].T
        if any(c != 1.0 for c in scales):
            out = out * torch.tensor(scales, dtype=out.dtype, device=out.device)[:, None, None]
        return out.to(dtype)

    def _bgmv(self, layer: int, module: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        store = self._bg_store(x)
        cache = None if store is not None else self._bg_cache(x)
        if store is not None:  # the store's held group (an adapter lacking a module has zeros)
            group, j = store.group_of.get(module, ((), -1))
            R = store.rank
        elif cache is None:
            group, j = self._bg_info(layer, module)
            R = self._rmax
        else:
            info = cache.get(("bgmv-info", layer, module))
            if info is None:
                info = cache[("bgmv-info", layer, module)] = self._bg_info(layer, module)
            group, j = info
            R = self._rmax
        if j < 0:
            return y
        view = self._bg_view
        shared = self._bg_shared
        if (shared is not None and shared[0] == layer and shared[1] is x and shared[2] == group
                and (x.is_inference() or shared[3] == x._version)):
            u = shared[4]  # q, k, v (gate, up) of one layer: x @ A^T done once for the group
        else:
            if store is not None:
                A = self._bg_take(store.A[(layer, group)], x)  # [C, G*R, d_in], slot entries
            else:
                A = self._bg_stack(cache, "A", layer, group, x.dtype)
            if view is not None:
                s0, C, L = view
                xv = x if s0 == 0 and C * L == x.shape[0] else x[s0:s0 + C * L]
                u = torch.bmm(xv.reshape(C, L, -1), A.transpose(1, 2))
            else:
                index, chunk_aid, valid = self._bg_tensors(x)
                if chunk_aid is not None and store is None:
                    A = A.index_select(0, chunk_aid)
                u = torch.bmm(x.index_select(0, index).view(self._bg_C, self._bg_Lt, -1), A.transpose(1, 2))
                if valid is not None:
                    u = u * valid
            if store is not None:  # the store keeps B unscaled: scale x A^T per entry instead
                scale = self._bg_scale(store, u)
                if scale is not None:
                    u = u * scale
            if len(group) > 1:
                self._bg_shared = (layer, x, group, None if x.is_inference() else x._version, u)
        if len(group) > 1:
            u = u[:, :, j * R:(j + 1) * R]
        if store is not None:
            B = self._bg_take(store.B[(layer, module)], x).transpose(1, 2)  # [C, R, d_out]
        else:
            B = self._bg_stack(cache, "B", layer, (module,), x.dtype)
        if not y.is_contiguous():
            y = y.contiguous()
        if view is not None:
            s0, C, L = view
            yv = y if s0 == 0 and C * L == y.shape[0] else y[s0:s0 + C * L]
            yv.view(C, L, -1).baddbmm_(u, B)
            return y
        index, chunk_aid, _ = self._bg_tensors(x)
        if chunk_aid is not None and store is None:
            B = B.index_select(0, chunk_aid)
        return y.index_add_(0, index, torch.bmm(u, B).view(-1, y.shape[1]))
