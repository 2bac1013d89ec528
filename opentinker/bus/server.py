"""The ROUTER side of the bus: sessions, idempotent requests, cancellation, heartbeats,
bounded work and typed errors.

A client first says :class:`~protocols.messages.Hello` (the protocol version is checked there
and in every header); the server answers :class:`~protocols.messages.Welcome` and from then
on serves that peer's requests, each in its own task, so a slow handler never blocks the
socket. What the server does with every kind of frame:

===============================  ===========================================================
frame                             reply
===============================  ===========================================================
undecodable / wrong version /     ``Error`` with the decode error's code (when the request id
unknown type / bad field / over   can be read) and ``error/<code>`` counted
a :class:`Limits` bound
more frames or bytes than the     ``Error(too_large)``; read frame by frame, only its first two
limits take                       frames kept (``dropped/too_many_frames`` or ``_bytes``,
                                  ``dropped/bytes``), one log line a second at most
request before ``Hello``          ``Error(no_handshake)``; before its ``Hello`` a peer's message
                                  is decoded only when it could be one (``HELLO_LIMITS``)
``Heartbeat``                     ``Heartbeat`` (answered on the socket loop, never queued)
``Cancel(request_id)``            ``Ack`` (the request's task is cancelled; the request itself
                                  ends with ``Error(cancelled)`` or its result) or ``not_found``
``Shutdown``                      ``Ack``, then the server stops
a request while ``max_inflight``  ``Error(busy)``: bounded work instead of unbounded memory
are running
a retried state-changing request  the first request's reply, never applied twice (remembered
                                  per peer identity and request id)
a request with ``stream`` set     any number of partials (``SampleChunk``) the handler emits
                                  through :meth:`Server.emitter`, then the final reply
===============================  ===========================================================

A final reply that finds the peer's queue full waits until there is room (the socket routes
with ``ROUTER_MANDATORY``, so a full queue is seen rather than silently dropped); partials are
dropped instead (:mod:`opentinker.bus.stream`).

:meth:`Server.tick` counts heartbeats of every peer (called each ``heartbeat_s`` by the
server's own loop, or by a test); a peer silent for 3 ticks is lost: its requests are
cancelled and it must say ``Hello`` again.
"""

from __future__ import annotations

import asyncio
import collections
import contextvars
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from typing import Any

import zmq
import zmq.asyncio

from opentinker.bus.auth import Guard, run_user
from opentinker.bus.common import (
    DEFAULT_HEARTBEAT_S,
    DEFAULT_HWM,
    LOOPBACK,
    BeatCounter,
    Counters,
    CurveKeys,
    bind_guarded,
    configure,
    cut_error,
    frame_cap,
    read_bounds,
    server_side,
)
from opentinker.bus.frames import Cut, plain_context
from opentinker.bus.held import watch
from opentinker.bus.logs import LogEvery
from opentinker.bus.loop import SocketReader, run_eager
from opentinker.bus.stream import DEFAULT_BACKLOG, Emitter, Outbox, Parked, wants_stream
from protocols.codec import DEFAULT_LIMITS, DecodeError, Limits, decode, encode
from protocols.messages import (
    PARTIALS,
    PROTOCOL_VERSION,
    STATE_CHANGING,
    Ack,
    Cancel,
    Error,
    ErrorCode,
    Heartbeat,
    Hello,
    Message,
    Shutdown,
    Welcome,
)

log = logging.getLogger(__name__)
Handler = Callable[[Message], Awaitable[Message]]


_SESSION = frozenset({Hello, Heartbeat, Cancel, Shutdown})
"""Messages the server answers itself (never passed to the handler)."""
_PARTIALS = frozenset(PARTIALS)

HELLO_LIMITS = Limits(max_bytes=4096, max_buffers=0, max_body_bytes=4096, max_ndim=1)
"""What a peer's message may be before its ``Hello``: no more than a ``Hello`` needs. A larger
one is not decoded and gets ``Error(no_handshake)`` (a bundled client then says ``Hello`` and
retries), so a peer without a session costs the server next to nothing."""

_SERVING: contextvars.ContextVar[tuple[Server, Emitter | None, _Peer] | None] = contextvars.ContextVar(
    "opentinker_bus_serving", default=None)
"""In a request's task (each has its own context): its server, its emitter (None unless the
request asked for a stream) and its peer's session."""


@dataclass
class _Peer:
    name: str
    beats: BeatCounter
    principal: str = ""
    """The bus user it authenticated as (ZeroMQ's ``User-Id`` of its ``Hello``)."""
    inflight: dict[int, asyncio.Task] = field(default_factory=dict)
    streams: dict[int, Emitter] = field(default_factory=dict)
    """Emitters of its streamed requests in flight, by request id (closed on Cancel)."""
    last_request: int = 0
    """The server's request count when it last sent a request (its handshake counts)."""


class Server:
    """ROUTER server: ``await handler(msg)`` for each request of each connected peer.

    Args:
        handler: serves one request; ``ValueError``/``TypeError`` become an ``Error(invalid)``
            reply, ``LookupError`` such as ``KeyError`` (an unknown name) ``Error(not_found)``, anything else
            ``Error(internal)``; the server keeps serving.
        endpoint: where to bind (``tcp://``, ``ipc://``, ``inproc://``); a non-loopback TCP
            address needs ``keys``. On a run with a CURVE pair, a server without ``keys`` or
            ``accounts`` uses the pair, and ``LOOPBACK`` is the run's host
            (:func:`~opentinker.bus.common.server_side`).
        max_bytes: shorthand for ``limits.max_bytes``.
        limits: what one request may cost (frames, bytes, body, array rank), each checked
            before the work it bounds; a request over them gets ``Error(too_large)`` (or
            ``bad_message``).
        idempotency_cache: replies of state-changing requests remembered for retries, by
            (peer identity, request id).
        max_inflight: requests handled at once (all peers); more get ``Error(busy)``.
        max_peers: sessions at once; a ``Hello`` beyond evicts the least recently active
            session of the peer name that holds the most (see :meth:`_evict_for`).
        heartbeat_s: interval of :meth:`tick`; ``None``: no automatic ticks (tests tick).
        keys: CURVE keys; ``keys.allowed_clients`` restricts who may connect.
        on_shutdown: called after a ``Shutdown`` request is acknowledged.
        owners: peer names (from ``Hello``) whose ``Shutdown`` is obeyed; another peer's gets
            ``Error(invalid)``, counted ``error/not_owner`` (none by default: the process that
            made the server stops it).
        stream_backlog: partials of one request waiting to be sent, at most (more are
            dropped, see :mod:`opentinker.bus.stream`).
        accounts: further PLAIN users this server accepts, user -> secret, besides the run's
            own (:mod:`opentinker.bus.auth`); read at each handshake, so the caller may add
            and remove accounts while it serves.
        curve_users: with ``keys``, the only client keys accepted, public key (Z85 text) ->
            the user each stands for (its principal); read at each handshake, as ``accounts``.
    """

    def __init__(
        self,
        handler: Handler,
        endpoint: str = LOOPBACK,
        name: str = "server",
        *,
        max_bytes: int | None = None,
        limits: Limits | None = None,
        idempotency_cache: int = 4096,
        max_inflight: int = 1024,
        max_peers: int = 1024,
        heartbeat_s: float | None = DEFAULT_HEARTBEAT_S,
        keys: CurveKeys | None = None,
        hwm: int = DEFAULT_HWM,
        on_shutdown: Callable[[], Any] | None = None,
        stream_backlog: int = DEFAULT_BACKLOG,
        owners: Collection[str] = (),
        accounts: Mapping[str, bytes] | None = None,
        curve_users: Mapping[str, str] | None = None,
    ) -> None:
        endpoint, keys = server_side(endpoint, keys, accounts)
        if curve_users is not None and keys is None:
            raise ValueError("curve_users needs keys: they are the client keys of a CURVE server")
        self.accounts, self.curve_users = accounts, curve_users
        self.handler = handler
        self.name = name
        self.limits = (limits or DEFAULT_LIMITS).with_max_bytes(max_bytes)
        self.max_bytes = self.limits.max_bytes
        self.max_inflight = max_inflight
        self.max_peers = max_peers
        self.heartbeat_s = heartbeat_s
        self.keys = keys
        self.hwm = hwm
        self.on_shutdown = on_shutdown
        self.owners = frozenset(owners)
        self.stream_backlog = stream_backlog
        self.counters = Counters()
        self._bind_to = endpoint
        self._sock: zmq.Socket | None = None
        self._tasks: list[asyncio.Task] = []
        self._peers: dict[bytes, _Peer] = {}
        self._running = 0
        self._seen = 0
        """Requests and handshakes so far: orders sessions by their last request."""
        self._done: collections.OrderedDict[tuple[bytes, int], asyncio.Future] = collections.OrderedDict()
        """Replies of state-changing requests by (peer identity, request id), oldest first."""
        self._cache_size = idempotency_cache
        self._log = LogEvery(log)
        self._auth: Guard | None = None
        self.stopped: asyncio.Event | None = None
        """Set once the server has stopped (created in :meth:`start`, on the loop)."""
        self.endpoint = ""

    async def start(self, ctx: zmq.asyncio.Context) -> str:
        """Bind and start serving; returns the bound endpoint (with the OS-picked port)."""
        self.stopped = asyncio.Event()
        self._loop = asyncio.get_running_loop()
        sock = configure(plain_context(ctx).socket(zmq.ROUTER), hwm=self.hwm, max_bytes=self.max_bytes,
                         keys=self.keys, server=True)
        # A reply to a peer whose queue is full fails (EAGAIN) instead of vanishing: partials
        # are then dropped and counted, a final reply waits for room (Parked).
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Watched from before the bind: no connection is accepted unseen.
        held = watch(sock, self._bind_to, self.name, self.counters, max_bytes=self.max_bytes,
                     frame_cap=frame_cap(self.max_bytes), router=True, curve=self.keys is not None)
        try:
            self._auth = bind_guarded(sock, self._bind_to, self.name, self.counters, self.keys, self.accounts,
                                      self.curve_users)
        except zmq.ZMQError:
            if held is not None:
                held.close()
            raise
        self._sock = sock
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._io = SocketReader(sock, self._on_frames, self._loop, bounds=read_bounds(self.limits, router=True),
                                on_cut=self._on_cut, watch=held)
        self._outbox = Outbox(self._loop, self._route, self.counters, self.stream_backlog)
        self._parked = Parked(self._loop, self._route, self._peers.__contains__, self.counters,
                              limit=self.max_inflight)
        if self.heartbeat_s:
            self._tasks.append(asyncio.create_task(self._beat(self.heartbeat_s)))
        return self.endpoint

    def emitter(self) -> Emitter | None:
        """The :class:`~opentinker.bus.stream.Emitter` of the request the calling handler
        serves, or None when that request did not ask for partials (no ``stream=True``).

        Call it in the handler (in its task, before or after an ``await``), then call the
        emitter from any thread: ``emit(SampleChunk(...))``. Raises RuntimeError outside a
        handler of this server.
        """
        return self._serving("emitter")[1]

    def peer_name(self) -> str:
        """The name (from its ``Hello``) of the peer whose request the handler is serving; call
        it in the handler's task. Only authenticated peers have sessions, so this tells the
        run's components apart, not adversaries."""
        return self._serving("peer_name")[2].name

    def principal(self) -> str:
        """The bus user the peer whose request the handler is serving authenticated as (the
        run's own user, or an account's: a shared scheduler's job); call it in the handler's
        task. Unlike :meth:`peer_name`, a peer cannot choose it: ZeroMQ's handshake set it."""
        return self._serving("principal")[2].principal

    def drop_principal(self, principal: str) -> int:
        """End every session of ``principal`` (a job closed on a shared scheduler): their
        requests in flight are cancelled. Returns the number of sessions ended; call it on
        the server's loop."""
        idents = [i for i, p in self._peers.items() if p.principal == principal]
        for ident in idents:
            self._drop(ident)
        return len(idents)

    def _serving(self, what: str) -> tuple[Server, Emitter | None, _Peer]:
        serving = _SERVING.get()
        if serving is None or serving[0] is not self:
            raise RuntimeError(f"{self.name}: Server.{what}() is for this server's handler, while it serves a request")
        return serving

    @property
    def peers(self) -> dict[str, int]:
        """Connected peers by name -> requests in flight."""
        return {p.name: len(p.inflight) for p in self._peers.values()}

    def _on_frames(self, frames: list[zmq.Frame]) -> None:
        try:
            self._dispatch(frames)
        except Exception:  # nothing a peer sends may stop the server
            self.counters["error/internal"] += 1
            log.exception("%s: dispatch failed", self.name)

    def _on_cut(self, kept: list[zmq.Frame], cut: Cut) -> None:
        """A message over the read bounds, of which only ``kept`` (identity, header) was held:
        counted, logged (at most a line a second) and answered ``too_large``."""
        try:
            identity = kept[0].bytes
            cut = cut._replace(parts=cut.parts - 1, nbytes=cut.nbytes - len(identity))  # the message, not the routing
            rid, err = cut_error(kept[1] if len(kept) > 1 else None, cut, self.limits, self.counters)
            self._log.warning("drop", "%s: dropped a message from %s: %s (%d bytes freed)",
                              self.name, identity.hex(), err.message, cut.nbytes)
            self._send(identity, err, rid or 0)
        except Exception:  # nothing a peer sends may stop the server
            self.counters["error/internal"] += 1
            log.exception("%s: dropping a message failed", self.name)

    async def _beat(self, interval: float) -> None:
        while True:
            await asyncio.sleep(interval)
            self.tick()

    def tick(self) -> list[str]:
        """One heartbeat interval passed: count it for every peer; drop the peers silent for
        3 intervals (their requests are cancelled). Returns the names of the dropped peers."""
        lost = [ident for ident, p in self._peers.items() if p.beats.tick()]
        names = []
        for ident in lost:
            peer = self._peers[ident]
            names.append(peer.name)
            self.counters["peer_lost"] += 1
            # A peer with nothing in flight that went quiet is a client done or idle (a CLI call,
            # a person thinking at a prompt): said at INFO. One whose requests are cancelled: WARNING.
            self._log.log(logging.WARNING if peer.inflight else logging.INFO, "lost" if peer.inflight else "idle lost",
                          "%s: peer %s lost (no frame in %d heartbeats); cancelling %d requests",
                          self.name, peer.name, peer.beats.limit, len(peer.inflight))
            self._drop(ident)
        return names

    def _drop(self, ident: bytes) -> _Peer:
        """End a session: its requests in flight are cancelled, its streams closed."""
        peer = self._peers.pop(ident)
        for task in peer.inflight.values():
            task.cancel()
        for em in peer.streams.values():
            self._outbox.close(em)
        return peer

    def _dispatch(self, frames: list[zmq.Frame]) -> None:
        if len(frames) < 2:
            self.counters["error/bad_frame"] += 1
            return
        identity = frames[0].bytes
        peer = self._peers.get(identity)
        try:
            rid, msg = decode([f.buffer for f in frames[1:]], limits=self.limits if peer is not None else HELLO_LIMITS)
        except DecodeError as e:
            code = e.code
            if peer is None and code is ErrorCode.TOO_LARGE:  # larger than a Hello: not read further
                code = ErrorCode.NO_HANDSHAKE
                e = DecodeError(code, f"{self.name}: say Hello first (before it a message may be at most "
                                      f"{HELLO_LIMITS.max_bytes} bytes in 2 frames)", e.request_id)
            self.counters[f"error/{code.value}"] += 1
            self._log.warning(f"bad/{code.value}", "%s: bad frame from %s: %s", self.name, identity.hex(), e)
            self._send(identity, Error(code=code, message=str(e)), e.request_id or 0)
            return
        kind = type(msg).__name__
        self.counters[f"recv/{kind}"] += 1
        if peer is not None:
            peer.beats.missed = 0  # heard from it
            if rid in peer.inflight:  # a retry of a request still running: its reply answers both
                self.counters["dedup"] += 1
                return
            if type(msg) not in _SESSION and self._running < self.max_inflight:  # the hot path
                self._seen += 1
                peer.last_request = self._seen
                self._running += 1
                task = run_eager(self._request(identity, peer, rid, msg), self._loop)
                if task is not None:  # it waits for something: cancellable while in flight
                    peer.inflight[rid] = task
                return
        if isinstance(msg, Hello):
            self._hello(identity, rid, msg, _user_id(frames[1]))
        elif peer is None:
            self.counters["error/no_handshake"] += 1
            self._send(identity, Error(code=ErrorCode.NO_HANDSHAKE,
                                       message=f"{self.name}: say Hello before {kind}"), rid)
        elif isinstance(msg, Heartbeat):
            self._send(identity, Heartbeat(seq=msg.seq), rid)
        elif isinstance(msg, Cancel):
            task = peer.inflight.get(msg.request_id)
            if task is None:
                self._send(identity, Error(code=ErrorCode.NOT_FOUND,
                                           message=f"no request {msg.request_id} in flight"), rid)
            else:
                self.counters["cancelled"] += 1
                em = peer.streams.get(msg.request_id)
                if em is not None:  # no partial of it after the Ack
                    self._outbox.close(em)
                task.cancel()
                self._send(identity, Ack(), rid)
        elif isinstance(msg, Shutdown):
            if peer.name not in self.owners or peer.principal != run_user():  # a shared scheduler's jobs never may
                self.counters["error/not_owner"] += 1
                self._log.warning("not_owner", "%s: refused a shutdown from %s (not an owner)", self.name, peer.name)
                self._send(identity, Error(code=ErrorCode.INVALID, message=(
                    f"{self.name}: Shutdown is only for its owners ({sorted(self.owners)}), not {peer.name!r}")), rid)
                return
            log.info("%s: shutdown requested by %s: %s", self.name, peer.name, msg.reason)
            self._send(identity, Ack(), rid)
            asyncio.get_running_loop().call_soon(self._shutdown)
        elif self._running >= self.max_inflight:
            self.counters["error/busy"] += 1
            self._send(identity, Error(code=ErrorCode.BUSY,
                                       message=f"{self.name}: {self._running} requests in flight (max {self.max_inflight})"), rid)
        else:
            self._running += 1
            task = run_eager(self._request(identity, peer, rid, msg), self._loop)
            if task is not None:  # it waits for something: cancellable while in flight
                peer.inflight[rid] = task

    def _hello(self, identity: bytes, rid: int, msg: Hello, principal: str) -> None:
        if msg.version != PROTOCOL_VERSION:  # the header said otherwise: a broken peer
            self.counters["error/bad_version"] += 1
            self._log.warning("version", "%s: peer %s says protocol %d, this side %d", self.name, msg.peer, msg.version,
                              PROTOCOL_VERSION)
            self._send(identity, Error(code=ErrorCode.BAD_VERSION,
                                       message=f"peer speaks protocol {msg.version}, this side {PROTOCOL_VERSION}"), rid)
            return
        name = msg.peer or identity.hex()
        if self.accounts is not None and principal != run_user() and principal not in self.accounts:
            # An account removed since this connection's handshake (a job closed on a shared scheduler).
            self.counters["error/closed_account"] += 1
            self._send(identity, Error(code=ErrorCode.INVALID,
                                       message=f"{self.name}: {principal!r} may no longer connect (its job was closed)"), rid)
            return
        if identity not in self._peers and len(self._peers) >= self.max_peers:
            self._evict_for(name)
        old = self._peers.get(identity)
        self._seen += 1
        self._peers[identity] = _Peer(name=name, beats=BeatCounter(), principal=principal,
                                      inflight=old.inflight if old else {},
                                      streams=old.streams if old else {}, last_request=self._seen)
        self.counters["handshakes"] += 1
        self._send(identity, Welcome(version=PROTOCOL_VERSION, peer=self.name, heartbeat_s=self.heartbeat_s or 0.0), rid)

    def _evict_for(self, name: str) -> None:
        """The session table is full and ``name`` says Hello: make room, never refuse (a
        component can always reconnect). The session evicted belongs to the name holding the
        most sessions (so one name, or one process opening many, cannot fill the table), and is
        the one of them that sent a request longest ago; its requests are cancelled as if it
        were lost. A name's sessions never crowd out another's."""
        per_name = collections.Counter(p.name for p in self._peers.values())
        crowded = max(per_name.values())
        victim = min((ident for ident, p in self._peers.items() if per_name[p.name] == crowded),
                     key=lambda ident: self._peers[ident].last_request)
        peer = self._drop(victim)
        self.counters["peer_evicted"] += 1
        self._log.warning("evict", "%s: session table full (%d): evicted a session of %s (%d of its sessions) "
                          "for %s", self.name, self.max_peers, peer.name, crowded, name)

    async def _request(self, identity: bytes, peer: _Peer, rid: int, msg: Message) -> None:
        em = None
        if wants_stream(msg):
            em = peer.streams[rid] = self._outbox.emitter(identity, rid)
        _SERVING.set((self, em, peer))  # this task's own context (run_eager): read by emitter(), peer_name()
        try:
            if isinstance(msg, STATE_CHANGING):
                reply = await self._once(identity, rid, msg)
            else:
                try:
                    reply = await self.handler(msg)
                except Exception as e:  # noqa: BLE001 - becomes an Error reply
                    reply = self._error_reply(e)
        except asyncio.CancelledError:
            reply = Error(code=ErrorCode.CANCELLED, message=f"{type(msg).__name__} {rid} was cancelled")
        finally:
            self._running -= 1
            peer.inflight.pop(rid, None)
            if em is not None:  # its queued partials go first, none after the final
                peer.streams.pop(rid, None)
                self._outbox.finish(em)
        if type(reply) in _PARTIALS:  # a client would wait on for the final reply
            self.counters["error/internal"] += 1
            self._log.error("partial", "%s: the handler answered %s with a partial %s", self.name, type(msg).__name__,
                            type(reply).__name__)
            reply = Error(code=ErrorCode.INTERNAL, message=f"the handler answered with a partial {type(reply).__name__}")
        self._send(identity, reply, rid, final=True)

    async def _once(self, identity: bytes, rid: int, msg: Message) -> Message:
        """A state-changing request, applied once per (peer identity, request id): a retry
        from the same peer waits for (or gets) the first one's reply; another peer's request
        with the same id is a request of its own."""
        key = (identity, rid)
        fut = self._done.get(key)
        if fut is not None:
            self.counters["dedup"] += 1
            return await asyncio.shield(fut)
        fut = asyncio.get_running_loop().create_future()
        self._done[key] = fut
        while len(self._done) > self._cache_size:
            self._done.popitem(last=False)
        try:
            reply = await self._call(msg)
        except asyncio.CancelledError:
            # Cancelled before it changed anything (a handler that had started finishes and
            # returns instead): a retry must apply it.
            self._done.pop(key, None)
            fut.cancel()
            raise
        fut.set_result(reply)
        return reply

    async def _call(self, msg: Message) -> Message:
        try:
            return await self.handler(msg)
        except Exception as e:  # noqa: BLE001 - becomes an Error reply
            return self._error_reply(e)

    def _error_reply(self, e: Exception) -> Error:
        """The ``Error`` for a handler's exception (the server keeps serving)."""
        if isinstance(e, LookupError):  # an unknown name (adapter, policy); KeyError's str is a repr
            self.counters["error/not_found"] += 1
            return Error(code=ErrorCode.NOT_FOUND, message=str(e.args[0]) if e.args else type(e).__name__)
        if isinstance(e, (ValueError, TypeError)):
            self.counters["error/invalid"] += 1
            return Error(code=ErrorCode.INVALID, message=f"{type(e).__name__}: {e}")
        self.counters["error/internal"] += 1
        self._log.error(f"internal/{type(e).__name__}", "%s: handler failed", self.name, exc_info=e)
        return Error(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")

    def _send(self, identity: bytes, reply: Message, rid: int, final: bool = False) -> None:
        """Send ``reply``; a ``final`` reply to a request waits for room in a full queue."""
        if self._sock is None or self._sock.closed:
            return
        self.counters[f"sent/{type(reply).__name__}"] += 1
        frames = [identity, *encode(reply, rid)]
        why = self._route(frames)
        if why is None or (why == "full" and final and self._parked.add(frames)):
            return
        self.counters["error/send"] += 1  # the peer is gone, or its queue is full: dropped
        if why == "unroutable":
            log.debug("%s: %s to %s dropped: %s", self.name, type(reply).__name__, identity.hex(), why)
        else:
            self._log.warning("send", "%s: %s to %s dropped: %s", self.name, type(reply).__name__, identity.hex(), why)

    def _route(self, frames: list[Any]) -> str | None:
        """Send ``[identity, *frames]`` now: None, or why it could not go (``full``: the
        peer's queue is at its high-water mark; ``unroutable``: no such peer, or stopped)."""
        if self._sock is None or self._sock.closed:
            return "unroutable"
        try:
            self._io.send(frames)
        except zmq.Again:
            return "full"
        except zmq.ZMQError:  # EHOSTUNREACH: the peer disconnected
            return "unroutable"
        return None

    def _shutdown(self) -> None:
        asyncio.ensure_future(self.stop())
        if self.on_shutdown is not None:
            self.on_shutdown()

    async def stop(self) -> None:
        """Stop serving: cancel every request and close the socket."""
        for t in self._tasks:
            t.cancel()
        for peer in self._peers.values():
            for t in peer.inflight.values():
                t.cancel()
            for em in peer.streams.values():
                self._outbox.close(em)
        if self._sock is not None:
            self._parked.clear()
            self._io.close()
        if self._auth is not None:
            self._auth.close()
            self._auth = None
        if self.stopped is not None:
            self.stopped.set()


def _user_id(frame: zmq.Frame) -> str:
    """The bus user ZeroMQ's handshake authenticated the frame's sender as; this process's own
    user where the transport authenticates nobody (``inproc://``: the same process)."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return run_user()
    return user if isinstance(user, str) and user else run_user()
