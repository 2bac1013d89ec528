"""The engine's scheduler: which rows run in a step and how many tokens each computes.

Plain Python over lists and numpy arrays, no tensors (nano-vllm's ``engine/scheduler.py`` and
vLLM v1's ``Scheduler`` have this role; the tensors are :mod:`opentinker.engine.model_runner`'s).
One step is three calls:

1. :meth:`Scheduler.admit`: cancelled rows leave (their blocks are freed at once); waiting rows
   are admitted in arrival order while KV blocks and row slots last (while the pool is short,
   warm rows first: :meth:`Scheduler._warm_first`). Each reserves blocks for
   its prompt plus ``max_tokens`` (a running row never runs out, nothing is preempted), reusing
   whatever prefix of its prompt is cached under its (model copy, adapter, version) key. A row
   whose whole prompt another row is computing under the same key becomes that row's *twin*: it
   computes nothing, and when the prompt is done it takes the other row's keys and values
   (copied by the runner, at most a block's worth beyond the shared cached blocks) and draws its
   first token from the same logits with its own seed. A row sharing only a part of another's
   prompt being computed waits a step to reuse it.
2. :meth:`Scheduler.schedule`: every decoding row gets one token and the prompts still being
   prefilled get chunks, oldest first, within ``max_batch_tokens`` (decodes first: a long
   prompt never stalls the rows already talking); rows are ordered by adapter slot (batched
   LoRA reads each adapter's matrices once) and cut into one :class:`ScheduledBatch` per model
   copy (the base with its adapters, and each full-parameter policy's private copy).
3. :meth:`Scheduler.update` with the tokens the runner drew: rows advance, twins start, rows
   that drew a stop token or reached ``max_tokens`` finish and free their blocks, which stay in
   the prefix index (least recently used evicted first), so a seat's next turn prefills only its
   new tokens.

Every admitted row (twins included) holds a *row slot* in ``[0, max_rows)`` for as long as it
runs: the model runner keeps the row's sampling parameters and block table at that slot and
writes them once, when the slot changes hands (:attr:`Sequence.row_slot`).
"""

from __future__ import annotations

import collections
import itertools
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

import numpy as np

from opentinker.engine.kv_cache import BlockManager
from opentinker.engine.memory import OverBudget
from opentinker.engine.registry import UnknownAdapterError
from opentinker.engine.sequence import SeqStatus, Sequence
from protocols.messages import SamplingParams, StopReason

__all__ = [
    "WARM_FIRST_PATIENCE",
    "WARM_FIRST_WINDOW",
    "EngineStats",
    "RequestTooLarge",
    "ScheduledBatch",
    "Scheduler",
]

WARM_FIRST_PATIENCE = 256
"""Admissions a waiting row may be passed over by warmer rows while the KV pool is short;
then it goes first, in arrival order (no row waits forever behind a stream of warm ones).
256 steps are ~1-2 minutes of a CPU rollout and a few seconds on a GPU."""
WARM_FIRST_WINDOW = 64
"""Waiting rows the warm-first order ranks, from the front of the queue (the rest keep their
places behind them): finding a row's cached prefix walks its prompt block by block, so a long
queue of long prompts would cost a step milliseconds of Python."""


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


@dataclass(eq=False)
class ScheduledBatch:
    """One forward of one model copy: what the scheduler hands the model runner."""

    copy_key: Hashable
    """The model copy that computes (``"base"``: the shared base and its LoRA adapters)."""
    rows: list[Sequence]
    """Rows in forward order: by adapter slot, so one adapter's tokens are contiguous."""
    num_tokens: list[int]
    """Tokens each row computes this step: ``rows[b].tokens[num_computed : num_computed + n]``."""
    adapter_slots: list[int]
    """Each row's adapter slot in the LoRA store (-1: no LoRA: the bare base, or a full copy)."""
    samples: list[int]
    """Indices into ``rows`` of the rows whose chunk reaches their last token: they draw."""
    twins: list[tuple[int, Sequence]]
    """``(index into samples, twin)``: a twin draws from that row's logits with its own seed."""

    @property
    def decode(self) -> bool:
        """Every row computes one token (a pure decode step)."""
        return all(n == 1 for n in self.num_tokens)

    @property
    def drawing(self) -> list[Sequence]:
        """The rows that draw, in the order of the runner's result: samples, then twins."""
        return [self.rows[i] for i in self.samples] + [t for _, t in self.twins]


Drawn = list[tuple[int, float]]
"""``(token, log-prob)`` per drawing row of a batch (:attr:`ScheduledBatch.drawing` order)."""


class Scheduler:
    """Waiting and running rows of one engine, their KV blocks and row slots.

    ``registry`` answers, in plain Python: an adapter's model copy and LoRA slot
    (``decoder_for``, ``slot_of``), its version, and whether it is resident (``get``)."""

    def __init__(self, registry, blocks: BlockManager, max_context: int, max_batch_tokens: int,
                 max_rows: int, copy_kv: Callable[[np.ndarray, np.ndarray], None],
                 bytes_per_block: int) -> None:
        """``copy_kv(src_slots, dst_slots)`` copies keys and values between KV slots (the
        runner's pool): a twin takes its leader's prompt that way."""
        self.registry = registry
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_context = int(max_context)
        self.max_batch_tokens = int(max_batch_tokens)
        self._max_rows = self.row_slots = int(max_rows)
        if self.max_batch_tokens < 1 or self.row_slots < 1:
            raise ValueError(f"max_batch_tokens ({max_batch_tokens}) and max_rows ({max_rows}) must be >= 1")
        self.copy_kv = copy_kv
        self.bytes_per_block = bytes_per_block
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._n_twins = 0
        """Admitted rows waiting on a running twin's prompt (they count against ``max_rows``)."""
        self._free_slots: list[int] = list(range(self.row_slots - 1, -1, -1))
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
        """Called with each row admitted (to running, or as a running row's twin)."""
        self.fair_key: Callable[[Sequence], Hashable] | None = None
        """Who a row is for (a scheduler's bus peer): waiting rows are admitted round-robin
        over these, fewest running first, so one peer's flood of rows does not queue another's
        few behind it; ``None``: first come, first served."""
        self.stats = EngineStats()
        self._ids = itertools.count()

    @property
    def max_rows(self) -> int:
        """Most rows admitted at once (twins included); at most the row slots it was built with."""
        return self._max_rows

    @max_rows.setter
    def max_rows(self, n: int) -> None:
        if not 1 <= int(n) <= self.row_slots:
            raise ValueError(f"max_rows must be in [1, {self.row_slots}] (the row slots this engine was built with)")
        self._max_rows = int(n)

    # ------------------------------------------------------------------------------- intake

    def check(self, prompt: np.ndarray, params: SamplingParams) -> None:
        """Raise :class:`RequestTooLarge` for a row that can never run."""
        need = len(prompt) + params.max_tokens
        if need > self.max_context:
            raise RequestTooLarge(f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} = {need} "
                                  f"exceeds the model's context of {self.max_context} tokens")
        blocks = -(-need // self.block_size)
        if blocks > self.blocks.num_blocks:
            raise RequestTooLarge(
                f"prompt of {len(prompt)} tokens + max_tokens {params.max_tokens} needs {blocks} KV blocks "
                f"({blocks * self.bytes_per_block} bytes); the KV budget holds {self.blocks.num_blocks} "
                f"({self.blocks.num_blocks * self.bytes_per_block} bytes): raise the KV budget or lower max_tokens")

    def add(self, adapter: str | None, prompt: np.ndarray, params: SamplingParams, seed: int,
            owner: object = None, forced: np.ndarray | None = None) -> Sequence:
        """Queue one row; it joins the running batch at a coming step. With ``forced``
        (``int32[F]``, ``F <= max_tokens``) it takes those tokens instead of drawing."""
        self.check(prompt, params)
        if forced is not None and not 1 <= len(forced) <= params.max_tokens:
            raise ValueError(f"a forced reply of {len(forced)} tokens: want 1 to max_tokens ({params.max_tokens})")
        if adapter is not None:
            self.registry.get(adapter)
        seq = Sequence(next(self._ids), adapter, np.asarray(prompt, dtype=np.int32), params, int(seed), owner,
                       forced=None if forced is None else np.asarray(forced, dtype=np.int32))
        self.waiting.append(seq)
        return seq

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

    # ------------------------------------------------------------------------------- admission

    def _namespace(self, adapter: str | None) -> tuple[Hashable, str | None, int]:
        """The prefix-cache key of a row: (model copy, adapter, version)."""
        return (self.registry.decoder_for(adapter)[1], adapter, self.registry.version(adapter))

    def _take_slot(self, seq: Sequence) -> None:
        seq.row_slot = self._free_slots.pop()

    def _finish(self, seq: Sequence, reason: StopReason | None) -> None:
        self._release_twins(seq)
        if seq.alloc is not None:
            self.blocks.free(seq.alloc)
            seq.alloc = None
        if seq.row_slot >= 0:
            self._free_slots.append(seq.row_slot)
            seq.row_slot = -1
        seq.status = SeqStatus.FINISHED
        seq.stop_reason = reason
        if reason is None and seq.error is None:
            self.stats.cancelled += 1
        else:
            self.stats.finished += 1

    def admit(self) -> list[Sequence]:
        """Drop cancelled rows and admit waiting ones; returns the rows that ended."""
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
        return finished + self._admit()

    def _fair_order(self) -> None:
        """Reorder the waiting rows by :attr:`fair_key`: each row ranks by the rows of its key
        running or ahead of it in the queue (the k-th waiting row of a key with r running
        ranks r + k), ties by arrival. One key only: the order stays."""
        if self.fair_key is None or len(self.waiting) < 2:
            return
        keys = [self.fair_key(s) for s in self.waiting]
        if len(set(keys)) < 2:
            return
        ahead = collections.Counter(self.fair_key(s) for s in self.running)
        ranked = []
        for i, (k, seq) in enumerate(zip(keys, self.waiting)):
            ranked.append((ahead[k], i, seq))
            ahead[k] += 1
        self.waiting = collections.deque(seq for _, _, seq in sorted(ranked, key=lambda r: r[:2]))

    def _warm_first(self) -> None:
        """While the KV pool is short (:attr:`kv_full`), admit the waiting rows whose prompt has
        the longest cached prefix first (SGLang's longest-prefix-match order), each key of
        :attr:`fair_key` keeping the places :meth:`_fair_order` gave it; rows passed over
        :data:`WARM_FIRST_PATIENCE` times go first, in arrival order. Only the first
        :data:`WARM_FIRST_WINDOW` waiting rows are ranked.

        Why: a multi-turn rollout whose conversations do not all fit the pool runs as many as
        fit, and each seat's next turn comes back while its conversation is still cached. In
        arrival order it queues behind the rows that arrived first, and by the time it is
        admitted they have evicted its blocks (a least-recently-used cache under a cyclic
        access larger than itself misses every time), so most turns prefilled their whole
        conversation again: connect four's rollout hit 0.33 of its prompt tokens in the prefix
        cache where 0.73 were earlier turns. Warm first, a seat's turns run while its blocks
        are cached, and a warm row also needs fewer fresh blocks, so more rows fit."""
        if not self.kv_full or len(self.waiting) < 2:
            return
        rows = list(itertools.islice(self.waiting, WARM_FIRST_WINDOW))
        rest = list(itertools.islice(self.waiting, WARM_FIRST_WINDOW, None))
        keys = [self.fair_key(s) for s in rows] if self.fair_key is not None else [None] * len(rows)
        ranked: dict[Hashable, list[tuple[int, int, int, Sequence]]] = collections.defaultdict(list)
        for i, (k, seq) in enumerate(zip(keys, rows)):
            overdue = seq.waited >= WARM_FIRST_PATIENCE
            ranked[k].append((0 if overdue else 1, 0 if overdue else -self._cached_prefix(seq), i, seq))
        order = {k: iter(sorted(r, key=lambda x: x[:3])) for k, r in ranked.items()}
        self.waiting = collections.deque([next(order[k])[3] for k in keys] + rest)

    def _cached_prefix(self, seq: Sequence) -> int:
        """Tokens of ``seq``'s prompt whose KV the prefix index holds now (0 for a row whose
        adapter is gone: admission refuses it)."""
        if seq.adapter is not None and seq.adapter not in self.registry.adapters:
            return 0
        return self.blocks.match(self._namespace(seq.adapter), seq.tokens)[1]

    def _admit(self) -> list[Sequence]:
        """Move waiting rows into the running set while blocks and row slots last (in
        :meth:`_fair_order`, then :meth:`_warm_first`)."""
        self._fair_order()
        self._warm_first()
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
                self._take_slot(seq)
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
            self._take_slot(seq)
            self._start(seq, ns)
            if self.on_admit is not None:
                self.on_admit(seq)
            prefilling[(ns, seq.prompt.tobytes())] = seq
        self.waiting = keep
        if not keep:
            self.kv_full = False
        elif self.kv_full:
            for seq in keep:
                seq.waited += 1
        return gone

    def _start(self, seq: Sequence, ns: tuple[Hashable, str | None, int]) -> None:
        """Give ``seq`` its KV blocks (its cached prefix shared) and make it a running row."""
        seq.alloc = self.blocks.allocate(ns, seq.tokens, seq.params.max_tokens)
        seq.namespace = ns
        seq.version = ns[2]
        seq.num_computed = seq.num_cached = seq.alloc.num_cached_tokens
        seq.slots_S = np.asarray(seq.alloc.slots(0, seq.alloc.num_tokens), dtype=np.int64)
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
                self._free_slots.append(t.row_slot)
                t.row_slot = -1
            self._n_twins -= len(seq.twins)
            self.waiting.extendleft(reversed(seq.twins))
            seq.twins = []

    def _start_twins(self, leader: Sequence, draws: dict[int, tuple[int, float]],
                     progressed: list[Sequence], finished: list[Sequence]) -> None:
        """``leader`` computed its prompt this step: each twin gets its own blocks (the prompt's
        cached prefix shared, now that the leader indexed it), the keys and values of the
        rest of the prompt copied from the leader's slots, and the token it drew from the
        leader's last logits. A twin that no longer fits (blocks) waits again."""
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
            if not self.blocks.can_allocate(ns, t.tokens, t.params.max_tokens):
                self._free_slots.append(t.row_slot)
                t.row_slot = -1
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
            self.copy_kv(np.concatenate(src), np.concatenate(dst))
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

    # ------------------------------------------------------------------------------- the step

    def schedule(self) -> list[ScheduledBatch]:
        """This step's work, one batch per model copy (none when nothing runs)."""
        rows = self.running
        if not rows:
            return []
        if self.pause is not None:
            rows = [s for s in self.running if not self.pause(s)] or self.running
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
        reg = self.registry
        slots = {s.adapter: reg.slot_of(s.adapter) for s, _ in plan}
        plan.sort(key=lambda p: (p[0].adapter is not None, slots[p[0].adapter], p[0].adapter or ""))
        by_copy: dict[Hashable, list[tuple[Sequence, int]]] = {}
        for seq, n in plan:
            by_copy.setdefault(reg.decoder_for(seq.adapter)[1], []).append((seq, n))
        batches = []
        for key, part in by_copy.items():
            seqs = [s for s, _ in part]
            samples = [i for i, (s, n) in enumerate(part) if s.num_computed + n == len(s.tokens)]
            twins = [(j, t) for j, i in enumerate(samples) for t in seqs[i].twins if not t.cancelled]
            batches.append(ScheduledBatch(key, seqs, [n for _, n in part], [slots[s.adapter] for s in seqs],
                                          samples, twins))
        return batches

    def update(self, batches: list[ScheduledBatch], drawn: list[Drawn]) -> tuple[list[Sequence], list[Sequence]]:
        """Advance the rows of this step's batches by what the runner computed and drew.
        Returns ``(progressed, finished)``: rows that drew a token, and rows that ended."""
        st = self.stats
        st.steps += 1
        n_rows = sum(len(b.rows) for b in batches)
        st.rows += n_rows
        st.last_step_rows = n_rows
        st.per_step_rows.append(n_rows)
        progressed: list[Sequence] = []
        finished: list[Sequence] = []
        for batch, result in zip(batches, drawn):
            by_row = dict(zip(batch.samples, result))
            twin_draws = {t.seq_id: d for (_, t), d in zip(batch.twins, result[len(batch.samples):])}
            for i, (seq, n) in enumerate(zip(batch.rows, batch.num_tokens)):
                seq.num_computed += n
                if seq.num_computed <= seq.num_prompt:
                    st.prefill_tokens += n
                else:
                    st.prefill_tokens += max(0, seq.num_prompt - (seq.num_computed - n))
                self.blocks.commit(seq.alloc, seq.tokens[: seq.num_computed])
                if seq.twins and seq.num_computed == seq.num_prompt:
                    self._start_twins(seq, twin_draws, progressed, finished)
                if i in by_row:
                    self._take(seq, *by_row[i], progressed, finished)
        return progressed, finished

    def _take(self, seq: Sequence, tok: int, lp: float, progressed: list[Sequence], finished: list[Sequence]) -> None:
        """Append the drawn token to a running row; it ends on a stop token, at ``max_tokens``,
        or after its forced reply."""
        seq.tokens.append(tok)
        seq.out_tokens.append(tok)
        seq.out_logprobs.append(lp)
        self.stats.decode_tokens += 1
        progressed.append(seq)
        reason = None
        if tok in seq.params.stop_token_ids:
            reason = StopReason.STOP
        elif len(seq.out_tokens) >= (seq.params.max_tokens if seq.forced is None else len(seq.forced)):
            reason = StopReason.LENGTH
        if reason is not None:
            self.running.remove(seq)
            self._finish(seq, reason)
            finished.append(seq)
