import asyncio

import pytest
import zmq
import zmq.asyncio

from conftest import run
from opentinker.bus.auth import secure_client
from opentinker.bus import Client, Puller, Pusher, RemoteError, Server
from protocols.messages import (
    Ack, AdamParams, ErrorCode, OptimStep, OptimStepResult, SampleRequest, SamplingParams, Trajectory,
)


def test_request_reply_many_in_flight_and_errors():
    async def main():
        ctx = zmq.asyncio.Context()
        applied = []

        async def handler(msg):
            if isinstance(msg, OptimStep):
                applied.append(msg.adapter)
                version = len(applied)
                await asyncio.sleep(0.01)
                return OptimStepResult(version=version, grad_norm=0.0)
            if isinstance(msg, SampleRequest):
                raise ValueError("no model here")
            return Ack()

        server = Server(handler, name="t")
        ep = await server.start(ctx)
        assert ep.startswith("tcp://127.0.0.1:")
        client = Client(ctx, ep)
        replies = await asyncio.gather(*(client.request(OptimStep(adapter=f"a{i}", params=AdamParams()), 10) for i in range(20)))
        assert sorted(r.version for r in replies) == list(range(1, 21))
        # A retry with the same request id is answered from the first result, never applied twice.
        rid = client.next_request_id()
        first = await client.request(OptimStep(adapter="x", params=AdamParams()), 10, request_id=rid)
        again = await client.request(OptimStep(adapter="x", params=AdamParams()), 10, request_id=rid)
        assert first == again and applied.count("x") == 1 and server.counters["dedup"] == 1
        with pytest.raises(RemoteError) as e:
            await client.request(SampleRequest(adapter=None, prompts=[], params=SamplingParams()), 10)
        assert e.value.error.code is ErrorCode.INVALID and "no model here" in str(e.value)
        # A malformed frame gets an Error reply and a counter; the server keeps serving.
        raw = ctx.socket(zmq.DEALER)
        secure_client(raw)  # an authenticated peer sending garbage
        raw.connect(ep)
        await raw.send_multipart([b"not a header", b"x"])
        frames = await asyncio.wait_for(raw.recv_multipart(), 5)
        assert b"bad_frame" in frames[1]
        assert server.counters["error/bad_frame"] == 1
        assert isinstance(await client.request(OptimStep(adapter="y", params=AdamParams()), 10), OptimStepResult)
        raw.close(0)
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_timeout_names_the_request():
    async def main():
        ctx = zmq.asyncio.Context()

        async def slow(msg):
            await asyncio.sleep(5)
            return Ack()

        server = Server(slow)
        client = Client(ctx, await server.start(ctx))
        with pytest.raises(TimeoutError, match="OptimStep"):
            await client.request(OptimStep(adapter="a", params=AdamParams()), timeout=0.2)
        client.close()
        await server.stop()
        ctx.destroy(0)

    run(main())


def test_push_pull_carries_trajectories_and_drops_garbage():
    async def main():
        ctx = zmq.asyncio.Context()
        puller = Puller(ctx)
        pusher = Pusher(ctx, puller.endpoint)
        await pusher._sock.send_multipart([b"junk"])  # same socket: arrives first
        t = Trajectory(episode_id=1, group_id=0, seat="player_0", seed=0, policy="p", turns=[], total_reward=1.0)
        await pusher.send(t)
        got = await asyncio.wait_for(puller.recv(), 5)
        assert got == t and puller.counters["error/bad_frame"] == 1
        pusher.close()
        puller.close()
        ctx.destroy(0)

    run(main())
