"""What every bus socket shares: endpoint rules, CURVE keys, socket options, counters, the
errors a caller sees, and the heartbeat counter.

Endpoints are ``tcp://``, ``ipc://`` or ``inproc://``. A socket binds a non-loopback TCP
address only with CURVE keys (authentication and encryption); local runs bind
``tcp://127.0.0.1:*`` and publish the port the OS picked.
"""

from __future__ import annotations

import collections
import dataclasses
import ipaddress
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass

import zmq

from opentinker.bus.auth import (
    Credentials,
    Guard,
    guard_server,
    run_curve,
    secure_client,
)
from opentinker.bus.frames import Bounds, Cut
from protocols.codec import (
    DEFAULT_LIMITS,
    DEFAULT_MAX_BYTES,
    DecodeError,
    Limits,
    decode,
    decode_header,
)
from protocols.messages import Error, ErrorCode, Message, Welcome

LOOPBACK = "tcp://127.0.0.1:*"
DEFAULT_HEARTBEAT_S = 3.0
"""Heartbeat interval: a peer that sends nothing for ``MISSED_BEATS`` of them is lost."""
MISSED_BEATS = 3
DEFAULT_HWM = 1000
"""ZeroMQ high-water mark (messages) of every socket's send and receive queues."""
SCHEMES = ("tcp", "ipc", "inproc")
DEFAULT_SPIN_S = 1e-3
"""How long a client polls for a reply before it waits on the socket (covers most loopback
round trips; see :class:`ReplyPolling`)."""

REPLY_LIMITS = dataclasses.replace(DEFAULT_LIMITS, max_buffers=1 << 20, max_body_bytes=DEFAULT_MAX_BYTES)
"""What a client takes in one reply (or partial): the replies to its own requests, which may
carry many more arrays (a ``LogprobsResult`` per sequence) and a longer body (an
``EpisodesDone``'s transcripts) than a server takes in a request."""
MAX_IDENTITY_BYTES = 255
"""A ZeroMQ routing id is at most 255 bytes (the frame a ROUTER puts before a message)."""

yield_cpu = getattr(os, "sched_yield", lambda: None)
"""Give the CPU to another runnable thread (between two polls of a socket)."""


class RemoteError(RuntimeError):
    """The peer answered with an :class:`~protocols.messages.Error`."""

    def __init__(self, error: Error, where: str = "") -> None:
        super().__init__(f"{where}: {error.code.value}: {error.message}" if where else error.message)
        self.error = error


class PeerLost(ConnectionError):
    """Nothing arrived from the peer for ``MISSED_BEATS`` heartbeat intervals; every request
    still pending on it fails with this error."""


class ProtocolMismatch(ConnectionError):
    """The peer speaks another ``PROTOCOL_VERSION``; raised when connecting."""


class PartialCallbackFailed(Exception):
    """A request's ``on_partial`` callback raised ``error``: the clients fail that request
    with ``error`` (and cancel it on the server)."""

    def __init__(self, error: Exception) -> None:
        super().__init__(error)
        self.error = error


class Counters(collections.Counter):
    """Message counters by kind, e.g. ``recv/SampleRequest``, ``error/bad_frame``."""

    def snapshot(self) -> dict[str, int]:
        return dict(self)


@dataclass(frozen=True)
class CurveKeys:
    """CURVE keys (Z85-encoded, 40 bytes each) of one side of a connection.

    A server uses ``public``/``secret`` and, when ``allowed_clients`` is not empty, accepts
    only those client public keys. A client uses its own pair and ``server_public``.
    """

    public: bytes
    secret: bytes
    server_public: bytes = b""
    allowed_clients: tuple[bytes, ...] = ()

    @classmethod
    def generate(cls) -> CurveKeys:
        """A fresh key pair (``zmq.curve_keypair``)."""
        if not zmq.has("curve"):
            raise RuntimeError("this libzmq was built without CURVE support")
        public, secret = zmq.curve_keypair()
        return cls(public=public, secret=secret)

    def client_of(self, server: CurveKeys) -> CurveKeys:
        """This pair as a client of ``server``."""
        return CurveKeys(public=self.public, secret=self.secret, server_public=server.public)

    def allowing(self, *clients: CurveKeys) -> CurveKeys:
        """This pair as a server that accepts only ``clients``."""
        return CurveKeys(public=self.public, secret=self.secret,
                         allowed_clients=tuple(c.public for c in clients))


def run_keys() -> CurveKeys | None:
    """The run's CURVE pair (:func:`~opentinker.bus.auth.set_run_curve`) as both sides use it: a
    server with it accepts only it, a client presents it to a server that has it; None when
    the run is on PLAIN."""
    curve = run_curve()
    if curve is None:
        return None
    public, secret, _host = curve
    return CurveKeys(public=public, secret=secret, server_public=public, allowed_clients=(public,))


def tcp_endpoint(host: str, port: int | str = "*") -> str:
    """``tcp://HOST:PORT``, an IPv6 address in brackets (``port`` ``*``: any free one)."""
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def server_side(endpoint: str, keys: CurveKeys | None,
                accounts: Mapping[str, bytes] | None = None) -> tuple[str, CurveKeys | None]:
    """Where a server binds and the keys it uses: those given; else, on a run with a CURVE
    pair, the pair and the run's host for the default ``LOOPBACK`` (a server with PLAIN
    ``accounts``, a shared scheduler's, stays as it is); checked by :func:`check_bind`."""
    curve = run_curve()
    if keys is None and accounts is None and curve is not None:
        keys = run_keys()
        if endpoint == LOOPBACK:
            host = curve[2]
            endpoint = tcp_endpoint(host)
    check_bind(endpoint, keys)
    return endpoint, keys


def is_loopback(endpoint: str) -> bool:
    """True for ``ipc://``, ``inproc://`` and TCP on a loopback address (127.0.0.0/8, ::1,
    ``localhost``); ValueError for another scheme."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or scheme not in SCHEMES:
        raise ValueError(f"endpoint {endpoint!r}: the bus speaks {', '.join(s + '://' for s in SCHEMES)}")
    if scheme != "tcp":
        return True
    host = rest.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # '*', an interface name or a host name: may face the network


def check_bind(endpoint: str, keys: CurveKeys | None) -> None:
    """Refuse to bind a non-loopback address without CURVE keys."""
    if keys is None and not is_loopback(endpoint):
        raise ValueError(
            f"refusing to bind {endpoint} without CURVE keys: a non-loopback address needs "
            "authentication and encryption (pass keys=CurveKeys.generate()), or bind tcp://127.0.0.1:*"
        )


def frame_cap(max_bytes: int) -> int:
    """The largest frame a socket with ``max_bytes`` accepts (``ZMQ_MAXMSGSIZE``): libzmq
    disconnects a peer that sends a larger one before it is held. ``max_bytes`` plus a margin
    (up to 1 MiB), so a message a little over ``max_bytes`` still gets a ``too_large`` reply."""
    return min(max_bytes + min(max_bytes, 1 << 20), 1 << 62)


def configure(
    sock: zmq.Socket,
    *,
    hwm: int = DEFAULT_HWM,
    max_bytes: int = DEFAULT_MAX_BYTES,
    keys: CurveKeys | None = None,
    server: bool = False,
    credentials: Credentials | None = None,
) -> zmq.Socket:
    """Options every bus socket gets: ``LINGER=0``, bounded queues (``hwm`` messages each
    way), a hard cap of :func:`frame_cap` bytes per frame (libzmq drops a peer that sends more; a
    message between ``max_bytes`` and that gets a ``too_large`` reply), and its credentials:
    CURVE when ``keys`` are given (a connecting socket with neither ``keys`` nor ``credentials``
    uses the run's CURVE pair when it has one, :func:`run_keys`), else a connecting socket
    presents the run's secret (PLAIN, :mod:`opentinker.bus.auth`; or ``credentials``); a binding socket is made a PLAIN or CURVE server by
    :func:`~opentinker.bus.auth.guard_server`."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.MAXMSGSIZE, frame_cap(max_bytes))
    if credentials is not None and credentials.curve is not None and not server:  # a remote service's job
        public, secret, server_public = (k.encode() for k in credentials.curve)
        keys = CurveKeys(public=public, secret=secret, server_public=server_public)
    if keys is None and credentials is None and not server:
        keys = run_keys()  # a run on CURVE: its servers have the run's pair
    if keys is not None:
        sock.curve_publickey = keys.public
        sock.curve_secretkey = keys.secret
        if server:
            sock.curve_server = True
        else:
            if not keys.server_public:
                raise ValueError("a CURVE client needs the server's public key (CurveKeys.client_of)")
            sock.curve_serverkey = keys.server_public
    elif not server:
        secure_client(sock, credentials)
    return sock


def bind_guarded(sock: zmq.Socket, endpoint: str, name: str, counters: Counters,
                 keys: CurveKeys | None, accounts: Mapping[str, bytes] | None = None,
                 curve_users: Mapping[str, str] | None = None) -> Guard:
    """Make ``sock`` (configured with ``server=True``) a PLAIN server with the run's secret, or
    a CURVE server with ``keys`` (only ``keys.allowed_clients`` when given), and bind it; on a
    failed bind the registration and the socket are closed. :meth:`Guard.close` goes with the
    socket's close."""
    guard = guard_server(sock, name, counters, curve=keys is not None,
                         curve_allowed=keys.allowed_clients if keys is not None else (), accounts=accounts,
                         curve_users=curve_users)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError:
        guard.close()
        sock.close(linger=0)
        raise
    return guard


def read_bounds(limits: Limits, router: bool = False) -> Bounds:
    """What a reader keeps of one message under ``limits`` (:func:`~opentinker.bus.frames.recv_bounded`):
    on a ROUTER the identity frame comes first, and is kept with the header of a message that is cut."""
    extra = 1 if router else 0
    return Bounds(parts=limits.max_frames + extra, nbytes=limits.max_bytes + extra * MAX_IDENTITY_BYTES,
                  keep=1 + extra)


def cut_error(header: zmq.Frame | None, cut: Cut, limits: Limits, counters: Counters) -> tuple[int | None, Error]:
    """A message the reader did not keep (``cut``), counted (``dropped/too_many_<why>``,
    ``dropped/bytes``, ``error/too_large``): its request id (None when the header frame cannot be
    read) and the ``too_large`` error that answers it."""
    counters[f"dropped/too_many_{cut.why}"] += 1
    counters["dropped/bytes"] += cut.nbytes
    counters["error/too_large"] += 1
    rid = None
    if header is not None:
        try:
            rid = decode_header(header.buffer).request_id
        except DecodeError as e:
            rid = e.request_id
    if cut.why == "frames":
        text = f"message of {cut.parts} frames > limit {limits.max_frames} (max_buffers {limits.max_buffers})"
    else:
        text = f"message of {cut.nbytes} bytes > limit {limits.max_bytes}"
    return rid, Error(code=ErrorCode.TOO_LARGE, message=f"too_large: {text}")


class BeatCounter:
    """Missed heartbeats of one peer, counted in ticks, never timed.

    The owner calls :meth:`tick` once per heartbeat interval and :meth:`heard` whenever a
    frame arrives from the peer; the peer is lost at the ``limit``-th tick in a row with
    nothing heard, i.e. within ``limit`` intervals of its last frame.
    """

    def __init__(self, limit: int = MISSED_BEATS) -> None:
        if limit < 1:
            raise ValueError(f"heartbeat limit must be >= 1, got {limit}")
        self.limit = limit
        self.missed = 0

    def heard(self) -> None:
        self.missed = 0

    def tick(self) -> bool:
        """One interval passed; True when the peer is now lost."""
        self.missed += 1
        return self.missed >= self.limit


def read_reply(frames: list[zmq.Frame], limits: Limits | int, counters: Counters) -> tuple[int | None, Message]:
    """``(request_id, reply)`` of a frame a client received, counted; an undecodable one is
    an ``Error`` for its request id when the header could be read (else ``None``).
    ``limits`` may be a plain ``max_bytes``."""
    if isinstance(limits, int):
        limits = REPLY_LIMITS.with_max_bytes(limits)
    try:
        rid, reply = decode([f.buffer for f in frames], limits=limits)
    except DecodeError as e:
        counters[f"error/{e.code.value}"] += 1
        return e.request_id, Error(code=e.code, message=str(e))
    counters[f"recv/{type(reply).__name__}"] += 1
    return rid, reply


def check_welcome(reply: Message, where: str) -> Welcome:
    """The server's answer to ``Hello``, or the error a client raises for it."""
    if isinstance(reply, Error):
        if reply.code is ErrorCode.BAD_VERSION:
            raise ProtocolMismatch(f"{where}: {reply.message}")
        raise RemoteError(reply, f"{where} (Hello)")
    if not isinstance(reply, Welcome):
        raise ProtocolMismatch(f"{where}: answered Hello with {type(reply).__name__}")
    return reply


class ReplyPolling:
    """When a client should poll for a reply instead of waiting on the socket's descriptor.

    Waking a thread that waits on a descriptor costs tens of microseconds (much more on a
    virtual machine whose idle CPUs halt); a reply that comes within ``spin_s`` of its request
    is read sooner by polling the socket, for at most ``spin_s`` of CPU per request. Polling
    pays only for fast requests, so waits are averaged per message type (weight ``ema`` for
    the newest; every reply counts, so a type that turns fast is polled for again) and a type
    whose average is above ``spin_s`` (sampling, a training step) is not polled for; the
    first request of a type is. ``spin_s=0`` never polls.
    """

    def __init__(self, spin_s: float = DEFAULT_SPIN_S, ema: float = 0.2) -> None:
        if not (math.isfinite(spin_s) and spin_s >= 0):
            raise ValueError(f"spin_s must be a finite number of seconds >= 0, got {spin_s!r}")
        self.spin_s = spin_s
        self.ema = ema
        self.rtt: dict[type, float] = {}
        """Moving average of the round trip (s) per message type."""

    def worth_it(self, kind: type) -> bool:
        """Poll for a reply to a ``kind`` request? (Yes for a type not seen yet.)"""
        if not self.spin_s:
            return False
        typical = self.rtt.get(kind)
        return typical is None or typical <= self.spin_s

    def record(self, kind: type, rtt: float) -> None:
        """A ``kind`` request's reply came ``rtt`` s after it was sent."""
        typical = self.rtt.get(kind)
        self.rtt[kind] = rtt if typical is None else typical + self.ema * (rtt - typical)
