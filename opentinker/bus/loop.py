"""Plain ZeroMQ sockets on an asyncio loop, without a future per message.

``zmq.asyncio`` makes a future for every send and receive; at ~100 µs round trips that is
most of the cost. Here a socket's file descriptor is watched with ``loop.add_reader`` and, when
it fires, every waiting message is read with non-blocking calls (ZeroMQ's descriptor is
edge-triggered, so a reader drains while ``EVENTS`` shows a message, and checks again after a
send made outside its own callback). Handlers run eagerly (:func:`run_eager`): a request whose handler never waits is
answered inside the same callback, with no task at all.
"""

from __future__ import annotations

import asyncio
import collections.abc
import contextvars
import gc
import sys
import threading
from collections.abc import Callable, Coroutine, Generator
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import zmq
import zmq.asyncio

from opentinker.bus.auth import release_context
from protocols.codec import BIG_BUFFERS, gc_pause, gc_resume

if TYPE_CHECKING:
    from opentinker.bus.held import HeldWatch

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """uvloop's event loop where it is installed (Linux and macOS: about 1.5x less overhead
    per wake-up), else asyncio's; every bus loop of OpenTinker is made here."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


DRAIN_BATCH = 256
"""Messages read per callback before yielding to the loop (fairness between sockets)."""

# Plain ints: pyzmq's flag enums cost an enum construction per ``|`` (half of a small
# send_multipart/recv_multipart pair on Python 3.11).
NOBLOCK, SNDMORE, EVENTS, POLLIN = int(zmq.NOBLOCK), int(zmq.SNDMORE), int(zmq.EVENTS), int(zmq.POLLIN)
RCVMORE = int(zmq.RCVMORE)


def send_frames(sock: zmq.Socket, frames: list[Any], flags: int = 0) -> None:
    """``send_multipart(frames, flags, copy=False)`` without the enum arithmetic (pyzmq still
    copies frames under its copy threshold and sends larger ones without copying)."""
    last = len(frames) - 1
    for i, f in enumerate(frames):
        sock.send(f, flags | SNDMORE if i < last else flags, copy=False)


def recv_frames(sock: zmq.Socket, flags: int = 0) -> list[zmq.Frame]:
    """``recv_multipart(flags, copy=False)``, reading ``more`` from each frame."""
    f = sock.recv(flags, copy=False)
    parts = [f]
    while f.more:
        f = sock.recv(flags, copy=False)
        parts.append(f)
    return parts


class Bounds(NamedTuple):
    """What :func:`recv_bounded` keeps of one multipart message: at most ``parts`` frames of
    ``nbytes`` bytes in all; of a message over either, only its first ``keep`` frames (the
    identity and header a reply needs)."""

    parts: int
    nbytes: int
    keep: int = 1


class Cut(NamedTuple):
    """A message :func:`recv_bounded` did not keep whole: ``why`` (``frames``: more than
    ``Bounds.parts``; ``bytes``: more than ``Bounds.nbytes``), and how many frames and bytes it
    had in all (every frame read, the dropped ones freed as they were read), and the bytes it
    took on the wire: each frame with its ZMTP header (``wire``), and on CURVE inside its
    MESSAGE command (``wire_curve``; :func:`frame_wire`)."""

    why: str
    parts: int
    nbytes: int
    wire: int = 0
    wire_curve: int = 0


CURVE_FRAME = 33
"""Bytes CURVE adds to each frame: a MESSAGE command (``\\x07MESSAGE``, an 8-byte nonce, a
16-byte MAC and a flags byte around the data), itself sent as a ZMTP frame."""


def frame_wire(size: int, curve: bool = False) -> int:
    """Bytes one frame of ``size`` bytes takes on the wire: its data and its ZMTP header (2
    bytes up to 255 bytes, else 9), on CURVE of the MESSAGE command that carries it."""
    if curve:
        size += CURVE_FRAME
    return size + (2 if size < 256 else 9)


_DISCARD = bytearray()
"""``recv_into`` an empty buffer discards a frame without making a ``zmq.Frame`` of it."""


def recv_bounded(sock: zmq.Socket, bounds: Bounds, flags: int = 0,
                 on_large: Callable[[], None] | None = None) -> tuple[list[zmq.Frame], Cut | None]:
    """One multipart message, read frame by frame: ``(frames, None)``, or, for a message over
    ``bounds``, ``(its first bounds.keep frames, Cut)``: the frames past the bound are read and
    freed one at a time, never held together (libzmq hands a message over once all of it has
    arrived; this bounds what the reader adds to that). ``on_large()`` is called once the
    message has ``BIG_BUFFERS`` frames, before the next is read."""
    f = sock.recv(flags, copy=False)
    parts = [f]
    size = len(f)
    max_parts, max_bytes = bounds.parts, bounds.nbytes
    while f.more:
        if len(parts) >= max_parts or size > max_bytes:
            break
        if len(parts) == BIG_BUFFERS and on_large is not None:
            on_large()
        f = sock.recv(flags, copy=False)
        parts.append(f)
        size += len(f)
    else:
        if size <= max_bytes:
            return parts, None
    why = "bytes" if size > max_bytes else "frames"
    n, more = len(parts), f.more
    wire = wire_curve = 0
    for f in parts:
        wire, wire_curve = wire + frame_wire(len(f)), wire_curve + frame_wire(len(f), True)
    del parts[bounds.keep:]
    del f
    recv_into = getattr(sock, "recv_into", None)  # pyzmq >= 26.4
    while more:
        if recv_into is not None:
            one = recv_into(_DISCARD, flags=flags)
            more = sock.getsockopt(RCVMORE)
        else:
            f = sock.recv(flags, copy=False)
            one = len(f)
            more = f.more
            del f
        size += one
        wire, wire_curve = wire + frame_wire(one), wire_curve + frame_wire(one, True)
        n += 1
    return parts, Cut(why, n, size, wire, wire_curve)


class SocketReader:
    """Calls ``on_frames(frames)`` for every multipart message arriving on ``sock``.

    With ``bounds``, a message over them is not kept whole (:func:`recv_bounded`):
    ``on_cut(first_frames, cut)`` is called for it instead (``on_cut`` is required then).
    With ``watch`` (a bound socket's :class:`~opentinker.bus.held.HeldWatch`, which needs
    ``bounds``), every message read is reported to it, and it checks on the same loop.
    """

    def __init__(self, sock: zmq.Socket, on_frames: Callable[[list[zmq.Frame]], None],
                 loop: asyncio.AbstractEventLoop | None = None, *, bounds: Bounds | None = None,
                 on_cut: Callable[[list[zmq.Frame], Cut], None] | None = None,
                 watch: HeldWatch | None = None) -> None:
        if bounds is not None and on_cut is None:
            raise ValueError("a SocketReader with bounds needs on_cut")
        if watch is not None and bounds is None:
            raise ValueError("a SocketReader with a watch needs bounds")
        self.sock = sock
        self.on_frames = on_frames
        self.bounds = bounds
        self.on_cut = on_cut
        self.loop = loop or asyncio.get_running_loop()
        self._scheduled = False
        self._draining = False
        self._paused = False
        self._fd = sock.getsockopt(zmq.FD)
        self.watch = watch
        if watch is not None:
            watch.start(self.loop)
        self.loop.add_reader(self._fd, self.drain)
        self.kick()  # messages may have arrived before the reader was attached

    def kick(self) -> None:
        """Check for messages soon (after a send, which may have consumed the edge)."""
        if not self._scheduled:
            self._scheduled = True
            self.loop.call_soon(self.drain)

    def _read_one(self) -> None:
        """Read one message (``zmq.Again`` when there is none) and hand it on. A message of
        many frames is read and handled with the garbage collector paused
        (:func:`~protocols.codec.gc_pause`): what it makes is usually gone by the end."""
        if self.bounds is None:
            self.on_frames(recv_frames(self.sock, NOBLOCK))
            return
        self._paused = False
        try:
            frames, cut = recv_bounded(self.sock, self.bounds, NOBLOCK, self._pause)
            if self.watch is not None:
                self.watch.read(frames, cut)
            if cut is None:
                self.on_frames(frames)
            else:
                self.on_cut(frames, cut)  # type: ignore[misc]
        finally:
            if self._paused:
                gc_resume()

    def _pause(self) -> None:
        self._paused = gc_pause()

    def drain(self) -> None:
        """Read until the socket has nothing more (``zmq.Again``), at most ``DRAIN_BATCH``."""
        self._scheduled = False
        self._draining = True
        sock = self.sock
        if sock.closed:
            return
        try:
            # The first read is tried blind (the descriptor fired: usually a message is
            # there); after each message EVENTS says whether another is waiting.
            try:
                self._read_one()
            except zmq.Again:
                return
            for _ in range(DRAIN_BATCH - 1):
                if sock.closed or not sock.getsockopt(EVENTS) & POLLIN:
                    return
                self._read_one()
            self.kick()
        except zmq.ZMQError as e:
            # Closed under us while a read was scheduled: its context was destroyed at shutdown,
            # or the socket was closed through another view of it (``closed`` is per view).
            if e.errno not in (zmq.ENOTSOCK, zmq.ETERM):
                raise
        finally:
            self._draining = False

    def send(self, frames: list[Any]) -> None:
        """Send without blocking; raises ``zmq.Again`` when the queue is full."""
        sock = self.sock
        send_frames(sock, frames, NOBLOCK)
        # Inside drain the loop reads on anyway; elsewhere the send may have taken the edge of
        # a message that already arrived: reading EVENTS re-arms it, and shows what is waiting.
        if not self._draining and sock.getsockopt(EVENTS) & POLLIN:
            self.kick()

    def close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        if not self.sock.closed:
            self.loop.remove_reader(self._fd)
            self.sock.close(linger=0)


class _Resume(collections.abc.Coroutine):
    """The rest of a coroutine that already ran up to its first wait on ``pending``, as a
    coroutine a task can run: its first step hands the task that wait, and a cancellation
    (or any exception) thrown in, even before that first step, goes into the coroutine, so
    its handler sees it exactly as it would in a task of its own."""

    __slots__ = ("coro", "first", "pending")

    def __init__(self, coro: Coroutine[Any, Any, Any], pending: Any) -> None:
        self.coro, self.pending, self.first = coro, pending, True

    def send(self, value: Any) -> Any:
        if self.first:
            self.first = False
            pending, self.pending = self.pending, None
            return pending
        return self.coro.send(value)

    def throw(self, *exc: Any) -> Any:
        self.first, self.pending = False, None
        return self.coro.throw(*exc)

    def close(self) -> None:
        self.coro.close()

    def __await__(self) -> Generator[Any, Any, Any]:
        return self  # type: ignore[return-value]

    def __next__(self) -> Any:
        return self.send(None)


def run_eager(coro: Coroutine[Any, Any, Any], loop: asyncio.AbstractEventLoop) -> asyncio.Task | None:
    """Run ``coro`` now, up to its first wait; None when it finished without waiting, else the
    task that carries on from there (and can be cancelled like any task, also before it has
    taken a step).

    Either way the coroutine runs in a context of its own (a copy of the caller's), so what
    it sets in a ``ContextVar`` stays its own. On Python 3.12+ this is an eager task (the
    coroutine runs in its own task from the start, so ``asyncio.timeout`` and ``wait_for``
    work in its first part); on 3.11 the first part runs with no current task and the rest in
    a task.
    """
    if sys.version_info >= (3, 12):
        task = asyncio.Task(coro, loop=loop, eager_start=True)
        if task.done():
            task.result()  # re-raise what the coroutine raised, as the 3.11 path does
            return None
        return task
    ctx = contextvars.copy_context()
    try:
        pending = ctx.run(coro.send, None)
    except StopIteration:
        return None
    return loop.create_task(_Resume(coro, pending), context=ctx)


def settle_heap() -> None:
    """Collect garbage, then move every object alive into the collector's permanent generation
    (``gc.freeze``). A long-lived component calls this once it has loaded what it keeps for its
    life (a model, its modules): the collector's full passes, which a steady stream of messages
    sets off every second or so, then scan only what came after, where in a process with torch
    loaded each one would otherwise hold the bus loop (and every thread) for ~100 ms. Frozen
    objects are still freed by reference counting; cycles among them are collected only after
    :func:`unsettle_heap`."""
    gc.collect()
    gc.freeze()


def unsettle_heap() -> None:
    """Undo :func:`settle_heap` (every object frozen goes back to the collector's oldest
    generation): a component that settled its heap calls this when it stops, so what it
    loaded can be collected in a process that lives on (tests, a driver)."""
    gc.unfreeze()


class LoopThread:
    """An asyncio event loop (uvloop's where installed) in a daemon thread, with its own
    ZeroMQ context."""

    def __init__(self, name: str) -> None:
        self.loop = new_event_loop()
        self.ctx = zmq.asyncio.Context()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and block for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        async def _cancel_all() -> None:
            me = asyncio.current_task()
            for t in asyncio.all_tasks():
                if t is not me:
                    t.cancel()

        if self.loop.is_running():
            try:
                self.run(_cancel_all(), timeout=5)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        release_context(self.ctx)
        self.ctx.destroy(linger=0)
