"""A blocking client of the bus, for scripts and notebooks (and the lowest-latency path).

:class:`SyncClient` speaks the same session as the asyncio client: ``Hello`` when it is
made, many requests in flight (:meth:`SyncClient.submit` then :meth:`SyncClient.result`),
per-request timeouts that cancel the request on the server, and heartbeats while it waits:
three intervals with no frame from the server raise
:class:`~opentinker.bus.common.PeerLost`. Like the asyncio client it polls for a fast reply
for up to ``spin_s`` before it blocks on the socket
(:class:`~opentinker.bus.common.ReplyPolling`). Not thread-safe (a ZeroMQ socket is not): use
one per thread.

Partial results (``SampleChunk`` for ``SampleRequest(stream=True)``) go to the request's
``on_partial`` callback, in order, on the caller's thread, as the client reads them: while
:meth:`SyncClient.result` waits for that request or for another one. They are never taken for
the reply; those of a request without a callback (yet), or of no outstanding request, are
counted (``stream/ignored``, ``stream/unknown``) and dropped.
"""

from __future__ import annotations

import time

import zmq

from opentinker.bus.auth import Credentials
from opentinker.bus.client_state import (
    Answer,
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
    PeerLost,
    configure,
    read_bounds,
    yield_cpu,
)
from opentinker.bus.frames import NOBLOCK, Cut, recv_bounded, send_frames
from protocols.codec import Limits
from protocols.messages import Message, Welcome


class SyncClient(StateClient):
    """Blocking DEALER client (the session, the matching and the heartbeats are its
    :class:`~opentinker.bus.client_state.ClientState`; this class is its blocking I/O).

    Args:
        endpoint: the server's bound endpoint.
        ctx: a (non-asyncio) ZeroMQ context; default: one owned by this client.
        keys: CURVE keys of this client (``CurveKeys.client_of(server_keys)``).
        heartbeat_s: while waiting, a ``Heartbeat`` goes out every this many seconds without
            a frame, and the server is lost after 3 of them.
        connect_timeout: seconds to wait for the ``Welcome``.
        spin_s: poll for a reply for up to this long before blocking on the socket (0: never).
        limits: what one reply may be (default :data:`~opentinker.bus.common.REPLY_LIMITS`;
            ``max_bytes`` replaces its ``max_bytes``); a reply over them fails its request
            with ``RemoteError(too_large)``.
    """

    def __init__(
        self,
        endpoint: str,
        name: str = "sync-client",
        *,
        ctx: zmq.Context | None = None,
        keys: CurveKeys | None = None,
        heartbeat_s: float = DEFAULT_HEARTBEAT_S,
        max_bytes: int | None = None,
        hwm: int = DEFAULT_HWM,
        connect_timeout: float = 30.0,
        spin_s: float = DEFAULT_SPIN_S,
        limits: Limits | None = None,
        credentials: Credentials | None = None,
    ) -> None:
        super().__init__(name, endpoint, heartbeat_s, spin_s, limits, max_bytes)
        self._bounds = read_bounds(self.limits)
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._sock = configure(self._ctx.socket(zmq.DEALER), hwm=hwm, max_bytes=self.max_bytes, keys=keys,
                               credentials=credentials)
        self._sock.connect(endpoint)
        self._rcvtimeo = -1
        self.state.last_send = time.perf_counter()
        try:
            self.connect(connect_timeout)
        except BaseException:
            self.close()
            raise

    @property
    def _outstanding(self) -> dict[int, Message]:
        """Request id -> the request, until its reply is taken (resent after a re-Hello)."""
        return self.state.outstanding

    @property
    def _replies(self) -> dict[int, Answer]:
        return self.state.replies

    @property
    def _sent_at(self) -> dict[int, float]:
        return self.state.sent_at

    def connect(self, timeout: float = 30.0) -> Welcome:
        """Say ``Hello``; raises :class:`ProtocolMismatch` when the versions differ."""
        rid, hello = self.state.hello()
        self._send(hello, rid)
        try:
            reply = self._wait(rid, timeout)
        finally:
            self.state.forget(rid)
        return self.state.welcomed(reply)

    def submit(self, msg: Message, request_id: int | None = None, on_partial: PartialCallback | None = None) -> int:
        """Send ``msg`` without waiting; returns its request id for :meth:`result`.
        ``on_partial`` gets every partial result of it read from now on (see :meth:`result`)."""
        rid = next_request_id() if request_id is None else request_id
        return self._send(self.state.request(msg, rid, on_partial), rid)

    def result(self, request_id: int, timeout: float = 600.0, on_partial: PartialCallback | None = None) -> Message:
        """The reply to request ``request_id``, waiting up to ``timeout`` s (then the request
        is cancelled on the server and :class:`TimeoutError` raised). Raises
        :class:`RemoteError` for an ``Error`` reply and :class:`PeerLost` when the server went
        silent.

        ``on_partial(m)`` (instead of the one given to :meth:`submit`) is called on this thread
        for each partial result of the request read from now on, in the server's order; an
        exception from it fails the request with that exception (raised here) and cancels it
        on the server."""
        state = self.state
        if request_id not in state.outstanding:
            raise KeyError(f"request {request_id} was not submitted, or its result was taken")
        if on_partial is not None:
            state.on_partial[request_id] = on_partial
        msg = state.outstanding[request_id]
        for attempt in range(2):
            reply = self._wait(request_id, timeout)
            if not state.retry(reply, attempt):
                break
            self.connect(timeout)  # the server restarted or dropped us: Hello, then the request again
            self._send(state.request(msg, request_id), request_id)
        state.forget(request_id)
        return state.result(msg, reply)

    def request(self, msg: Message, timeout: float = 600.0, request_id: int | None = None,
                on_partial: PartialCallback | None = None) -> Message:
        """Send ``msg`` and return its reply (see :meth:`result`)."""
        return self.result(self.submit(msg, request_id, on_partial), timeout)

    def _send(self, send: Send, rid: int) -> int:
        send_frames(self._sock, send.frames)
        self.state.sent(rid, time.perf_counter())
        return rid

    def _wait(self, rid: int, timeout: float) -> Answer:
        """Block on the socket until ``rid``'s answer; each ``heartbeat_s`` with no frame is a
        heartbeat tick."""
        state = self.state
        deadline = time.monotonic() + timeout
        state.waiting_since = time.perf_counter()
        sock = self._sock
        msg = state.outstanding.get(rid)
        if rid not in state.replies and msg is not None and state.polling.worth_it(type(msg)):
            self._poll(rid, min(deadline, time.monotonic() + state.polling.spin_s))
        while rid not in state.replies:
            left = deadline - time.monotonic()
            if left <= 0:
                state.forget(rid)
                self._cancel_remote(rid)
                raise TimeoutError(f"{self.name}: no reply to request {rid} from {self.endpoint} in {timeout:.3g} s")
            wait_ms = max(1, int(1000 * min(left, self.heartbeat_s)))
            if wait_ms != self._rcvtimeo:
                sock.setsockopt(zmq.RCVTIMEO, wait_ms)
                self._rcvtimeo = wait_ms
            try:
                read = recv_bounded(sock, self._bounds)
            except zmq.Again:
                if wait_ms >= int(1000 * self.heartbeat_s) and (lost := self._tick()) is not None:
                    raise lost from None
                continue
            self._take(read)
            if state.beat_due(time.perf_counter()):
                # Replies keep coming but this side sends nothing (it waits on many requests):
                # without a frame from it the server would count it lost and cancel them.
                self._beat(state.beat(time.perf_counter()))
        return state.take(rid)

    def _poll(self, rid: int, until: float) -> None:
        """Read without blocking until ``rid``'s reply is in or ``until`` (``time.monotonic``)."""
        self.counters["spins"] += 1
        sock = self._sock
        while rid not in self.state.replies and time.monotonic() < until:
            try:
                read = recv_bounded(sock, self._bounds, NOBLOCK)
            except zmq.Again:
                yield_cpu()
                continue
            self.counters["polled"] += 1
            self._take(read)

    def _take(self, read: tuple[list[zmq.Frame], Cut | None]) -> None:
        """Hand a message read to the state (which keeps a reply, passes a partial result to
        its callback and counts everything); cancel a request whose callback raised."""
        got = self.state.receive(*read, time.perf_counter())
        if got.cancel:
            self._cancel_remote(got.rid)  # type: ignore[arg-type]

    def tick(self) -> bool:
        """One heartbeat interval passed with no frame: send a ``Heartbeat``; True (and the
        session forgotten) when this was the 3rd in a row."""
        return self._tick() is not None

    def _tick(self) -> PeerLost | None:
        """:meth:`tick`: None when a ``Heartbeat`` went out, else the :class:`PeerLost` to raise."""
        beat = self.state.tick(time.perf_counter())
        if isinstance(beat, PeerLost):
            return beat
        self._beat(beat)
        return None

    def _beat(self, beat: Send) -> None:
        self._sock.send_multipart(beat.frames)

    def _cancel_remote(self, rid: int) -> None:
        try:
            self._sock.send_multipart(self.state.cancel(rid).frames, flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counters["error/cancel_not_sent"] += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        if self._own_ctx:
            self._ctx.term()

    def __enter__(self) -> SyncClient:  # noqa: PYI034
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
