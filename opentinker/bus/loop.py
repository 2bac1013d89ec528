"""Plain ZeroMQ sockets on an asyncio loop, without a future per message.

``zmq.asyncio`` makes a future for every send and receive; at ~100 µs round trips that is
most of the cost. Here a socket's file descriptor is watched with ``loop.add_reader`` and, when
it fires, every waiting message is read with non-blocking calls (ZeroMQ's descriptor is
edge-triggered, so a reader drains while ``EVENTS`` shows a message, and checks again after a
send made outside its own callback; the frames themselves are read and sent by
:mod:`opentinker.bus.frames`). Handlers run eagerly (:func:`run_eager`): a request whose handler never waits is
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
from typing import Any, TypeVar

import zmq
import zmq.asyncio

from opentinker.bus.auth import release_context
from opentinker.bus.frames import (
    EVENTS,
    NOBLOCK,
    POLLIN,
    Bounds,
    Cut,
    recv_bounded,
    recv_frames,
    send_frames,
)
from opentinker.bus.held import HeldWatch
from protocols.codec import gc_pause, gc_resume

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
            # Cancel, then let each task run its cancellation out (its finally blocks, the gather
            # it awaited) before the loop stops, as asyncio.run does: a task still cancelling
            # when the loop stops is destroyed pending ("Task was destroyed but it is pending!").
            me = asyncio.current_task()
            others = [t for t in asyncio.all_tasks() if t is not me]
            for t in others:
                t.cancel()
            if others:
                await asyncio.wait(others, timeout=4)

        if self.loop.is_running():
            try:
                self.run(_cancel_all(), timeout=5)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
            self.loop.call_soon_threadsafe(self.loop.stop)
            self._thread.join(timeout=5)
        release_context(self.ctx)
        self.ctx.destroy(linger=0)
