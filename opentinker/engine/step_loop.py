"""The engine: continuous batching over a paged, prefix-reusing KV cache, with every row's
adapter applied by batched LoRA on the shared base weights.

Two halves, as in nano-vllm (``engine/scheduler.py``, ``engine/model_runner.py``) and vLLM v1:

* the :class:`~opentinker.engine.scheduler.Scheduler` (plain Python) admits rows (KV blocks
  for prompt + ``max_tokens`` reserved up front, cached prefixes reused, twins), and each step
  plans one token per decoding row plus prefill chunks within ``max_batch_tokens``, as one
  :class:`~opentinker.engine.scheduler.ScheduledBatch` per model copy;
* the :class:`~opentinker.engine.model_runner.ModelRunner` owns the tensors: the KV pool, the
  per-slot row state, the forward (paged attention through block tables, LoRA read in place
  from the slot store) and the draw, which depends on (seed, position) only, so it does not
  matter which rows share the step; on CUDA a decode step replays a captured graph.

:class:`Engine` joins them: ``step()`` is admit, schedule, execute, update. It is synchronous
and single-threaded (the scheduler service calls it from its compute thread, between training
operations). Unlike nano-vllm, one step mixes prefill chunks and decodes (as vLLM v1 does), and
blocks are reserved up front instead of preempting.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Hashable, Iterable

import numpy as np

from opentinker.engine.kv_cache import BlockManager, KVPool
from opentinker.engine.memory import tune_malloc, trim_heap
from opentinker.engine.model_runner import ModelRunner
from opentinker.engine.scheduler import EngineStats, RequestTooLarge, Scheduler
from opentinker.engine.sequence import Sequence
from protocols.messages import SamplingParams

__all__ = ["Engine", "EngineStats", "RequestTooLarge"]

TRIM_INTERVAL_S = 1.0
"""Least time between two hand-backs of the heap's free pages when the engine goes idle."""


class Engine:
    """Continuous batching of sampling rows on one model copy with many adapters.

    ``registry`` is a :class:`~opentinker.engine.lora_registry.LoraRegistry` (the decoder and
    the adapters' LoRA tensors and versions)."""

    def __init__(
        self,
        registry,
        kv_budget_bytes: int = 256 << 20,
        block_size: int = 8,
        max_batch_tokens: int = 2048,
        max_rows: int = 256,
        lora_method: str = "slots",
        copy_id: Hashable = 0,
        cuda_graphs: bool = True,
    ) -> None:
        """``cuda_graphs``: replay decode steps from captured CUDA graphs (CUDA with triton
        only; False runs every step eagerly)."""
        spec = registry.decoder.spec
        self.registry = registry
        self.device = registry.device
        self.copy_id = copy_id
        if self.device.type == "cpu":
            tune_malloc()  # activations reused from the heap, not re-faulted each layer
        dtype = registry.dtype
        blocks = KVPool.blocks_for_budget(kv_budget_bytes, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                          block_size, dtype)
        self.pool = KVPool(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, blocks, dtype,
                           self.device)
        self.blocks = BlockManager(blocks, block_size, self.pool.bytes_per_block)
        self.block_size = block_size
        self.max_context = int(registry.max_context)
        self.runner = ModelRunner(registry, self.pool, max_rows, self.max_context, lora_method, cuda_graphs)
        self.scheduler = Scheduler(registry, self.blocks, self.max_context, max_batch_tokens, max_rows,
                                   self.runner.copy_kv, self.pool.bytes_per_block)
        self._busy = False
        self._last_trim = float("-inf")
        registry.pinned = lambda: {s.adapter for s in self.running if s.adapter is not None}

    # The scheduler's state, as the scheduler service reads and steers it.
    stats = property(lambda self: self.scheduler.stats)
    waiting = property(lambda self: self.scheduler.waiting)
    running = property(lambda self: self.scheduler.running)
    held = property(lambda self: self.scheduler.held)
    kv_full = property(lambda self: self.scheduler.kv_full)
    lora_method = property(lambda self: self.runner.lora_method)

    def _hook(name: str):  # noqa: N805 - a property factory for the scheduler's callbacks
        return property(lambda self: getattr(self.scheduler, name),
                        lambda self, fn: setattr(self.scheduler, name, fn))

    hold: Callable[[Sequence], bool] | None = _hook("hold")
    pause: Callable[[Sequence], bool] | None = _hook("pause")
    on_admit: Callable[[Sequence], None] | None = _hook("on_admit")
    max_batch_tokens: int = _hook("max_batch_tokens")
    max_rows: int = _hook("max_rows")
    del _hook

    # ------------------------------------------------------------------------------- intake

    def check(self, prompt: np.ndarray, params: SamplingParams) -> None:
        """Raise :class:`RequestTooLarge` for a row that can never run."""
        self.scheduler.check(prompt, params)

    def add(self, adapter: str | None, prompt: np.ndarray, params: SamplingParams, seed: int,
            owner: object = None, forced: np.ndarray | None = None) -> Sequence:
        """Queue one row; it joins the running batch at a coming step (with ``forced``, a
        reply given instead of drawn: :attr:`Sequence.forced`)."""
        return self.scheduler.add(adapter, prompt, params, seed, owner, forced)

    def cancel(self, seqs: Iterable[Sequence]) -> None:
        """Mark rows cancelled: they leave at the next step, their blocks freed."""
        for s in seqs:
            s.cancelled = True

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def rows_of(self, adapter: str) -> int:
        """Running rows of ``adapter``."""
        return self.scheduler.rows_of(adapter)

    def retire(self, adapter: str) -> None:
        """Forget every cached prefix of ``adapter`` (after its weights changed)."""
        self.scheduler.retire(adapter)

    # ------------------------------------------------------------------------------- the step

    def step(self) -> tuple[list[Sequence], list[Sequence]]:
        """Run one step. Returns ``(progressed, finished)``: rows that drew a token this step,
        and rows that ended (finished, cancelled or dropped), each once."""
        finished = self.scheduler.admit()
        batches = self.scheduler.schedule()
        if not batches:
            self._went_idle()
            return [], finished
        t0 = time.perf_counter()
        drawn = [self.runner.execute(b) for b in batches]
        self.stats.forward_s += time.perf_counter() - t0
        progressed, done = self.scheduler.update(batches, drawn)
        self._busy = True
        if not self.running and not self.waiting:
            self._went_idle()
        return progressed, finished + done

    def _went_idle(self) -> None:
        """The last row finished: a CPU engine gives the heap's free pages back (once per busy
        spell). A step's transients (a 2048-token prefill: ~40 MB) and the persistent
        allocations made meanwhile leave free holes in glibc's heap that the next request's
        differently sized transients do not fill, so without this each request's holes stay
        resident on top of the next one's (SmolLM2-135M, 16 adapters: +16 MB after one small
        request, measured). The next request faults back in only what it uses, so this runs at
        most once per ``TRIM_INTERVAL_S``: a rollout's many short calls in a row would otherwise
        fault their transients in again at every call."""
        now = time.monotonic()
        if self._busy and self.device.type == "cpu" and now - self._last_trim >= TRIM_INTERVAL_S:
            trim_heap()
            self._last_trim = now
        self._busy = False

    # ------------------------------------------------------------------------------- helpers

    def run_until_done(self, seqs: list[Sequence], on_step: Callable[[list[Sequence]], None] | None = None) -> None:
        """Step until every row of ``seqs`` has finished (rows of others may share the steps)."""
        while not all(s.finished for s in seqs):
            progressed, _ = self.step()
            if on_step is not None:
                on_step(progressed)

    def metrics(self) -> dict[str, int]:
        """Integer counters (totals since start) and gauges: queue depth, running rows, steps
        and rows over them, prompt tokens computed and taken from the prefix cache, tokens
        drawn, forward time, KV blocks and bytes, weights and adapter bytes (and the bytes the
        LoRA slot store reserves), adapters resident and spilled. Rates are differences of totals (the coordinator logs them per step)."""
        kv = self.blocks.stats()
        st = self.stats
        return {
            "engine/queue_depth": len(self.waiting),
            "engine/running_rows": len(self.running),
            "engine/steps": st.steps,
            "engine/rows": st.rows,
            "engine/prefill_tokens": st.prefill_tokens,
            "engine/decode_tokens": st.decode_tokens,
            "engine/prompt_tokens": st.prompt_tokens,
            "engine/cached_prompt_tokens": st.cached_tokens,
            "engine/twinned_rows": st.twinned,
            "engine/twin_prompt_tokens": st.twin_tokens,
            "engine/forward_ms": int(st.forward_s * 1000),
            "engine/graph_steps": self.runner.graphs.replays if self.runner.graphs is not None else 0,
            "engine/kv_blocks_total": kv.blocks_total,
            "engine/kv_blocks_in_use": kv.blocks_in_use,
            "engine/kv_blocks_cached": kv.blocks_cached,
            "engine/kv_bytes_total": self.pool.nbytes,
            "engine/kv_bytes_in_use": kv.bytes_in_use,
            "engine/kv_evictions": kv.evictions,
            "engine/weights_bytes": sum(p.numel() * p.element_size() for p in self.registry.decoder.parameters()),
            "engine/adapters_resident": len(self.registry.memory.resident),
            "engine/adapters_spilled": len(self.registry.memory.spilled),
            "engine/adapter_bytes_resident": self.registry.memory.resident_bytes,
            "engine/lora_store_bytes": self.registry.slots.nbytes,
            "engine/adapter_spills": self.registry.memory.spills,
            "engine/adapter_restores": self.registry.memory.restores,
        }
