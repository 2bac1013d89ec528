"""The asyncio side of the bus: a DEALER :class:`Client` with many requests in flight
(one-way sockets are in :mod:`opentinker.bus.pipeline`).

A client says ``Hello`` on its first request (the versions are compared there: a mismatch is
:class:`~opentinker.bus.common.ProtocolMismatch` here and a counted ``bad_version`` on
the server), then sends a ``Heartbeat`` every ``heartbeat_s``. Every frame from the server
counts as a sign of life; after 3 intervals with none, every pending request fails with
:class:`~opentinker.bus.common.PeerLost`. A request that times out or whose caller is
cancelled is cancelled on the server too (``Cancel``). At most ``max_inflight`` requests are
in flight; further callers wait for a slot (backpressure).

Waiting for a reply: after a send the client also polls its socket at every turn of the event
loop, for up to ``spin_s`` (other tasks and sockets are served between polls; the
descriptor stays watched throughout). A reply that comes within that window is read without
the wake-up from the descriptor, for some more CPU; once a message type's round trips
average more than ``spin_s`` (sampling, a training step), its requests are not polled for
(:class:`~opentinker.bus.common.ReplyPolling`).

Partial results (``SampleChunk`` for ``SampleRequest(stream=True)``) go to the request's
``on_partial`` callback, in order, on the client's loop; they are never taken for the reply
(nor timed as one), and those of a request without a callback, or of no pending request,
are counted (``stream/ignored``, ``stream/unknown``) and dropped.
"""

from __future__ import annotations

import asyncio
import collections
import heapq
import itertools
import logging
import time

import zmq
import zmq.asyncio

from opentinker.bus.auth import Credentials
from opentinker.bus.client_state import (
    PartialCallback,
    Send,
    StateClient,
    next_request_id,
)
from opentinker.bus.common import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_HWM,
    DEFAULT_SPIN_S,
    CurveKeys,
    PartialCallbackFailed,
    configure,
    read_bounds,
    yield_cpu,
)
from opentinker.bus.frames import EVENTS, POLLIN, Cut, plain_context
from opentinker.bus.logs import LogEvery
from opentinker.bus.loop import SocketReader
from protocols.codec import Limits
from protocols.messages import Message, Welcome

log = logging.getLogger(__name__)


class Client(StateClient):
    """DEALER client: many requests in flight, matched to replies by request id (the session,
    the matching and the heartbeats are its :class:`~opentinker.bus.client_state.ClientState`;
    this class is its asyncio I/O).

    Args:
        ctx: the asyncio ZeroMQ context (``inproc://`` needs the server's).
        endpoint: the server's bound endpoint.
        keys: CURVE keys of this client (``CurveKeys.client_of(server_keys)``).
        heartbeat_s: interval of :meth:`tick`; ``None``: no automatic ticks (tests tick).
        max_inflight: requests in flight at once; more callers wait.
        spin_s: after each send, poll the socket at every loop turn for up to this long before
            waiting on its descriptor (0: never; see :class:`~opentinker.bus.common.ReplyPolling`).
        limits: what one reply may be (default :data:`~opentinker.bus.common.REPLY_LIMITS`;
            ``max_bytes`` replaces its ``max_bytes``); a reply over them fails its request
            with ``RemoteError(too_large)``.
        credentials: the bus user and secret to present (PLAIN) instead of this process's
            own (a job's on a shared scheduler).
    """

    def __init__(
        self,
        ctx: zmq.asyncio.Context,
        endpoint: str,
        name: str = "client",
        *,
        keys: CurveKeys | None = None,
        heartbeat_s: float | None = DEFAULT_HEARTBEAT_S,
        max_inflight: int = 1024,
        max_bytes: int | None = None,
        hwm: int = DEFAULT_HWM,
        spin_s: float = DEFAULT_SPIN_S,
        limits: Limits | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        super().__init__(name, endpoint, heartbeat_s, spin_s, limits, max_bytes)
        self._log = LogEvery(log)
        self._sock = configure(plain_context(ctx).socket(zmq.DEALER), hwm=hwm, max_bytes=self.max_bytes, keys=keys,
                               credentials=credentials)
        self._sock.connect(endpoint)
        self._pending: dict[int, asyncio.Future] = {}
        """Request id -> the future its caller awaits, while it is pending."""
        self._io: SocketReader | None = None
        self._beater: asyncio.Task | None = None
        self._connecting: asyncio.Future | None = None
        self._deadlines: _Deadlines | None = None
        self._inflight = 0
        self._slot_waiters: collections.deque[asyncio.Future] = collections.deque()
        self._max_inflight = max_inflight
        self._spin_until = 0.0
        self._spinning = False
        self._polled = 0
        """Requests pending whose replies are polled for."""

    async def connect(self, timeout: float = 30.0) -> Welcome:
        """Say ``Hello`` (once; concurrent callers share it) and return the server's ``Welcome``."""
        if self.state.welcome is not None:
            return self.state.welcome
        if self._connecting is None:
            self._connecting = asyncio.ensure_future(self._hello(timeout))
        try:
            return await asyncio.shield(self._connecting)
        finally:
            if self._connecting is not None and self._connecting.done():
                self._connecting = None

    async def _hello(self, timeout: float) -> Welcome:
        self._start()
        rid, hello = self.state.hello()
        reply = self.state.welcomed(await self._roundtrip(hello, rid, timeout))
        if self.heartbeat_s and self._beater is None:
            self._beater = asyncio.create_task(self._beat(self.heartbeat_s))
        return reply

    def _start(self) -> None:
        if self._io is None:
            self._io = SocketReader(self._sock, self._on_frames, bounds=read_bounds(self.limits), on_cut=self._on_cut)

    async def request(self, msg: Message, timeout: float = 600.0, request_id: int | None = None,
                      on_partial: PartialCallback | None = None) -> Message:
        """Send ``msg`` and return the reply.

        ``on_partial(m)`` is called on this client's loop for each partial result of the
        request (e.g. ``SampleChunk`` when ``msg`` is a ``SampleRequest(stream=True)``), in
        the order the server sent them, before this returns; the reply is the final message,
        complete whether or not partials were read. An exception from ``on_partial`` fails
        the request with that exception (and cancels it on the server).

        Raises:
            RemoteError: the server answered ``Error`` (e.g. ``invalid``, ``busy``).
            TimeoutError: no reply in ``timeout`` s; the request is cancelled on the server.
            PeerLost: the server went silent for 3 heartbeats.
            ProtocolMismatch: the server speaks another protocol version.
        """
        if self._sock.closed:
            raise ConnectionError(f"{self.name}: the client is closed")
        rid = next_request_id() if request_id is None else request_id
        state = self.state
        for attempt in range(2):
            if state.welcome is None:
                await self.connect(timeout)
            if self._inflight >= self._max_inflight:
                await self._slot()
            self._inflight += 1
            try:
                reply = await self._roundtrip(state.request(msg, rid, on_partial), rid, timeout)
            finally:
                self._inflight -= 1
                self._pass_slot()
            if not state.retry(reply, attempt):  # else: the server restarted or dropped us
                break
        return state.result(msg, reply)

    async def _slot(self) -> None:
        """Wait (first come, first served) until fewer than ``max_inflight`` are in flight."""
        while self._inflight >= self._max_inflight:
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                await waiter
            except asyncio.CancelledError:
                if waiter in self._slot_waiters:
                    self._slot_waiters.remove(waiter)
                else:  # it had been given the slot: pass it on
                    self._pass_slot()
                raise

    def _pass_slot(self) -> None:
        """Wake the first slot waiter still waiting (one cancelled meanwhile is skipped)."""
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    async def _roundtrip(self, send: Send, rid: int, timeout: float) -> Message:
        """Send request ``rid`` (``send``, made by the state) and wait for its answer; the
        request is cancelled on the server when it times out, its caller is cancelled or its
        partial callback raised, and forgotten by the state whatever happens."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._pending[rid] = fut
        if self._deadlines is None:
            self._deadlines = _Deadlines(loop)
        deadline = self._deadlines.add(fut, timeout, len(self._pending))
        state = self.state
        kind = type(state.outstanding[rid])
        try:
            try:
                self._io.send(send.frames)  # type: ignore[union-attr]
            except zmq.Again:
                await self._send_when_room(send.frames, fut)
            sent = time.perf_counter()
            state.sent(rid, sent)
            if not state.polling.worth_it(kind):
                return await fut
            self._polled += 1
            try:
                self._poll_for_reply(sent + state.polling.spin_s)
                return await fut
            finally:
                self._polled -= 1
        except _Expired:
            self._cancel_remote(rid)
            raise TimeoutError(
                f"{self.name}: no reply to {kind.__name__} from {self.endpoint} in {timeout:.3g} s"
            ) from None
        except asyncio.CancelledError:
            self._cancel_remote(rid)
            raise
        except PartialCallbackFailed as failed:  # cancelled on the server when it raised
            raise failed.error from None
        finally:
            _Deadlines.done(deadline)
            self._pending.pop(rid, None)
            state.forget(rid)

    async def _send_when_room(self, frames: list, fut: asyncio.Future) -> None:
        """The queue is full (the high-water mark): retry, backing off, until the request's
        future is done (it expires with the request's timeout)."""
        assert self._io is not None
        delay = 1e-4
        while True:
            try:
                self._io.send(frames)
                return
            except zmq.Again:
                if fut.done():
                    fut.result()  # raises the expiry
                self.counters["send_waits"] += 1
                await asyncio.sleep(delay)
                delay = min(2 * delay, 0.05)

    def _poll_for_reply(self, until: float) -> None:
        """Poll the socket from the next loop turn on, until ``until`` (``time.perf_counter``;
        a later request extends it) or no polled-for request is pending."""
        self._spin_until = max(self._spin_until, until)
        if not self._spinning:
            self._spinning = True
            self.counters["spins"] += 1
            self._io.loop.call_soon(self._spin)  # type: ignore[union-attr]

    def _spin(self) -> None:
        """One poll; schedules the next one (should anything raise, polling just stops, and
        the next polled-for request starts it again)."""
        self._spinning = False
        io = self._io
        if io is None or self._sock.closed or not self._polled or time.perf_counter() > self._spin_until:
            return
        if self._sock.getsockopt(EVENTS) & POLLIN:
            io.drain()
        else:
            yield_cpu()  # let the threads that carry the reply (ZeroMQ's I/O thread) run first
        io.loop.call_soon(self._spin)
        self._spinning = True

    def _cancel_remote(self, rid: int) -> None:
        if not self._sock.closed:
            self._fire(self.state.cancel(rid))

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        self._read(frames, None)

    def _on_cut(self, kept: list[zmq.Frame], cut: Cut) -> None:
        """A reply over ``limits``, not kept: its request fails with ``too_large``."""
        err = self._read(kept, cut)  # an Error (too_large)
        self._log.warning("drop", "%s: dropped a reply from %s: %s", self.name, self.endpoint,
                          getattr(err, "message", err))

    def _read(self, frames: list[zmq.Frame], cut: Cut | None) -> Message:
        """A message read: the state says which request it answers; that request's future
        gets the answer, unless it is over already (timed out, cancelled: its own path
        cancels it on the server). Returns the message read."""
        rid, msg, cancel = self.state.receive(frames, cut, time.perf_counter())
        if rid is not None:
            answer = self.state.take(rid)
            fut = self._pending.get(rid)
            if fut is not None and not fut.done():
                if cancel:
                    self._cancel_remote(rid)
                if isinstance(answer, PartialCallbackFailed):
                    fut.set_exception(answer)
                else:
                    fut.set_result(answer)
        return msg

    async def _beat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.tick()

    def tick(self) -> bool:
        """One heartbeat interval passed: send a ``Heartbeat``, or, after 3 intervals with no
        frame from the server, fail every pending request with :class:`PeerLost`. Returns
        True when the server is lost."""
        if self.state.welcome is None:
            return False
        beat = self.state.tick(time.perf_counter())
        if isinstance(beat, Send):
            self._fire(beat)
            return False
        for fut in self._pending.values():
            if not fut.done():
                fut.set_exception(beat)
        return True

    def _fire(self, send: Send) -> None:
        """Send without waiting; a full queue or an unconnected socket drops it (counted)."""
        try:
            if self._io is not None:
                self._io.send(send.frames)
            else:
                self._sock.send_multipart(send.frames, zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters[f"error/{send.what}_not_sent"] += 1

    def close(self) -> None:
        """Close the socket; every request still pending or waiting for a slot fails with
        ``ConnectionError`` (their callers are not cancelled)."""
        if self._beater is not None:
            self._beater.cancel()
        for fut in [*self._pending.values(), *self._slot_waiters]:
            if not fut.done():
                fut.set_exception(ConnectionError(f"{self.name}: the client was closed"))
        self._slot_waiters.clear()
        if self._io is not None:
            self._io.close()
        else:
            self._sock.close(linger=0)


class _Expired(Exception):
    """A request's timeout passed (raised inside the client, turned into TimeoutError)."""


class _Deadlines:
    """Request timeouts on one timer (not a timer per request): a heap of ``[deadline, seq,
    future]`` entries, the timer set for the earliest. A finished request clears its entry's
    future (so no reply is kept alive by the heap), and cleared entries are skipped, or
    dropped all at once when they are most of the heap."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.heap: list[list] = []
        self.seq = itertools.count()
        self.handle: asyncio.TimerHandle | None = None
        self.at = float("inf")

    def add(self, fut: asyncio.Future, timeout: float, live: int) -> list:
        """Expire ``fut`` after ``timeout`` s; ``live``: requests in flight (for compaction).
        Returns the entry, for :meth:`done`."""
        deadline = self.loop.time() + timeout
        entry = [deadline, next(self.seq), fut]
        heapq.heappush(self.heap, entry)
        if len(self.heap) > max(1024, 4 * live):  # mostly finished requests: drop them
            self.heap = [e for e in self.heap if e[2] is not None]
            heapq.heapify(self.heap)
        if deadline < self.at:
            self._arm(deadline)
        return entry

    @staticmethod
    def done(entry: list) -> None:
        entry[2] = None

    def _arm(self, when: float) -> None:
        if self.handle is not None:
            self.handle.cancel()
        self.at = when
        self.handle = self.loop.call_at(when, self._fire)

    def _fire(self) -> None:
        self.handle, self.at = None, float("inf")
        now = self.loop.time()
        while self.heap and (self.heap[0][0] <= now or self.heap[0][2] is None):
            fut = heapq.heappop(self.heap)[2]
            if fut is not None and not fut.done():
                fut.set_exception(_Expired())
        if self.heap:
            self._arm(self.heap[0][0])
