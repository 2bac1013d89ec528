"""The message bus: typed ZeroMQ request-reply (ROUTER/DEALER) and PUSH/PULL, on asyncio.

* :class:`Server` binds a ROUTER and answers each request with the handler's reply; a frame it
  cannot decode gets an :class:`~protocols.messages.Error` reply (when the request id can be
  read) and a counter, and the server keeps serving. Replies to state-changing requests
  (``protocols.messages.STATE_CHANGING``) are remembered by request id: a retry is answered
  from the first result and never applied twice.
* :class:`Client` connects a DEALER; many requests may be in flight, each matched to its reply
  by request id and bounded by a timeout.
* :class:`Pusher` / :class:`Puller` carry trajectories one way (PUSH round-robins, never fans
  out, so each learner binds its own PULL).
* :class:`LoopThread` runs an asyncio loop in a daemon thread, so a component can serve the
  bus while its owner (a Ray actor method, a test) blocks.

Sockets use ``LINGER=0``. Local runs bind ``tcp://127.0.0.1:*`` and publish the port the OS
picked (``Server.endpoint``).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import threading
from typing import Any, Awaitable, Callable, Coroutine, TypeVar

import zmq
import zmq.asyncio

from protocols.codec import DEFAULT_MAX_BYTES, DecodeError, decode, encode
from protocols.messages import STATE_CHANGING, Error, ErrorCode, Message

log = logging.getLogger(__name__)
T = TypeVar("T")

LOOPBACK = "tcp://127.0.0.1:*"
Handler = Callable[[Message], Awaitable[Message]]


class RemoteError(RuntimeError):
    """The peer answered with an :class:`Error`."""

    def __init__(self, error: Error, where: str = "") -> None:
        super().__init__(f"{where}: {error.code.value}: {error.message}" if where else error.message)
        self.error = error


class Counters(collections.Counter):
    """Message counters by kind, e.g. ``recv/SampleRequest``, ``error/bad_frame``."""

    def snapshot(self) -> dict[str, int]:
        return dict(self)


def _socket(ctx: zmq.asyncio.Context, kind: int) -> zmq.asyncio.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class Server:
    """ROUTER server: ``await handler(msg)`` for each request, reply to its sender.

    Each request is handled in its own task, so a slow handler never blocks the socket.
    """

    def __init__(
        self,
        handler: Handler,
        endpoint: str = LOOPBACK,
        name: str = "server",
        max_bytes: int = DEFAULT_MAX_BYTES,
        idempotency_cache: int = 4096,
    ) -> None:
        self.handler = handler
        self.name = name
        self.max_bytes = max_bytes
        self.counters = Counters()
        self._bind_to = endpoint
        self._sock: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self._done: collections.OrderedDict[int, asyncio.Future] = collections.OrderedDict()
        self._cache_size = idempotency_cache
        self.endpoint = ""

    async def start(self, ctx: zmq.asyncio.Context) -> str:
        """Bind and start serving; returns the bound endpoint (with the OS-picked port)."""
        self._sock = _socket(ctx, zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self._sock.bind(self._bind_to)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._task = asyncio.create_task(self._serve())
        return self.endpoint

    async def _serve(self) -> None:
        assert self._sock is not None
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            task = asyncio.create_task(self._handle(frames))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    async def _handle(self, frames: list[zmq.Frame]) -> None:
        identity, *body = frames
        try:
            rid, msg = decode([f.buffer for f in body], self.max_bytes)
        except DecodeError as e:
            self.counters[f"error/{e.code.value}"] += 1
            log.warning("%s: bad frame: %s", self.name, e)
            await self._reply(identity, Error(code=e.code, message=str(e)), e.request_id or 0)
            return
        kind = type(msg).__name__
        self.counters[f"recv/{kind}"] += 1
        if isinstance(msg, STATE_CHANGING):
            fut = self._done.get(rid)
            if fut is not None:
                self.counters["dedup"] += 1
                reply = await asyncio.shield(fut)
                await self._reply(identity, reply, rid)
                return
            fut = asyncio.get_running_loop().create_future()
            self._done[rid] = fut
            while len(self._done) > self._cache_size:
                self._done.popitem(last=False)
            reply = await self._call(msg)
            fut.set_result(reply)
        else:
            reply = await self._call(msg)
        await self._reply(identity, reply, rid)

    async def _call(self, msg: Message) -> Message:
        try:
            return await self.handler(msg)
        except (ValueError, KeyError, TypeError) as e:
            self.counters["error/invalid"] += 1
            return Error(code=ErrorCode.INVALID, message=f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - a bug in one request must not stop the server
            self.counters["error/internal"] += 1
            log.exception("%s: handler failed", self.name)
            return Error(code=ErrorCode.INTERNAL, message=f"{type(e).__name__}: {e}")

    async def _reply(self, identity: zmq.Frame, reply: Message, rid: int) -> None:
        assert self._sock is not None
        self.counters[f"sent/{type(reply).__name__}"] += 1
        await self._sock.send_multipart([identity, *encode(reply, rid)], copy=False)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
        for t in list(self._tasks):
            t.cancel()
        if self._sock is not None:
            self._sock.close(linger=0)


class Client:
    """DEALER client with many requests in flight, matched to replies by request id."""

    _ids = itertools.count(1)

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str, name: str = "client") -> None:
        self.endpoint = endpoint
        self.name = name
        self.counters = Counters()
        self._sock = _socket(ctx, zmq.DEALER)
        self._sock.connect(endpoint)
        self._pending: dict[int, asyncio.Future] = {}
        self._reader: asyncio.Task | None = None
        # Request ids are unique across processes: a random high half and a counter.
        self._base = int.from_bytes(os.urandom(3), "little") << 32

    def next_request_id(self) -> int:
        return self._base | next(self._ids)

    async def request(
        self, msg: Message, timeout: float = 600.0, request_id: int | None = None
    ) -> Message:
        """Send ``msg`` and return the reply; raise :class:`RemoteError` on an ``Error`` reply
        and :class:`TimeoutError` after ``timeout`` seconds (the request is then forgotten)."""
        if self._reader is None:
            self._reader = asyncio.create_task(self._read())
        rid = self.next_request_id() if request_id is None else request_id
        fut = asyncio.get_running_loop().create_future()
        self._pending[rid] = fut
        self.counters[f"sent/{type(msg).__name__}"] += 1
        try:
            await self._sock.send_multipart(encode(msg, rid), copy=False)
            reply = await asyncio.wait_for(fut, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(
                f"{self.name}: no reply to {type(msg).__name__} from {self.endpoint} in {timeout:.0f} s"
            ) from None
        finally:
            self._pending.pop(rid, None)
        if isinstance(reply, Error):
            raise RemoteError(reply, f"{self.name} -> {self.endpoint} ({type(msg).__name__})")
        return reply

    async def _read(self) -> None:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                rid, reply = decode([f.buffer for f in frames])
            except DecodeError as e:
                self.counters[f"error/{e.code.value}"] += 1
                if e.request_id is not None and e.request_id in self._pending:
                    fut = self._pending[e.request_id]
                    if not fut.done():
                        fut.set_result(Error(code=e.code, message=str(e)))
                continue
            self.counters[f"recv/{type(reply).__name__}"] += 1
            fut = self._pending.get(rid)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
        self._sock.close(linger=0)


class Pusher:
    """PUSH socket for one-way messages (trajectories) to one receiver."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str) -> None:
        self.endpoint = endpoint
        self.sent = 0
        self._sock = _socket(ctx, zmq.PUSH)
        self._sock.connect(endpoint)

    async def send(self, msg: Message) -> None:
        await self._sock.send_multipart(encode(msg), copy=False)
        self.sent += 1

    def close(self) -> None:
        self._sock.close(linger=0)


class Puller:
    """PULL socket bound by a receiver (a learner); undecodable frames are counted, dropped."""

    def __init__(self, ctx: zmq.asyncio.Context, endpoint: str = LOOPBACK, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._sock = _socket(ctx, zmq.PULL)
        self._sock.bind(endpoint)
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.max_bytes = max_bytes
        self.counters = Counters()

    async def recv(self) -> Message:
        while True:
            frames = await self._sock.recv_multipart(copy=False)
            try:
                _, msg = decode([f.buffer for f in frames], self.max_bytes)
            except DecodeError as e:
                self.counters[f"error/{e.code.value}"] += 1
                log.warning("puller %s: dropped bad frame: %s", self.endpoint, e)
                continue
            self.counters[f"recv/{type(msg).__name__}"] += 1
            return msg

    def close(self) -> None:
        self._sock.close(linger=0)


class LoopThread:
    """An asyncio event loop in a daemon thread, with its own ZeroMQ context."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
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
        self.ctx.destroy(linger=0)
