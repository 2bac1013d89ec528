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
from collections.abc import Callable

import zmq

from opentinker.bus.auth import Credentials
from opentinker.bus.client import next_request_id
from opentinker.bus.common import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_HWM,
    DEFAULT_SPIN_S,
    REPLY_LIMITS,
    BeatCounter,
    Counters,
    CurveKeys,
    PartialCallbackFailed,
    PeerLost,
    RemoteError,
    ReplyPolling,
    check_welcome,
    configure,
    cut_error,
    read_bounds,
    read_reply,
    yield_cpu,
)
from opentinker.bus.frames import NOBLOCK, Cut, recv_bounded, send_frames
from protocols.codec import Limits, encode
from protocols.messages import (
    PARTIALS,
    PROTOCOL_VERSION,
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Message,
    Welcome,
)

_PARTIALS = frozenset(PARTIALS)
PartialCallback = Callable[[Message], None]


class SyncClient:
    """Blocking DEALER client.

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
        self.polling = ReplyPolling(spin_s)
        self.endpoint = endpoint
        self.name = name
        self.heartbeat_s = heartbeat_s
        self.limits = (limits or REPLY_LIMITS).with_max_bytes(max_bytes)
        self.max_bytes = self.limits.max_bytes
        self._bounds = read_bounds(self.limits)
        self.counters = Counters()
        self.beats = BeatCounter()
        self._own_ctx = ctx is None
        self._ctx = zmq.Context() if ctx is None else ctx
        self._sock = configure(self._ctx.socket(zmq.DEALER), hwm=hwm, max_bytes=self.max_bytes, keys=keys,
                               credentials=credentials)
        self._sock.connect(endpoint)
        self._rcvtimeo = -1
        self._outstanding: dict[int, Message] = {}
        """Request id -> the request, until its reply is taken (resent after a re-Hello)."""
        self._replies: dict[int, Message | PartialCallbackFailed] = {}
        self._on_partial: dict[int, PartialCallback] = {}
        """Request id -> its partial-result callback, while it is outstanding."""
        self._sent_at: dict[int, float] = {}
        """Request id -> when it was last sent (``time.perf_counter``), until its reply."""
        self._waiting_since = 0.0
        """When the current :meth:`_wait` began: a reply's wait counts from its send or from
        then, whichever is later (a caller that takes its result late did not wait for it)."""
        self._last_send = time.perf_counter()
        """When this client last sent a frame: the server hears from it at least every
        ``heartbeat_s`` while it waits, even while replies keep arriving."""
        self.welcome: Welcome | None = None
        try:
            self.connect(connect_timeout)
        except BaseException:
            self.close()
            raise

    def connect(self, timeout: float = 30.0) -> Welcome:
        """Say ``Hello``; raises :class:`ProtocolMismatch` when the versions differ."""
        rid = self._send(Hello(version=PROTOCOL_VERSION, peer=self.name), next_request_id())
        try:
            reply = self._wait(rid, timeout)
        finally:
            self._outstanding.pop(rid, None)
            self._sent_at.pop(rid, None)
        self.welcome = reply = check_welcome(reply, f"{self.name} -> {self.endpoint}")
        return reply

    def submit(self, msg: Message, request_id: int | None = None, on_partial: PartialCallback | None = None) -> int:
        """Send ``msg`` without waiting; returns its request id for :meth:`result`.
        ``on_partial`` gets every partial result of it read from now on (see :meth:`result`)."""
        rid = next_request_id() if request_id is None else request_id
        if on_partial is not None:
            self._on_partial[rid] = on_partial
        return self._send(msg, rid)

    def result(self, request_id: int, timeout: float = 600.0, on_partial: PartialCallback | None = None) -> Message:
        """The reply to request ``request_id``, waiting up to ``timeout`` s (then the request
        is cancelled on the server and :class:`TimeoutError` raised). Raises
        :class:`RemoteError` for an ``Error`` reply and :class:`PeerLost` when the server went
        silent.

        ``on_partial(m)`` (instead of the one given to :meth:`submit`) is called on this thread
        for each partial result of the request read from now on, in the server's order; an
        exception from it fails the request with that exception (raised here) and cancels it
        on the server."""
        if request_id not in self._outstanding:
            raise KeyError(f"request {request_id} was not submitted, or its result was taken")
        if on_partial is not None:
            self._on_partial[request_id] = on_partial
        msg = self._outstanding[request_id]
        for attempt in range(2):
            reply = self._wait(request_id, timeout)
            if isinstance(reply, Error) and reply.code is ErrorCode.NO_HANDSHAKE and attempt == 0:
                self.connect(timeout)  # the server restarted or dropped us
                self._send(msg, request_id)
                continue
            break
        self._outstanding.pop(request_id, None)
        self._on_partial.pop(request_id, None)
        if isinstance(reply, PartialCallbackFailed):
            raise reply.error
        if isinstance(reply, Error):
            raise RemoteError(reply, f"{self.name} -> {self.endpoint} ({type(msg).__name__})")
        return reply

    def request(self, msg: Message, timeout: float = 600.0, request_id: int | None = None,
                on_partial: PartialCallback | None = None) -> Message:
        """Send ``msg`` and return its reply (see :meth:`result`)."""
        return self.result(self.submit(msg, request_id, on_partial), timeout)

    def _send(self, msg: Message, rid: int) -> int:
        self._outstanding[rid] = msg
        self.counters[f"sent/{type(msg).__name__}"] += 1
        send_frames(self._sock, encode(msg, rid))
        self._sent_at[rid] = self._last_send = time.perf_counter()
        return rid

    def _wait(self, rid: int, timeout: float) -> Message | PartialCallbackFailed:
        """Block on the socket until ``rid``'s reply; each ``heartbeat_s`` with no frame is a
        heartbeat tick."""
        deadline = time.monotonic() + timeout
        self._waiting_since = time.perf_counter()
        sock = self._sock
        msg = self._outstanding.get(rid)
        if rid not in self._replies and msg is not None and self.polling.worth_it(type(msg)):
            self._poll(rid, min(deadline, time.monotonic() + self.polling.spin_s))
        while rid not in self._replies:
            left = deadline - time.monotonic()
            if left <= 0:
                self._outstanding.pop(rid, None)
                self._sent_at.pop(rid, None)
                self._on_partial.pop(rid, None)
                self._cancel_remote(rid)
                raise TimeoutError(f"{self.name}: no reply to request {rid} from {self.endpoint} in {timeout:.3g} s")
            wait_ms = max(1, int(1000 * min(left, self.heartbeat_s)))
            if wait_ms != self._rcvtimeo:
                sock.setsockopt(zmq.RCVTIMEO, wait_ms)
                self._rcvtimeo = wait_ms
            try:
                read = recv_bounded(sock, self._bounds)
            except zmq.Again:
                if wait_ms >= int(1000 * self.heartbeat_s) and self.tick():
                    raise PeerLost(f"{self.name}: nothing from {self.endpoint} in {self.beats.limit} heartbeats") from None
                continue
            self._take(read)
            if time.perf_counter() - self._last_send >= self.heartbeat_s:
                # Replies keep coming but this side sends nothing (it waits on many requests):
                # without a frame from it the server would count it lost and cancel them.
                self._beat()
        return self._replies.pop(rid)

    def _poll(self, rid: int, until: float) -> None:
        """Read without blocking until ``rid``'s reply is in or ``until`` (``time.monotonic``)."""
        self.counters["spins"] += 1
        sock = self._sock
        while rid not in self._replies and time.monotonic() < until:
            try:
                read = recv_bounded(sock, self._bounds, NOBLOCK)
            except zmq.Again:
                yield_cpu()
                continue
            self.counters["polled"] += 1
            self._take(read)

    def _take(self, read: tuple[list[zmq.Frame], Cut | None]) -> None:
        """Keep a reply to a request still outstanding, pass a partial result to its
        callback; count everything. A reply over ``limits`` (``read`` has its cut) fails its
        request with ``too_large``."""
        self.beats.heard()
        frames, cut = read
        if cut is None:
            rid, reply = read_reply(frames, self.limits, self.counters)
        else:
            rid, reply = cut_error(frames[0] if frames else None, cut, self.limits, self.counters)
        if type(reply) in _PARTIALS:  # never the reply, nor timed as one
            self._partial(rid, reply)
            return
        sent = self._sent_at.pop(rid, None) if rid is not None else None
        if rid in self._outstanding and rid not in self._replies:  # a failed callback's error stays
            self._replies[rid] = reply
            if sent is not None:
                waited = time.perf_counter() - max(sent, self._waiting_since)
                self.polling.record(type(self._outstanding[rid]), waited)

    def _partial(self, rid: int | None, msg: Message) -> None:
        if rid is None or (callback := self._on_partial.get(rid)) is None:
            self.counters["stream/ignored" if rid in self._outstanding else "stream/unknown"] += 1
            return
        try:
            callback(msg)
        except Exception as e:  # noqa: BLE001 - the caller's error, raised from result()
            self.counters["stream/callback_error"] += 1
            del self._on_partial[rid]
            if rid not in self._replies:
                self._replies[rid] = PartialCallbackFailed(e)
                self._sent_at.pop(rid, None)
                self._cancel_remote(rid)

    def tick(self) -> bool:
        """One heartbeat interval passed with no frame: send a ``Heartbeat``; True (and the
        session forgotten) when this was the 3rd in a row."""
        if self.beats.tick():
            self.counters["peer_lost"] += 1
            self.beats.heard()
            self.welcome = None
            return True
        self._beat()
        return False

    def _beat(self) -> None:
        self.counters["sent/Heartbeat"] += 1
        self._sock.send_multipart(encode(Heartbeat(seq=self.beats.missed), next_request_id()))
        self._last_send = time.perf_counter()

    def _cancel_remote(self, rid: int) -> None:
        self.counters["sent/Cancel"] += 1
        try:
            self._sock.send_multipart(encode(Cancel(request_id=rid), next_request_id()), flags=zmq.NOBLOCK)
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
