"""The engine's model runner: the tensors of a step, the forward and the draw.

The :class:`~opentinker.engine.scheduler.Scheduler` decides which rows compute how many
tokens; this runner (nano-vllm's ``ModelRunner``, vLLM v1's ``GPUModelRunner`` with its
``InputBatch``) turns a :class:`~opentinker.engine.scheduler.ScheduledBatch` into tokens:

* **A persistent input batch by row slot.** Each admitted row holds a row slot (the
  scheduler's); its sampling parameters (temperature, top-k, top-p, seed) and its block table
  live at that slot in device tensors, written once when the slot changes hands, never rebuilt.
* **One host-to-device copy per step.** What changes every step (token ids, positions, the KV
  slot each new token writes, which row slots run, context lengths, which rows draw, each
  token's adapter slot) is packed on the host into one int64 buffer (pinned on CUDA) and
  copied at once; the fields are views of it.
* **The forward**: the decoder over the flat tokens, :class:`~.model.paged_step.StepAttention`
  reading each row's context through its block table, :class:`~.model.slot_lora.SlotLora`
  reading every token's adapter in place from the LoRA slot store, the vocabulary projection
  at the drawing rows only, and one :func:`~opentinker.engine.sampling.draw` over them all
  (a row with a forced reply, ``SampleRequest.forced``, takes its given token there).
  The ops of a decode step are a function of the model's layers, not of its rows or adapters
  (``tests/test_engine_ops.py`` counts them).
* **CUDA graphs** (:class:`DecodeGraphs`): on CUDA with triton, a decode step whose rows all
  draw (no twin, no top-k / top-p, no forced reply) replays a graph captured for the smallest
  batch-size bucket that holds it, with LoRA and sampling inside; padding rows write to the
  pool's scratch slot and attend to nothing. Prefill stays eager. The one host-device sync of
  a step is the read of the drawn tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
import torch

from opentinker.engine import sampling
from opentinker.engine.kv_cache import KVPool
from opentinker.engine.model import triton_ops
from opentinker.engine.model.lora import METHODS, LoraBatch
from opentinker.engine.model.lora_weights import LoraStackCache
from opentinker.engine.model.paged_step import StepAttention
from opentinker.engine.model.slot_lora import SlotLora, chunk_plan
from opentinker.engine.scheduler import Drawn, ScheduledBatch

__all__ = ["GRAPH_BUCKETS", "LORA_METHODS", "DecodeGraphs", "ModelRunner"]

log = logging.getLogger(__name__)

LORA_METHODS = ("slots",) + METHODS
"""``"slots"`` (the default): :class:`SlotLora` on the slot store; the others are
:class:`~.model.lora.LoraBatch`'s methods (stacked copies, kept for comparison)."""
GRAPH_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
"""Batch sizes a decode graph is captured for (a step runs in the smallest that holds it)."""


class ModelRunner:
    """The tensors of one engine: KV pool, per-slot row state, forward, sampling."""

    def __init__(self, registry, pool: KVPool, max_rows: int, max_context: int,
                 lora_method: str = "slots", cuda_graphs: bool = True) -> None:
        if lora_method not in LORA_METHODS:
            raise ValueError(f"lora_method must be one of {LORA_METHODS}, got {lora_method!r}")
        self.registry = registry
        self.pool = pool
        self.device = dev = registry.device
        self.block_size = pool.block_size
        self.max_blocks = -(-int(max_context) // self.block_size)
        self.lora_method = lora_method
        self._stacks = LoraStackCache()
        P = int(max_rows) + 1
        self.pad_slot = P - 1
        """The row slot of padding rows (no sequence ever holds it)."""
        self.temperature_P = torch.ones(P, dtype=torch.float32, device=dev)
        self.top_k_P = torch.zeros(P, dtype=torch.int64, device=dev)
        self.top_p_P = torch.ones(P, dtype=torch.float32, device=dev)
        self.seed_P = torch.zeros(P, dtype=torch.int64, device=dev)
        self.block_table_P_M = torch.zeros(P, self.max_blocks, dtype=torch.int32, device=dev)
        self._written: list[tuple[int, bool] | None] = [None] * P
        """What each row slot holds: (seq_id, block table written), None: nothing yet."""
        self._scale: tuple[tuple, torch.Tensor] | None = None
        self._pinned: torch.Tensor | None = None
        self._copied: torch.cuda.Event | None = None
        self.triton = dev.type == "cuda" and triton_ops.available(dev)
        """Decode attention and LoRA run as triton kernels (CUDA with triton)."""
        self.graphs = DecodeGraphs(self, int(max_rows)) if cuda_graphs and self.triton else None

    # ------------------------------------------------------------------------------ row state

    def copy_kv(self, src_S: np.ndarray, dst_S: np.ndarray) -> None:
        """Copy keys and values between KV slots (a twin takes its leader's prompt)."""
        self.pool.copy_slots(torch.from_numpy(src_S).to(self.device), torch.from_numpy(dst_S).to(self.device))

    def _write_rows(self, batch: ScheduledBatch) -> None:
        """Write the sampling parameters and block table of the batch's rows whose slot does
        not hold them yet (rows new to their slot; a twin's table once it has blocks)."""
        fresh = []
        for s in batch.rows + [t for _, t in batch.twins]:
            state = (s.seq_id, s.alloc is not None)
            if self._written[s.row_slot] != state:
                self._written[s.row_slot] = state
                fresh.append(s)
        if not fresh:
            return
        dev = self.device
        slots = torch.tensor([s.row_slot for s in fresh], dtype=torch.long, device=dev)
        p = [s.params for s in fresh]
        self.temperature_P.index_copy_(0, slots, torch.tensor([q.temperature for q in p], dtype=torch.float32, device=dev))
        self.top_k_P.index_copy_(0, slots, torch.tensor([q.top_k for q in p], dtype=torch.int64, device=dev))
        self.top_p_P.index_copy_(0, slots, torch.tensor([q.top_p for q in p], dtype=torch.float32, device=dev))
        self.seed_P.index_copy_(0, slots, torch.tensor([sampling._int64(s.seed) for s in fresh], dtype=torch.int64,
                                                       device=dev))
        tabled = [s for s in fresh if s.alloc is not None]
        if tabled:
            table = np.zeros((len(tabled), self.max_blocks), dtype=np.int32)
            for r, s in enumerate(tabled):
                table[r, :len(s.alloc.block_table)] = s.alloc.block_table
            rows = torch.tensor([s.row_slot for s in tabled], dtype=torch.long, device=dev)
            self.block_table_P_M.index_copy_(0, rows, torch.from_numpy(table).to(dev))

    def scales(self) -> torch.Tensor:
        """``float32[S]``: alpha / r of each slot of the LoRA store (0 for a free slot), on the
        device. One tensor per store layout, updated in place when the occupants change (a
        captured graph keeps reading it)."""
        store = self.registry.slots
        key = tuple((id(o), o.scale) if o is not None else None for o in store.owners)
        values = [o.scale if o is not None else 0.0 for o in store.owners] or [0.0]
        if self._scale is None or self._scale[1].numel() != len(values):
            self._scale = (key, torch.tensor(values, dtype=torch.float32, device=self.device))
        elif self._scale[0] != key:
            self._scale[1].copy_(torch.tensor(values, dtype=torch.float32))
            self._scale = (key, self._scale[1])
        return self._scale[1]

    def to_device(self, host: np.ndarray) -> torch.Tensor:
        """One int64 host buffer to the device in one copy, through a reused pinned buffer on
        CUDA (refilled only once the previous copy out of it has completed)."""
        t = torch.from_numpy(host)
        if self.device.type != "cuda":
            return t
        if self._copied is not None:  # no read of drawn tokens since the last copy (a prefill-only step)
            self._copied.synchronize()
        if self._pinned is None or self._pinned.numel() < t.numel():
            self._pinned = torch.empty(max(t.numel(), 1 << 16), dtype=torch.int64, pin_memory=True)
        buf = self._pinned[:t.numel()]
        buf.copy_(t)
        out = buf.to(self.device, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()
        return out

    # ------------------------------------------------------------------------------ the step

    @torch.no_grad()
    def execute(self, batch: ScheduledBatch) -> Drawn:
        """Compute the batch's tokens; return ``(token, log-prob)`` per drawing row
        (:attr:`ScheduledBatch.drawing` order)."""
        drawn = self._execute(batch)
        if drawn:
            self._copied = None  # reading the tokens waited for the device: the pinned buffer is free
        return drawn

    def _execute(self, batch: ScheduledBatch) -> Drawn:
        self._write_rows(batch)
        drawing = batch.drawing
        if (self.graphs is not None and batch.copy_key == "base" and batch.decode and not batch.twins
                and len(batch.samples) == len(batch.rows) and len(batch.rows) <= self.graphs.max_batch
                and all(s.params.top_k == 0 and s.params.top_p >= 1 and s.forced is None for s in drawing)):
            return self.graphs.run(batch)
        return self._eager(batch)

    def _eager(self, batch: ScheduledBatch) -> Drawn:
        rows, n = batch.rows, np.asarray(batch.num_tokens, dtype=np.int64)
        start = np.array([s.num_computed for s in rows], dtype=np.int64)
        end = start + n
        ids = np.concatenate([np.asarray(s.tokens[a:b], dtype=np.int64) for s, a, b in zip(rows, start, end)])
        pos = np.concatenate([np.arange(a, b) for a, b in zip(start, end)])
        slot_map = np.concatenate([s.slots_S[a:b] for s, a, b in zip(rows, start, end)])
        row_slot = np.array([s.row_slot for s in rows], dtype=np.int64)
        q_end = np.cumsum(n)
        samples = np.asarray(batch.samples, dtype=np.int64)
        logit_row = np.concatenate([np.arange(len(samples)), [j for j, _ in batch.twins]]).astype(np.int64)
        drawing = batch.drawing
        draw_slot = np.array([s.row_slot for s in drawing], dtype=np.int64)
        draw_pos = np.array([len(s.tokens) for s in drawing], dtype=np.int64)
        forced = np.array([s.forced_next for s in drawing], dtype=np.int64)
        forced = forced if (forced >= 0).any() else forced[:0]
        token_slot = np.repeat(np.asarray(batch.adapter_slots, dtype=np.int64), n)
        lora_kind = self._lora_kind(batch)
        plan = chunk_plan(token_slot, self.registry.slots.rank) if lora_kind == "torch" else None
        lora_fields = ([token_slot] if lora_kind == "triton" else [plan.index_T, plan.chunk_slot_C]
                       if plan is not None else [])
        fields = [ids, pos, slot_map, row_slot, end, q_end[samples] - 1 if len(samples) else samples,
                  logit_row, draw_slot, draw_pos, forced, *lora_fields]
        sizes = [len(f) for f in fields]
        packed = self.to_device(np.concatenate(fields).astype(np.int64, copy=False))
        parts = list(packed.split(sizes))
        (ids_N, pos_N, slot_map_N, row_slot_B, ctx_len_B, sample_idx_R, logit_row_D, draw_slot_D, draw_pos_D,
         forced_D) = parts[:10]
        decoder = self.registry.decoder_for(rows[0].adapter)[0]
        attn = StepAttention(self.pool.k, self.pool.v, self.block_size, slot_map_N,
                             self.block_table_P_M.index_select(0, row_slot_B), ctx_len_B, n, end, self.triton)
        lora = None
        if lora_kind == "triton":
            lora = SlotLora.per_token(self.registry.slots, self.scales(), parts[10])
        elif lora_kind == "torch":
            lora = SlotLora.chunked(self.registry.slots, self.scales(), plan, parts[10], parts[11],
                                   self.registry.dtype)
        elif lora_kind == "legacy":
            adapters = [self.registry.decoder_for(s.adapter)[2] for s in rows]
            lora = LoraBatch(adapters, batch.num_tokens, method=self.lora_method, stack_cache=self._stacks)
        h_N_H = decoder(ids_N, pos_N, attn, lora)
        if not len(drawing):
            return []
        logits_D_V = decoder.logits(h_N_H.index_select(0, sample_idx_R)).index_select(0, logit_row_D)
        params = [s.params for s in drawing]
        tokens_D, logp_D = sampling.draw(
            logits_D_V, self.temperature_P.index_select(0, draw_slot_D), self.top_k_P.index_select(0, draw_slot_D),
            self.top_p_P.index_select(0, draw_slot_D), self.seed_P.index_select(0, draw_slot_D), draw_pos_D,
            max(p.top_k for p in params), any(p.top_p < 1 for p in params), forced_D if len(forced) else None)
        return _read(tokens_D, logp_D)

    def _lora_kind(self, batch: ScheduledBatch) -> str | None:
        """How this batch's LoRA runs: ``"triton"``, ``"torch"`` (:class:`SlotLora`),
        ``"legacy"`` (:class:`LoraBatch`), or None (no row has LoRA)."""
        if batch.copy_key != "base" or all(s < 0 for s in batch.adapter_slots):
            return None
        if self.lora_method != "slots" or self.registry.slots.dtype != torch.float32:
            return "legacy"
        return "triton" if self.triton else "torch"


def _read(tokens_D: torch.Tensor, logp_D: torch.Tensor) -> Drawn:
    """The drawn tokens and log-probs on the host: the step's one device-to-host read."""
    both = torch.stack([tokens_D.to(torch.float64), logp_D.to(torch.float64)]).cpu().tolist()
    return [(int(t), float(lp)) for t, lp in zip(both[0], both[1])]


class DecodeGraphs:
    """Decode steps captured in CUDA graphs, one per batch-size bucket, sharing one memory pool.

    A graph's inputs are views of one static int64 buffer (token ids, positions, the KV slot
    each token writes, row slots, context lengths, adapter slots), filled from the host in one
    copy before each replay; its outputs are the drawn tokens and log-probs. Graphs are
    captured on first use of a bucket and dropped when the LoRA store is laid out anew or the
    decoder changes (their pointers would be stale). Padding rows: token 0 at position 0,
    writing the pool's scratch slot, attending to nothing (context 0), adapter slot -1, row
    slot :attr:`ModelRunner.pad_slot`."""

    def __init__(self, runner: ModelRunner, max_rows: int) -> None:
        self.runner = runner
        self.buckets = [b for b in GRAPH_BUCKETS if b < max_rows] + [max_rows]
        self.max_batch = max_rows
        self.static = torch.zeros(6 * max_rows, dtype=torch.int64, device=runner.device)
        self.graphs: dict[int, tuple[Callable[[], None], torch.Tensor, torch.Tensor]] = {}
        self.key: tuple | None = None
        self.pool = None
        self.replays = 0
        """Decode steps replayed from a captured graph (the engine's ``engine/graph_steps``)."""

    def _views(self, B: int) -> list[torch.Tensor]:
        """ids, pos, slot_map, row_slot, ctx_len, adapter_slot: ``[B]`` views of the buffer."""
        M = self.max_batch
        return [self.static[i * M:i * M + B] for i in range(6)]

    def _fill(self, B: int, batch: ScheduledBatch | None) -> None:
        """The static buffer for ``B`` rows: the batch's rows, then padding rows."""
        r = self.runner
        host = np.zeros((6, self.max_batch), dtype=np.int64)
        host[2, :] = r.pool.scratch_slot
        host[3, :] = r.pad_slot
        host[5, :] = -1
        if batch is not None:
            rows = batch.rows
            n = len(rows)
            pos = np.array([s.num_computed for s in rows], dtype=np.int64)
            host[0, :n] = [s.tokens[p] for s, p in zip(rows, pos)]
            host[1, :n] = pos
            host[2, :n] = [s.slots_S[p] for s, p in zip(rows, pos)]
            host[3, :n] = [s.row_slot for s in rows]
            host[4, :n] = pos + 1
            host[5, :n] = batch.adapter_slots
        self.static.copy_(r.to_device(host.reshape(-1)))

    def _body(self, B: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One decode step of ``B`` rows on the static inputs (what a graph captures)."""
        r = self.runner
        ids, pos, slot_map, row_slot, ctx_len, adapter_slot = self._views(B)
        decoder = r.registry.decoder
        attn = StepAttention(r.pool.k, r.pool.v, r.block_size, slot_map, r.block_table_P_M.index_select(0, row_slot),
                             ctx_len, np.ones(B, dtype=np.int64), np.ones(B, dtype=np.int64), triton=True)
        lora = SlotLora.per_token(r.registry.slots, r.scales(), adapter_slot) if r.registry.slots.capacity else None
        h = decoder(ids, pos, attn, lora)
        return sampling.draw(decoder.logits(h), r.temperature_P.index_select(0, row_slot),
                              r.top_k_P.index_select(0, row_slot), r.top_p_P.index_select(0, row_slot),
                              r.seed_P.index_select(0, row_slot), pos + 1, 0, False)

    def _capture(self, B: int) -> tuple[Callable[[], None], torch.Tensor, torch.Tensor]:
        self._fill(B, None)
        if self.runner.device.type != "cuda":
            # No graphs off CUDA: a "replay" runs the same body on the static buffers, so the
            # buffers, buckets and padding rows are tested on CPU (triton's interpreter).
            tokens = torch.empty(B, dtype=torch.int64)
            logp = torch.empty(B, dtype=torch.float32)

            def replay() -> None:
                t, lp = self._body(B)
                tokens.copy_(t)
                logp.copy_(lp)
            return replay, tokens, logp
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # compile the kernels and settle the allocator first
            self._body(B)
        torch.cuda.current_stream().wait_stream(stream)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            tokens, logp = self._body(B)
        return graph.replay, tokens, logp

    def run(self, batch: ScheduledBatch) -> Drawn:
        """Replay (capturing first if needed) the bucket's graph for this decode batch."""
        r = self.runner
        key = (id(r.registry.decoder), r.registry.slots.relayouts, r.registry.slots.capacity, id(r.pool.k))
        if key != self.key:
            self.graphs.clear()
            self.key = key
        n = len(batch.rows)
        B = next(b for b in self.buckets if b >= n)
        if B not in self.graphs:
            self.graphs[B] = self._capture(B)
        replay, tokens, logp = self.graphs[B]
        r.scales()  # an adapter placed in a free slot since: its alpha / r, in place where the graph reads it
        self._fill(B, batch)
        replay()
        self.replays += 1
        return _read(tokens[:n], logp[:n])
