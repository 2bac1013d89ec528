"""The engine's step loop: continuous batching over a paged, prefix-reusing KV cache, with
every row's adapter applied by batched LoRA on the shared base weights.

Each :meth:`Engine.step` is one forward pass of the decoder over a flat batch of tokens:

1. cancelled rows leave (their blocks are freed at once);
2. waiting rows are admitted in arrival order while KV blocks and row slots last: each
   reserves blocks for its prompt plus ``max_tokens`` (so a running row never runs out and
   nothing is ever preempted), reusing whatever prefix of its prompt is cached under its
   (model copy, adapter, version) key; a row whose whole prompt another row is computing
   under the same key becomes that row's *twin*: it computes nothing, and when the prompt is
   done it takes the other row's keys and values (copied, at most a block's worth beyond the
   shared cached blocks) and draws its first token from the same logits with its own seed;
   a row sharing only a part of another's prompt being computed waits a step to reuse it;
3. every decoding row gets one token and the prompts still being prefilled get chunks, oldest
   first, within ``max_batch_tokens`` (decodes first: a long prompt never stalls the rows
   already talking);
4. rows are ordered by adapter (batched LoRA's segments) and run in ONE forward; only the last
   position of each row that completes its chunk goes through the vocabulary projection;
5. those rows draw their next token on the device (:mod:`opentinker.engine.sampling`: the
   draw depends on (seed, position) only, so it does not matter which rows share the step);
   finished rows free their blocks, which stay in the prefix index (least recently used
   evicted first), so a seat's next turn, which extends this prompt and reply, prefills only
   its new tokens.

The step loop is synchronous and single-threaded (the scheduler service calls it from its
compute thread, between training operations). The nano-vllm engine
(GeeeekExplorer/nano-vllm, ``engine/scheduler.py``, ``block_manager.py``) has the same shape;
unlike it, one step mixes prefill chunks and decodes (as vLLM v1 does), and blocks are
reserved up front instead of preempting.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field

import numpy as np
import torch

from opentinker.engine.kv_cache import BlockManager, KVPool
from opentinker.engine.memory import OverBudget, trim_heap, tune_malloc
from opentinker.engine.model import PagedAttention, PagedLayout
from opentinker.engine.model.lora import DEFAULT_METHOD, LoraBatch, LoraStackCache
from opentinker.engine.registry import UnknownAdapterError
from opentinker.engine.sampling import SamplingBatch
from opentinker.engine.sequence import SeqStatus, Sequence
from protocols.messages import SamplingParams, StopReason

TRIM_INTERVAL_S = 1.0
"""Least time between two hand-backs of the heap's free pages when the engine goes idle."""


Drawn = tuple[list["tuple[int, float] | None"], dict[int, tuple[int, float]]]
"""What a forward draws: (token, log-prob) or None per planned row, and by ``seq_id`` for twins."""


class RequestTooLarge(ValueError):
    """A request that can never run: longer than the model's context, or needing more KV
    blocks than the whole pool holds. The message says which, with the numbers."""


@dataclass
class EngineStats:
    """Counters since the engine started (the scheduler's metrics read them)."""

    steps: int = 0
    rows: int = 0
    """Sum over steps of rows in the step (mean rows per step = rows / steps)."""
    prefill_tokens: int = 0
    """Prompt tokens computed (cached prefixes excluded)."""
    decode_tokens: int = 0
    """Tokens drawn."""
    cached_tokens: int = 0
    """Prompt tokens taken from the prefix cache at admission."""
    prompt_tokens: int = 0
    """Prompt tokens admitted (cached or not)."""
    forward_s: float = 0.0
    finished: int = 0
    cancelled: int = 0
    deferred: int = 0
    """Admissions put off by a step so a row could reuse another's prompt being computed."""
    twinned: int = 0
    """Rows that took the prompt KV and last logits of a row with the same prompt (a twin)
    instead of computing them."""
    twin_tokens: int = 0
    """Prompt tokens of those rows copied from their twin (not cached, not computed):
    ``prompt_tokens = prefill_tokens + cached_tokens + twin_tokens``."""
    last_step_rows: int = 0
    per_step_rows: collections.deque = field(default_factory=lambda: collections.deque(maxlen=256))


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
        lora_method: str = DEFAULT_METHOD,
        copy_id: Hashable = 0,
    ) -> None:
        spec = registry.decoder.spec
        self.registry = registry
        self.device = registry.device
        self.copy_id = copy_id
        if self.device.type == "cpu":
            tune_malloc()  # activations reused from the heap, not re-faulted each layer
        self.max_batch_tokens = int(max_batch_tokens)
        self.max_rows = int(max_rows)
        if self.max_batch_tokens < 1 or self.max_rows < 1:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) and max_rows ({max_rows}) must be >= 1")
        self.max_context = int(registry.max_context)
        dtype = registry.dtype
        blocks = KVPool.blocks_for_budget(kv_budget_bytes, spec.num_layers, spec.num_kv_heads, spec.head_dim,
                                          block_size, dtype)
        self.pool = KVPool(spec.num_layers, spec.num_kv_heads, spec.head_dim, block_size, blocks, dtype,
                           self.device)
        self.blocks = BlockManager(blocks, block_size, self.pool.bytes_per_block)
        self.block_size = block_size
        self.lora_method = lora_method
        self._stacks = LoraStackCache()
        self.waiting: collections.deque[Sequence] = collections.deque()
        self._busy = False
        self._last_trim = float("-inf")
        self.running: list[Sequence] = []
        self._n_twins = 0
        """Admitted rows waiting on a running twin's prompt (they count against ``max_rows``)."""
        self.held: set[str] = set()
        """Adapters whose waiting rows are not admitted (an optimizer step waits for their
        running rows to finish, so no row straddles two versions)."""
        self.hold: Callable[[Sequence], bool] | None = None
        """Also not admitted while this says so (a shared scheduler holds back the rows of a
        job over its share of compute while another job waits)."""
        self.pause: Callable[[Sequence], bool] | None = None
        """Running rows this says so of sit a step out, keeping their KV blocks, while other rows
        compute (a shared scheduler pauses the rows of a job over its share of compute); when
        every running row would sit out, all compute."""
        self.kv_full = False
        """An admission stopped for lack of KV blocks since the waiting queue was last empty:
        the rows running are what fits."""
        self.on_admit: Callable[[Sequence], None] | None = None
        """Called with each row the engine admits (to running, or as a running row's twin)."""
        self.stats = EngineStats()
        self._ids = itertools.count()
        registry.pinned = lambda: {s.adapter for s in self.running if s.adapter is not None}

    # ------------------------------------------------------------------------------- intake

    def check(self, prompt: np.ndarray, params: SamplingParams) -> None:
        """Raise :class:`RequestTooLarge` / ``ValueError`` for a row that can never run."""
        need = len(prompt) + params.max_tokens
        if need > self.max_context:
            raise RequestTooLarge(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {need} "
                                  f"exceeds the model's context of {self.max_context} tokens")
        blocks = -(-need // self.block_size)
        if blocks > self.blocks.num_blocks:
            raise RequestTooLarge(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} needs {blocks} KV blocks "
                f"({blocks * self.pool.bytes_per_block} bytes); the KV budget holds {self.blocks.num_blocks} "
                f"({self.pool.nbytes} bytes): raise the KV budget or lower max_tokens")

    def add(self, adapter: str | None, prompt: np.ndarray, params: SamplingParams, seed: int,
            owner: object = None) -> Sequence:
        """Queue one row; it joins the running batch at a coming step."""
        self.check(prompt, params)
        if adapter is not None:
            self.registry.get(adapter)
        seq = Sequence(next(self._ids), adapter, np.asarray(prompt, dtype=np.int32), params, int(seed), owner)
        self.waiting.append(seq)
        return seq

    def cancel(self, seqs: Iterable[Sequence]) -> None:
        """Mark rows cancelled: they leave at the next step, their blocks freed."""
        for s in seqs:
            s.cancelled = True

    def has_work(self) -> bool:
        return bool(self.running) or any(not self._held(s) for s in self.waiting)

    def _held(self, seq: Sequence) -> bool:
        return seq.adapter in self.held or (self.hold is not None and self.hold(seq))

    def rows_of(self, adapter: str) -> int:
        """Running rows of ``adapter``."""
        return sum(1 for s in self.running if s.adapter == adapter)

    def retire(self, adapter: str) -> None:
        """Forget every cached prefix of ``adapter`` (after its weights changed)."""
        self.blocks.retire_where(lambda ns: ns[1] == adapter)

    # ------------------------------------------------------------------------------- the step

    def _namespace(self, adapter: str | None) -> tuple[Hashable, str | None, int]:
        """The prefix-cache key of a row: (model copy, adapter, version)."""
        return (self.registry.decoder_for(adapter)[1], adapter, self.registry.version(adapter))

    def _finish(self, seq: Sequence, reason: StopReason | None) -> None:
        self._release_twins(seq)
        if seq.alloc is not None:
            self.blocks.free(seq.alloc)
            seq.alloc = None
        seq.status = SeqStatus.FINISHED
        seq.stop_reason = reason
        if reason is None and seq.error is None:
            self.stats.cancelled += 1
        else:
            self.stats.finished += 1

    def _admit(self) -> list[Sequence]:
        """Move waiting rows into the running set while blocks and row slots last."""
        gone: list[Sequence] = []
        keep: collections.deque[Sequence] = collections.deque()
        # Rows computing their prompt, by (namespace, prompt): a waiting row with the same key
        # becomes their twin instead of computing it again (a group's first turns).
        prefilling = {(s.namespace, s.prompt.tobytes()): s for s in self.running
                      if s.num_computed < s.num_prompt and s.leader is None}
        while self.waiting:
            seq = self.waiting.popleft()
            if seq.cancelled:
                self._finish(seq, None)
                gone.append(seq)
                continue
            if self._held(seq) or len(self.running) + self._n_twins >= self.max_rows:
                keep.append(seq)
                continue
            if seq.adapter is not None and seq.adapter not in self.registry.adapters:
                seq.error = UnknownAdapterError(f"adapter {seq.adapter!r} was dropped before its rows ran")
                self._finish(seq, None)
                gone.append(seq)
                continue
            if seq.adapter is not None:
                try:
                    self.registry.get(seq.adapter)  # resident now (others may spill)
                except OverBudget as e:
                    if self.running:  # it fits once rows of other adapters finish
                        keep.append(seq)
                        continue
                    seq.error = e
                    self._finish(seq, None)
                    gone.append(seq)
                    continue
            ns = self._namespace(seq.adapter)
            leader = prefilling.get((ns, seq.prompt.tobytes()))
            if leader is not None:  # the same prompt is being computed: take its KV and logits
                seq.leader = leader
                leader.twins.append(seq)
                self._n_twins += 1
                if self.on_admit is not None:
                    self.on_admit(seq)
                continue
            if self._prefilling_same_prefix(ns, seq):
                keep.append(seq)  # joins next step, reusing that row's prompt instead of recomputing it
                self.stats.deferred += 1
                continue
            if not self.blocks.can_allocate(ns, seq.tokens, seq.params.max_tokens):
                self.kv_full = True
                keep.append(seq)
                keep.extend(self.waiting)  # first come, first served: nobody jumps the queue
                self.waiting.clear()
                break
            self._start(seq, ns)
            if self.on_admit is not None:
                self.on_admit(seq)
            prefilling[(ns, seq.prompt.tobytes())] = seq
        self.waiting = keep
        if not keep:
            self.kv_full = False
        return gone

    def _start(self, seq: Sequence, ns: tuple[Hashable, str | None, int]) -> None:
        """Give ``seq`` its KV blocks (its cached prefix shared) and make it a running row."""
        seq.alloc = self.blocks.allocate(ns, seq.tokens, seq.params.max_tokens)
        seq.namespace = ns
        seq.version = ns[2]
        seq.num_computed = seq.num_cached = seq.alloc.num_cached_tokens
        seq.slots_S = seq.alloc.slots_tensor(0, seq.alloc.num_tokens, self.device)
        seq.status = SeqStatus.RUNNING
        self.stats.cached_tokens += seq.num_cached
        self.stats.prompt_tokens += seq.num_prompt
        self.running.append(seq)

    def _release_twins(self, seq: Sequence) -> None:
        """``seq`` leaves before its prompt is computed: its twins wait again, at the front of
        the queue in their order (the next admission computes the prompt for them)."""
        if seq.twins:
            for t in seq.twins:
                t.leader = None
            self._n_twins -= len(seq.twins)
            self.waiting.extendleft(reversed(seq.twins))
            seq.twins = []

    def _start_twins(self, leader: Sequence, draws: dict[int, tuple[int, float]],
                     progressed: list[Sequence], finished: list[Sequence]) -> None:
        """``leader`` computed its prompt this step: each twin gets its own blocks (the prompt's
        cached prefix shared, now that the leader indexed it), the keys and values of the
        rest of the prompt copied from the leader's slots, and the token it drew from the
        leader's last logits. A twin that no longer fits (blocks or row slots) waits again."""
        twins, leader.twins = leader.twins, []
        self._n_twins -= len(twins)
        back: list[Sequence] = []
        started: list[Sequence] = []
        L, ns = leader.num_prompt, leader.namespace
        src, dst = [], []
        for t in twins:
            t.leader = None
            if t.cancelled:
                self._finish(t, None)
                finished.append(t)
                continue
            if len(self.running) >= self.max_rows or not self.blocks.can_allocate(ns, t.tokens, t.params.max_tokens):
                back.append(t)
                continue
            self._start(t, ns)
            src.append(leader.slots_S[t.num_computed:L])
            dst.append(t.slots_S[t.num_computed:L])
            self.stats.twinned += 1
            self.stats.twin_tokens += L - t.num_computed
            t.num_computed = L
            self.blocks.commit(t.alloc, t.tokens[:L])
            started.append(t)
        if src:
            self.pool.copy_slots(torch.cat(src), torch.cat(dst))
        for t in started:  # after the copy: a twin that stops at once frees its blocks
            self._take(t, *draws[t.seq_id], progressed, finished)
        self.waiting.extendleft(reversed(back))

    def _prefilling_same_prefix(self, ns: Hashable, seq: Sequence) -> bool:
        """Whether a running row of the same namespace is still computing at least one whole
        block of ``seq``'s prompt that the prefix index does not hold yet: rows with the same
        prompt (a group's first turns) then compute it once, not once each."""
        _, cached = self.blocks.match(ns, seq.tokens)
        prompt = seq.prompt
        for other in self.running:
            if other.namespace != ns or other.num_computed >= other.num_prompt:
                continue
            n = min(len(prompt), other.num_prompt)
            differ = np.nonzero(other.prompt[:n] != prompt[:n])[0]
            common = int(differ[0]) if len(differ) else n
            if common - cached >= self.block_size:
                return True
        return False

    def step(self) -> tuple[list[Sequence], list[Sequence]]:
        """Run one step. Returns ``(progressed, finished)``: rows that drew a token this step,
        and rows that ended (finished, cancelled or dropped), each once."""
        finished: list[Sequence] = []
        for t in [t for s in self.running for t in s.twins if t.cancelled]:
            t.leader.twins.remove(t)
            t.leader = None
            self._n_twins -= 1
            self._finish(t, None)
            finished.append(t)
        for seq in [s for s in self.running if s.cancelled]:
            self.running.remove(seq)
            self._finish(seq, None)
            finished.append(seq)
        finished += self._admit()
        if not self.running:
            self._went_idle()
            return [], finished
        rows = self.running
        if self.pause is not None:
            rows = [s for s in self.running if not self.pause(s)] or self.running
        # Decoding rows first, then prefill chunks in admission order, within the token budget.
        budget = self.max_batch_tokens
        plan: list[tuple[Sequence, int]] = []
        for seq in rows:
            if seq.pending == 1 and budget > 0:
                plan.append((seq, 1))
                budget -= 1
        for seq in rows:
            if seq.pending > 1 and budget > 0:
                n = min(seq.pending, budget)
                plan.append((seq, n))
                budget -= n
        # Rows grouped by adapter, in slot order: batched LoRA then reads consecutive slots in place.
        slot_of = self.registry.slot_of
        plan.sort(key=lambda p: (p[0].adapter is not None, slot_of(p[0].adapter), p[0].adapter or ""))
        t0 = time.perf_counter()
        drawn, twin_draws = self._forward(plan)
        self.stats.forward_s += time.perf_counter() - t0
        self.stats.steps += 1
        self.stats.rows += len(plan)
        self.stats.last_step_rows = len(plan)
        self.stats.per_step_rows.append(len(plan))
        progressed: list[Sequence] = []
        for (seq, n), tok_lp in zip(plan, drawn):
            seq.num_computed += n
            if seq.num_computed <= seq.num_prompt:
                self.stats.prefill_tokens += n
            else:
                self.stats.prefill_tokens += max(0, seq.num_prompt - (seq.num_computed - n))
            self.blocks.commit(seq.alloc, seq.tokens[: seq.num_computed])
            if seq.twins and seq.num_computed == seq.num_prompt:
                self._start_twins(seq, twin_draws, progressed, finished)
            if tok_lp is not None:
                self._take(seq, *tok_lp, progressed, finished)
        self._busy = True
        if not self.running and not self.waiting:
            self._went_idle()
        return progressed, finished

    def _take(self, seq: Sequence, tok: int, lp: float, progressed: list[Sequence], finished: list[Sequence]) -> None:
        """Append the drawn token to a running row; it ends on a stop token or at ``max_tokens``."""
        seq.tokens.append(tok)
        seq.out_tokens.append(tok)
        seq.out_logprobs.append(lp)
        self.stats.decode_tokens += 1
        progressed.append(seq)
        reason = None
        if tok in seq.params.stop_token_ids:
            reason = StopReason.STOP
        elif len(seq.out_tokens) >= seq.params.max_tokens:
            reason = StopReason.LENGTH
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason)
            finished.append(seq)

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

    def _forward(self, plan: list[tuple[Sequence, int]]) -> Drawn:
        """The drawn (token, log-prob) of each planned row whose chunk reaches its last token,
        else None, and those of the twins of rows that complete their prompt (by twin
        ``seq_id``): one forward per model copy in the plan (the base with its LoRA adapters,
        and each full-parameter policy's private copy)."""
        groups: dict[int, list[int]] = {}
        for i, (seq, _) in enumerate(plan):
            groups.setdefault(id(self.registry.decoder_for(seq.adapter)[0]), []).append(i)
        if len(groups) == 1:
            return self._forward_copy(plan)
        out: list[tuple[int, float] | None] = [None] * len(plan)
        twins: dict[int, tuple[int, float]] = {}
        for rows in groups.values():
            drawn, t = self._forward_copy([plan[i] for i in rows])
            twins.update(t)
            for i, r in zip(rows, drawn):
                out[i] = r
        return out, twins

    @torch.no_grad()
    def _forward_copy(self, plan: list[tuple[Sequence, int]]) -> Drawn:
        """One forward over the planned chunks of rows of one model copy; a row completing its
        prompt draws for its twins too, from the same logits."""
        dev = self.device
        ids, pos, q_start, q_len, ctx_len, slots_write, ctx_rows = [], [], [], [], [], [], []
        start = 0
        for seq, n in plan:
            a, b = seq.num_computed, seq.num_computed + n
            ids.append(torch.as_tensor(seq.tokens[a:b], dtype=torch.long))
            pos.append(torch.arange(a, b, dtype=torch.long))
            slots_write.append(seq.slots_S[a:b])
            ctx_rows.append(seq.slots_S[:b])
            q_start.append(start)
            q_len.append(n)
            ctx_len.append(b)
            start += n
        ids_N = torch.cat(ids).to(dev)
        pos_N = torch.cat(pos).to(dev)
        slot_mapping_N = torch.cat(slots_write)
        ctx_slots_B_C = torch.nn.utils.rnn.pad_sequence(ctx_rows, batch_first=True)
        layout = PagedLayout(slot_mapping_N, q_start, q_len, ctx_len, ctx_slots_B_C)
        attn = PagedAttention(self.pool.k, self.pool.v, layout)
        reg = self.registry
        found = [reg.decoder_for(seq.adapter) for seq, _ in plan]
        decoder = found[0][0]
        adapters = [lora for _, _, lora in found]
        lora = None if all(a is None for a in adapters) else LoraBatch(
            adapters, q_len, method=self.lora_method, stack_cache=self._stacks)
        h_N_H = decoder(ids_N, pos_N, attn, lora)
        sampling = [i for i, (seq, n) in enumerate(plan) if seq.num_computed + n == len(seq.tokens)]
        out: list[tuple[int, float] | None] = [None] * len(plan)
        if not sampling:
            return out, {}
        last = torch.as_tensor([q_start[i] + q_len[i] - 1 for i in sampling], dtype=torch.long, device=dev)
        logits_R_V = decoder.logits(h_N_H.index_select(0, last))
        rows = [plan[i][0] for i in sampling]
        # Twins draw from their leader's logits row (the same prompt under the same weights).
        twins = [(r, t) for r, i in enumerate(sampling) for t in plan[i][0].twins if not t.cancelled]
        if twins:
            logits_R_V = torch.cat([logits_R_V, logits_R_V[torch.as_tensor([r for r, _ in twins], device=dev)]])
            rows = rows + [t for _, t in twins]
        batch = SamplingBatch.from_params([s.params for s in rows], [s.seed for s in rows],
                                          [len(s.tokens) for s in rows], dev)
        tokens_R, logp_R = batch.sample(logits_R_V)
        drawn = list(zip(tokens_R.tolist(), logp_R.float().tolist()))
        for i, (t, lp) in zip(sampling, drawn):
            out[i] = (int(t), float(lp))
        return out, {t.seq_id: (int(tok), float(lp)) for (_, t), (tok, lp) in zip(twins, drawn[len(sampling):])}

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
