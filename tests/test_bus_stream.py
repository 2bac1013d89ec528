"""Streamed partial results on the bus: a ``SampleRequest(stream=True)`` answered by
``SampleChunk`` partials (emitted from another thread) before its one final reply, on both
clients; cancellation, late emits, full client queues and retries (docs/protocol.md,
Streaming). Every wait is bounded in count and time; loopback and inproc only."""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from conftest import run, until

from opentinker.bus.auth import secure_client
from opentinker.bus import Client, RemoteError, Server, SyncClient
from protocols.codec import DecodeError, decode, encode
from protocols.messages import (
    PARTIALS,
    PROTOCOL_VERSION,
    Ack,
    Cancel,
    ErrorCode,
    Hello,
    SampleChunk,
    SampleRequest,
    SampleResult,
    SamplingParams,
    StopReason,
    Welcome,
)

ROWS = 2


def request(stream: bool = True, client: str = "") -> SampleRequest:
    prompts = [np.arange(3, dtype=np.int32) + r for r in range(ROWS)]
    return SampleRequest(adapter=None, prompts=prompts, params=SamplingParams(max_tokens=64), client=client, stream=stream)


def chunk(seq: int, rows: int = ROWS) -> SampleChunk:
    """Step ``seq``: one token per row (``10 * seq + row``)."""
    return SampleChunk(rows=list(range(rows)), tokens=[np.array([10 * seq + r], np.int32) for r in range(rows)],
                       logprobs=[np.array([-(seq + 1) / 8], np.float32) for _ in range(rows)], seq=seq)


def result(steps: int, rows: int = ROWS) -> SampleResult:
    """The whole reply of ``steps`` steps: what the chunks add up to."""
    return SampleResult(tokens=[np.array([10 * s + r for s in range(steps)], np.int32) for r in range(rows)],
                        logprobs=[np.array([-(s + 1) / 8 for s in range(steps)], np.float32) for _ in range(rows)],
                        stop_reasons=[StopReason.LENGTH] * rows, adapter_version=-1, batch_id=0)


def joined(chunks: list[SampleChunk], rows: int = ROWS) -> list[list[int]]:
    """Per row, the tokens of ``chunks`` in order."""
    out: list[list[int]] = [[] for _ in range(rows)]
    for c in chunks:
        for r, t in zip(c.rows, c.tokens):
            out[r] += t.tolist()
    return out


def wait_for(predicate, what: str, n: int = 500) -> None:
    """``until`` for a thread that is not the loop's."""
    asyncio.run(until(predicate, what, n))


class Streamer:
    """Answers a SampleRequest with ``steps`` chunks emitted from a worker thread (never the
    loop's), ``step_s`` apart, then the final result (of the steps it made) after ``tail_s``.
    With ``until_closed`` it emits until its emitter closes (at most ``steps``) and records
    where it stopped. With ``finish_when_cancelled`` a cancel does not stop the handler: it
    waits for the producer and answers with its result, as the scheduler does for a request
    already computing."""

    def __init__(self, steps: int = 5, step_s: float = 0.0, tail_s: float = 0.0, until_closed: bool = False,
                 finish_when_cancelled: bool = False) -> None:
        self.steps, self.step_s, self.tail_s, self.until_closed = steps, step_s, tail_s, until_closed
        self.finish_when_cancelled = finish_when_cancelled
        self.server: Server | None = None
        self.emitters: list = []
        self.accepted: list[bool] = []
        self.producer_threads: set[int] = set()
        self.stopped_at: int | None = None
        self.produced = threading.Event()

    async def __call__(self, msg):
        assert isinstance(msg, SampleRequest)
        emit = self.server.emitter()
        self.emitters.append(emit)

        def produce() -> None:
            self.producer_threads.add(threading.get_ident())
            for seq in range(self.steps):
                if emit is None or (self.until_closed and emit.closed):
                    self.stopped_at = seq
                    break
                self.accepted.append(emit(chunk(seq)))
                if self.step_s:
                    time.sleep(self.step_s)
            else:
                self.stopped_at = self.steps
            self.produced.set()

        work = asyncio.ensure_future(asyncio.to_thread(produce))
        try:
            await asyncio.shield(work)
        except asyncio.CancelledError:
            if not self.finish_when_cancelled:
                raise
            await work
        if self.tail_s:
            await asyncio.sleep(self.tail_s)
        return result(self.stopped_at)

    def again(self, **settings) -> None:
        """Start afresh with these settings, on the same server."""
        server = self.server
        self.__init__(**settings)
        self.server = server


class Scope:
    """The servers, clients and sockets of one test, all closed when it ends, passed or
    failed: one left open would make destroying the context wait forever."""

    def __init__(self, ctx: zmq.asyncio.Context) -> None:
        self.ctx = ctx
        self.servers: list[Server] = []
        self.closers: list = []

    async def serve(self, handler, endpoint: str = "tcp://127.0.0.1:*", **kw) -> tuple[Server, str]:
        """A started server (``handler.server`` set when the handler has that attribute)."""
        server = Server(handler, endpoint, heartbeat_s=None, **kw)
        if hasattr(handler, "server"):
            handler.server = server
        self.servers.append(server)
        return server, await server.start(self.ctx)

    def client(self, endpoint: str, **kw) -> Client:
        c = Client(self.ctx, endpoint, heartbeat_s=None, **kw)
        self.closers.append(c.close)
        return c

    def raw(self, endpoint: str, plain: bool = False) -> zmq.Socket:
        """A bare DEALER (``plain``: the blocking API, on the same libzmq context)."""
        sock = (zmq.Context.shadow(self.ctx.underlying) if plain else self.ctx).socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        secure_client(sock)
        sock.connect(endpoint)
        self.closers.append(lambda: sock.close(0))
        return sock

    async def greeted(self, endpoint: str) -> zmq.asyncio.Socket:
        """A bare asyncio DEALER that has said Hello."""
        sock = self.raw(endpoint)
        await sock.send_multipart(encode(Hello(version=PROTOCOL_VERSION, peer="raw"), 1))
        assert isinstance(decode(await asyncio.wait_for(sock.recv_multipart(), 5))[1], Welcome)
        return sock

    async def close(self) -> None:
        """Close everything, each whatever the others do."""
        for close in [*self.closers, *(s.stop for s in self.servers)]:
            with contextlib.suppress(Exception):
                done = close()
                if done is not None:
                    await done


async def read_until_final(raw: zmq.asyncio.Socket, rid: int, log: list, n: int = 3000) -> list[tuple[int, str]]:
    """Append ``(request id, message)`` of every frame to ``log`` until request ``rid``'s final
    reply (at most ``n`` frames, 5 s each); returns ``(id, type name)`` of all of ``log``."""
    for _ in range(n):
        log.append(decode(await asyncio.wait_for(raw.recv_multipart(), 5)))
        if log[-1][0] == rid and type(log[-1][1]) not in PARTIALS:
            break
    return [(i, type(m).__name__) for i, m in log]


def run_scoped(body, timeout: float = 60.0) -> None:
    """Run ``await body(scope)`` on a fresh loop and context, cleaned up however it ends."""
    async def main():
        ctx = zmq.asyncio.Context()
        scope = Scope(ctx)
        try:
            await body(scope)
        finally:
            await scope.close()
            ctx.destroy(0)

    run(main(), timeout)


def test_sample_chunk_round_trips_and_the_protocol_refuses_version_2():
    assert PROTOCOL_VERSION == 12 and PARTIALS == (SampleChunk,)
    c = chunk(4)
    rid, out = decode([bytes(f) for f in encode(c, 99)])
    assert rid == 99 and out == c and out.tokens[1].dtype == np.int32 and out.logprobs[0].dtype == np.float32
    assert out.tokens[1].tolist() == [41] and out.rows == [0, 1] and out.seq == 4
    assert SampleRequest(adapter=None, prompts=[], params=SamplingParams()).stream is False  # off by default
    assert decode(encode(request(), 1))[1].stream is True
    # Protocol 2 frames are refused, and so is a protocol-2 Hello at a server.
    frames = [bytes(f) for f in encode(Hello(version=2, peer="old"), 5)]
    frames[0] = msgspec.msgpack.encode([2, 5, 0])
    with pytest.raises(DecodeError) as e:
        decode(frames)
    assert e.value.code is ErrorCode.BAD_VERSION and e.value.request_id == 5

    async def body(scope: Scope) -> None:
        server, ep = await scope.serve(Streamer())
        raw = scope.raw(ep)
        await raw.send_multipart(frames)
        rid, err = decode(await asyncio.wait_for(raw.recv_multipart(), 5))
        assert (rid, err.code) == (5, ErrorCode.BAD_VERSION) and f"peer speaks protocol 2, this side {PROTOCOL_VERSION}" in err.message
        assert server.counters["error/bad_version"] == 1 and server.peers == {}

    run_scoped(body)


def test_both_clients_get_the_chunks_in_order_then_the_final():
    """Chunks emitted on a worker thread reach the asyncio client's callback on its loop, and
    the blocking client's on the caller's thread, in order and all before the final reply,
    which holds every token. The final reply's round trip (not a chunk's) is what reply
    polling averages."""
    async def body(scope: Scope) -> None:
        steps, tail = 6, 0.05
        handler = Streamer(steps=steps, tail_s=tail)
        server, ep = await scope.serve(handler)
        client = scope.client(ep)
        loop_thread = threading.get_ident()
        events: list = []
        threads: set[int] = set()

        def on_partial(m):
            threads.add(threading.get_ident())
            events.append(m)

        final = await client.request(request(), 10, on_partial=on_partial)
        events.append(final)
        assert [type(e).__name__ for e in events] == ["SampleChunk"] * steps + ["SampleResult"]
        assert [e.seq for e in events[:-1]] == list(range(steps))
        assert joined(events[:-1]) == [t.tolist() for t in final.tokens] == [t.tolist() for t in result(steps).tokens]
        assert threads == {loop_thread} and loop_thread not in handler.producer_threads
        assert handler.accepted == [True] * steps and server.counters["sent/SampleChunk"] == steps
        assert client.counters["recv/SampleChunk"] == steps and client.counters["stream/ignored"] == 0
        assert client.polling.rtt[SampleRequest] >= tail  # timed to the final reply, not to a chunk
        assert client._on_partial == {} and client._pending == {}

        def sync_part():
            with SyncClient(ep, name="sync") as c:
                me, got, seen = threading.get_ident(), [], set()

                def cb(m):
                    seen.add(threading.get_ident())
                    got.append(m)

                final = c.request(request(), 10, on_partial=cb)
                assert seen == {me} and [m.seq for m in got] == list(range(steps))
                assert joined(got) == [t.tolist() for t in final.tokens]
                assert c.polling.rtt[SampleRequest] >= tail and not c._sent_at
                # A callback given to submit gets the chunks too (result() reads them).
                got2: list = []
                rid = c.submit(request(), on_partial=got2.append)
                again = c.result(rid, 10)
                assert joined(got2) == [t.tolist() for t in again.tokens] and [m.seq for m in got2] == list(range(steps))
                assert c._on_partial == {} and c.counters["stream/ignored"] == 0
                return c.counters["recv/SampleChunk"]

        assert await asyncio.to_thread(sync_part) == 2 * steps

    run_scoped(body)


def test_a_client_without_a_callback_gets_only_the_final():
    """``stream`` off: the handler gets no emitter and nothing but the final reply is sent.
    ``stream`` on without a callback: the chunks arrive, are counted and dropped, and the
    request's result is still the final reply."""
    async def body(scope: Scope) -> None:
        handler = Streamer(steps=4)
        server, ep = await scope.serve(handler)
        client = scope.client(ep)
        called: list = []
        quiet = await client.request(request(stream=False), 10, on_partial=called.append)
        assert handler.emitters == [None] and called == [] and server.counters["sent/SampleChunk"] == 0
        assert isinstance(quiet, SampleResult) and client.counters["recv/SampleChunk"] == 0
        final = await client.request(request(), 10)
        assert [t.tolist() for t in final.tokens] == [t.tolist() for t in result(4).tokens]
        assert client.counters["recv/SampleChunk"] == 4 and client.counters["stream/ignored"] == 4

        def sync_part():
            with SyncClient(ep) as c:
                assert isinstance(c.request(request(stream=False), 10), SampleResult)
                assert isinstance(c.request(request(), 10), SampleResult)
                return c.counters.snapshot()

        counters = await asyncio.to_thread(sync_part)
        assert counters["recv/SampleChunk"] == 4 and counters["stream/ignored"] == 4
        assert counters["recv/SampleResult"] == 2

    run_scoped(body)


def test_a_callback_that_raises_fails_its_request_and_cancels_it():
    """An exception from ``on_partial`` is raised from the request (both clients), which is
    cancelled on the server (its producer stops)."""
    def boom(m):
        if m.seq == 2:
            raise KeyError("bad chunk")

    async def body(scope: Scope) -> None:
        handler = Streamer(steps=2000, step_s=0.003, until_closed=True)
        server, ep = await scope.serve(handler)
        client = scope.client(ep)
        with pytest.raises(KeyError, match="bad chunk"):
            await client.request(request(), 10, on_partial=boom)
        await until(handler.produced.is_set, "the producer to stop")
        assert client.counters["stream/callback_error"] == 1 and client.counters["sent/Cancel"] == 1
        assert handler.stopped_at < 2000 and server.counters["cancelled"] == 1 and client._on_partial == {}

        def sync_part():
            with SyncClient(ep) as c:
                with pytest.raises(KeyError, match="bad chunk"):
                    c.request(request(), 10, on_partial=boom)
                assert c.counters["stream/callback_error"] == 1 and c.counters["sent/Cancel"] == 1
                assert c._on_partial == {} and c._outstanding == {} and c._replies == {}

        handler.again(steps=2000, step_s=0.003, until_closed=True)
        await asyncio.to_thread(sync_part)
        await until(handler.produced.is_set, "the producer to stop")
        assert handler.stopped_at < 2000 and server.counters["cancelled"] == 2

    run_scoped(body)


def test_handlers_get_their_own_request_s_emitter_before_and_after_awaiting():
    """Concurrent requests: each handler's ``emitter()`` is its own request's, whether asked
    for before its first ``await`` or after; a request without ``stream`` gets None; outside
    a handler it is an error, and only partial types may be emitted."""
    async def body(scope: Scope) -> None:
        seen: dict[str, object] = {}
        refused: list[str] = []

        async def handler(msg):
            early = server.emitter()
            await asyncio.sleep(0.01)
            late = server.emitter()
            seen[msg.client] = late if early is late else "another emitter"
            if late is not None:
                try:
                    late(Ack())  # a client would take it for the final reply
                except TypeError as e:
                    refused.append(str(e))
            return result(1)

        server, ep = await scope.serve(handler)
        client = scope.client(ep)
        rids = [client.next_request_id() for _ in range(6)]
        await asyncio.gather(*(client.request(request(stream=i % 3 != 0, client=str(i)), 10, request_id=rid)
                               for i, rid in enumerate(rids)))
        for i, rid in enumerate(rids):
            em = seen[str(i)]
            assert (em is None) if i % 3 == 0 else (em.request_id == rid and em.closed)
        assert len(refused) == 4 and all("Ack is not a partial result" in r for r in refused)
        assert server.counters["sent/Ack"] == 0
        with pytest.raises(RuntimeError, match="while it serves a request"):
            server.emitter()

    run_scoped(body)


def test_cancel_mid_stream_stops_the_chunks_at_the_ack():
    """Wire view (a raw DEALER): chunks, then the ``Ack`` of the Cancel, then the request's
    final ``Error(cancelled)``, and no chunk after the ``Ack``; the producer sees its emitter
    close and stops. The asyncio client's callback is not called after it cancels; the
    blocking client's is not called after its timeout."""
    async def body(scope: Scope) -> None:
        handler = Streamer(steps=2000, step_s=0.003, until_closed=True)
        server, ep = await scope.serve(handler)
        raw = await scope.greeted(ep)
        await raw.send_multipart(encode(request(), 7))
        log = [decode(await asyncio.wait_for(raw.recv_multipart(), 5)) for _ in range(3)]
        await raw.send_multipart(encode(Cancel(request_id=7), 8))
        kinds = await read_until_final(raw, 7, log)
        ack = kinds.index((8, "Ack"))
        assert all(k == (7, "SampleChunk") for k in kinds[:ack])
        assert kinds[ack + 1:] == [(7, "Error")] and log[-1][1].code is ErrorCode.CANCELLED
        assert [m.seq for _, m in log[:ack]] == list(range(ack))
        await until(lambda: handler.produced.is_set(), "the producer to notice the cancel")
        assert handler.stopped_at < 2000 and handler.emitters[0].closed
        assert not await raw.poll(100)  # nothing more for the request
        assert server.counters["sent/SampleChunk"] == ack and server.counters["cancelled"] == 1

        # A request too far along to stop (the handler finishes it): still no chunk after
        # the Ack, and the final reply is its result.
        handler.again(steps=2000, step_s=0.003, until_closed=True, finish_when_cancelled=True)
        await raw.send_multipart(encode(request(), 17))
        log = [decode(await asyncio.wait_for(raw.recv_multipart(), 5)) for _ in range(3)]
        await raw.send_multipart(encode(Cancel(request_id=17), 18))
        kinds = await read_until_final(raw, 17, log)
        ack = kinds.index((18, "Ack"))
        assert all(k == (17, "SampleChunk") for k in kinds[:ack]) and kinds[ack + 1:] == [(17, "SampleResult")]
        assert handler.stopped_at < 2000 and len(log[-1][1].tokens[0]) == handler.stopped_at
        assert joined([m for _, m in log[:ack]]) == [t[:ack].tolist() for t in log[-1][1].tokens]

        # The asyncio client: cancelled by its caller mid-stream.
        handler2 = Streamer(steps=2000, step_s=0.003, until_closed=True)
        server2, ep2 = await scope.serve(handler2)
        client = scope.client(ep2)
        got: list = []
        task = asyncio.ensure_future(client.request(request(), 30, on_partial=got.append))
        await until(lambda: len(got) >= 3, "three chunks")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        at_cancel = len(got)
        await until(lambda: handler2.produced.is_set(), "the producer to stop")
        await until(lambda: client.counters["recv/Error"] == 1, "the final Error(cancelled)")
        assert len(got) == at_cancel and [m.seq for m in got] == list(range(at_cancel))
        assert client.counters["recv/Ack"] == 1 and server2.counters["cancelled"] == 1

        # The blocking client: its timeout cancels the request; no callback afterwards.
        handler3 = Streamer(steps=2000, step_s=0.003, until_closed=True)
        server3, ep3 = await scope.serve(handler3)

        def sync_part():
            with SyncClient(ep3) as c:
                calls: list = []
                with pytest.raises(TimeoutError):
                    c.request(request(), 0.3, on_partial=calls.append)
                n = len(calls)
                wait_for(handler3.produced.is_set, "the producer to stop")
                # Its reply comes after everything the server sent before (one connection, in order).
                assert isinstance(c.request(request(stream=False), 10), SampleResult)
                assert n > 0 and len(calls) == n and c._on_partial == {}
                return c.counters.snapshot()

        counters = await asyncio.to_thread(sync_part)
        assert counters["sent/Cancel"] == 1 and counters["recv/Ack"] == 1 and counters["recv/Error"] == 1
        assert counters.get("stream/ignored", 0) == 0

    run_scoped(body)


def test_chunks_still_queued_at_the_cancel_never_follow_its_ack():
    """Chunks queued, not yet sent, when the Cancel is read: dropped (``cancelled``), so the
    wire shows the ``Ack`` and then only the final ``Error(cancelled)``. Deterministic: the
    chunks are emitted by another request's handler read in the same drain as the Cancel
    (inproc, both sent before the server's loop runs)."""
    async def body(scope: Scope) -> None:
        kept: list = []

        async def handler(msg):
            if msg.client == "poke":  # emits for the streaming request, then answers at once
                assert all(kept[0](chunk(s)) for s in range(3))
                return Ack()
            kept.append(server.emitter())
            await asyncio.Event().wait()  # until cancelled

        server, ep = await scope.serve(handler, f"inproc://stream-cancel-{os.getpid()}")
        raw = scope.raw(ep, plain=True)
        raw.send_multipart(encode(Hello(version=PROTOCOL_VERSION, peer="raw"), 1))
        raw.send_multipart(encode(request(), 7))
        await until(lambda: len(kept) == 1, "the streaming request to start")
        raw.send_multipart(encode(request(client="poke", stream=False), 9))
        raw.send_multipart(encode(Cancel(request_id=7), 8))
        log: list = []

        def read() -> bool:
            while raw.poll(0):
                log.append(decode(raw.recv_multipart()))
            return any(rid == 7 for rid, _ in log)

        await until(read, "the request's final reply")
        await asyncio.sleep(0.05)
        read()
        kinds = [(rid, type(m).__name__) for rid, m in log]
        assert kinds == [(1, "Welcome"), (9, "Ack"), (8, "Ack"), (7, "Error")], kinds
        assert log[-1][1].code is ErrorCode.CANCELLED and kept[0].closed
        assert server.counters["stream/dropped/cancelled"] == 3 == server.counters["stream/dropped"]
        assert server.counters["sent/SampleChunk"] == 0

    run_scoped(body)


def test_run_eager_gives_each_coroutine_its_own_context():
    """What a handler sets in a ContextVar (the server's record of the request it serves)
    stays its own: before and after its first wait, and never seen by the caller."""
    import contextvars

    from opentinker.bus.loop import run_eager

    var: contextvars.ContextVar[str] = contextvars.ContextVar("var", default="caller")

    async def main():
        loop = asyncio.get_running_loop()
        seen: dict[str, list[str]] = {}
        gate = asyncio.Event()

        async def coro(name: str, wait: bool) -> None:
            var.set(name)
            seen[name] = [var.get()]
            if wait:
                await gate.wait()
            seen[name].append(var.get())

        tasks = [run_eager(coro(f"c{i}", wait=i % 2 == 0), loop) for i in range(4)]
        assert var.get() == "caller" and [t is None for t in tasks] == [False, True, False, True]
        gate.set()
        await asyncio.gather(*(t for t in tasks if t is not None))
        assert seen == {f"c{i}": [f"c{i}", f"c{i}"] for i in range(4)} and var.get() == "caller"

    run(main())


def test_no_chunk_after_the_final_and_a_handler_cannot_answer_with_a_chunk():
    """Chunks emitted on the loop just before the handler returns still precede the final
    reply; an emit after it is dropped and counted (``late``), and never sent. A handler that
    returns a chunk as its reply gets ``Error(internal)`` sent instead."""
    async def body(scope: Scope) -> None:
        kept: list = []

        async def handler(msg):
            if msg.client == "chunk-as-final":
                return chunk(0)
            emit = server.emitter()
            kept.append(emit)
            assert emit(chunk(0)) and emit(chunk(1))  # queued; the loop has not sent them yet
            return result(2)

        server, ep = await scope.serve(handler)
        client = scope.client(ep)
        events: list = []
        final = await client.request(request(), 10, on_partial=events.append)
        assert [m.seq for m in events] == [0, 1] and joined(events) == [t.tolist() for t in final.tokens]
        emit = kept[0]
        assert emit.closed
        accepted = await asyncio.to_thread(emit, chunk(2))  # from another thread, after the final
        assert accepted is False
        await until(lambda: server.counters["stream/dropped/late"] == 1, "the late chunk to be counted")
        await asyncio.sleep(0.05)
        assert server.counters["stream/dropped"] == 1 and server.counters["sent/SampleChunk"] == 2
        assert client.counters["recv/SampleChunk"] == 2 and client.counters["stream/unknown"] == 0
        with pytest.raises(RemoteError) as e:
            await client.request(request(client="chunk-as-final"), 10)
        assert e.value.error.code is ErrorCode.INTERNAL and "partial SampleChunk" in e.value.error.message

    run_scoped(body)


def test_a_full_client_queue_drops_chunks_and_the_final_still_arrives():
    """A client that does not read (queues of 2 messages each way, inproc so no kernel buffer
    hides them): the server drops the chunks that find its queue full (counted), parks the
    final reply, and sends it once the client reads; the chunks that got through are in order
    (gaps in ``seq``). A handler that emits faster than the loop sends meets the backlog bound."""
    async def body(scope: Scope) -> None:
        steps = 60
        handler = Streamer(steps=steps)
        server, ep = await scope.serve(handler, f"inproc://stream-full-{os.getpid()}", hwm=2)

        def sync_part():
            with SyncClient(ep, ctx=zmq.Context.shadow(scope.ctx.underlying), hwm=2) as c:
                rid = c.submit(request())  # and read nothing while the stream runs
                wait_for(lambda: server.counters["parked"] == 1, "the final reply to wait for room")
                got: list = []
                final = c.result(rid, 10, on_partial=got.append)
                return got, final

        got, final = await asyncio.to_thread(sync_part)
        assert handler.accepted == [True] * steps  # queued; dropped later, at the socket
        seqs = [m.seq for m in got]
        assert 0 < len(seqs) < steps and seqs == sorted(set(seqs)) and seqs[0] == 0
        dropped = server.counters["stream/dropped/full"]
        assert dropped == steps - len(seqs) == server.counters["stream/dropped"]
        assert server.counters["sent/SampleChunk"] == len(seqs) and server.counters["error/send"] == 0
        assert [t.tolist() for t in final.tokens] == [t.tolist() for t in result(steps).tokens]

        # The backlog bound: 10 chunks emitted on the loop before it can send any.
        async def burst(msg):
            emit = server2.emitter()
            return SampleResult(tokens=[], logprobs=[], stop_reasons=[], adapter_version=-1,
                                batch_id=sum(emit(chunk(s)) for s in range(10)))

        server2, ep2 = await scope.serve(burst, stream_backlog=4)
        client = scope.client(ep2)
        got2: list = []
        reply = await client.request(request(), 10, on_partial=got2.append)
        assert reply.batch_id == 4 and [m.seq for m in got2] == [0, 1, 2, 3]
        assert server2.counters["stream/dropped/backlog"] == 6 == server2.counters["stream/dropped"]

    run_scoped(body)


def test_a_retry_in_flight_shares_the_stream_and_a_lost_peer_s_stream_closes():
    """The same request id sent again while the first still streams: one set of chunks, one
    final reply (nothing replayed). A client that falls silent is dropped after 3 ticks and
    its stream closes, so the producer stops."""
    async def body(scope: Scope) -> None:
        release = asyncio.Event()

        async def handler(msg):
            emit = server.emitter()
            emit(chunk(0))
            await release.wait()
            emit(chunk(1))
            return result(2)

        server, ep = await scope.serve(handler)
        raw = await scope.greeted(ep)
        await raw.send_multipart(encode(request(), 5))
        log = [decode(await asyncio.wait_for(raw.recv_multipart(), 5))]
        await raw.send_multipart(encode(request(), 5))
        await until(lambda: server.counters["dedup"] == 1, "the retry to be recognised")
        release.set()
        kinds = await read_until_final(raw, 5, log, n=10)
        assert kinds == [(5, "SampleChunk"), (5, "SampleChunk"), (5, "SampleResult")]
        assert [m.seq for _, m in log[:2]] == [0, 1]
        assert not await raw.poll(100) and server.counters["recv/SampleRequest"] == 2

        handler2 = Streamer(steps=2000, step_s=0.003, until_closed=True, finish_when_cancelled=True)
        server2, ep2 = await scope.serve(handler2)
        quiet = scope.client(ep2, name="quiet")
        got: list = []
        task = asyncio.ensure_future(quiet.request(request(), 60, on_partial=got.append))
        await until(lambda: len(got) >= 2, "the stream to start")
        assert server2.tick() == [] and server2.tick() == [] and server2.tick() == ["quiet"]
        await until(lambda: handler2.produced.is_set(), "the producer to see the stream closed")
        assert handler2.stopped_at < 2000 and handler2.emitters[0].closed
        task.cancel()

    run_scoped(body)
