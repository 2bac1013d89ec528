"""The scheduler: one base model per device, many LoRA adapters, served over the bus.

Requests arrive on an asyncio ROUTER (:class:`opentinker.bus.Server`) and queue for a single
compute thread, so the bus keeps answering while a training step runs. That thread also loads
the model, so it is the one thread of the process that runs torch (one OpenMP pool: see
:meth:`SchedulerService.start`). State-changing requests are idempotent by request id (the bus
remembers their replies).

With the engine's own forward (:class:`~opentinker.engine.step_loop.Engine`), the compute
thread runs a step loop: the rows of every ``SampleRequest`` join the running batch at the next
step, whoever sent them and whichever adapter they use, and leave when they finish; a
cancelled request frees its rows at the next step; a request with ``stream=True`` gets a
``SampleChunk`` of its new tokens after every step that drew some. Every other operation
(training, log-probs, adapter lifecycle) runs between steps, round-robin over adapters, under
a fairness policy: while both kinds wait, operations get ``train_share`` of the compute time
(decayed over ``fair_window_s``), so a steady stream of sampling cannot starve a
``forward_backward``, nor the reverse. An operation that changes an adapter's weights waits
until that adapter's running rows finish (no reply straddles two versions); meanwhile new rows
of that adapter are held back.

Without it (architectures the engine does not run, or ``engine="peft"``) the compute thread
takes the oldest request; a sample request takes every other waiting sample request with it
and serves all their rows in one batch.

A shared scheduler (``tenants``, ``opentinker serve``) serves many jobs: each authenticates
as its own bus user, its adapter names and folders are its own, and the scheduler's own user
opens and closes jobs (:mod:`opentinker.engine.tenants`).

Every request's arrays are checked when it arrives, before it is queued or batched with
another client's (:func:`~opentinker.engine.request_checks.check_request`): a bad request fails alone with ``Error(invalid)``
naming the field, and its batch-mates never see it.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import threading
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any

import msgspec

from opentinker.bus import LOOPBACK, LoopThread, Server, settle_heap, unsettle_heap
from opentinker.bus.auth import new_secret, run_user
from opentinker.bus.common import CurveKeys
from opentinker.bus.stream import wants_stream
from opentinker.engine.anchored import Anchored
from opentinker.engine.request_checks import (
    DEFAULT_MAX_NEW_TOKENS,
    absolute_root,
    check_job_name,
    check_probe,
    check_request,
    confined,
    placed,
)
from opentinker.engine.rss import process_memory, reset_peak_memory
from opentinker.engine.tenants import Tenants
from opentinker.files import root_holding
from opentinker.logs import escape_controls
from protocols.codec import Limits
from protocols.messages import (
    MAX_STATS_BATCHES,
    AdapterInfo,
    AdapterList,
    CloseJob,
    CreateAdapter,
    DiscardGradients,
    DropAdapter,
    ForwardBackward,
    ForwardBackwardResult,
    JobList,
    JobOpened,
    ListAdapters,
    ListJobs,
    LoadAdapter,
    LogprobsRequest,
    LogprobsResult,
    Message,
    OpenJob,
    OptimStep,
    OptimStepResult,
    SampleRequest,
    SampleResult,
    SaveAdapter,
    Saved,
    SchedulerStats,
    SnapshotAdapter,
    ValuesRequest,
    ValuesResult,
)

log = logging.getLogger(__name__)


COMPUTE_OPS = (
    SampleRequest, LogprobsRequest, ValuesRequest, CreateAdapter, DropAdapter, SnapshotAdapter,
    LoadAdapter, ForwardBackward, OptimStep, DiscardGradients, SaveAdapter,
)
"""Requests that queue for the compute thread."""

JOB_CONTROL = (OpenJob, CloseJob, ListJobs)
"""Requests that open, close and list the jobs of a shared scheduler (its owner's)."""


STOP_TIMEOUT_S = 60.0
"""How long :meth:`SchedulerService.stop` waits for the compute thread's current work."""


@dataclass
class _Job:
    msg: Message
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    started: bool = False
    """Taken by the compute thread (under the queue's lock): too late to cancel."""
    emit: Any = None
    """Sends partial results (a ``SampleRequest`` with ``stream=True``), else None."""
    cancelled: bool = False
    """Its caller cancelled while the engine ran its rows: they leave at the next step."""
    dropped: bool = False
    """Its caller cancelled before it started: it never runs."""
    tenant: str = ""
    """The job it came from on a shared scheduler (its compute time is charged to it)."""
    peer: str = ""
    """The bus peer that sent it (its ``Hello`` name): waiting rows are admitted fairly over
    ``(tenant, peer)``."""


class SchedulerService:
    """Owns a :class:`~opentinker.engine.host.ModelHost` and serves it on the bus."""

    def __init__(
        self,
        model_path: str,
        device: str = "cpu",
        threads: int | None = None,
        endpoint: str = LOOPBACK,
        batch_window_s: float = 0.005,
        max_batch_wait_s: float = 0.05,
        max_batch_rows: int = 512,
        engine: str = "auto",
        engine_options: dict[str, Any] | None = None,
        train_share: float = 0.5,
        fair_window_s: float = 10.0,
        fair_anticipate_s: float = 0.25,
        limits: Limits | None = None,
        adapter_roots: Sequence[str] | None = None,
        max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS,
        read_roots: Sequence[str] = (),
        tenants: Tenants | None = None,
        curve_keys: CurveKeys | None = None,
    ) -> None:
        """``engine``, ``engine_options``: see :class:`~opentinker.engine.host.ModelHost`.
        ``train_share``: the share of compute time operations get while sampling also waits
        (decayed over ``fair_window_s``); ``fair_anticipate_s``: how long a job whose work ran out
        still shares compute with the others (:class:`~opentinker.engine.step_worker.JobShare`).
        ``batch_window_s``, ``max_batch_wait_s`` and
        ``max_batch_rows`` shape the PEFT path's whole-request batches. ``limits``: what one
        request may be on the bus (default :data:`protocols.codec.DEFAULT_LIMITS`).
        ``adapter_roots``: the folders that ``SaveAdapter`` and ``LoadAdapter`` paths must lie in
        (symbolic links resolved; a job gives its run folder); ``None``: anywhere (a scheduler
        used as a library by its owner). ``read_roots``: folders that ``LoadAdapter`` may also
        read and nothing may write (a job's warm-start adapters). ``max_new_tokens``: the most tokens one row may ask to
        draw (with its prompt, it must also fit the model's context). ``tenants``: serve many jobs, each
a tenant (:mod:`opentinker.engine.tenants`); the scheduler's own user opens and closes them.
        ``curve_keys``: with ``tenants`` made with the owner's CURVE key, the bus is a CURVE server
        with these keys (``endpoint`` may then face the network) accepting the owner's and each
        running job's key only (:attr:`Tenants.curve_users`)."""
        self.tenants = tenants
        self.curve_keys = curve_keys
        self.tenant_ms: collections.Counter[str] = collections.Counter()
        """Compute time (ms) spent on each job's requests (a sampling step's split by rows)."""
        self.services: dict[type, Any] = {}
        """Further requests for the scheduler's owner only, message type -> ``async fn(msg)``
        (a service's job queue)."""
        self.contended_ms: collections.Counter[str] = collections.Counter()
        """Of it, the time while two or more jobs had work (the step loop's sharing applied;
        counted by :class:`~opentinker.engine.step_worker.StepWorker`)."""
        self.max_new_tokens = int(max_new_tokens)
        self._owner: dict[str, str] = {}
        """Adapter name -> the peer that made it (created, loaded or snapshotted): only that peer
        may drop it."""
        self.limits = limits
        self.adapter_roots = None if adapter_roots is None else [os.path.realpath(r) for r in adapter_roots]
        self.load_roots = None if self.adapter_roots is None else self.adapter_roots + [
            os.path.realpath(r) for r in read_roots]
        self.engine = engine
        self.engine_options = engine_options
        self.train_share = train_share
        self.fair_window_s = fair_window_s
        if not 0 <= fair_anticipate_s <= 60:
            raise ValueError(f"fair_anticipate_s must be in [0, 60] seconds, got {fair_anticipate_s}")
        self.fair_anticipate_s = fair_anticipate_s
        self.model_path = model_path
        self.device = device
        self.threads = threads
        self.batch_window_s = batch_window_s
        self.max_batch_wait_s = max_batch_wait_s
        self.max_batch_rows = max_batch_rows
        self._bind = endpoint
        self._jobs: collections.deque[_Job] = collections.deque()
        self._cv = threading.Condition()
        self._stop = False
        self.batches: collections.deque[list[str]] = collections.deque(maxlen=MAX_STATS_BATCHES)
        self.compute_counters: collections.Counter[str] = collections.Counter()
        self._batch_ids = 0
        self.host: Any = None
        self.endpoint = ""

    def start(self) -> str:
        """Start the compute thread, which loads the model and then computes, and the server;
        return the endpoint (the model's load error, if it fails).

        Every torch call of the scheduler runs on that one thread, the load included. Torch's
        CPU thread pool (GNU OpenMP) belongs to the thread that starts parallel work: a second
        thread's pool beside the caller's makes libgomp count more threads than cores, and it
        then barely spins before sleeping at each parallel op's end. A training step took 1.22x
        as long that way (``benchmarks/compute_thread.py``)."""
        loaded = threading.Event()
        failed: list[BaseException] = []

        def compute() -> None:
            try:
                target = self._load()
            except BaseException as e:  # noqa: BLE001 - start() raises it on the caller's thread
                failed.append(e)
                return
            finally:
                loaded.set()
            target()

        self._worker = threading.Thread(target=compute, name="scheduler-compute", daemon=True)
        self._worker.start()
        loaded.wait()
        if failed:
            self._worker.join()
            raise failed[0]
        self.loop = LoopThread("scheduler-bus")
        curve_users = self.tenants.curve_users if self.tenants is not None else None
        if (curve_users is None) != (self.curve_keys is None):
            raise ValueError("a scheduler on CURVE needs tenants made with the owner's CURVE key, and both need keys")
        self.server = Server(self._handle, self._bind, name="scheduler", limits=self.limits,
                             accounts=self.tenants.accounts if self.tenants is not None else None,
                             keys=self.curve_keys, curve_users=curve_users)
        self.endpoint = self.loop.run(self.server.start(self.loop.ctx))
        return self.endpoint

    def _load(self) -> Callable[[], None]:
        """Load the model (on the compute thread); the loop that thread then runs."""
        from opentinker.engine.host import ModelHost

        self.host = ModelHost(self.model_path, device=self.device, threads=self.threads, engine=self.engine,
                              engine_options=self.engine_options)
        settle_heap()  # the model stack stays until stop(): full collections skip it meanwhile
        if self.host.engine is None:
            return self._work
        from opentinker.engine.step_worker import StepWorker

        return StepWorker(self, self.train_share, self.fair_window_s, self.fair_anticipate_s).run

    # --------------------------------------------------------------------------- bus side

    async def _handle(self, msg: Message) -> Message:
        tenant = self._tenant()
        if isinstance(msg, JOB_CONTROL):
            return await self._job_control(msg, tenant)
        if type(msg) in self.services:
            if tenant is not None:
                raise ValueError(f"{type(msg).__name__} is for the service's owner, not job {tenant!r}")
            return await self.services[type(msg)](msg)
        if isinstance(msg, SchedulerStats):
            reply = SchedulerStats(counters=self.counters(), batches=[list(b) for b in self.batches])
            if msg.reset_peak and tenant is None:
                reset_peak_memory()
            return reply
        if isinstance(msg, ListAdapters):
            listed = AdapterList(adapters=[AdapterInfo(name=n, version=self.host.version(n))
                                           for n in sorted(self.host.adapters)])
            return listed if self.tenants is None else self.tenants.unqualify(listed, tenant)
        if not isinstance(msg, COMPUTE_OPS):
            raise TypeError(f"the scheduler does not serve {type(msg).__name__}")
        reg = self.host.registry
        check_request(msg, reg.vocab_size, reg.max_context, self.max_new_tokens, reg.hidden_size)
        if self.tenants is not None:
            msg = self.tenants.qualify(msg, tenant)
            if tenant is not None and isinstance(msg, (SaveAdapter, LoadAdapter)):
                t = self.tenants.running(tenant)
                roots = t.roots if isinstance(msg, SaveAdapter) else t.roots + t.read_roots
                msg = msgspec.structs.replace(msg, path=confined(msg.path, roots))
        peer = self.server.peer_name()
        if isinstance(msg, DropAdapter):
            owner = self._owner.get(msg.name)
            if owner is not None and owner != peer:
                self.compute_counters["refused/not_owner"] += 1
                raise ValueError(f"adapter {msg.name!r} was made by {owner!r}: only it may drop it, not {peer!r}")
        try:
            reply = await self._submit(msg, tenant or "")
        except (LookupError, ValueError, TypeError) as e:
            if tenant is None or self.tenants is None:
                raise
            text = self.tenants.error_text(str(e.args[0]) if isinstance(e, LookupError) and e.args else str(e), tenant)
            raise type(e)(text) from None  # what a job reads names its own adapters only
        if isinstance(reply, AdapterInfo) and not isinstance(msg, DiscardGradients):  # made, loaded, snapshotted, dropped
            if isinstance(msg, DropAdapter):
                self._owner.pop(msg.name, None)
            else:
                self._owner.setdefault(msg.name, peer)
        return reply if self.tenants is None else self.tenants.unqualify(reply, tenant)

    def _tenant(self) -> str | None:
        """The job of the request being served on a shared scheduler; None for the
        scheduler's own user (and on a scheduler of one job)."""
        if self.tenants is None:
            return None
        principal = self.server.principal()
        if principal == run_user():
            return None
        self.tenants.running(principal)  # closed since its handshake: refused
        return principal

    async def _job_control(self, msg: Message, tenant: str | None) -> Message:
        """``OpenJob``, ``CloseJob``, ``ListJobs``: the scheduler's own user only."""
        if self.tenants is None:
            raise TypeError(f"{type(msg).__name__}: this scheduler serves one job (start a shared one with "
                            "opentinker serve)")
        if tenant is not None:
            self.compute_counters["refused/not_owner"] += 1
            raise ValueError(f"{type(msg).__name__} is for the scheduler's owner, not job {tenant!r}")
        if isinstance(msg, OpenJob):
            check_job_name(msg.name)
            roots = [absolute_root(r, "OpenJob.roots") for r in msg.roots]
            read_roots = [absolute_root(r, "OpenJob.read_roots") for r in msg.read_roots]
            if msg.probe:
                check_probe(msg.probe, msg.probe_text, roots)
            secret = new_secret()
            t = self.tenants.open(msg.name, secret.encode(), roots, read_roots, msg.priority)
            log.info("scheduler: opened job %s (%s)", t.job, escape_controls(t.name))
            public, curve_secret = self.tenants.curve_pair(t.job) if self.tenants.curve_users is not None else ("", "")
            return JobOpened(job=t.job, secret=secret, curve_public=public, curve_secret=curve_secret)
        if isinstance(msg, CloseJob):
            t = self.tenants.close(msg.job)
            ended = self.server.drop_principal(t.job)
            names = self.tenants.adapters_of(t.job, list(self.host.adapters))
            for name in names:  # its adapters, their optimizer states and cached blocks are freed
                await self._submit(DropAdapter(name=name), t.job)
                self._owner.pop(name, None)
            log.info("scheduler: closed job %s: %d sessions ended, %d adapters dropped", t.job, ended, len(names))
            return self.tenants.info(t, list(self.host.adapters), self.tenant_ms[t.job], self.contended_ms[t.job])
        internals = list(self.host.adapters)
        return JobList(jobs=[self.tenants.info(t, internals, self.tenant_ms[t.job], self.contended_ms[t.job])
                             for t in self.tenants.jobs.values()])

    def charge(self, jobs: Sequence[_Job], dt: float, weights: Sequence[float] | None = None) -> dict[str, float]:
        """Charge ``dt`` seconds of compute to the jobs' tenants, split by ``weights`` (a
        sampling step lists the job of each running row, weighed by the tokens it computed),
        else equally per entry; returns the seconds charged to each tenant (none on a
        scheduler of one job)."""
        if self.tenants is None or not jobs:
            return {}
        total = float(sum(weights)) if weights is not None else 0.0
        shares = [dt * w / total for w in weights] if weights is not None and total > 0 else [dt / len(jobs)] * len(jobs)
        charged: collections.Counter[str] = collections.Counter()
        for job, seconds in zip(jobs, shares):
            charged[job.tenant] += seconds
        for tenant, seconds in charged.items():
            self.tenant_ms[tenant] += 1000.0 * seconds
        return charged

    def _peer(self) -> str:
        """The name of the peer whose request is being served ("" outside a handler)."""
        try:
            return self.server.peer_name()
        except (RuntimeError, AttributeError):
            return ""

    async def _submit(self, msg: Message, tenant: str = "") -> Message:
        """Queue ``msg`` for the compute thread and wait for its reply (a cancelled caller drops
        it while queued, frees its rows while sampling, else waits for the state change)."""
        loop = asyncio.get_running_loop()
        job = _Job(msg, loop.create_future(), loop, tenant=tenant, peer=self._peer())
        if isinstance(msg, SampleRequest) and wants_stream(msg):
            job.emit = self.server.emitter()
        with self._cv:
            self._jobs.append(job)
            self._cv.notify()
        try:
            return await asyncio.shield(job.future)
        except asyncio.CancelledError:
            with self._cv:
                if not job.started:  # still queued: it never runs
                    job.dropped = True
                    if job in self._jobs:
                        self._jobs.remove(job)
                    self.compute_counters["cancelled_queued"] += 1
                    raise
                if isinstance(msg, SampleRequest) and self.host.engine is not None:
                    job.cancelled = True  # the step loop frees its rows at the next step
                    self.compute_counters["cancelled_running"] += 1
                    self._cv.notify()
                    raise
            # Already computing: a state-changing op will have happened, so finish it and
            # reply (the bus keeps the reply for retries) rather than pretend it was cancelled.
            self.compute_counters["cancel_too_late"] += 1
            return await job.future

    # --------------------------------------------------------------------------- compute side

    def _take(self) -> list[_Job] | None:
        with self._cv:
            while not self._jobs and not self._stop:
                self._cv.wait()
            if self._stop:
                return None
            head = self._jobs.popleft()
            head.started = True
            if not isinstance(head.msg, SampleRequest):
                return [head]
        # Requests that are on their way join this batch: wait while new ones keep arriving
        # (each within batch_window_s of the last), at most max_batch_wait_s in all.
        deadline = time.perf_counter() + self.max_batch_wait_s
        seen = -1
        while self.batch_window_s > 0 and time.perf_counter() < deadline:
            with self._cv:
                n = len(self._jobs)
            if n == seen:
                break
            seen = n
            time.sleep(self.batch_window_s)
        with self._cv:
            batch, rest, rows = [head], collections.deque(), len(head.msg.prompts)
            for job in self._jobs:
                if isinstance(job.msg, SampleRequest) and rows + len(job.msg.prompts) <= self.max_batch_rows:
                    job.started = True
                    batch.append(job)
                    rows += len(job.msg.prompts)
                else:
                    rest.append(job)
            self._jobs = rest
        return batch

    def _work(self) -> None:
        while True:
            jobs = self._take()
            if jobs is None:
                return
            t0 = time.perf_counter()
            try:
                if isinstance(jobs[0].msg, SampleRequest):
                    replies: list[Any] = self._sample(jobs)
                else:
                    replies = [self._run(jobs[0].msg)]
            except Exception as e:  # noqa: BLE001 - the error goes back to the caller
                for job in jobs:
                    job.loop.call_soon_threadsafe(_set_exception, job.future, e)
                continue
            finally:
                # Time spent computing, by kind of request: the rest of a client's wait is queueing and transport.
                dt = time.perf_counter() - t0
                self.compute_counters[f"compute_ms/{type(jobs[0].msg).__name__}"] += int(1000 * dt)
                self.charge([j for j in jobs for _ in getattr(j.msg, "prompts", (None,))], dt)
            for job, reply in zip(jobs, replies):
                job.loop.call_soon_threadsafe(_set_result, job.future, reply)

    def _sample(self, jobs: list[_Job]) -> list[SampleResult]:
        adapters, prompts, params, seeds, owners, forced = [], [], [], [], [], []
        for j, job in enumerate(jobs):
            m: SampleRequest = job.msg  # type: ignore[assignment]
            for i, p in enumerate(m.prompts):
                adapters.append(m.adapter)
                prompts.append(p)
                params.append(m.params)
                seeds.append(m.params.seed + i)
                owners.append(j)
                forced.append(m.forced[i] if m.forced is not None else None)
        try:
            rows = self.host.sample(adapters, prompts, params, seeds, forced)
        except (ValueError, TypeError, KeyError):
            if len(jobs) == 1:
                raise
            # One bad request must not fail its batch-mates: serve each alone.
            return [self._sample_or_error(job) for job in jobs]
        self._batch_ids += 1
        self.compute_counters["sample_batches"] += 1
        self.compute_counters["sample_rows"] += len(rows)
        self.batches.append([jobs[o].msg.client for o in owners])  # type: ignore[union-attr]
        out = []
        for j, job in enumerate(jobs):
            mine = [r for r, o in zip(rows, owners) if o == j]
            out.append(
                SampleResult(
                    tokens=[r.tokens for r in mine],
                    logprobs=[r.logprobs for r in mine],
                    stop_reasons=[r.stop_reason for r in mine],
                    adapter_version=self.host.version(job.msg.adapter),  # type: ignore[union-attr]
                    batch_id=self._batch_ids,
                )
            )
        return out

    def _sample_or_error(self, job: _Job) -> Any:
        try:
            return self._sample([job])[0]
        except (ValueError, TypeError, KeyError) as e:
            return e

    def _run_parts(self, msg: Message, max_tokens: int) -> Generator[None, None, Message]:
        """:meth:`_run` as a generator: a ``ForwardBackward`` yields after each part of at most
        ``max_tokens`` tokens (so other jobs' work can run between its parts), any other
        operation runs whole at the first ``next``."""
        if not isinstance(msg, ForwardBackward):
            return self._run(msg)
        self.compute_counters[type(msg).__name__] += 1
        loss, metrics = yield from self.host.forward_backward_parts(
            msg.adapter, msg.datums, msg.loss, msg.loss_config, msg.normalizer, value_normalizer=msg.value_normalizer,
            max_tokens=max_tokens)
        return ForwardBackwardResult(loss=loss, metrics=metrics)

    def _placed(self, path: str, roots: Sequence[str] | None) -> str | Anchored:
        """:func:`placed` with this scheduler's ``roots``; on a shared scheduler (no roots of
        its own), a job's path, confined to the job's folders on arrival, is anchored at the
        job's root, and the owner's (in no job's folders) is taken as given."""
        if roots is None and self.tenants is not None:
            jobs = [r for t in list(self.tenants.jobs.values()) for r in t.roots + t.read_roots]
            if root_holding(path, jobs) is not None:
                return placed(path, jobs)
        return placed(path, roots)

    def _run(self, msg: Message) -> Message:
        host = self.host
        self.compute_counters[type(msg).__name__] += 1
        if isinstance(msg, LogprobsRequest):
            return LogprobsResult(logprobs=host.logprobs(msg.adapter, msg.sequences, temperature=msg.temperature,
                                                         tail=msg.tail),
                                  adapter_version=host.version(msg.adapter))
        if isinstance(msg, ValuesRequest):
            return ValuesResult(values=host.values(msg.adapter, msg.sequences), adapter_version=host.version(msg.adapter))
        if isinstance(msg, CreateAdapter):
            return AdapterInfo(name=msg.name, version=host.create_adapter(msg.name, msg.spec))
        if isinstance(msg, ForwardBackward):
            loss, metrics = host.forward_backward(msg.adapter, msg.datums, msg.loss, msg.loss_config, msg.normalizer,
                                                  value_normalizer=msg.value_normalizer)
            return ForwardBackwardResult(loss=loss, metrics=metrics)
        if isinstance(msg, OptimStep):
            version, grad_norm = host.optim_step(msg.adapter, msg.params)
            return OptimStepResult(version=version, grad_norm=grad_norm)
        if isinstance(msg, DiscardGradients):
            return AdapterInfo(name=msg.adapter, version=host.discard_gradients(msg.adapter))
        if isinstance(msg, SaveAdapter):
            return Saved(path=msg.path, version=host.save(msg.adapter, self._placed(msg.path, self.adapter_roots)))
        if isinstance(msg, DropAdapter):
            host.drop_adapter(msg.name)
            return AdapterInfo(name=msg.name, version=-1)
        if isinstance(msg, SnapshotAdapter):
            return AdapterInfo(name=msg.name, version=host.snapshot(msg.adapter, msg.name))
        if isinstance(msg, LoadAdapter):
            return AdapterInfo(name=msg.name, version=host.load(self._placed(msg.path, self.load_roots), msg.name,
                                                                trainable=msg.trainable, fresh=msg.fresh))
        raise ValueError(f"unexpected {type(msg).__name__}")

    def _reply(self, job: _Job, value: Any) -> None:
        """Hand ``value`` (a message or an exception) to the request's waiting handler."""
        job.loop.call_soon_threadsafe(_set_result, job.future, value)

    def counters(self) -> dict[str, int]:
        """Bus counters (``recv/SampleRequest``, ``error/...``) and compute counters."""
        out = dict(self.server.counters) if hasattr(self, "server") else {}
        out.update(self.compute_counters)
        engine = self.host.engine if self.host is not None else None
        if engine is not None:
            out.update(engine.metrics())
        out.update(process_memory())
        return out

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> None:
        """Stop serving, then wait (at most ``timeout`` s) for the compute thread to finish what
        it runs: the engine stops between two steps, the PEFT path after its current call. A
        process that exited with the thread still inside torch would abort (``terminate called
        without an active exception``, exit 134)."""
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self.host is not None:
            self.host.inference.interrupt.set()
        if hasattr(self, "loop"):
            self.loop.run(self.server.stop())
            self.loop.stop()
        worker = getattr(self, "_worker", None)
        if worker is not None and worker is not threading.current_thread():
            worker.join(timeout)
            if worker.is_alive():
                log.warning("scheduler: the compute thread is still busy after %.0f s", timeout)
        if self.host is not None:
            unsettle_heap()


def _set_result(fut: asyncio.Future, value: Any) -> None:
    if fut.done():
        return
    if isinstance(value, Exception):
        fut.set_exception(value)
    else:
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
