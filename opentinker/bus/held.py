"""What libzmq holds for a bound socket's connections, bounded per connection and in total.

libzmq hands a multipart message to the reader only once its last frame has arrived, and
takes any number of frames before that (each frame capped by ``ZMQ_MAXMSGSIZE``): a peer that
writes ZMTP itself and never sends the last frame would make the receiver hold its frames for
as long as the connection stays open. The reader cannot see those frames, but the kernel
counts what libzmq read from each connection, so their size is known by difference:

    held(connection) = bytes libzmq read from it (TCP_INFO's ``tcpi_bytes_received`` less what
                       still waits in the kernel, ``FIONREAD``)
                     - bytes of the messages the reader got from it (``ZMQ_SRCFD`` names the
                       connection of each), with their ZMTP frame headers

A :class:`HeldWatch` checks every connection of its socket each ``interval_s`` (the accepted
connections come from the socket's monitor). A connection holding more than ``per_connection``
bytes at two checks in a row, with no message from it read in between, is cut
(``shutdown(2)`` on its descriptor): libzmq drops the unfinished message and frees its frames.
When the connections from one address together hold more than ``per_peer``, and when all
connections together hold more than ``total``, the largest of those that made no progress
since the last check are cut until the rest fit (five connections of one peer, each under the
per-connection bound, held 2,002 MB under a total of 2,056 MB before ``per_peer``). A peer is
its address: on loopback every local process shares one, so there ``per_peer`` bounds them
together. A legitimate sender's message in
flight is at most ``max_bytes`` (and one complete message the reader has not been handed yet),
so ``per_connection`` (``max_bytes`` plus the frame cap plus 1 MiB by default) never cuts one.
Each cut is counted (``dropped/held_connections``, ``dropped/held_bytes``) and logged in one line.

What a peer can make the receiver hold is thus ``per_peer`` over all its connections (and
``total`` over all peers) plus what it sends in two intervals. Linux only (TCP_INFO's byte counts, Linux 4.1+),
and ``tcp://`` only: elsewhere :func:`supported` is False and nothing is watched.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import socket
import struct
import sys
import termios
import threading
from dataclasses import dataclass

import zmq

from opentinker.bus.frames import Cut, frame_wire
from opentinker.bus.logs import LogEvery

log = logging.getLogger(__name__)

BYTES_RECEIVED_AT = 128
"""Offset of ``tcpi_bytes_received`` (u64) in Linux's ``struct tcp_info`` (since Linux 4.1)."""
TCP_INFO_LEN = 136
SLACK = 64 * 1024
"""Bytes on a connection that are no message: the ZMTP greeting and handshake, commands."""
DEFAULT_INTERVAL_S = 0.1
SRCFD = int(getattr(zmq, "SRCFD", 2))
_EVENTS = int(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CLOSED)


def supported() -> bool:
    """Whether the kernel reports per-connection received bytes (Linux's TCP_INFO)."""
    return sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO")


def wire_bytes(frames: list[zmq.Frame], skip: int = 0, curve: bool = False) -> int:
    """Bytes ``frames`` took on the wire (:func:`~opentinker.bus.frames.frame_wire` each). The
    first ``skip`` frames are not counted (a ROUTER's routing id frame is made by the
    receiver, not sent)."""
    return sum(frame_wire(len(f), curve) for f in frames[skip:])


def _borrow(fd: int) -> socket.socket | None:
    """A socket object on libzmq's descriptor ``fd`` (give it back with ``detach()``, never
    ``close()``); None when ``fd`` is no socket (any more)."""
    try:
        return socket.socket(fileno=fd)
    except OSError:
        return None


def received(fd: int) -> int | None:
    """Bytes libzmq has read from the TCP connection ``fd`` (the kernel's count less what is
    still queued in it); None when ``fd`` is not a TCP socket (any more)."""
    s = _borrow(fd)
    if s is None:
        return None
    try:
        info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_LEN)
        queued = struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return None
    finally:
        s.detach()  # the descriptor is libzmq's
    if len(info) < BYTES_RECEIVED_AT + 8:
        return None
    return struct.unpack_from("Q", info, BYTES_RECEIVED_AT)[0] - queued


def _peer(fd: int) -> tuple[tuple, tuple] | None:
    """``(local address, peer address)`` of the socket ``fd``; None when it is not connected."""
    s = _borrow(fd)
    if s is None:
        return None
    try:
        return s.getsockname(), s.getpeername()
    except OSError:
        return None
    finally:
        s.detach()


@dataclass
class _Conn:
    """One accepted connection: its addresses (to tell a reused descriptor), the wire bytes
    and count of the messages read from it, and what it held at the last two checks."""

    addrs: tuple[tuple, tuple]
    delivered: int = 0
    messages: int = 0
    seen_messages: int = 0
    held: int = 0
    prev_held: int = 0
    identity: bytes = b""


class HeldWatch:
    """Bounds what libzmq holds for the connections of one bound ``tcp://`` socket.

    The socket's reader calls :meth:`delivered` for every message it reads (its first frame,
    its wire bytes); :meth:`check` is called each ``interval_s`` on the reader's thread. The
    watch owns a monitor socket on ``sock`` (libzmq allows one per socket), made in ``ctx``
    (default: the socket's context; a shadow socket has none); make it before ``sock`` binds,
    so no connection is accepted unseen.

    ``follows_reader``: the reader reads only when its owner asks (a puller's ``recv()``),
    and tells the watch with :meth:`reader_waits`; between checks in which it never waited,
    complete messages may be queued for it, so nothing is cut then (it is not the peers that
    stopped). A reader that drains as messages come (a server's) needs no such care.
    """

    def __init__(self, sock: zmq.Socket, name: str, counters: dict, *, per_connection: int,
                 total: int, interval_s: float = DEFAULT_INTERVAL_S, router: bool = False,
                 curve: bool = False, follows_reader: bool = False, ctx: zmq.Context | None = None,
                 per_peer: int | None = None) -> None:
        per_peer = total if per_peer is None else per_peer
        if per_connection < 1 or not per_connection <= per_peer <= total:
            raise ValueError(f"HeldWatch: need 1 <= per_connection <= per_peer <= total, got {per_connection}, "
                             f"{per_peer}, {total}")
        self.per_peer = per_peer
        """What all connections from one address may hold together."""
        self.name = name
        self.counters = counters
        self._log = LogEvery(log)
        self.per_connection = per_connection
        self.total = total
        self.interval_s = interval_s
        self.router = router
        self.curve = curve
        self._conns: dict[int, _Conn] = {}
        self._sock = sock
        address = f"inproc://opentinker-held-{id(self):x}"
        sock.monitor(address, _EVENTS)
        self._monitor = zmq.Context.shadow((ctx or sock.context).underlying).socket(zmq.PAIR)
        # libzmq's I/O thread sends events with a blocking send: a full queue (a loop held up
        # while connections come and go) would stall every socket of the context. Events are
        # a few dozen bytes; the loop reads them as they come.
        self._monitor.setsockopt(zmq.RCVHWM, 0)
        self._monitor.connect(address)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._monitor_fd: int | None = None
        self._closed = False
        self.follows_reader = follows_reader
        self._reader_waiting = self._reader_waited = False

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """Check every ``interval_s`` on ``loop`` (the reader's) until :meth:`close`."""
        if self._handle is None and not self._closed:
            self._loop = loop
            # Connections are learnt as they are accepted, before their handshake ends and
            # long before a message of theirs can be read (a descriptor is reused at once).
            self._monitor_fd = self._monitor.getsockopt(zmq.FD)
            loop.add_reader(self._monitor_fd, self._events)
            self._events()
            self._handle = loop.call_later(self.interval_s, self._tick)

    def _tick(self) -> None:
        self._handle = None
        if self._closed:
            return
        try:
            self.check()
        except Exception:  # a check must never stop the reader's loop
            self.counters["error/internal"] += 1
            log.exception("%s: checking what libzmq holds failed", self.name)
        self._handle = self._loop.call_later(self.interval_s, self._tick)

    def read(self, frames: list[zmq.Frame], cut: Cut | None) -> None:
        """The reader read one message: ``frames`` (those it kept of it, when ``cut``)."""
        if not frames:
            return
        skip = 1 if self.router else 0
        if cut is None:
            nbytes = wire_bytes(frames, skip, self.curve)
        else:  # the reader's own count; a ROUTER's routing id was never on the wire
            nbytes = (cut.wire_curve if self.curve else cut.wire) - wire_bytes(frames[:skip], 0, self.curve)
        self.delivered(frames[0], nbytes)

    def delivered(self, first: zmq.Frame, nbytes: int) -> None:
        """A message of ``nbytes`` wire bytes was read; ``first`` is its first frame."""
        try:
            fd = first.get(SRCFD)
        except zmq.ZMQError:
            return
        conn = self._conns.get(fd)
        if conn is None:
            self._events()  # its ACCEPTED event may not have been read yet
            conn = self._conns.get(fd) or self._accepted(fd)
            if conn is None:
                return
        conn.delivered += nbytes
        conn.messages += 1
        if self.router and not conn.identity:
            conn.identity = first.bytes

    def _accepted(self, fd: int) -> _Conn | None:
        addrs = _peer(fd)
        if addrs is None:
            return None
        conn = self._conns[fd] = _Conn(addrs)
        return conn

    def _events(self) -> None:
        """Apply the monitor's events: connections accepted and gone."""
        while True:
            try:
                frames = self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            except zmq.ZMQError:  # closed at shutdown
                return
            if len(frames) < 2 or len(frames[0]) < 6:
                continue
            event, fd = struct.unpack("=HI", frames[0][:6])
            if event == zmq.EVENT_ACCEPTED:
                known = self._conns.get(fd)
                if known is None or known.addrs != _peer(fd):  # not this connection, already seen
                    self._conns.pop(fd, None)
                    self._accepted(fd)
            else:
                self._conns.pop(fd, None)

    def excess(self) -> dict[int, int]:
        """For each watched connection now (descriptor -> bytes): what libzmq read from it less
        the wire bytes of the messages read from it (its handshake, and what it holds)."""
        self._events()
        out = {}
        for fd, conn in list(self._conns.items()):
            got = received(fd)
            if got is None:
                self._conns.pop(fd, None)
                continue
            # What was read of a connection never falls short of its messages: more (messages of
            # a closed connection read after its descriptor went to a new one) is no credit.
            conn.delivered = min(conn.delivered, got)
            out[fd] = got - conn.delivered
        return out

    def held(self) -> dict[int, int]:
        """Bytes libzmq holds for each watched connection now (descriptor -> bytes): its
        :meth:`excess` less :data:`SLACK`, at least 0."""
        out = {}
        for fd, excess in self.excess().items():
            self._conns[fd].held = out[fd] = max(0, excess - SLACK)
        return out

    def reader_waits(self, waiting: bool) -> None:
        """The reader (``follows_reader``) now waits for a message, or stopped waiting."""
        self._reader_waiting = waiting
        self._reader_waited = self._reader_waited or waiting

    def check(self) -> list[int]:
        """One check: cut the connections holding too much (see the module's docstring).
        Returns the descriptors cut."""
        self.held()
        conns = self._conns
        if self.follows_reader and not self._reader_waited:  # messages may be waiting for the reader
            for c in conns.values():
                c.prev_held, c.seen_messages = 0, c.messages
            return []
        self._reader_waited = self._reader_waiting
        # Held at this check and the last, with no message read from it in between.
        stalled = {fd: c for fd, c in conns.items() if c.messages == c.seen_messages and c.held and c.prev_held}
        cut = [fd for fd, c in stalled.items() if c.held > self.per_connection and c.prev_held > self.per_connection]
        # Then each address down to per_peer (five connections of one peer, each under the
        # per-connection bound, held 2,002 MB), then all of them down to total.
        for address in {c.addrs[1][0] for c in conns.values()}:
            mine = {fd for fd, c in conns.items() if c.addrs[1][0] == address}
            self._cut_down(stalled, cut, mine, self.per_peer)
        self._cut_down(stalled, cut, set(conns), self.total)
        for c in conns.values():
            c.prev_held, c.seen_messages = c.held, c.messages
        return [fd for fd in cut if self._cut(fd)]

    def _cut_down(self, stalled: dict[int, _Conn], cut: list[int], among: set[int], bound: int) -> None:
        """Add to ``cut`` the largest ``stalled`` connections of ``among`` until what the rest
        of ``among`` holds is within ``bound``."""
        rest = sum(self._conns[fd].held for fd in among if fd not in cut)
        for fd in sorted(set(stalled) & among, key=lambda fd: -stalled[fd].held):
            if rest <= bound:
                return
            if fd not in cut:
                cut.append(fd)
                rest -= stalled[fd].held

    def _cut(self, fd: int) -> bool:
        conn = self._conns[fd]
        if _peer(fd) != conn.addrs:  # closed meanwhile and the number reused: start it afresh,
            del self._conns[fd]
            fresh = self._accepted(fd)  # counting nothing as held so far
            got = received(fd)
            if fresh is not None and got is not None:
                fresh.delivered = got
            return False
        s = _borrow(fd)
        if s is None:
            return False
        try:
            s.shutdown(socket.SHUT_RDWR)
        except OSError:
            return False
        finally:
            s.detach()
        del self._conns[fd]
        self.counters["dropped/held_connections"] += 1
        self.counters["dropped/held_bytes"] += conn.held
        who = f"{conn.addrs[1][0]}:{conn.addrs[1][1]}"
        if conn.identity:
            who += f" (routing id {conn.identity.hex()})"
        self._log.warning("cut", "%s: cut the connection from %s: libzmq held %d bytes of an unfinished message "
                          "with nothing read from it (limit %d per connection, %d per address, %d in all)",
                          self.name, who, conn.held, self.per_connection, self.per_peer, self.total)
        return True

    def close(self) -> None:
        """Stop watching (call before the socket closes), from any thread: the watch's own
        loop, while it runs, does the work."""
        loop = self._loop
        if loop is not None and loop.is_running() and not _running_on(loop):
            done = threading.Event()

            def on_loop() -> None:
                try:
                    self._close()
                finally:
                    done.set()

            loop.call_soon_threadsafe(on_loop)
            if done.wait(10):
                return
        self._close()

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        if self._monitor_fd is not None and self._loop is not None:
            self._loop.remove_reader(self._monitor_fd)
            self._monitor_fd = None
        try:
            self._sock.monitor(None, 0)
        except zmq.ZMQError:
            pass
        self._monitor.close(linger=0)
        self._conns.clear()


def _running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False


def per_connection_bound(max_bytes: int, frame_cap: int) -> int:
    """What one connection may hold: a message in flight up to the frame cap, one complete
    message the reader has not been handed yet (``max_bytes``), and 1 MiB."""
    return max_bytes + frame_cap + (1 << 20)


def watch(sock: zmq.Socket, endpoint: str, name: str, counters: dict, *, max_bytes: int, frame_cap: int,
          router: bool = False, curve: bool = False, follows_reader: bool = False,
          ctx: zmq.Context | None = None) -> HeldWatch | None:
    """A :class:`HeldWatch` for ``sock`` bound at ``endpoint`` with the default bounds (per
    connection :func:`per_connection_bound`, twice that per peer address, four times that in
    all); None where nothing can be watched (not Linux, not ``tcp://``)."""
    if not supported() or not endpoint.startswith("tcp://"):
        return None
    per = per_connection_bound(max_bytes, frame_cap)
    return HeldWatch(sock, name, counters, per_connection=per, per_peer=2 * per, total=4 * per, router=router,
                     curve=curve, follows_reader=follows_reader, ctx=ctx)
