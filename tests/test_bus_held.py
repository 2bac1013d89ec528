"""What libzmq holds for a bound socket's connections is bounded (issue #14,
:mod:`opentinker.bus.held`): an authenticated peer that writes ZMTP itself and never sends a
message's last frame is cut once it holds more than the per-connection bound, many peers
together are cut down to the total bound, a well-behaved peer's traffic is accounted to the
byte and never cut, and the server keeps serving."""

from __future__ import annotations

import asyncio
import logging
import socket
import struct
import threading

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from conftest import run, until

from opentinker.bus import Client, LoopThread, Puller, Pusher, RemoteError, Server
from opentinker.bus.auth import run_secret, run_user, secure_client
from opentinker.bus.common import CurveKeys, frame_cap
from opentinker.bus.held import (
    SLACK,
    HeldWatch,
    per_connection_bound,
    supported,
    wire_bytes,
)
from protocols.codec import Limits
from protocols.messages import PROTOCOL_VERSION, Ack, Heartbeat, LogprobsResult

pytestmark = pytest.mark.skipif(not supported(), reason="TCP_INFO byte counts are Linux's")

MAX_BYTES = 1 << 20
LIMITS = Limits(max_bytes=MAX_BYTES)
PER = per_connection_bound(MAX_BYTES, frame_cap(MAX_BYTES))
MIB = b"\0" * (1 << 20)


def _command(name: bytes, data: bytes) -> bytes:
    body = bytes([len(name)]) + name + data
    return bytes([0x04, len(body)]) + body if len(body) < 256 else b"\x06" + struct.pack(">Q", len(body)) + body


def _exactly(s: socket.socket, n: int) -> bytes:
    """``n`` bytes (a socket with a timeout ignores ``MSG_WAITALL``)."""
    got = b""
    for _ in range(n):
        if len(got) == n:
            break
        more = s.recv(n - len(got))
        assert more, f"connection closed after {len(got)} of {n} bytes"
        got += more
    return got


def _read_command(s: socket.socket) -> bytes:
    flags = _exactly(s, 1)[0]
    size = _exactly(s, 1)[0] if flags & 0x02 == 0 else struct.unpack(">Q", _exactly(s, 8))[0]
    return _exactly(s, size)


def zmtp_plain(endpoint: str, socket_type: bytes, source: str = "") -> socket.socket:
    """A peer that speaks ZMTP 3.0 with PLAIN itself (the run's user and secret, so it is
    authenticated), as a ``socket_type`` socket, from the loopback address ``source`` (default:
    the OS's choice): unlike libzmq, it can send a message's frames and never its last one."""
    host, port = endpoint.removeprefix("tcp://").rsplit(":", 1)
    s = socket.create_connection((host, int(port)), timeout=10, source_address=(source, 0) if source else None)
    s.sendall(b"\xff" + b"\0" * 8 + b"\x7f\x03\x00" + b"PLAIN".ljust(20, b"\0") + b"\0" + b"\0" * 31)
    assert _exactly(s, 64)[12:17] == b"PLAIN"
    user, secret = run_user().encode(), run_secret()
    s.sendall(_command(b"HELLO", bytes([len(user)]) + user + bytes([len(secret)]) + secret))
    assert _read_command(s).startswith(b"\x07WELCOME")
    s.sendall(_command(b"INITIATE", b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type))
    assert _read_command(s).startswith(b"\x05READY")
    return s


def send_unfinished(s: socket.socket, mib: int, frame: int = 1 << 20) -> None:
    """``mib`` MiB in frames of ``frame`` bytes, each with MORE set: a message that never ends."""
    data = MIB[:frame]
    for _ in range((mib << 20) // frame):
        s.sendall(b"\x03" + struct.pack(">Q", len(data)) + data)


def cut_off(s: socket.socket) -> bool:
    """Whether the other side closed the connection (within the socket's timeout)."""
    try:
        return s.recv(1) == b""
    except ConnectionError:
        return True


async def ack_server(ctx: zmq.asyncio.Context, name: str) -> tuple[Server, str, HeldWatch]:
    """A server of ``LIMITS`` answering ``Ack``; its endpoint and its watch."""

    async def handler(msg):
        return Ack()

    server = Server(handler, name=name, limits=LIMITS, heartbeat_s=None)
    ep = await server.start(ctx)
    assert server._io.watch is not None
    return server, ep, server._io.watch


def test_wire_bytes_counts_each_frames_zmtp_header():
    frames = [zmq.Frame(b"id"), zmq.Frame(b"x" * 255), zmq.Frame(b"x" * 256)]
    assert wire_bytes(frames) == 2 + 2 + 255 + 2 + 256 + 9
    assert wire_bytes(frames, skip=1) == 255 + 2 + 256 + 9
    # CURVE: a MESSAGE command of 33 bytes more around each frame
    assert wire_bytes(frames, skip=1, curve=True) == (255 + 33 + 9) + (256 + 33 + 9)
    assert wire_bytes([zmq.Frame(b"x" * 222)], curve=True) == 222 + 33 + 2


@pytest.mark.parametrize("curve", [False, True], ids=["plain", "curve"])
def test_a_long_lived_connection_is_accounted_to_the_byte(curve):
    """What libzmq read from a client's connection less the wire bytes of its messages is its
    handshake, and stays exactly that over 1,500 requests of small and large frames and a few
    over the server's limits (read frame by frame and dropped; on CURVE too, where each frame
    travels in a MESSAGE command): no drift that a long-lived connection could add up to a cut."""

    async def main():
        ctx = zmq.asyncio.Context()

        async def handler(msg):
            return Ack()

        keys = CurveKeys.generate() if curve else None
        server = Server(handler, name="accounted", heartbeat_s=None, keys=keys,
                        limits=Limits(max_bytes=1 << 20, max_buffers=8))
        ep = await server.start(ctx)
        watch = server._io.watch
        assert watch is not None and watch.curve is curve
        client = Client(ctx, ep, name="long", heartbeat_s=None,
                        keys=CurveKeys.generate().client_of(keys) if curve else None)
        assert isinstance(await client.request(Heartbeat(seq=0), 10), Heartbeat)
        (first,) = watch.excess().values()
        assert 0 < first < 4096  # the handshake
        for i in range(1500):
            msg = Heartbeat(seq=i) if i % 10 else LogprobsResult(logprobs=[np.full(1000 + i, i, np.float32)],
                                                                 adapter_version=i)
            await client.request(msg, 10)
            if i % 300 == 0:  # over the limits: 21 arrays (too many frames), 3 x 400 KB (too many bytes)
                for n, size in ((21, 50 + i), (3, 100_000)):
                    with pytest.raises(RemoteError, match="too_large"):
                        await client.request(LogprobsResult(logprobs=[np.zeros(size, np.float32)] * n,
                                                            adapter_version=i), 10)
        assert server.counters["dropped/too_many_frames"] == 5 and server.counters["dropped/too_many_bytes"] == 5
        assert list(watch.excess().values()) == [first]
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main(), timeout=120)


def test_an_unfinished_message_over_the_bound_is_cut_and_the_server_serves_on(caplog):
    """An authenticated peer sends 3x the per-connection bound of frames and never the last:
    within two checks of passing the bound its connection is cut (counted, one log line),
    while a well-behaved peer's messages near ``max_bytes`` are accounted to the byte and never
    cut, and its requests are answered afterwards."""

    async def main():
        ctx = zmq.asyncio.Context()
        server, ep, watch = await ack_server(ctx, "held")
        assert watch.per_connection == PER and watch.total == 4 * PER
        client = Client(ctx, ep, name="good", heartbeat_s=None)
        assert isinstance(await client.request(Heartbeat(seq=1), 5), Heartbeat)
        attacker = await asyncio.to_thread(zmtp_plain, ep, b"DEALER")
        sender = asyncio.create_task(asyncio.to_thread(send_unfinished, attacker, 3 * PER >> 20))
        for i in range(8):  # while it sends: messages of 0.9 MiB from a libzmq peer (each refused: no Hello)
            good = ctx.socket(zmq.DEALER)
            secure_client(good)
            good.connect(ep)
            await good.send_multipart([msgspec.msgpack.encode([PROTOCOL_VERSION, i, 1]),
                                       msgspec.msgpack.encode({"type": "Ack"}), b"\0" * 900_000])
            assert await good.poll(5000)
            await good.recv_multipart()
            # Every connection but the attacker's: what was read of it is its handshake and messages.
            excess = sorted(watch.excess().values())
            assert len(excess) >= 2 and excess[-2] < 4096, excess
            good.close(0)
        await sender
        await until(lambda: server.counters["dropped/held_connections"] == 1, "the cut", n=1000)
        assert server.counters["dropped/held_bytes"] > PER
        assert await asyncio.to_thread(cut_off, attacker)
        assert max(watch.held().values(), default=0) < SLACK
        assert isinstance(await client.request(Heartbeat(seq=2), 5), Heartbeat)
        assert server.counters["error/internal"] == 0
        attacker.close()
        client.close()
        await server.stop()
        ctx.destroy(0)

    with caplog.at_level(logging.WARNING, logger="opentinker.bus.held"):
        run(main(), timeout=60)
    cuts = [r.getMessage() for r in caplog.records if "cut the connection" in r.getMessage()]
    assert len(cuts) == 1 and "unfinished message" in cuts[0], cuts


def test_peers_each_under_the_bound_are_cut_down_to_the_total():
    """Seven peers (each from its own loopback address) each hold 3 MiB unfinished (under the
    per-connection bound of 4 MiB), 21 MiB in all against a total bound of 16 MiB: two are cut,
    and the five left (15 MiB) keep their connections."""

    async def main():
        ctx = zmq.asyncio.Context()
        server, ep, watch = await ack_server(ctx, "held_total")
        peers = [await asyncio.to_thread(zmtp_plain, ep, b"DEALER", f"127.0.0.{2 + i}") for i in range(7)]
        for p in peers:
            await asyncio.to_thread(send_unfinished, p, 3)
        await until(lambda: server.counters["dropped/held_connections"] >= 2, "two cuts", n=1000)
        for _ in range(5):  # a few more checks: nothing more is cut once the rest fit
            await asyncio.sleep(watch.interval_s)
        held = watch.held()
        assert server.counters["dropped/held_connections"] == 2
        assert len(held) == 5 and sum(held.values()) <= watch.total
        closed = [await asyncio.to_thread(cut_off_soon, p) for p in peers]
        assert sum(closed) == 2
        for p in peers:
            p.close()
        await server.stop()
        ctx.destroy(0)

    run(main(), timeout=60)


def test_one_peers_connections_are_cut_down_to_the_per_peer_bound():
    """The attack: five connections of one peer each held 400 MB unfinished, under the
    per-connection bound, 2,002 MB in all under the total of 2,056 MB, for as long as they
    stayed open. Scaled: five connections from 127.0.0.2 each hold 3 MiB (per-connection bound
    4 MiB, 15 MiB under the total of 16 MiB): they are cut down to the per-peer bound of 8 MiB
    (three cut, two kept), and another peer's 3 MiB (from 127.0.0.3) is left alone."""

    async def main():
        ctx = zmq.asyncio.Context()
        server, ep, watch = await ack_server(ctx, "held_peer")
        assert watch.per_peer == 2 * watch.per_connection and 15 << 20 < watch.total
        mine = [await asyncio.to_thread(zmtp_plain, ep, b"DEALER", "127.0.0.2") for _ in range(5)]
        other = await asyncio.to_thread(zmtp_plain, ep, b"DEALER", "127.0.0.3")
        for p in [*mine, other]:
            await asyncio.to_thread(send_unfinished, p, 3)
        await until(lambda: server.counters["dropped/held_connections"] >= 3, "three cuts", n=1000)
        for _ in range(5):  # a few more checks: nothing more is cut once each peer fits
            await asyncio.sleep(watch.interval_s)
        assert server.counters["dropped/held_connections"] == 3
        closed = [await asyncio.to_thread(cut_off_soon, p) for p in mine]
        assert sum(closed) == 3 and not await asyncio.to_thread(cut_off_soon, other)
        held = watch.held()
        assert len(held) == 3 and sum(held.values()) <= 2 * watch.per_peer
        for p in [*mine, other]:
            p.close()
        await server.stop()
        ctx.destroy(0)

    run(main(), timeout=60)


def cut_off_soon(s: socket.socket) -> bool:
    """Whether the connection is closed, looking for at most 0.2 s."""
    s.settimeout(0.2)
    try:
        return cut_off(s)
    except TimeoutError:
        return False


def test_a_pullers_pushers_are_watched_too():
    """A puller (a learner's trajectory intake) cuts a pusher that holds an unfinished message
    over the bound, and takes the next well-behaved message."""

    async def main():
        ctx = zmq.asyncio.Context()
        puller = Puller(ctx, limits=LIMITS)
        receiving = asyncio.create_task(puller.recv())
        attacker = await asyncio.to_thread(zmtp_plain, puller.endpoint, b"PUSH")
        await asyncio.to_thread(send_unfinished, attacker, 2 * PER >> 20)
        await until(lambda: puller.counters["dropped/held_connections"] == 1, "the cut", n=1000)
        assert await asyncio.to_thread(cut_off, attacker)
        pusher = Pusher(ctx, puller.endpoint)
        sent = Heartbeat(seq=5)
        await pusher.send(sent)
        assert await asyncio.wait_for(receiving, 5) == sent
        attacker.close()
        pusher.close()
        puller.close()
        ctx.destroy(0)

    run(main(), timeout=60)


def _router_with_watch(ctx: zmq.Context) -> tuple[zmq.Socket, HeldWatch, str]:
    """A plain ROUTER watched from before its bind, its monitor events read only when the
    watch looks (no loop): the order of events and messages is the test's."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    w = HeldWatch(router, "unit", {}, per_connection=PER, total=4 * PER, router=True)
    router.bind("tcp://127.0.0.1:*")
    return router, w, router.getsockopt_string(zmq.LAST_ENDPOINT)


def test_a_message_read_before_its_connections_event_is_still_counted():
    """The reader can be handed a connection's first message before the watch has read the
    monitor's ACCEPTED event: the message counts, and the event does not reset it."""
    ctx = zmq.Context()
    router, w, ep = _router_with_watch(ctx)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(ep)
    dealer.send_multipart([b"h", b"\0" * 100_000])
    assert router.poll(5000)
    w.read(router.recv_multipart(copy=False), None)
    (excess,) = w.excess().values()
    assert 0 < excess < 4096, excess  # the handshake only
    # More than was read is never credit: what a closed connection's messages would give a
    # new one on the same descriptor.
    fd = next(iter(w._conns))
    w._conns[fd].delivered += 10**9
    assert list(w.excess().values()) == [0]
    w.close()
    for s in (dealer, router):
        s.close(0)
    ctx.term()


def test_unread_monitor_events_never_stall_the_sockets():
    """1,500 connections come and go while nobody reads the monitor (a loop held up): the
    events queue without bound, so libzmq's I/O thread never blocks and a message still
    arrives."""
    ctx = zmq.Context()
    router, w, ep = _router_with_watch(ctx)
    host, port = ep.removeprefix("tcp://").rsplit(":", 1)
    for _ in range(1500):
        socket.create_connection((host, int(port)), timeout=5).close()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(ep)
    dealer.send_multipart([b"still", b"here"])
    assert router.poll(10_000), "the I/O thread stalled"
    assert router.recv_multipart()[1:] == [b"still", b"here"]
    w.close()
    for s in (dealer, router):
        s.close(0)
    ctx.term()


def test_a_puller_whose_owner_is_not_reading_cuts_nobody():
    """A pusher's complete messages queue while the puller's owner is busy (no ``recv()``):
    more than the bound waits, yet nobody is cut, and every message is then received."""

    async def main():
        ctx = zmq.asyncio.Context()
        puller = Puller(ctx, limits=LIMITS)
        watch = puller._watch
        assert watch is not None and watch.follows_reader
        pusher = Pusher(ctx, puller.endpoint)
        sent = [LogprobsResult(logprobs=[np.full(25_000, i, np.float32)], adapter_version=i) for i in range(60)]
        for m in sent:  # 6 MB of complete messages, past the 4 MiB bound
            await pusher.send(m)
        await until(lambda: max(watch.held().values(), default=0) > PER, "the queue past the bound", n=1000)
        for _ in range(5):  # checks run meanwhile: the reader is away, so none cuts
            await asyncio.sleep(watch.interval_s)
        got = [await asyncio.wait_for(puller.recv(), 10) for _ in sent]
        assert [m.adapter_version for m in got] == list(range(60))
        assert puller.counters["dropped/held_connections"] == 0
        pusher.close()
        puller.close()
        ctx.destroy(0)

    run(main(), timeout=60)


def test_a_puller_closes_from_another_thread_while_its_loop_runs():
    """A learner stops its puller from the driver's thread: the watch is closed on the loop
    it runs on, and the loop goes on."""
    lt = LoopThread("held-close")

    async def make() -> Puller:
        p = Puller(lt.ctx, limits=LIMITS)
        asyncio.ensure_future(p.recv())
        return p

    puller = lt.run(make(), timeout=10)
    assert puller._watch is not None
    puller.close()
    assert puller._watch._closed
    assert lt.run(asyncio.sleep(0, result="alive"), timeout=10) == "alive"
    assert puller.counters["error/internal"] == 0
    lt.stop()


def test_stop_lets_every_cancelled_task_finish():
    """A task cancelled at shutdown while it awaits a gather must finish before the loop stops:
    else it is destroyed pending ("Task was destroyed but it is pending!" on stderr at exit)."""
    lt = LoopThread("stopping")
    started = threading.Event()

    async def inner() -> None:
        await asyncio.sleep(100)

    async def outer() -> None:
        started.set()
        try:
            await asyncio.gather(inner(), inner())
        finally:  # cleanup that takes a few turns of the loop, as a coordinator's step does
            for _ in range(20):
                await asyncio.sleep(0)

    asyncio.run_coroutine_threadsafe(outer(), lt.loop)
    assert started.wait(5)

    async def tasks() -> set:
        return {t for t in asyncio.all_tasks() if t is not asyncio.current_task()}

    pending = lt.run(tasks(), timeout=5)
    assert len(pending) == 3
    lt.stop()
    assert all(t.done() for t in pending), [t for t in pending if not t.done()]
