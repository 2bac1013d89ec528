"""Streamed partial results: any number of partial messages
(:data:`~protocols.messages.PARTIALS`, e.g. ``SampleChunk``) for a request before its one final
reply, and the server side that sends them.

A handler asks :meth:`~opentinker.bus.server.Server.emitter` for the :class:`Emitter` of the
request it serves and hands it to whatever produces the partials, typically the scheduler's
compute thread. An emitter is thread-safe and never blocks: it encodes a partial on the
caller's thread and queues it; the server's event loop sends what is queued (one wake-up of the
loop for every partial posted meanwhile, whatever the number of requests). Partials are bounded
twice, and a bound drops the partial (counted) rather than block or grow: at most ``backlog``
wait per request (the loop is not keeping up), and none is queued in ZeroMQ for a peer whose
queue is at its high-water mark. The final reply is never dropped for a full queue: it waits
in :class:`Parked` until there is room (or the peer is lost).

Drops are counted as ``stream/dropped`` and ``stream/dropped/<why>``:

==============  ==================================================================
why             the partial was
==============  ==================================================================
``late``        emitted after its request's final reply, or after its ``Cancel``
``cancelled``   queued, not yet sent, when its request was cancelled
``backlog``     one more than ``backlog`` waiting for its request to be sent
``full``        for a peer whose queue is at its high-water mark
``unroutable``  for a peer that is gone, or a server that has stopped
==============  ==================================================================
"""

from __future__ import annotations

import asyncio
import collections
import threading
from collections.abc import Callable
from typing import Any

from opentinker.bus.common import Counters
from protocols.codec import encode
from protocols.messages import PARTIALS, Message

DEFAULT_BACKLOG = 256
"""Partials of one request waiting for the loop to send them, at most."""

Route = Callable[[list[Any]], "str | None"]
"""Sends ``[identity, *frames]`` without blocking: None when sent, else why not (``full``,
``unroutable``)."""

_PARTIALS = frozenset(PARTIALS)


def wants_stream(msg: Message) -> bool:
    """Whether ``msg`` asks for partial results (a ``stream`` field set to true, e.g.
    ``SampleRequest(stream=True)``)."""
    return getattr(msg, "stream", False) is True


class Emitter:
    """Sends the partial results of one request: ``emit(msg)``, from any thread.

    Returns True when ``msg`` is queued for sending, False when it was dropped at once
    (counted): its request has ended (final reply sent, or cancelled) or ``backlog``
    partials of it already wait. A queued partial is still dropped if the peer's queue is
    full when its turn comes. Partials of one request leave in the order they were emitted,
    all before the final reply when emitted before the handler returned. ``msg``'s arrays
    are sent without copying: do not write to them afterwards.

    ``closed`` turns True once the request's final reply is on its way or the request was
    cancelled (or its peer lost): a producer should stop working for it then.
    """

    __slots__ = ("_closed", "_outbox", "_queue", "_ready", "identity", "request_id")

    def __init__(self, outbox: Outbox, identity: bytes, request_id: int, closed: bool = False) -> None:
        self.request_id = request_id
        self.identity = identity
        self._outbox = outbox
        self._queue: list[tuple[str, list[Any]]] = []
        self._closed = closed
        self._ready = False
        """In the outbox's list of emitters with something to send (under its lock)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def __call__(self, msg: Message) -> bool:
        kind = type(msg)
        if kind not in _PARTIALS:  # a client would take it for the final reply
            raise TypeError(f"{kind.__name__} is not a partial result (protocols.messages.PARTIALS: "
                            f"{', '.join(t.__name__ for t in PARTIALS)})")
        if self._closed:  # checked again under the lock; this only saves encoding it
            return self._outbox.drop("late")
        return self._outbox.post(self, kind.__name__, encode(msg, self.request_id))

    def __repr__(self) -> str:
        return f"Emitter(request_id={self.request_id}, closed={self._closed})"


class Outbox:
    """The partials of every request of one server, on their way from producer threads to
    the socket. One lock, and at most one callback scheduled on the loop at a time.

    Args:
        loop: the server's event loop (every send happens there).
        route: sends a frame list, see :data:`Route`.
        counters: the server's counters (written on the loop only).
        backlog: partials waiting per request, at most.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, route: Route, counters: Counters,
                 backlog: int = DEFAULT_BACKLOG) -> None:
        if backlog < 1:
            raise ValueError(f"backlog must be >= 1, got {backlog}")
        self.loop = loop
        self.route = route
        self.counters = counters
        self.backlog = backlog
        self._lock = threading.Lock()
        self._ready: list[Emitter] = []
        self._drops: collections.Counter[str] = collections.Counter()
        """Drops seen off the loop, counted on it at the next flush."""
        self._scheduled = False

    def emitter(self, identity: bytes, request_id: int, closed: bool = False) -> Emitter:
        return Emitter(self, identity, request_id, closed)

    # ------------------------------------------------------------------ any thread

    def post(self, em: Emitter, kind: str, frames: list[Any]) -> bool:
        with self._lock:
            if em._closed:
                why: str | None = "late"
            elif len(em._queue) >= self.backlog:
                why = "backlog"
            else:
                why = None
                em._queue.append((kind, frames))
                if not em._ready:
                    em._ready = True
                    self._ready.append(em)
            if why is not None:
                self._drops[why] += 1
            if self._scheduled:
                return why is None
            self._scheduled = True
        self._wake()
        return why is None

    def drop(self, why: str) -> bool:
        """Count one partial dropped off the loop; returns False (what ``emit`` returns)."""
        with self._lock:
            self._drops[why] += 1
            if self._scheduled:
                return False
            self._scheduled = True
        self._wake()
        return False

    def _wake(self) -> None:
        try:
            self.loop.call_soon_threadsafe(self._flush)
        except RuntimeError:  # the loop is closed: the server, and its counters, are gone
            pass

    # ------------------------------------------------------------------ on the loop

    def _flush(self) -> None:
        with self._lock:
            self._scheduled = False
            ready, self._ready = self._ready, []
            drops, self._drops = self._drops, collections.Counter()
            batches = []
            for em in ready:
                em._ready = False
                if em._queue:
                    batches.append((em, em._queue))
                    em._queue = []
        for why, n in drops.items():
            self._count(why, n)
        for em, items in batches:
            self._send(em, items)

    def _send(self, em: Emitter, items: list[tuple[str, list[Any]]]) -> None:
        for i, (kind, frames) in enumerate(items):
            why = self.route([em.identity, *frames])
            if why is None:
                self.counters[f"sent/{kind}"] += 1
            elif why == "full":  # the rest would find it full too: drop them without trying
                self._count(why, len(items) - i)
                return
            else:
                self._count(why, 1)

    def finish(self, em: Emitter) -> None:
        """The request's final reply is about to be sent: send what it has queued first,
        then accept nothing more (later partials are dropped as ``late``)."""
        with self._lock:
            em._closed = True
            items, em._queue = em._queue, []
        if items:
            self._send(em, items)

    def close(self, em: Emitter, why: str = "cancelled") -> None:
        """The request was cancelled (or its peer lost): drop what it has queued, accept
        nothing more."""
        with self._lock:
            em._closed = True
            n, em._queue = len(em._queue), []
        if n:
            self._count(why, n)

    def _count(self, why: str, n: int) -> None:
        self.counters["stream/dropped"] += n
        self.counters[f"stream/dropped/{why}"] += n


class Parked:
    """Final replies that found their peer's queue full: retried on a timer (1 ms, doubling
    to 50 ms while nothing goes) until each is sent or its peer is lost. At most ``limit``
    wait; another one, or one whose peer is lost, is dropped and counted ``error/send``.

    Args:
        loop: the server's event loop.
        route: sends a frame list, see :data:`Route`.
        alive: whether a peer identity is still connected (the server's sessions).
        counters: the server's counters (``parked`` counts finals that had to wait).
        limit: finals waiting, at most.
    """

    MIN_DELAY_S = 1e-3
    MAX_DELAY_S = 0.05

    def __init__(self, loop: asyncio.AbstractEventLoop, route: Route, alive: Callable[[bytes], bool],
                 counters: Counters, limit: int) -> None:
        self.loop = loop
        self.route = route
        self.alive = alive
        self.counters = counters
        self.limit = limit
        self._waiting: collections.deque[list[Any]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None
        self._delay = self.MIN_DELAY_S

    def __len__(self) -> int:
        return len(self._waiting)

    def add(self, frames: list[Any]) -> bool:
        """Keep ``frames`` (identity first) to send when there is room; False when ``limit``
        finals already wait (the caller drops it)."""
        if len(self._waiting) >= self.limit:
            return False
        self.counters["parked"] += 1
        self._waiting.append(frames)
        if self._timer is None:
            self._delay = self.MIN_DELAY_S
            self._timer = self.loop.call_later(self._delay, self._retry)
        return True

    def _retry(self) -> None:
        self._timer = None
        still: collections.deque[list[Any]] = collections.deque()
        sent = False
        for frames in self._waiting:
            why = self.route(frames) if self.alive(frames[0]) else "unroutable"
            if why is None:
                sent = True
            elif why == "full":
                still.append(frames)
            else:
                self.counters["error/send"] += 1
        self._waiting = still
        if still:
            self._delay = self.MIN_DELAY_S if sent else min(2 * self._delay, self.MAX_DELAY_S)
            self._timer = self.loop.call_later(self._delay, self._retry)

    def clear(self) -> None:
        """Drop every waiting final (the server stops)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self.counters["error/send"] += len(self._waiting)
        self._waiting.clear()
