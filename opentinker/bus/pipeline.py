"""One-way messages (ZeroMQ's pipeline pattern): a :class:`Pusher` sends, say, trajectories
to the :class:`Puller` a learner binds. A full queue makes the sender wait (backpressure), or,
for best-effort messages, drops them (counted)."""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from opentinker.bus.common import (
    DEFAULT_HWM,
    LOOPBACK,
    Counters,
    CurveKeys,
    bind_guarded,
    configure,
    cut_error,
    frame_cap,
    read_bounds,
    server_side,
)
from opentinker.bus.frames import NOBLOCK, recv_bounded, send_frames
from opentinker.bus.held import watch
from opentinker.bus.logs import LogEvery
from protocols.codec import DEFAULT_LIMITS, DecodeError, Limits, decode, encode
from protocols.messages import Message

log = logging.getLogger(__name__)


class Pusher:
    """PUSH socket for one-way messages (trajectories) to one receiver; a full queue (``hwm``)
    makes :meth:`send` wait, up to ``timeout`` s (backpressure, not unbounded memory)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, *, keys: CurveKeys | None = None,
                 hwm: int = DEFAULT_HWM) -> None:
        self.endpoint = endpoint
        self.sent = self.dropped = 0
        self._sock = configure(ctx.socket(zmq.PUSH), hwm=hwm, keys=keys)
        self._sock.connect(endpoint)
        self._plain = zmq.Socket.shadow(self._sock.underlying)

    async def send(self, msg: Message, timeout: float = 600.0) -> None:
        try:
            await asyncio.wait_for(self._sock.send_multipart(encode(msg), copy=False), timeout)
        except TimeoutError:
            raise TimeoutError(f"push to {self.endpoint}: queue full for {timeout:.3g} s") from None
        self.sent += 1

    def try_send(self, msg: Message) -> bool:
        """Send now or drop (a full queue, no receiver yet): for best-effort messages such as
        progress, which must never hold up their sender. Returns whether it went."""
        try:  # through a blocking view of the socket: zmq.asyncio would queue, not raise
            send_frames(self._plain, encode(msg), NOBLOCK)
        except zmq.Again:
            self.dropped += 1
            return False
        self.sent += 1
        return True

    def close(self) -> None:
        self._sock.close(linger=0)


class Puller:
    """PULL socket bound by a receiver (a learner); undecodable frames, and messages over
    ``limits`` (read frame by frame, never held whole), are counted and dropped (logged at
    most once a second)."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str = LOOPBACK, max_bytes: int | None = None,
                 *, keys: CurveKeys | None = None, hwm: int = DEFAULT_HWM, limits: Limits | None = None) -> None:
        endpoint, keys = server_side(endpoint, keys)
        self.limits = (limits or DEFAULT_LIMITS).with_max_bytes(max_bytes)
        self.max_bytes = self.limits.max_bytes
        self.counters = Counters()
        self._sock = configure(ctx.socket(zmq.PULL), hwm=hwm, max_bytes=self.max_bytes, keys=keys, server=True)
        self._plain = zmq.Socket.shadow(self._sock.underlying)
        self._watch = watch(self._plain, endpoint, "puller", self.counters, max_bytes=self.max_bytes,
                            frame_cap=frame_cap(self.max_bytes), curve=keys is not None, follows_reader=True, ctx=ctx)
        """What libzmq holds for each pusher, bounded (:mod:`opentinker.bus.held`), watched from
        before the bind; it checks on the loop the puller is made on (or of its first
        :meth:`recv`), and only while :meth:`recv` is being called."""
        try:
            self._guard = bind_guarded(self._sock, endpoint, "puller", self.counters, keys)
        except zmq.ZMQError:
            if self._watch is not None:
                self._watch.close()
            raise
        if self._watch is not None:
            try:
                self._watch.start(asyncio.get_running_loop())
            except RuntimeError:  # made outside a loop: the first recv() starts it
                pass
        self._bounds = read_bounds(self.limits)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._log = LogEvery(log)

    async def recv(self) -> Message:
        watch = self._watch
        if watch is None:
            return await self._recv()
        watch.start(asyncio.get_running_loop())
        watch.reader_waits(True)
        try:
            return await self._recv()
        finally:
            watch.reader_waits(False)

    async def _recv(self) -> Message:
        while True:
            try:  # through a blocking view of the socket, frame by frame (zmq.asyncio takes all)
                frames, cut = recv_bounded(self._plain, self._bounds, NOBLOCK)
            except zmq.Again:
                await self._sock.poll(flags=zmq.POLLIN)
                continue
            if self._watch is not None:
                self._watch.read(frames, cut)
            if cut is not None:
                _, err = cut_error(frames[0] if frames else None, cut, self.limits, self.counters)
                self._log.warning("drop", "puller %s: dropped a message: %s", self.endpoint, err.message)
                continue
            try:
                _, msg = decode([f.buffer for f in frames], limits=self.limits)
            except DecodeError as e:
                self.counters[f"error/{e.code.value}"] += 1
                self._log.warning(f"bad/{e.code.value}", "puller %s: dropped bad frame: %s", self.endpoint, e)
                continue
            self.counters[f"recv/{type(msg).__name__}"] += 1
            return msg

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
        self._guard.close()
        self._sock.close(linger=0)
