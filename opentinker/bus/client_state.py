"""The client side of a bus session, without sockets: one state machine under both clients.

:class:`ClientState` decides what a client sends and what a frame it reads means; it never
touches a socket or a clock. The asyncio :class:`~opentinker.bus.client.Client` and the
blocking :class:`~opentinker.bus.sync.SyncClient` each drive one with their own I/O: they send
the frames its methods return (a :class:`Send`), feed it every message they read
(:meth:`ClientState.receive`) and every heartbeat interval (:meth:`ClientState.tick`), and pass
it the time where it needs one, so a test drives it with plain values.

What it keeps and decides, once for both clients:

* the session: ``Hello`` (:meth:`~ClientState.hello`), the server's ``Welcome`` checked
  (:meth:`~ClientState.welcomed`), and the one retry after a new ``Hello`` when the server
  answers ``no_handshake`` (it restarted, or dropped this client; :meth:`~ClientState.retry`);
* the requests outstanding (request id -> request), their partial-result callbacks and when
  each was sent, and which reply answers which request: the first answer of an outstanding
  request is kept in :attr:`~ClientState.replies` (a later one is dropped), partial results
  go to their request's callback and are never taken for the reply, and a callback that
  raises fails its request (:class:`~opentinker.bus.common.PartialCallbackFailed`) and
  cancels it on the server;
* heartbeats: a ``Heartbeat`` each interval, the server lost after
  :data:`~opentinker.bus.common.MISSED_BEATS` intervals with no frame from it
  (:class:`~opentinker.bus.common.PeerLost`), and a ``Heartbeat`` due when this side has sent
  nothing for an interval (:meth:`~ClientState.beat_due`);
* each message type's round trips (:class:`~opentinker.bus.common.ReplyPolling`), timed from
  the send, or from when the caller began waiting when that is later;
* the counters (``sent/<type>``, ``recv/<type>``, ``stream/*``, ``peer_lost``, ...).

Request ids are unique across processes (:func:`next_request_id`).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from typing import Any, NamedTuple

import zmq

from opentinker.bus.common import (
    DEFAULT_SPIN_S,
    REPLY_LIMITS,
    BeatCounter,
    Counters,
    PartialCallbackFailed,
    PeerLost,
    RemoteError,
    ReplyPolling,
    check_welcome,
    cut_error,
    read_reply,
)
from opentinker.bus.frames import Cut
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

PartialCallback = Callable[[Message], None]
"""Called with each partial result (``SampleChunk``) of its request, in the server's order."""
Answer = Message | PartialCallbackFailed
"""What answers a request: the server's reply, or the error its partial callback raised."""

_PARTIALS = frozenset(PARTIALS)
_ids = itertools.count(1)
_BASE = int.from_bytes(os.urandom(3), "little") << 32
"""Request ids are unique across processes: a random high half and a counter."""


def next_request_id() -> int:
    """A request id no other request of this process (or, but for a 2**-24 chance, of another
    process) has."""
    return _BASE | next(_ids)


class Send(NamedTuple):
    """Frames for the driver to send now; ``what`` names them in the counter of a send that
    fails (``error/<what>_not_sent``): ``request``, ``heartbeat`` or ``cancel``."""

    frames: list[Any]
    what: str


class Received(NamedTuple):
    """What :meth:`ClientState.receive` made of a message read: ``rid``, the request it
    answered (its answer is in :attr:`ClientState.replies`; None: it answered none),
    ``message``, what was read (a ``too_large`` ``Error`` for a message over the limits), and
    ``cancel``: cancel that request on the server (:meth:`ClientState.cancel`; its partial
    callback raised)."""

    rid: int | None
    message: Message
    cancel: bool = False


class ClientState:
    """One client's session, requests and heartbeats, driven by a client's own I/O.

    Args:
        name: this client's name (in ``Hello`` and in errors).
        endpoint: the server's endpoint (in errors).
        limits: what one reply may be (a longer one answers its request with ``too_large``).
        heartbeat_s: the heartbeat interval the driver ticks at (:meth:`beat_due`).
        spin_s: poll for a reply of a type whose round trips average at most this
            (:class:`~opentinker.bus.common.ReplyPolling`; 0: never).
    """

    def __init__(self, name: str, endpoint: str, limits: Limits, heartbeat_s: float | None,
                 spin_s: float = DEFAULT_SPIN_S) -> None:
        self.polling = ReplyPolling(spin_s)
        self.name = name
        self.endpoint = endpoint
        self.limits = limits
        self.heartbeat_s = heartbeat_s
        self.counters = Counters()
        self.beats = BeatCounter()
        self.welcome: Welcome | None = None
        """The server's ``Welcome`` while in a session; None before it and once lost."""
        self.outstanding: dict[int, Message] = {}
        """Request id -> the request, until the driver forgets it (:meth:`forget`)."""
        self.on_partial: dict[int, PartialCallback] = {}
        """Request id -> its partial-result callback, while it is outstanding."""
        self.sent_at: dict[int, float] = {}
        """Request id -> when it was last sent, until its reply."""
        self.replies: dict[int, Answer] = {}
        """Request id -> its answer, until the driver takes it (:meth:`take`)."""
        self.waiting_since = 0.0
        """When the caller began waiting: a reply's round trip counts from its send or from
        then, whichever is later (a caller that takes its result late did not wait for it)."""
        self.last_send = 0.0
        """When this client last sent a frame (:meth:`beat_due`)."""

    @property
    def where(self) -> str:
        """``name -> endpoint``, for errors."""
        return f"{self.name} -> {self.endpoint}"

    # ------------------------------------------------------------------ what to send

    def hello(self) -> tuple[int, Send]:
        """A ``Hello`` request (outstanding like any request): its id and frames."""
        rid = next_request_id()
        return rid, self.request(Hello(version=PROTOCOL_VERSION, peer=self.name), rid)

    def request(self, msg: Message, rid: int, on_partial: PartialCallback | None = None) -> Send:
        """``msg`` as request ``rid``, outstanding from now on (sent again after a new Hello:
        the same id); ``on_partial`` gets its partial results."""
        self.outstanding[rid] = msg
        if on_partial is not None:
            self.on_partial[rid] = on_partial
        self.counters[f"sent/{type(msg).__name__}"] += 1
        return Send(encode(msg, rid), "request")

    def sent(self, rid: int, now: float) -> None:
        """Request ``rid`` went out at ``now``: its round trip counts from here."""
        self.sent_at[rid] = self.last_send = now

    def cancel(self, rid: int) -> Send:
        """A ``Cancel`` of request ``rid`` (the server stops its work; counted)."""
        self.counters["sent/Cancel"] += 1
        return Send(encode(Cancel(request_id=rid), next_request_id()), "cancel")

    def beat(self, now: float) -> Send:
        """A ``Heartbeat`` sent at ``now`` (counted)."""
        self.counters["sent/Heartbeat"] += 1
        self.last_send = now
        return Send(encode(Heartbeat(seq=self.beats.missed), next_request_id()), "heartbeat")

    def beat_due(self, now: float) -> bool:
        """Has this side sent nothing for a heartbeat interval? (A client that waits on many
        replies still sends a frame each interval, or the server counts it lost.)"""
        return self.heartbeat_s is not None and now - self.last_send >= self.heartbeat_s

    def tick(self, now: float) -> Send | PeerLost:
        """One heartbeat interval passed: a ``Heartbeat`` to send, or, at the
        :data:`~opentinker.bus.common.MISSED_BEATS`-th interval in a row with no frame from
        the server, the :class:`PeerLost` its outstanding requests fail with (counted
        ``peer_lost``; the session is over: the next request says Hello again)."""
        if self.beats.tick():
            self.counters["peer_lost"] += 1
            self.beats.heard()
            self.welcome = None
            return PeerLost(f"{self.name}: nothing from {self.endpoint} in {self.beats.limit} heartbeats")
        return self.beat(now)

    # ------------------------------------------------------------------ what was read

    def receive(self, frames: list[zmq.Frame], cut: Cut | None, now: float) -> Received:
        """A message read from the server at ``now`` (``cut``: it was over ``limits`` and only
        its header was kept): which request it answered, if any.

        Every frame is a sign of life. A partial result goes to its request's callback (or is
        counted ``stream/ignored`` / ``stream/unknown`` and dropped); a callback that raises
        answers its request with :class:`PartialCallbackFailed` and cancels it. Any other
        message answers its request when that is outstanding and not answered yet."""
        self.beats.heard()
        if cut is None:
            rid, reply = read_reply(frames, self.limits, self.counters)
        else:
            rid, reply = cut_error(frames[0] if frames else None, cut, self.limits, self.counters)
        if type(reply) in _PARTIALS:  # never the reply, nor timed as one
            return self._partial(rid, reply)
        if rid is None:
            return Received(None, reply)
        sent = self.sent_at.pop(rid, None)
        if rid not in self.outstanding or rid in self.replies:  # a failed callback's error stays
            return Received(None, reply)
        self.replies[rid] = reply
        if sent is not None:
            self.polling.record(type(self.outstanding[rid]), now - max(sent, self.waiting_since))
        return Received(rid, reply)

    def _partial(self, rid: int | None, msg: Message) -> Received:
        if rid is None or (callback := self.on_partial.get(rid)) is None:
            self.counters["stream/ignored" if rid in self.outstanding else "stream/unknown"] += 1
            return Received(None, msg)
        try:
            callback(msg)
        except Exception as e:  # noqa: BLE001 - the caller's error, raised from its request
            self.counters["stream/callback_error"] += 1
            del self.on_partial[rid]
            if rid in self.replies:
                return Received(None, msg)
            self.replies[rid] = PartialCallbackFailed(e)
            self.sent_at.pop(rid, None)
            return Received(rid, msg, cancel=True)
        return Received(None, msg)

    # ------------------------------------------------------------------ outcomes

    def take(self, rid: int) -> Answer:
        """Request ``rid``'s answer, out of :attr:`replies` (KeyError when none came)."""
        return self.replies.pop(rid)

    def forget(self, rid: int) -> None:
        """Request ``rid`` is over (answered, timed out, cancelled): nothing is kept of it,
        and an answer still to come is dropped."""
        self.outstanding.pop(rid, None)
        self.on_partial.pop(rid, None)
        self.sent_at.pop(rid, None)
        self.replies.pop(rid, None)

    def welcomed(self, reply: Answer) -> Welcome:
        """The answer to ``Hello``: the session starts (raises
        :class:`~opentinker.bus.common.ProtocolMismatch` or :class:`RemoteError` for another)."""
        if isinstance(reply, PartialCallbackFailed):
            raise reply.error
        self.welcome = check_welcome(reply, self.where)
        self.beats.heard()
        return self.welcome

    def retry(self, reply: Answer, attempt: int) -> bool:
        """Send the request again, after a new ``Hello``? True for ``no_handshake`` (the
        server restarted, or dropped this client) on the first attempt; the session is over
        then (:attr:`welcome` is None)."""
        if attempt == 0 and isinstance(reply, Error) and reply.code is ErrorCode.NO_HANDSHAKE:
            self.welcome = None
            return True
        return False

    def result(self, msg: Message, reply: Answer) -> Message:
        """What the caller of request ``msg`` gets: the reply, or the error a failed callback
        raised, or :class:`RemoteError` for an ``Error`` reply."""
        if isinstance(reply, PartialCallbackFailed):
            raise reply.error
        if isinstance(reply, Error):
            raise RemoteError(reply, f"{self.where} ({type(msg).__name__})")
        return reply


class StateClient:
    """What both clients show of their :class:`ClientState` (``self.state``): the session's
    ``welcome``, ``counters``, ``beats``, ``polling`` and settings, as attributes of the client.

    Args:
        name, endpoint, heartbeat_s, spin_s: as :class:`ClientState` takes them.
        limits: what one reply may be (default :data:`~opentinker.bus.common.REPLY_LIMITS`);
            ``max_bytes`` replaces its ``max_bytes``.
    """

    def __init__(self, name: str, endpoint: str, heartbeat_s: float | None, spin_s: float,
                 limits: Limits | None, max_bytes: int | None) -> None:
        self.state = ClientState(name, endpoint, (limits or REPLY_LIMITS).with_max_bytes(max_bytes), heartbeat_s,
                                 spin_s)

    @property
    def welcome(self) -> Welcome | None:
        """The server's ``Welcome`` while in a session, else None."""
        return self.state.welcome

    @property
    def name(self) -> str:
        return self.state.name

    @property
    def endpoint(self) -> str:
        return self.state.endpoint

    @property
    def heartbeat_s(self) -> float | None:
        return self.state.heartbeat_s

    @property
    def limits(self) -> Limits:
        return self.state.limits

    @property
    def max_bytes(self) -> int:
        return self.state.limits.max_bytes

    @property
    def counters(self) -> Counters:
        return self.state.counters

    @property
    def beats(self) -> BeatCounter:
        return self.state.beats

    @property
    def polling(self) -> ReplyPolling:
        return self.state.polling

    @property
    def _on_partial(self) -> dict[int, PartialCallback]:
        return self.state.on_partial

    def next_request_id(self) -> int:
        """A fresh request id (:func:`next_request_id`)."""
        return next_request_id()
