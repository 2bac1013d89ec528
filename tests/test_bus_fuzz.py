"""Fuzz the server with 10,000 frames (seeded): random bytes and mutations of valid messages,
including one of each hostile class of issue #14 (huge array ranks, a buffer named twice, deep
nesting, too many frames, an oversized body), an outsider without the run's secret, and a
flood of sessions (one name, and a new name each time) into a table of 16, and an
authenticated peer that writes ZMTP itself and never ends its message, with a valid request
every 200 frames that must succeed. Every error counter ends above zero, the outsider never
gets a session or a reply, the flood only ever evicts idle sessions (never the busy ones,
never a ``busy`` refusal), the unfinished message's connection is cut, and the server is still
serving."""

from __future__ import annotations

import asyncio
import collections

import msgspec
import numpy as np
import zmq
import zmq.asyncio
from conftest import offer, run, until
from test_bus_held import send_unfinished, supported, zmtp_plain

from opentinker.bus.auth import secure_client
from opentinker.bus import Client, Server
from protocols.codec import Limits, encode
from protocols.messages import (
    PROTOCOL_VERSION,
    Ack,
    AdamParams,
    Datum,
    ForwardBackward,
    Hello,
    LogprobsRequest,
    LogprobsResult,
    OptimStep,
    SampleRequest,
    SamplingParams,
)

N_FRAMES = 10_000
VALID_EVERY = 200
MAX_BYTES = 64 * 1024
LIMITS = Limits(max_bytes=MAX_BYTES, max_buffers=16, max_body_bytes=16 * 1024)
ERRORS = ("bad_frame", "bad_version", "bad_message", "unknown_type", "too_large", "invalid", "no_handshake")
N_KINDS = 13
MAX_PEERS = 16
FLOOD_EVERY = 125
"""A flooding session says Hello every this many frames (80 over the run, 5 times the table)."""


def valid_messages() -> list:
    toks = np.arange(12, dtype=np.int32)
    return [
        OptimStep(adapter="a", params=AdamParams()),
        LogprobsRequest(adapter=None, sequences=[toks, toks[:5]]),
        SampleRequest(adapter="a", prompts=[toks], params=SamplingParams(max_tokens=3)),
        LogprobsResult(logprobs=[np.ones(7, np.float32)], adapter_version=2),
        ForwardBackward(adapter="a", loss="ppo", datums=[
            Datum(tokens=toks, loss_inputs={"mask": np.ones(12, np.float32)})]),
    ]


def mutate(rng: np.random.Generator, frames: list[bytes]) -> list[bytes]:
    """One of the ways a frame goes wrong: flipped or cut bytes, a wrong version, a wrong
    buffer count, an unknown type, a field of the wrong type, too many bytes, random frames,
    or one of the hostile classes: an array of many huge dimensions, a buffer named by many
    array references, nesting thousands deep, too many frames, a body over its limit."""
    f = [bytes(memoryview(x)) for x in frames]
    kind = int(rng.integers(N_KINDS))
    if kind == 0:  # flip bytes anywhere
        i = int(rng.integers(len(f)))
        b = bytearray(f[i])
        for _ in range(int(rng.integers(1, 4))):
            if b:
                b[int(rng.integers(len(b)))] = int(rng.integers(256))
        f[i] = bytes(b)
    elif kind == 1:  # cut a frame short
        i = int(rng.integers(len(f)))
        f[i] = f[i][: int(rng.integers(len(f[i]) + 1))]
    elif kind == 2:  # another protocol version
        h = msgspec.msgpack.decode(f[0])
        f[0] = msgspec.msgpack.encode([PROTOCOL_VERSION + int(rng.integers(1, 5)), h[1], h[2]])
    elif kind == 3:  # the header names the wrong number of buffers, or frames go missing
        f = f[:-1] if len(f) > 2 and rng.random() < 0.5 else [*f, b"extra"]
    elif kind == 4:  # an unknown message type
        body = msgspec.msgpack.decode(f[1])
        body["type"] = "DropTables"
        f[1] = msgspec.msgpack.encode(body)
    elif kind == 5:  # a field of the wrong type
        body = msgspec.msgpack.decode(f[1])
        key = sorted(k for k in body if k != "type")[int(rng.integers(len(body) - 1))]
        body[key] = [{"nested": "junk"}] if not isinstance(body[key], list) else "junk"
        f[1] = msgspec.msgpack.encode(body)
    elif kind == 6:  # more bytes than the server takes
        f = [*f[:2], *([b"\0" * (MAX_BYTES + 1)] if rng.random() < 0.5 else [])]
        if len(f) == 2:
            f[1] = f[1] + b"\0" * (MAX_BYTES + 1)
    elif kind == 7:  # random bytes in random frames
        f = [rng.bytes(int(rng.integers(0, 64))) for _ in range(int(rng.integers(1, 5)))]
    elif kind == 8:  # an array of a thousand huge dimensions
        f = [_header(f[0], 1), _array_ref_body(["int32", [2**63 - 1] * int(rng.integers(9, 1000)), 0]), b""]
    elif kind == 9:  # one buffer named by many array references
        f = [_header(f[0], 1), msgspec.msgpack.encode({"type": "LogprobsRequest", "adapter": None,
             "sequences": [["int32", [1], 0]] * int(rng.integers(2, 500))}), b"\0" * 4]
    elif kind == 10:  # nested thousands deep, where the decoder skips (an unknown field) or reads it untyped
        deep = b"\x91" * int(rng.integers(2000, 10_000)) + b"\xc0"
        f = [_header(f[0], 0), b"\x82" + msgspec.msgpack.encode({"type": "Ack"})[1:] + b"\xa2zz" + deep] \
            if rng.random() < 0.5 else [_header(f[0], 1), _array_ref_body(None)[:-1] + deep, b""]
    elif kind == 11:  # more frames than the server takes
        f = [*f, *[b""] * (LIMITS.max_frames + int(rng.integers(1, 100)))]
    else:  # a body over its limit
        f = [f[0], f[1] + b"\0" * LIMITS.max_body_bytes, *f[2:]]
    return f


def _header(frame: bytes, n_buffers: int) -> bytes:
    """The header ``frame`` (its request id) naming ``n_buffers`` buffers."""
    h = msgspec.msgpack.decode(frame)
    return msgspec.msgpack.encode([h[0], h[1], n_buffers])


def _array_ref_body(ref: object) -> bytes:
    return msgspec.msgpack.encode({"type": "LogprobsRequest", "adapter": None, "sequences": [ref]})


def test_ten_thousand_bad_frames_never_stop_the_server():
    async def main():
        ctx = zmq.asyncio.Context()

        async def handler(msg):
            if isinstance(msg, SampleRequest):
                raise ValueError("no model here")
            return msg if isinstance(msg, LogprobsResult) else Ack()

        server = Server(handler, name="fuzzed", limits=LIMITS, heartbeat_s=None, max_peers=MAX_PEERS)
        ep = await server.start(ctx)
        good = Client(ctx, ep, name="good", heartbeat_s=None)
        # One fuzzing socket that said Hello (its decodable frames reach the handler), and one
        # that never did.
        greeted, stranger = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s in (greeted, stranger):
            s.setsockopt(zmq.LINGER, 0)
            secure_client(s)  # authenticated peers: their frames reach the decoder
            s.connect(ep)
        # And an outsider with a wrong secret (authentication, #14): it may send what it likes,
        # none of it is decoded and nothing comes back.
        outsider = ctx.socket(zmq.DEALER)
        outsider.setsockopt(zmq.LINGER, 0)
        outsider.plain_username, outsider.plain_password = b"opentinker", b"not the run's secret, at least 32 chars"
        outsider.connect(ep)

        # And a peer with the secret that sends 4 MiB of one message and never its last frame.
        unfinished = None
        if supported():
            unfinished = await asyncio.to_thread(zmtp_plain, ep, b"DEALER")
            await asyncio.to_thread(send_unfinished, unfinished, 4, 64 * 1024)
        offer(outsider, encode(Hello(version=PROTOCOL_VERSION, peer="outsider"), 1))
        await greeted.send_multipart(encode(Hello(version=PROTOCOL_VERSION, peer="fuzzer"), 1))
        await asyncio.wait_for(greeted.recv_multipart(), 10)
        rng = np.random.default_rng(1234)
        templates = [encode(m, i + 2) for i, m in enumerate(valid_messages())]
        successes, flood = 0, []
        for n in range(N_FRAMES):
            if n % FLOOD_EVERY == 0:  # one source filling the session table: one name, or a new one each time
                s = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                secure_client(s)
                s.connect(ep)
                flood.append(s)
                name = "flood" if n % (2 * FLOOD_EVERY) == 0 else f"flood{n}"
                await s.send_multipart(encode(Hello(version=PROTOCOL_VERSION, peer=name), 1))
                await asyncio.wait_for(s.recv_multipart(), 10)
                await greeted.send_multipart(encode(OptimStep(adapter="a", params=AdamParams()), 10**6 + n))
            frames = templates[int(rng.integers(len(templates)))]
            sock = stranger if n % 10 == 0 else greeted
            await sock.send_multipart(frames if n % 10 == 0 else mutate(rng, frames))
            if n % 50 == 0:
                offer(outsider, mutate(rng, frames))
            if n % VALID_EVERY == VALID_EVERY - 1:
                reply = await good.request(LogprobsResult(logprobs=[np.full(4, n, np.float32)], adapter_version=n), 30)
                assert reply.adapter_version == n and reply.logprobs[0][0] == n
                successes += 1
                for s in (greeted, stranger):  # drain the error replies
                    while await s.poll(0):
                        await s.recv_multipart()
        assert successes == N_FRAMES // VALID_EVERY
        missing = [e for e in ERRORS if server.counters[f"error/{e}"] == 0]
        assert not missing, (missing, dict(server.counters))
        assert sum(server.counters[f"error/{e}"] for e in ERRORS) > N_FRAMES // 2
        assert server.counters["error/internal"] == 0
        assert server.counters["dropped/too_many_frames"] > 0  # read frame by frame, answered too_large
        assert server.counters["auth_denied"] >= 1 and await outsider.poll(100) == 0
        names = collections.Counter(p.name for p in server._peers.values())
        assert names["good"] == 1 and names["fuzzer"] == 1 and "outsider" not in names  # the busy ones kept theirs
        assert len(server._peers) == MAX_PEERS and server.counters["peer_evicted"] == N_FRAMES // FLOOD_EVERY + 2 - MAX_PEERS
        assert server.counters["error/busy"] == 0
        if unfinished is not None:
            await until(lambda: server.counters["dropped/held_connections"] == 1, "the unfinished message's cut")
            unfinished.close()
        print({k: v for k, v in sorted(server.counters.items()) if k.startswith(("error/", "recv/"))})
        for s in (greeted, stranger, outsider, *flood):
            s.close(0)
        good.close()
        await server.stop()
        ctx.destroy(0)

    run(main(), timeout=300)
