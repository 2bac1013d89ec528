"""The scheduler's compute thread when the engine runs its own forward: a step loop with
training operations between steps, under a fairness policy.

Each turn of :meth:`StepWorker.run` takes every newly queued request (sample rows join the
engine at once; other operations queue per adapter), then does ONE unit of work: an engine
step, or one operation. Which one, when both wait: operations run while their decayed share of
compute time is below ``train_share`` (so neither a steady stream of sampling nor a queue of
training steps can starve the other), and adapters take turns (round-robin), so one policy's
long queue of ``forward_backward`` calls does not delay another's.

An operation that changes an adapter's weights (``optim_step``, ``drop``, a ``load`` that
replaces nothing but must not race a drop) waits until that adapter has no running rows,
holding back its new rows meanwhile: a reply is drawn by one version from first token to last.

On a shared scheduler, jobs share compute by their priorities (:class:`JobShare`): while two
or more jobs have work, each may hold at most its priority's share of the rows that fit (the
engine's row slots, or the rows running once the KV blocks ran out),
and a job whose compute time per unit of priority is ahead of the least served one's
gets no new rows admitted, no operation run and its running rows paused (they keep their KV
blocks) until that one catches up, so backlogged jobs get compute in proportion to their priorities. A job whose
work ran out stays among them for ``anticipate_s`` (its next request is usually on its way:
an RL job's next turn, its training call after its rollouts), as in anticipatory disk
scheduling: the jobs ahead of it stay held meanwhile, and it keeps what it was owed. A
``forward_backward`` there runs a part of at most ``max_batch_tokens`` tokens at a time, so
other jobs' work runs between its parts and a job's long training call cannot take it far
past its share.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from dataclasses import dataclass, field
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import numpy as np

from opentinker.engine.inference import sampled_row
from opentinker.engine.sequence import Sequence
from protocols.messages import (
    DropAdapter,
    Message,
    OptimStep,
    SampleChunk,
    SampleRequest,
    SampleResult,
)

if TYPE_CHECKING:
    from opentinker.engine.service import SchedulerService, _Job


log = logging.getLogger(__name__)

CHANGES_WEIGHTS = (OptimStep, DropAdapter)
"""Operations that wait for the adapter's running rows to finish."""


def _adapter_of(msg: Message) -> str:
    """The adapter an operation concerns (its round-robin key)."""
    for attr in ("adapter", "name"):
        value = getattr(msg, attr, None)
        if isinstance(value, str):
            return value
    return ""


@dataclass
class _SampleJob:
    job: Any
    seqs: list[Sequence]
    emit: Any = None
    chunks: int = 0
    done: bool = False


@dataclass
class FairShare:
    """Decayed compute seconds of sampling steps and of operations; operations are due while
    their share is below ``train_share``."""

    train_share: float = 0.5
    window_s: float = 10.0
    sample_s: float = 0.0
    ops_s: float = 0.0
    _last: float = field(default_factory=time.perf_counter)

    def _decay(self) -> None:
        now = time.perf_counter()
        k = math.exp(-(now - self._last) / self.window_s)
        self.sample_s *= k
        self.ops_s *= k
        self._last = now

    def charge(self, kind: str, seconds: float) -> None:
        self._decay()
        if kind == "sample":
            self.sample_s += seconds
        else:
            self.ops_s += seconds

    def ops_due(self) -> bool:
        self._decay()
        total = self.sample_s + self.ops_s
        return total == 0 or self.ops_s <= self.train_share * total


@dataclass
class JobShare:
    """Compute seconds per job of a shared scheduler while jobs contend, and which jobs are
    ahead of their share.

    Only compute while two or more jobs have work counts (a job alone takes what it asks for
    and owes nothing for it later). A job whose work ran out less than ``anticipate_s`` ago
    still contends (:meth:`contending`): it keeps its place. A job that comes back after more
    than ``window_s`` away (or for the first time) starts level with the least served
    contending one, as in start-time fair queuing; back sooner, it keeps what it was owed, so an
    operation that ran long just before the other job paused is still paid back. The ledger
    does not decay (a decay forgives part of every debt, and a job whose operations are long
    and atomic would keep more than its share): instead no job is owed more than ``window_s``
    seconds per unit of priority behind the most served one."""

    window_s: float = 10.0
    """How long a job may be away and keep its place, and the most it may be owed (seconds of
    compute per unit of priority)."""
    slack_s: float = 0.05
    """How far (seconds per unit of priority) a job may run ahead of the least served
    one before it is held back: about one engine step, so jobs alternate at that grain."""
    anticipate_s: float = 0.25
    """How long a job whose work ran out still counts as contending."""
    used: dict[str, float] = field(default_factory=dict)
    _active: frozenset[str] = frozenset()
    _seen: dict[str, tuple[float, float]] = field(default_factory=dict)
    """Job -> (when it last had work, its priority then)."""
    _gone: dict[str, float] = field(default_factory=dict)
    """Job -> when it stopped contending."""

    def __post_init__(self) -> None:
        if not (self.window_s > 0 and self.slack_s >= 0 and 0 <= self.anticipate_s <= 60):
            raise ValueError(f"JobShare: window_s {self.window_s} must be > 0, slack_s {self.slack_s} >= 0 and "
                             f"anticipate_s {self.anticipate_s} in [0, 60]")

    def charge(self, tenant: str, seconds: float) -> None:
        self.used[tenant] = self.used.get(tenant, 0.0) + seconds

    def contending(self, working: dict[str, float], now: float | None = None) -> dict[str, float]:
        """The jobs that share compute now (job -> priority): those with work (``working``),
        and those whose work ran out less than ``anticipate_s`` ago."""
        now = time.perf_counter() if now is None else now
        for t, w in working.items():
            self._seen[t] = (now, w)
        for t in [t for t, (at, _) in self._seen.items() if now - at > self.anticipate_s]:
            del self._seen[t]
            self._gone[t] = now
        return {t: w for t, (_, w) in self._seen.items()}

    def wake_at(self, working: dict[str, float]) -> float | None:
        """When the first job that contends without work stops contending (``perf_counter``
        time), or None when every contending job has work."""
        waits = [at + self.anticipate_s for t, (at, _) in self._seen.items() if t not in working]
        return min(waits, default=None)

    def ahead(self, active: dict[str, float], now: float | None = None) -> set[str]:
        """Of the contending jobs (job -> priority), those to hold back now."""
        now = time.perf_counter() if now is None else now
        stayed = [t for t in active if t in self._active]
        if stayed:
            level = min(self.used.get(t, 0.0) / active[t] for t in stayed)
            for t in active.keys() - self._active:
                if now - self._gone.pop(t, -math.inf) > self.window_s:  # back from idle: level
                    self.used[t] = max(self.used.get(t, 0.0), level * active[t])
        self._active = frozenset(active)
        if len(active) < 2:
            return set()
        top = max(self.used.get(t, 0.0) / w for t, w in active.items())
        for t, w in active.items():  # owed at most window_s per unit of priority
            self.used[t] = max(self.used.get(t, 0.0), (top - self.window_s) * w)
        norm = {t: self.used[t] / w for t, w in active.items()}
        least = min(norm.values())
        return {t for t, u in norm.items() if u > least + self.slack_s}


class StepWorker:
    """Runs the scheduler's engine and operations on the compute thread."""

    def __init__(self, scheduler: SchedulerService, train_share: float = 0.5, fair_window_s: float = 10.0,
                 anticipate_s: float = 0.25) -> None:
        if not 0.0 < train_share < 1.0:
            raise ValueError(f"train_share must be in (0, 1), got {train_share}")
        self.s = scheduler
        self.engine = scheduler.host.engine
        self.fair = FairShare(train_share, fair_window_s)
        self.ops: collections.OrderedDict[str, collections.deque[_Job]] = collections.OrderedDict()
        self.sampling: dict[int, _SampleJob] = {}
        self.parts: dict[str, Generator[None, None, Any]] = {}
        """Adapter -> the operation at its queue's head that has run some of its parts."""
        self.jobs = JobShare(fair_window_s, anticipate_s=anticipate_s)
        # Waiting rows admitted round-robin over the peers (and jobs) that sent them.
        self.engine.scheduler.fair_key = lambda seq: (getattr(seq.owner, "tenant", ""),
                                                      getattr(seq.owner, "peer", ""))
        self.behind: set[str] = set()
        """Jobs held back this turn (:class:`JobShare`); empty unless the scheduler is shared."""
        self.slots: dict[str, int] = {}
        """Row slots each job with work may fill this turn (none: no limit)."""
        self.rows: collections.Counter[str] = collections.Counter()
        """Running rows per job, counted up as the engine admits."""
        self._new_rows: list[tuple[Sequence, int]] = []
        """Rows admitted during the current step, with the tokens they had computed then."""
        self.contended = False
        """Two or more jobs have work this turn: their compute is charged to their shares."""
        self.wake_at: float | None = None
        """When a job contending without work stops contending (the compute thread wakes then)."""
        if scheduler.tenants is not None:
            self.engine.hold = self._hold
            self.engine.pause = self._pause
            self.engine.on_admit = self._admitted

    # ----------------------------------------------------------------------------- intake

    def _intake(self, block: bool) -> bool:
        """Move queued requests in; False when the scheduler stops."""
        s = self.s
        with s._cv:
            while block and not s._jobs and not s._stop:
                left = 1.0 if self.wake_at is None else self.wake_at - time.perf_counter()
                if left <= 0:
                    break  # a job stopped contending: rows held for it may run now
                s._cv.wait(timeout=min(1.0, left))
            if s._stop:
                return False
            jobs = list(s._jobs)
            s._jobs.clear()
            for job in jobs:  # an operation starts when it runs; until then it can be cancelled
                if isinstance(job.msg, SampleRequest):
                    job.started = True
        for job in jobs:
            if isinstance(job.msg, SampleRequest):
                self._add_sample(job)
            else:
                self.ops.setdefault(_adapter_of(job.msg), collections.deque()).append(job)
        return True

    def _add_sample(self, job: _Job) -> None:
        m: SampleRequest = job.msg  # type: ignore[assignment]
        host = self.s.host
        try:
            host.inference.check_sample([m.adapter] * len(m.prompts), m.prompts, [m.params] * len(m.prompts), m.forced)
            seqs = [self.engine.add(m.adapter, p, m.params, m.params.seed + i, owner=job,
                                    forced=m.forced[i] if m.forced is not None else None)
                    for i, p in enumerate(m.prompts)]
        except (ValueError, KeyError) as e:  # one bad request never fails its batch-mates
            self.s._reply(job, e)
            return
        self.sampling[id(job)] = _SampleJob(job, seqs, emit=job.emit)
        self.s.compute_counters["SampleRequest"] += 1

    # ----------------------------------------------------------------------------- work

    def run(self) -> None:
        while True:
            self._share()  # before the idle check: rows held for a job that has gone idle are free again
            idle = not self.engine.has_work() and not self.ops and not self.engine.running
            if not self._intake(block=idle):
                return
            self._cancel_abandoned()
            self._share()
            op = self._next_op()
            if op is not None and (not self.engine.has_work() or self._job_first() or self.fair.ops_due()):
                self._run_op(op)
            elif self.engine.has_work():
                self._step()
            elif op is None and self.ops:
                # Every waiting operation waits for running rows that cannot run (held):
                # nothing else can happen, so run the oldest regardless.
                self._run_op(self._pop_any())

    def _share(self) -> None:
        if self.s.tenants is None:
            return
        working = self._active_jobs()
        active = self.jobs.contending(working)
        self.wake_at = self.jobs.wake_at(working)
        self.contended = len(working) > 1  # what the counters call shared: jobs asking at once
        self.behind = self.jobs.ahead(active)
        self.rows = collections.Counter(getattr(q.owner, "tenant", "") for q in self.engine.running)
        total = sum(active.values())
        # The rows that fit: the engine's row slots, or what is running when the KV blocks ran out.
        capacity = max(1, len(self.engine.running)) if self.engine.kv_full else self.engine.max_rows
        self.slots = {t: max(1, int(capacity * w / total)) for t, w in active.items()} if len(active) > 1 else {}

    def _job_first(self) -> bool:
        """While jobs contend, an operation of a job within its share runs before a step whose
        rows all belong to jobs ahead of theirs (the split between sampling and operations,
        :class:`FairShare`, is for the work of one job, not between jobs)."""
        if not self.behind:
            return False
        return all(getattr(q.owner, "tenant", "") in self.behind for q in self.engine.running)

    def _charge(self, jobs: list[_Job], dt: float, weights: list[float] | None = None) -> None:
        """The scheduler's per-job compute counters; while jobs contend, also their shares."""
        for tenant, seconds in self.s.charge(jobs, dt, weights).items():
            if self.contended:
                self.jobs.charge(tenant, seconds)
                self.s.contended_ms[tenant] += 1000.0 * seconds

    def _admitted(self, seq: Sequence) -> None:
        self.rows.update((getattr(seq.owner, "tenant", ""),))
        self._new_rows.append((seq, seq.num_computed))

    def _hold(self, seq: Sequence) -> bool:
        """Whether the engine keeps ``seq`` waiting: its job is ahead of its share of compute,
        or fills its share of row slots."""
        tenant = getattr(seq.owner, "tenant", "")
        return tenant in self.behind or self.rows[tenant] >= self.slots.get(tenant, self.engine.max_rows)

    def _pause(self, seq: Sequence) -> bool:
        """Whether ``seq``, running, sits this step out: its job is ahead of its share of compute
        (the engine still runs it when no other row can run)."""
        return getattr(seq.owner, "tenant", "") in self.behind

    def _active_jobs(self) -> dict[str, float]:
        """Jobs with work waiting or running -> their priorities (the owner's: ``owner_priority``)."""
        tenants = {getattr(q.owner, "tenant", "") for q in (*self.engine.running, *self.engine.waiting)}
        tenants.update(q[0].tenant for q in self.ops.values())
        jobs = self.s.tenants.jobs  # type: ignore[union-attr]
        owner = self.s.tenants.owner_priority  # type: ignore[union-attr]
        return {t: jobs[t].priority if t in jobs else owner for t in tenants}

    def _next_op(self) -> tuple[str, _Job] | None:
        """The next operation in round-robin order whose adapter has no running rows if it
        changes weights (such an adapter's new rows are held back meanwhile), of a job not
        held back."""
        for adapter, queue in self.ops.items():
            job = queue[0]
            if job.tenant in self.behind:
                continue
            if isinstance(job.msg, CHANGES_WEIGHTS) and self.engine.rows_of(adapter):
                self.engine.held.add(adapter)
                continue
            return adapter, job
        return None

    def _pop_any(self) -> tuple[str, _Job]:
        adapter = next(iter(self.ops))
        return adapter, self.ops[adapter][0]

    def _run_op(self, op: tuple[str, _Job]) -> None:
        """One quantum of an operation: all of it, or on a shared scheduler one part of a
        ``ForwardBackward`` (of at most the engine's ``max_batch_tokens`` tokens; the operation
        stays at the head of its adapter's queue until its last part, and other work runs
        between parts, so a long training call cannot run a job far past its share)."""
        adapter, job = op
        queue = self.ops.pop(adapter)
        parts = self.parts.get(adapter)
        with self.s._cv:
            dropped = job.dropped
            job.started = True
        if dropped:
            queue.popleft()
            if parts is not None:
                del self.parts[adapter]
                parts.close()
            if queue:
                self.ops[adapter] = queue
            return
        if parts is None:
            self.engine.held.discard(adapter)
            quantum = self.engine.max_batch_tokens if self.s.tenants is not None else 0
            parts = self.s._run_parts(job.msg, quantum) if quantum else None
        t0 = time.perf_counter()
        done = True
        try:
            if parts is None:
                reply: Any = self.s._run(job.msg)
            else:
                next(parts)
                done = False
        except StopIteration as e:
            reply = e.value
        except Exception as e:
            reply = e
        dt = time.perf_counter() - t0
        if done:
            queue.popleft()
            self.parts.pop(adapter, None)
        else:
            self.parts[adapter] = parts  # type: ignore[assignment]
        if queue:
            self.ops[adapter] = queue  # to the back: the next adapter's turn comes first
        self.fair.charge("ops", dt)
        self.s.compute_counters[f"compute_ms/{type(job.msg).__name__}"] += int(1000 * dt)
        self.s.compute_counters["op_parts"] += 1
        self._charge([job], dt)
        if done:
            self.s._reply(job, reply)

    def _step(self) -> None:
        t0 = time.perf_counter()
        try:
            plan_clients = [getattr(q.owner.msg, "client", "") for q in self.engine.running]
            rows = [(q, q.num_computed) for q in self.engine.running]
            self._new_rows = []
            progressed, finished = self.engine.step()
            rows += self._new_rows
        except Exception as e:
            self._fail_running(e)
            return
        dt = time.perf_counter() - t0
        self.fair.charge("sample", dt)
        self.s.compute_counters["compute_ms/SampleRequest"] += int(1000 * dt)
        # Each row's share of the step: the tokens it computed (a prompt chunk costs its length, a decode 1).
        self._charge([q.owner for q, _ in rows], dt, [max(0, q.num_computed - n) for q, n in rows])
        self.s.compute_counters["engine_steps"] += 1
        if plan_clients:
            self.s.batches.append(plan_clients)
        self._stream(progressed)
        for seq in finished:
            self._maybe_done(seq.owner)

    def _stream(self, progressed: list[Sequence]) -> None:
        by_job: dict[int, list[Sequence]] = {}
        for seq in progressed:
            entry = self.sampling.get(id(seq.owner))
            if entry is not None and entry.emit is not None:
                by_job.setdefault(id(seq.owner), []).append(seq)
        for key, seqs in by_job.items():
            entry = self.sampling[key]
            rows = [entry.seqs.index(q) for q in seqs]
            chunk = SampleChunk(
                rows=rows,
                tokens=[np.asarray(q.out_tokens[q.streamed:], dtype=np.int32) for q in seqs],
                logprobs=[np.asarray(q.out_logprobs[q.streamed:], dtype=np.float32) for q in seqs],
                seq=entry.chunks,
            )
            for q in seqs:
                q.streamed = len(q.out_tokens)
            entry.chunks += 1
            entry.emit(chunk)

    def _maybe_done(self, job: _Job) -> None:
        entry = self.sampling.get(id(job))
        if entry is None or not all(q.finished for q in entry.seqs):
            return
        del self.sampling[id(job)]
        if any(q.cancelled for q in entry.seqs):
            return  # its caller has gone
        errors = [q.error for q in entry.seqs if q.error is not None]
        if errors:
            self.engine.cancel(entry.seqs)  # its other rows leave at the next step
            self.s._reply(job, errors[0])
            return
        m: SampleRequest = job.msg  # type: ignore[assignment]
        rows = [sampled_row(q) for q in entry.seqs]
        versions = {q.version for q in entry.seqs}
        self.s._batch_ids += 1
        self.s.compute_counters["sample_rows"] += len(rows)
        self.s._reply(job, SampleResult(
            tokens=[r.tokens for r in rows], logprobs=[r.logprobs for r in rows],
            stop_reasons=[r.stop_reason for r in rows],
            adapter_version=max(versions) if m.adapter is not None else -1,
            batch_id=self.s._batch_ids,
        ))

    def _cancel_abandoned(self) -> None:
        """Rows of requests whose callers cancelled leave at the next step."""
        for entry in list(self.sampling.values()):
            if entry.job.cancelled and not entry.done:
                entry.done = True
                self.engine.cancel(entry.seqs)
                self.s.compute_counters["cancelled_rows"] += len(entry.seqs)

    def _fail_running(self, e: Exception) -> None:
        """A step raised (a fault of the engine, not of one request): every request with rows
        in the engine fails with that error, and the rows leave; the scheduler keeps serving."""
        log.exception("engine step failed; failing the %d requests in it", len(self.sampling))
        for entry in list(self.sampling.values()):
            self.engine.cancel(entry.seqs)
            del self.sampling[id(entry.job)]
            self.s._reply(entry.job, e)
        try:
            self.engine.step()  # frees the cancelled rows' blocks (no row computes)
        except Exception:
            log.exception("engine step after a failure failed too")
