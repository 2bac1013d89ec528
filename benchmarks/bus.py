"""Round-trip latency and throughput of the message bus (``opentinker.bus``) against a raw
pyzmq DEALER/ROUTER echo with the same frames and against a Ray actor call, in one run.

Every echo server runs in a separate process (``multiprocessing`` with ``spawn``; Ray runs its
actor in a worker process of its own). Two payloads:

* ``small``: a ``LogprobsRequest(adapter=None, sequences=[])`` answered by the bus with an
  ``Ack`` (the raw server echoes the request's frames, Ray echoes their bytes);
* ``1MiB``: a ``LogprobsResult`` whose field carries a 1 MiB ``float32`` array (one extra
  zero-copy frame), echoed back (Ray echoes the array itself).

Latency: sequential request / reply, p50 and p99 of ``--n`` round trips (``--n_large`` for
1 MiB) after a warm-up. Throughput: the same count with ``--window`` requests in flight;
MiB/s counts the request's bytes once per round trip (one way). "vs raw pyzmq" is the p50 over
the raw pyzmq p50 on the same transport and payload (Ray rows: against raw pyzmq over tcp).

    python benchmarks/bus.py --transports ipc,tcp --kinds bus_sync,bus_async,raw_zmq,ray --json bus.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import zmq
import zmq.asyncio
from rich.console import Console
from rich.table import Table

from opentinker.bus import LOOPBACK, Client, LoopThread, Server, SyncClient
from protocols.codec import encode
from protocols.messages import Ack, LogprobsRequest, LogprobsResult, Message

KINDS = ("bus_sync", "bus_async", "raw_zmq", "ray")
PAYLOADS = ("small", "1MiB")
LARGE_FLOATS = (1 << 20) // 4
SERVER_LIFE_S = 1800.0
"""A server process exits after this long even if never told to stop."""


@dataclass
class Args:
    n: int = 2000
    n_large: int = 200
    warmup: int = 50
    window: int = 32
    transports: str = "ipc,tcp"
    kinds: str = "bus_sync,bus_async,raw_zmq,ray"
    timeout: float = 30.0
    json: str = ""


def parse() -> Args:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in asdict(Args()).items():
        p.add_argument(f"--{k}", type=type(v), default=v)
    return Args(**vars(p.parse_args()))


def small_message() -> Message:
    return LogprobsRequest(adapter=None, sequences=[])


def large_message() -> Message:
    arr = np.random.default_rng(0).standard_normal(LARGE_FLOATS).astype(np.float32)
    return LogprobsResult(logprobs=[arr], adapter_version=0)


def frame_bytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


# ---------------------------------------------------------------------------------------------
# Echo servers (each in its own spawned process)


def serve_bus(bind: str, out: Any, stop: Any) -> None:
    """A bus ``Server``: ``LogprobsResult`` is echoed back, anything else answered ``Ack``."""

    async def handler(msg: Message) -> Message:
        return msg if isinstance(msg, LogprobsResult) else Ack()

    lt = LoopThread("bench-bus-server")
    server = Server(handler, bind, name="bench-echo")
    try:
        out.put(lt.run(server.start(lt.ctx), timeout=30))
        stop.wait(SERVER_LIFE_S)
        lt.run(server.stop(), timeout=5)
    finally:
        lt.stop()


def serve_raw(bind: str, out: Any, stop: Any) -> None:
    """A synchronous ROUTER that sends every request's frames back as they came, undecoded."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 100)
    try:
        sock.bind(bind)
        out.put(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        deadline = time.monotonic() + SERVER_LIFE_S
        for i in range(1 << 62):
            try:
                frames = sock.recv_multipart(copy=False)
            except zmq.Again:
                if stop.is_set() or time.monotonic() > deadline:
                    break
                continue
            sock.send_multipart(frames, copy=False)
            if i & 1023 == 0 and (stop.is_set() or time.monotonic() > deadline):
                break
    finally:
        sock.close(linger=0)
        ctx.term()


class EchoServer:
    """A spawned server process; ``endpoint`` is what it bound (the OS-picked port for tcp)."""

    def __init__(self, target: Callable, bind: str, timeout: float) -> None:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        self.stop_event = ctx.Event()
        self.proc = ctx.Process(target=target, args=(bind, out, self.stop_event), daemon=True)
        self.proc.start()
        self.endpoint = ""
        for _ in range(int(timeout * 10) + 1):
            try:
                self.endpoint = out.get(timeout=0.1)
                break
            except queue.Empty:
                if not self.proc.is_alive():
                    raise RuntimeError(f"echo server {target.__name__} died (exit {self.proc.exitcode})") from None
        if not self.endpoint:
            self.close()
            raise TimeoutError(f"echo server {target.__name__} did not report its endpoint in {timeout:.0f} s")

    def close(self) -> None:
        self.stop_event.set()
        self.proc.join(timeout=10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(timeout=5)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join(timeout=5)


# ---------------------------------------------------------------------------------------------
# Clients


def summary(lat_s: list[float], n_tp: int, tp_s: float, nbytes: int) -> dict[str, float]:
    lat_us = np.asarray(lat_s) * 1e6
    return {
        "n": len(lat_s),
        "bytes": nbytes,
        "p50_us": float(np.percentile(lat_us, 50)),
        "p99_us": float(np.percentile(lat_us, 99)),
        "msgs_per_s": n_tp / tp_s,
        "mib_per_s": n_tp * nbytes / tp_s / (1 << 20),
    }


def bench_bus(endpoint: str, msg: Message, n: int, args: Args) -> dict[str, float]:
    async def go() -> dict[str, float]:
        ctx = zmq.asyncio.Context()
        client = Client(ctx, endpoint, name="bench")
        try:
            for _ in range(args.warmup):
                await client.request(msg, timeout=args.timeout)
            reply = await client.request(msg, timeout=args.timeout)
            if isinstance(msg, LogprobsResult):
                assert isinstance(reply, LogprobsResult) and reply.logprobs[0].nbytes == msg.logprobs[0].nbytes
            else:
                assert isinstance(reply, Ack), reply
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                await client.request(msg, timeout=args.timeout)
                lat.append(time.perf_counter() - t)

            async def worker(count: int) -> None:
                for _ in range(count):
                    await client.request(msg, timeout=args.timeout)

            w = max(1, min(args.window, n))
            counts = [n // w + (i < n % w) for i in range(w)]
            t = time.perf_counter()
            await asyncio.gather(*(worker(c) for c in counts))
            tp = time.perf_counter() - t
            return summary(lat, n, tp, frame_bytes(encode(msg, 1)))
        finally:
            client.close()
            ctx.destroy(linger=0)

    return asyncio.run(asyncio.wait_for(go(), args.timeout * 20))


def bench_sync(endpoint: str, msg: Message, n: int, args: Args) -> dict[str, float]:
    with SyncClient(endpoint, name="bench-sync", connect_timeout=args.timeout) as client:
        for _ in range(args.warmup):
            client.request(msg, timeout=args.timeout)
        reply = client.request(msg, timeout=args.timeout)
        if isinstance(msg, LogprobsResult):
            assert isinstance(reply, LogprobsResult) and reply.logprobs[0].nbytes == msg.logprobs[0].nbytes
        else:
            assert isinstance(reply, Ack), reply
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            client.request(msg, timeout=args.timeout)
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        window = [client.submit(msg) for _ in range(min(args.window, n))]
        sent = len(window)
        for i in range(n):
            client.result(window[i], timeout=args.timeout)
            if sent < n:
                window.append(client.submit(msg))
                sent += 1
        tp = time.perf_counter() - t
        return summary(lat, n, tp, frame_bytes(encode(msg, 1)))


def bench_raw(endpoint: str, msg: Message, n: int, args: Args) -> dict[str, float]:
    frames = encode(msg, 1)
    nframes, nbytes = len(frames), frame_bytes(frames)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(args.timeout * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(args.timeout * 1000))
    try:
        sock.connect(endpoint)

        def round_trip() -> list[zmq.Frame]:
            sock.send_multipart(frames, copy=False)
            return sock.recv_multipart(copy=False)  # zmq.Again after RCVTIMEO

        for _ in range(args.warmup):
            round_trip()
        reply = round_trip()
        assert len(reply) == nframes and sum(len(f) for f in reply) == nbytes
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            round_trip()
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        sent = 0
        for _ in range(min(args.window, n)):
            sock.send_multipart(frames, copy=False)
            sent += 1
        for _ in range(n):
            sock.recv_multipart(copy=False)
            if sent < n:
                sock.send_multipart(frames, copy=False)
                sent += 1
        tp = time.perf_counter() - t
        return summary(lat, n, tp, nbytes)
    finally:
        sock.close(linger=0)
        ctx.term()


class Echo:
    def echo(self, x: Any) -> Any:
        return x


def bench_ray(payload: Any, nbytes: int, n: int, args: Args) -> dict[str, float]:
    import ray

    actor = ray.remote(num_cpus=0)(Echo).remote()
    try:
        for _ in range(args.warmup):
            ray.get(actor.echo.remote(payload), timeout=args.timeout * 2)
        reply = ray.get(actor.echo.remote(payload), timeout=args.timeout)
        assert len(reply) == len(payload)
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            ray.get(actor.echo.remote(payload), timeout=args.timeout)
            lat.append(time.perf_counter() - t)
        t = time.perf_counter()
        pending = [actor.echo.remote(payload) for _ in range(min(args.window, n))]
        sent = len(pending)
        for _ in range(n):
            ready, pending = ray.wait(pending, num_returns=1, timeout=args.timeout)
            if not ready:
                raise TimeoutError(f"ray echo: no reply in {args.timeout:.0f} s")
            ray.get(ready[0], timeout=args.timeout)
            if sent < n:
                pending.append(actor.echo.remote(payload))
                sent += 1
        tp = time.perf_counter() - t
        return summary(lat, n, tp, nbytes)
    finally:
        ray.kill(actor)


# ---------------------------------------------------------------------------------------------


def main() -> None:
    args = parse()
    transports = [t for t in args.transports.split(",") if t]
    kinds = [k for k in args.kinds.split(",") if k]
    for t in transports:
        assert t in ("ipc", "tcp"), f"unknown transport {t!r}"
    for k in kinds:
        assert k in KINDS, f"unknown kind {k!r}"
    msgs = {"small": small_message(), "1MiB": large_message()}
    counts = {"small": args.n, "1MiB": args.n_large}
    rows: list[dict[str, Any]] = []
    tmp = tempfile.mkdtemp(prefix="otbus-")
    try:
        for kind in (k for k in kinds if k != "ray"):
            target, bench = {"bus_sync": (serve_bus, bench_sync), "bus_async": (serve_bus, bench_bus),
                             "raw_zmq": (serve_raw, bench_raw)}[kind]
            for transport in transports:
                bind = f"ipc://{os.path.join(tmp, kind)}.sock" if transport == "ipc" else LOOPBACK
                server = EchoServer(target, bind, args.timeout * 2)
                try:
                    for payload in PAYLOADS:
                        r = bench(server.endpoint, msgs[payload], counts[payload], args)
                        rows.append({"kind": kind, "transport": transport, "payload": payload, **r})
                finally:
                    server.close()
        if "ray" in kinds:
            import ray

            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2, log_to_driver=False)
            try:
                small = b"".join(bytes(memoryview(f)) for f in encode(msgs["small"], 1))
                arr = msgs["1MiB"].logprobs[0]
                for payload, x, nb in (("small", small, len(small)), ("1MiB", arr, arr.nbytes)):
                    r = bench_ray(x, nb, counts[payload], args)
                    rows.append({"kind": "ray", "transport": "ray", "payload": payload, **r})
            finally:
                ray.shutdown()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    raw = {(r["transport"], r["payload"]): r["p50_us"] for r in rows if r["kind"] == "raw_zmq"}
    for r in rows:
        t = r["transport"]
        if t == "ray":
            t = "tcp" if ("tcp", r["payload"]) in raw else next((tt for tt, p in raw if p == r["payload"]), "")
        base = raw.get((t, r["payload"]))
        r["vs_raw_zmq"] = r["p50_us"] / base if base else None

    table = Table(title=f"bus round trips (server in another process; {args.n} small / {args.n_large} x 1 MiB, "
                        f"window {args.window}; MiB/s one way; ray vs raw over tcp)")
    for col in ("kind", "transport", "payload", "p50 µs", "p99 µs", "msgs/s", "MiB/s", "vs raw pyzmq"):
        table.add_column(col, justify="left" if col in ("kind", "transport", "payload") else "right")
    for r in rows:
        ratio = "—" if r["vs_raw_zmq"] is None else f"{r['vs_raw_zmq']:.2f}x"
        table.add_row(r["kind"], r["transport"], r["payload"], f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}",
                      f"{r['msgs_per_s']:.0f}", f"{r['mib_per_s']:.1f}", ratio)
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 110)
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": asdict(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
