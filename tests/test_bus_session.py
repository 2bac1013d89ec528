"""The bus session: handshake and version check, sync client, cancellation, heartbeats and
PeerLost (counted in ticks, never timed), bounded work, endpoints, CURVE, shutdown."""

from __future__ import annotations

import asyncio
import os
import tempfile
import time

import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio
from conftest import run, until

from opentinker.bus.auth import guard_server, secure_client
from opentinker.bus import (
    Client,
    CurveKeys,
    PeerLost,
    ProtocolMismatch,
    RemoteError,
    Server,
    SyncClient,
    check_bind,
    is_loopback,
)
from protocols.codec import decode, encode
from protocols.messages import (
    PROTOCOL_VERSION,
    Ack,
    AdamParams,
    ErrorCode,
    Hello,
    LogprobsResult,
    OptimStep,
    OptimStepResult,
    Shutdown,
    Welcome,
)


def step(name: str = "a") -> OptimStep:
    return OptimStep(adapter=name, params=AdamParams())


class Gate:
    """A handler that answers OptimStep with a count once ``release`` is set, and records
    how many requests ran at once and which were cancelled."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.running = 0
        self.peak = 0
        self.applied: list[str] = []
        self.cancelled = 0

    async def __call__(self, msg):
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        finally:
            self.running -= 1
        if isinstance(msg, OptimStep):
            self.applied.append(msg.adapter)
            return OptimStepResult(version=len(self.applied), grad_norm=0.0)
        return msg if isinstance(msg, LogprobsResult) else Ack()


def old_peer_frames(msg, rid: int, version: int = PROTOCOL_VERSION - 1) -> list[bytes]:
    frames = encode(msg, rid)
    header = msgspec.msgpack.encode([version, rid, len(frames) - 2])
    return [header, *(bytes(memoryview(f)) for f in frames[1:])]


def test_handshake_and_version_mismatch_on_both_sides():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        gate.release.set()
        server = Server(gate, heartbeat_s=None, name="srv")
        ep = await server.start(ctx)
        client = Client(ctx, ep, name="me", heartbeat_s=None)
        welcome = await client.connect(5)
        assert welcome == Welcome(version=PROTOCOL_VERSION, peer="srv", heartbeat_s=0.0)
        assert server.peers == {"me": 0} and server.counters["handshakes"] == 1
        # A peer of another version, saying Hello: the server refuses it and counts it.
        raw = ctx.socket(zmq.DEALER)
        secure_client(raw)
        raw.connect(ep)
        await raw.send_multipart(old_peer_frames(Hello(version=PROTOCOL_VERSION - 1, peer="old"), 7))
        rid, err = decode(await asyncio.wait_for(raw.recv_multipart(), 5))
        assert rid == 7 and err.code is ErrorCode.BAD_VERSION
        assert f"peer speaks protocol {PROTOCOL_VERSION - 1}, this side {PROTOCOL_VERSION}" in err.message
        assert server.counters["error/bad_version"] == 1 and "old" not in server.peers
        # A request before Hello is refused.
        await raw.send_multipart(encode(step(), 8))
        rid, err = decode(await asyncio.wait_for(raw.recv_multipart(), 5))
        assert (rid, err.code) == (8, ErrorCode.NO_HANDSHAKE) and server.counters["error/no_handshake"] == 1
        # The client's side of a mismatch: an old server answers with its own header version.
        old = ctx.socket(zmq.ROUTER)
        old_guard = guard_server(old, "old", {})  # it checks the run's secret, as every server does
        port = old.bind_to_random_port("tcp://127.0.0.1")
        stale = Client(ctx, f"tcp://127.0.0.1:{port}", heartbeat_s=None)
        pending = asyncio.ensure_future(stale.request(step(), 5))
        ident, *frames = await asyncio.wait_for(old.recv_multipart(), 5)
        hello_rid, hello = decode(frames)
        assert isinstance(hello, Hello) and hello.version == PROTOCOL_VERSION
        await old.send_multipart([ident, *old_peer_frames(Welcome(version=PROTOCOL_VERSION - 1), hello_rid)])
        with pytest.raises(ProtocolMismatch, match=f"peer speaks protocol {PROTOCOL_VERSION - 1}"):
            await pending
        for s in (raw, old):
            s.close(0)
        old_guard.close()
        stale.close()
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_sync_client_pipelines_and_its_timeout_cancels_on_the_server():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None)
        ep = await server.start(ctx)

        def sync_part():
            with SyncClient(ep, name="sync") as c:
                assert c.welcome.version == PROTOCOL_VERSION
                with pytest.raises(TimeoutError, match="no reply"):
                    c.request(step("never"), timeout=0.3)
                for _ in range(500):  # the Cancel reaches the server before the gate opens
                    if server.counters["cancelled"]:
                        break
                    time.sleep(0.01)
                rids = [c.submit(step(f"s{i}")) for i in range(8)]
                loop.call_soon_threadsafe(gate.release.set)
                versions = [c.result(r, timeout=10).version for r in reversed(rids)]
                assert sorted(versions) == list(range(1, 9))
                with pytest.raises(KeyError, match="not submitted"):
                    c.result(rids[0])
                return c.counters.snapshot()

        loop = asyncio.get_running_loop()
        counters = await asyncio.to_thread(sync_part)
        assert counters["sent/Cancel"] == 1 and counters["recv/OptimStepResult"] == 8
        await until(lambda: gate.cancelled == 1, "the timed-out request to be cancelled")
        assert server.counters["cancelled"] == 1 and "never" not in gate.applied
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_cancelled_request_is_cancelled_on_the_server_and_a_retry_applies_it_once():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None)
        client = Client(ctx, await server.start(ctx), heartbeat_s=None)
        rid = client.next_request_id()
        task = asyncio.ensure_future(client.request(step("x"), 10, request_id=rid))
        await until(lambda: gate.running == 1, "the request to start")
        task.cancel()
        await until(lambda: gate.cancelled == 1, "the server-side cancellation")
        assert server.counters["cancelled"] == 1 and client.counters["sent/Cancel"] == 1
        # The cancelled state-changing request never applied, so its retry does, once.
        gate.release.set()
        first = await client.request(step("x"), 10, request_id=rid)
        again = await client.request(step("x"), 10, request_id=rid)
        assert first == again == OptimStepResult(version=1, grad_norm=0.0)
        assert gate.applied == ["x"] and server.counters["dedup"] == 1
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_a_dead_server_is_noticed_in_three_heartbeats_and_pending_requests_fail():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None)
        client = Client(ctx, await server.start(ctx), heartbeat_s=None)
        await client.connect(5)
        # While the server answers, ticks never add up to a loss.
        for i in range(6):
            assert client.tick() is False
            await until(lambda n=i + 1: client.counters["recv/Heartbeat"] == n, "a heartbeat reply")
        assert client.beats.missed == 0
        pending = asyncio.ensure_future(client.request(step(), 60))
        await until(lambda: gate.running == 1, "the request to start")
        await server.stop()  # the server dies with the request in flight
        assert client.tick() is False and client.tick() is False
        await asyncio.sleep(0)
        assert not pending.done()
        assert client.tick() is True
        with pytest.raises(PeerLost, match="3 heartbeats"):
            await pending
        assert client.counters["peer_lost"] == 1
        client.close()
        ctx.destroy(0)

    run(main())


def test_a_silent_client_is_dropped_in_three_ticks_and_its_requests_cancelled():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None)
        ep = await server.start(ctx)
        client = Client(ctx, ep, name="quiet", heartbeat_s=None)
        task = asyncio.ensure_future(client.request(step(), 60))
        await until(lambda: gate.running == 1, "the request to start")
        assert server.tick() == [] and server.tick() == []
        assert server.tick() == ["quiet"]
        await until(lambda: gate.cancelled == 1, "the dropped peer's request to be cancelled")
        assert server.counters["peer_lost"] == 1 and server.peers == {}
        task.cancel()
        # The dropped client says Hello again by itself on its next request.
        gate.release.set()
        assert isinstance(await client.request(step(), 10), OptimStepResult)
        assert server.counters["handshakes"] == 2 and server.counters["error/no_handshake"] >= 1
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_sync_client_notices_a_dead_server():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None)
        ep = await server.start(ctx)
        c = await asyncio.to_thread(SyncClient, ep, heartbeat_s=0.05)
        rid = c.submit(step())
        await until(lambda: gate.running == 1, "the request to start")
        await server.stop()
        with pytest.raises(PeerLost):
            await asyncio.to_thread(c.result, rid, 30)
        assert c.counters["sent/Heartbeat"] == 2 and c.counters["peer_lost"] == 1
        with pytest.raises(PeerLost):  # saying Hello again to the dead server
            await asyncio.to_thread(c.connect, 30)
        assert c._outstanding == {rid: step()} and set(c._sent_at) == {rid}  # nothing kept of the Hello
        c.close()
        ctx.destroy(0)

    run(main())


def test_a_sync_client_waiting_on_many_replies_stays_alive_on_the_server():
    """Replies keep arriving (one every 0.05 s) while the client sends nothing: it must still
    send a frame every heartbeat, or the server counts it lost and cancels the rest."""
    async def main():
        ctx = zmq.asyncio.Context()

        async def slow(msg):
            await asyncio.sleep(0.05 * int(msg.adapter))
            return Ack()

        server = Server(slow, heartbeat_s=None)
        ep = await server.start(ctx)
        c = await asyncio.to_thread(SyncClient, ep, heartbeat_s=0.1)
        rids = [c.submit(OptimStep(adapter=str(i), params=AdamParams())) for i in range(1, 41)]

        def wait_all() -> list:
            return [c.result(r, 30) for r in rids]

        waiting = asyncio.ensure_future(asyncio.to_thread(wait_all))
        for _ in range(40):  # the server's heartbeat clock: 3 ticks without a frame lose a peer
            if waiting.done():
                break
            await asyncio.sleep(0.1)
            assert server.tick() == [], "the waiting client was counted lost"
        assert all(isinstance(r, Ack) for r in await waiting)
        assert c.counters["sent/Heartbeat"] >= 5
        c.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_bounded_work_on_both_sides():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None, max_inflight=3)
        ep = await server.start(ctx)
        client = Client(ctx, ep, heartbeat_s=None)
        tasks = [asyncio.ensure_future(client.request(step(f"b{i}"), 10)) for i in range(6)]
        await until(lambda: server.counters["error/busy"] == 3, "three busy replies")
        gate.release.set()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        busy = [r for r in results if isinstance(r, RemoteError)]
        assert len(busy) == 3 and all(r.error.code is ErrorCode.BUSY for r in busy)
        assert gate.peak == 3
        # A client with 2 slots never has more than 2 requests at the server.
        gate2 = Gate()
        gate2.release.set()
        server2 = Server(gate2, heartbeat_s=None)
        narrow = Client(ctx, await server2.start(ctx), heartbeat_s=None, max_inflight=2)
        await asyncio.gather(*(narrow.request(step(f"n{i}"), 10) for i in range(12)))
        assert gate2.peak <= 2 and len(gate2.applied) == 12
        for c in (client, narrow):
            c.close()
        await server.stop()
        await server2.stop()
        ctx.destroy(0)

    run(main())


def test_oversized_message_gets_too_large_and_the_server_keeps_serving():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        gate.release.set()
        server = Server(gate, heartbeat_s=None, max_bytes=4096)
        client = Client(ctx, await server.start(ctx), heartbeat_s=None)
        big = LogprobsResult(logprobs=[np.zeros(2048, np.float32)], adapter_version=0)
        with pytest.raises(RemoteError) as e:
            await client.request(big, 10)
        assert e.value.error.code is ErrorCode.TOO_LARGE and server.counters["error/too_large"] == 1
        small = LogprobsResult(logprobs=[np.arange(8, dtype=np.float32)], adapter_version=3)
        echoed = await client.request(small, 10)
        assert np.array_equal(echoed.logprobs[0], small.logprobs[0])
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


@pytest.mark.parametrize("transport", ["ipc", "inproc"])
def test_ipc_and_inproc_endpoints_with_both_clients(transport):
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        gate.release.set()
        tmp = tempfile.mkdtemp(prefix="otbus-")
        bind = f"ipc://{os.path.join(tmp, 's.sock')}" if transport == "ipc" else f"inproc://bus-{os.getpid()}"
        server = Server(gate, bind, heartbeat_s=None)
        ep = await server.start(ctx)
        assert ep.startswith(f"{transport}://")
        client = Client(ctx, ep, heartbeat_s=None)
        arr = np.arange(1000, dtype=np.float32)
        got = await client.request(LogprobsResult(logprobs=[arr], adapter_version=1), 10)
        assert np.array_equal(got.logprobs[0], arr)
        sync_ctx = zmq.Context.shadow(ctx.underlying)  # inproc needs the server's context

        def sync_part():
            with SyncClient(ep, ctx=sync_ctx) as c:
                return c.request(step("s"), 10)

        assert (await asyncio.to_thread(sync_part)).version == 1
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_refuses_to_bind_a_non_loopback_address_without_keys():
    assert is_loopback("tcp://127.0.0.1:*") and is_loopback("tcp://[::1]:5555")
    assert is_loopback("tcp://localhost:1") and is_loopback("ipc:///tmp/x") and is_loopback("inproc://x")
    assert not is_loopback("tcp://0.0.0.0:*") and not is_loopback("tcp://*:5555")
    assert not is_loopback("tcp://10.0.0.2:5555") and not is_loopback("tcp://eth0:5555")
    for ep in ("tcp://0.0.0.0:*", "tcp://*:5555", "tcp://192.168.1.4:7000"):
        with pytest.raises(ValueError, match=f"refusing to bind {ep.replace('*', '[*]')} without CURVE keys"):
            Server(Gate(), ep)
    with pytest.raises(ValueError, match="the bus speaks tcp://, ipc://, inproc://"):
        check_bind("udp://127.0.0.1:1", None)
    check_bind("tcp://0.0.0.0:*", CurveKeys.generate())  # with keys it may


def test_curve_encrypts_and_authenticates():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        gate.release.set()
        server_keys, alice, mallory = CurveKeys.generate(), CurveKeys.generate(), CurveKeys.generate()
        server = Server(gate, heartbeat_s=None, keys=server_keys.allowing(alice), name="vault")
        ep = await server.start(ctx)
        ok = Client(ctx, ep, keys=alice.client_of(server_keys), heartbeat_s=None)
        assert (await ok.request(step(), 10)).version == 1
        # Not on the allow list, or not speaking CURVE at all: never served.
        for keys in (mallory.client_of(server_keys), None):
            stranger = Client(ctx, ep, keys=keys, heartbeat_s=None)
            with pytest.raises(TimeoutError):
                await stranger.request(step("no"), 0.5)
            stranger.close()
        assert "no" not in gate.applied and server.counters["handshakes"] == 1
        ok.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_shutdown_is_obeyed_only_from_an_owner_then_the_server_stops():
    async def main():
        ctx = zmq.asyncio.Context()
        called = []
        server = Server(Gate(), heartbeat_s=None, on_shutdown=lambda: called.append(1), owners={"driver"})
        ep = await server.start(ctx)
        stranger = Client(ctx, ep, name="learner", heartbeat_s=None)
        with pytest.raises(RemoteError, match=r"Shutdown is only for its owners \(\['driver'\]\), not 'learner'"):
            await stranger.request(Shutdown(reason="not mine"), 10)
        assert not server.stopped.is_set() and server.counters["error/not_owner"] == 1
        stranger.close()
        client = Client(ctx, ep, name="driver", heartbeat_s=None)
        assert isinstance(await client.request(Shutdown(reason="test"), 10), Ack)
        await asyncio.wait_for(server.stopped.wait(), 5)
        assert called == [1]
        with pytest.raises(TimeoutError):
            await client.request(step(), 0.3)
        client.close()
        ctx.destroy(0)

    run(main())


def test_request_timeouts_share_one_timer_and_finished_requests_are_dropped():
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        gate.release.set()
        server = Server(gate, heartbeat_s=None)
        client = Client(ctx, await server.start(ctx), heartbeat_s=None)
        for i in range(3000):  # finished requests never pile up in the deadline heap
            await client.request(step(f"t{i}"), 600)
        assert len(client._deadlines.heap) <= 1024
        gate.release.clear()
        slow = [asyncio.ensure_future(client.request(step(f"late{i}"), 0.2 + 0.1 * i)) for i in range(3)]
        done = await asyncio.gather(*slow, return_exceptions=True)
        assert all(isinstance(d, TimeoutError) for d in done), done
        assert client.counters["sent/Cancel"] == 3
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_a_cancel_read_with_its_request_reaches_the_handler():
    """Request and Cancel arrive in one drain (the client timed out while the server was
    busy): the handler is cancelled before its task's first step and the slot is freed; a
    retry arriving while its first attempt still waits is answered once, applied once."""
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None, max_inflight=2)
        ep = await server.start(ctx)
        raw = zmq.Context.shadow(ctx.underlying).socket(zmq.DEALER)
        raw.setsockopt(zmq.LINGER, 0)
        secure_client(raw)
        raw.connect(ep)
        raw.send_multipart(encode(Hello(version=PROTOCOL_VERSION, peer="raw"), 1))
        await until(lambda: server.counters["handshakes"] == 1, "the handshake")
        from protocols.messages import Cancel
        raw.send_multipart(encode(step("gone"), 7))  # both queued before the server reads either
        raw.send_multipart(encode(Cancel(request_id=7), 8))
        await until(lambda: gate.cancelled == 1, "the handler to be cancelled")
        await until(lambda: server._running == 0, "the slot to be freed")
        assert server.peers == {"raw": 0} and gate.applied == []
        # A retry that arrives while the first is still waiting is answered by the first.
        raw.send_multipart(encode(step("y"), 20))
        raw.send_multipart(encode(step("y"), 20))
        await until(lambda: server.counters["dedup"] == 1, "the retry to be recognised")
        gate.release.set()
        await until(lambda: gate.applied == ["y"], "the request to be applied")
        replies = []
        for _ in range(100):
            while raw.poll(0):
                replies.append(decode(raw.recv_multipart()))
            if any(r == 20 for r, _ in replies):
                break
            await asyncio.sleep(0.01)
        assert [type(m).__name__ for r, m in replies if r == 20] == ["OptimStepResult"]
        assert gate.applied == ["y"] and server._running == 0
        raw.close(0)
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_try_send_drops_when_nobody_reads_and_close_fails_pending_requests():
    async def main():
        from opentinker.bus import Pusher

        ctx = zmq.asyncio.Context()
        pusher = Pusher(ctx, "tcp://127.0.0.1:9", hwm=2)  # nothing listens there
        sent = [pusher.try_send(step()) for _ in range(6)]
        assert sent.count(True) <= 2 and pusher.dropped >= 4 and not sent[-1]
        pusher.close()
        gate = Gate()
        server = Server(gate, heartbeat_s=None)
        client = Client(ctx, await server.start(ctx), heartbeat_s=None, max_inflight=1)
        flying = asyncio.ensure_future(client.request(step("a"), 60))
        waiting = asyncio.ensure_future(client.request(step("b"), 60))
        await until(lambda: gate.running == 1, "the first request to start")
        client.close()
        for task in (flying, waiting):
            with pytest.raises(ConnectionError, match="closed"):
                await task
        with pytest.raises(ConnectionError, match="closed"):
            await client.request(step("c"), 1)
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_a_client_polls_for_fast_replies_and_keeps_its_loop_serving():
    """With ``spin_s`` the client reads a reply by polling at each loop turn: here its socket's
    descriptor is not watched at all, so nothing else could read the reply. Other tasks run
    meanwhile, and the polling ends with the last pending request. With ``spin_s=0`` the same
    reply is never read (the request times out)."""
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None)
        ep = await server.start(ctx)
        client = Client(ctx, ep, heartbeat_s=None, spin_s=30.0)
        await client.connect(5)
        client._io.loop.remove_reader(client._io._fd)  # only the polling can read replies now
        spins = client.counters["spins"]
        task = asyncio.ensure_future(client.request(step("a"), 10))
        await until(lambda: gate.running == 1, "the request to start")
        turns = 0
        for _ in range(100):  # the loop keeps serving other tasks while the client polls
            await asyncio.sleep(0)
            turns += 1
        assert turns == 100 and not task.done() and client._spinning
        gate.release.set()
        assert await task == OptimStepResult(version=1, grad_norm=0.0)
        await until(lambda: not client._spinning, "the polling to stop")
        assert client.counters["spins"] == spins + 1 and client.counters["recv/OptimStepResult"] == 1

        park = Client(ctx, ep, heartbeat_s=None, spin_s=0.0)
        await park.connect(5)
        park._io.loop.remove_reader(park._io._fd)
        with pytest.raises(TimeoutError, match="no reply"):
            await park.request(step("b"), 0.3)
        assert park.counters["spins"] == 0 and park.counters["recv/OptimStepResult"] == 0
        for c in (client, park):
            c.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_a_client_does_not_poll_for_message_types_slower_than_spin_s():
    """Each message type's round trips are averaged; once the average is above ``spin_s`` the
    client waits on the descriptor at once (slow requests cost no CPU while they wait)."""
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        gate.release.set()
        server = Server(gate, heartbeat_s=None)
        client = Client(ctx, await server.start(ctx), heartbeat_s=None, spin_s=1e-9)
        for i in range(5):
            assert (await client.request(step(f"q{i}"), 10)).version == i + 1
        # Polled once for Hello and once for the first OptimStep, then never again.
        assert client.counters["spins"] == 2
        assert client.polling.rtt[OptimStep] > 1e-9 and client.polling.rtt[Hello] > 1e-9
        for bad in (-1.0, float("nan"), float("inf")):
            with pytest.raises(ValueError, match="spin_s"):
                Client(ctx, "inproc://x", spin_s=bad)
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_sync_client_polls_for_fast_replies_only():
    """The blocking client polls (never blocks) for a type whose replies come fast, and stops
    polling for a type whose average round trip is above ``spin_s``; both get every reply."""
    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        gate.release.set()
        server = Server(gate, heartbeat_s=None)
        ep = await server.start(ctx)

        def sync_part():
            with SyncClient(ep, name="fast", spin_s=30.0) as fast, SyncClient(ep, name="slow", spin_s=1e-9) as slow:
                got = [fast.request(step(f"f{i}"), timeout=10).version for i in range(3)]
                assert fast.counters["spins"] == 4 and fast.counters["polled"] == 4  # Hello, each OptimStep
                got += [slow.request(step(f"s{i}"), timeout=10).version for i in range(3)]
                assert slow.counters["spins"] == 2  # Hello and the first OptimStep only
                assert slow.polling.rtt[OptimStep] > 1e-9 and not slow._sent_at and not fast._sent_at
                return got

        assert sorted(await asyncio.to_thread(sync_part)) == list(range(1, 7))
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_polling_stops_with_the_last_polled_for_reply():
    """A slow request (not polled for) still pending does not keep the asyncio client polling
    after a fast reply; the blocking client counts a reply's wait from when its caller began
    waiting, not from the send (a result taken late was not waited for)."""
    release = asyncio.Event()

    async def handler(msg):
        if isinstance(msg, OptimStep):
            await release.wait()
            return OptimStepResult(version=1, grad_norm=0.0)
        return Ack()

    async def main():
        ctx = zmq.asyncio.Context()
        server = Server(handler, heartbeat_s=None)
        ep = await server.start(ctx)
        client = Client(ctx, ep, heartbeat_s=None, spin_s=30.0)
        await client.connect(5)
        client.polling.rtt[OptimStep] = 60.0  # known to be slow: not polled for
        slow = asyncio.ensure_future(client.request(step(), 60))
        await until(lambda: server._running == 1, "the slow request to start")
        assert not client._spinning and client._polled == 0
        assert isinstance(await client.request(LogprobsResult(logprobs=[], adapter_version=0), 10), Ack)
        await until(lambda: not client._spinning, "the polling to stop after the fast reply")
        assert client._polled == 0 and not slow.done()
        release.set()
        assert (await slow).version == 1

        def sync_part():
            with SyncClient(ep, name="late", spin_s=30.0) as c:
                rid = c.submit(LogprobsResult(logprobs=[], adapter_version=0))
                time.sleep(0.05)  # the reply arrives meanwhile
                t = time.perf_counter()
                assert isinstance(c.result(rid, 10), Ack)
                took = time.perf_counter() - t
                return c.polling.rtt[LogprobsResult], took

        waited, took = await asyncio.to_thread(sync_part)
        assert waited <= took  # only the time result() waited, not the 50 ms before it
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_an_idle_peer_lost_is_told_at_info_and_one_with_requests_at_warning(caplog):
    """A client with nothing in flight that goes quiet (a CLI call done, a person thinking at a
    ``play`` prompt) is no warning on the user's terminal; one whose requests are cancelled is."""
    import logging

    async def main():
        ctx = zmq.asyncio.Context()
        gate = Gate()
        server = Server(gate, heartbeat_s=None)
        ep = await server.start(ctx)
        idle = Client(ctx, ep, name="idle", heartbeat_s=None)
        gate.release.set()
        await idle.request(step("i"), 10)  # done: nothing in flight from here
        gate.release.clear()
        busy = Client(ctx, ep, name="busy", heartbeat_s=None)
        task = asyncio.ensure_future(busy.request(step(), 60))
        await until(lambda: gate.running == 1, "the request to start")
        with caplog.at_level(logging.INFO, logger="opentinker.bus.server"):
            for _ in range(3):
                server.tick()
        levels = {r.getMessage().split()[2]: r.levelno for r in caplog.records if "lost" in r.getMessage()}
        assert levels == {"idle": logging.INFO, "busy": logging.WARNING}, levels
        task.cancel()
        gate.release.set()
        idle.close()
        busy.close()
        await server.stop()
        ctx.destroy(0)

    run(main())
