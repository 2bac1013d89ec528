"""Round-trip latency and throughput of the message bus (``opentinker.bus``) against a raw
pyzmq DEALER/ROUTER echo with the same frames and against a Ray actor call, in one run.

Every echo server runs in a separate process (``multiprocessing`` with ``spawn``; Ray runs its
actor in a worker process of its own). Two payloads:

* ``small``: a ``LogprobsRequest(adapter=None, sequences=[])`` answered by the bus with an
  ``Ack`` (the raw server echoes the request's frames, Ray echoes their bytes);
* ``1MiB``: a ``LogprobsResult`` whose field carries a 1 MiB ``float32`` array (one extra
  zero-copy frame), echoed back (Ray echoes the array itself).

Rows: this bus's ``SyncClient``; its asyncio ``Client`` as configured by default (it polls the
socket at each loop turn for up to ``spin_s`` after a send) and with ``spin_s=0``
(``bus_async_park``: it waits on the socket's descriptor at once, so each reply costs an event
loop wake-up); raw pyzmq; Ray. "CPU µs" is the client process's CPU time (all its threads) per
round trip in the latency loop, the price of polling.

Authentication: every bus socket authenticates its peers (PLAIN with the run's secret, checked
by a ZAP handler; :mod:`opentinker.bus.auth`), so the ``bus_*`` rows include it. Its cost is
in the handshake, not in the messages: ``raw_zmq_plain`` is the raw echo behind PLAIN and a
ZAP handler, ``raw_zmq_curve`` behind CURVE (every frame encrypted), ``bus_sync_curve`` this
bus with CURVE keys (what a socket facing the network uses). "connect µs" is the median time
of ``--connects`` fresh connections, each to its first reply (handshake and authentication
included), for the raw and ``bus_sync*`` rows.

Latency: sequential request / reply, p50 and p99 of ``--n`` round trips (``--n_large`` for
1 MiB) after a warm-up. Throughput: the same count with ``--window`` requests in flight;
MiB/s counts the request's bytes once per round trip (one way). All servers run at once and
every row's requests are split into ``--rounds`` rounds taken in turn (the order rotating), so
a change in the machine's load mid-run hits every row alike. Ratios, each against the same
transport and payload (Ray rows: against raw pyzmq over tcp): "p50 vs raw" (this p50 / raw
pyzmq's), "throughput: raw / this" (raw pyzmq's msgs/s / this), "Ray p50 / this" (how many
times lower this latency is than a Ray actor call's).

    python benchmarks/bus.py --transports ipc,tcp --kinds bus_sync,bus_async,raw_zmq,ray --json bus.json
"""

from __future__ import annotations

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

from _args import parse_args
from _machine import script_provenance
from opentinker.bus import (
    DEFAULT_SPIN_S,
    LOOPBACK,
    Client,
    CurveKeys,
    LoopThread,
    Server,
    SyncClient,
    new_event_loop,
)
from opentinker.bus.auth import run_secret, run_user
from protocols.codec import encode
from protocols.messages import (
    Ack,
    LogprobsRequest,
    LogprobsResult,
    Message,
)

KINDS = ("bus_sync", "bus_async", "bus_async_park", "bus_sync_curve", "raw_zmq", "raw_zmq_plain", "raw_zmq_curve", "ray")
MECH = {"raw_zmq": "null", "raw_zmq_plain": "plain", "raw_zmq_curve": "curve", "bus_sync_curve": "curve"}
"""Security mechanism of each row (the other bus rows: PLAIN, the bus's default)."""
PAYLOADS = ("small", "1MiB")
LARGE_FLOATS = (1 << 20) // 4
SERVER_LIFE_S = 1800.0
"""A server process exits after this long even if never told to stop."""


@dataclass
class Args:
    n: int = 2000
    n_large: int = 1000
    warmup: int = 50
    window: int = 32
    rounds: int = 10
    """Each row's requests are split into this many rounds, taken in turn with the other rows."""
    transports: str = "ipc,tcp"
    kinds: str = "bus_sync,bus_async,bus_async_park,bus_sync_curve,raw_zmq,raw_zmq_plain,raw_zmq_curve,ray"
    connects: int = 20
    """Fresh connections timed to their first reply, per raw and bus_sync row (small payload)."""
    timeout: float = 30.0
    json: str = ""


def parse() -> Args:
    return parse_args(Args, __doc__)[0]


def small_message() -> Message:
    return LogprobsRequest(adapter=None, sequences=[])


def large_message() -> Message:
    arr = np.random.default_rng(0).standard_normal(LARGE_FLOATS).astype(np.float32)
    return LogprobsResult(logprobs=[arr], adapter_version=0)


def frame_bytes(frames: list[Any]) -> int:
    return sum(memoryview(f).nbytes for f in frames)


# ---------------------------------------------------------------------------------------------
# Echo servers (each in its own spawned process)


def serve_bus(bind: str, out: Any, stop: Any, keys: CurveKeys | None = None) -> None:
    """A bus ``Server`` (PLAIN with the run's secret, inherited from the parent's environment;
    CURVE with ``keys``): ``LogprobsResult`` is echoed back, anything else answered ``Ack``."""

    async def handler(msg: Message) -> Message:
        return msg if isinstance(msg, LogprobsResult) else Ack()

    lt = LoopThread("bench-bus-server")
    server = Server(handler, bind, name="bench-echo", keys=keys)
    try:
        out.put(lt.run(server.start(lt.ctx), timeout=30))
        stop.wait(SERVER_LIFE_S)
        lt.run(server.stop(), timeout=5)
    finally:
        lt.stop()


def serve_raw(bind: str, out: Any, stop: Any, mech: str = "null", keys: CurveKeys | None = None) -> None:
    """A synchronous ROUTER that sends every request's frames back as they came, undecoded;
    ``mech``: ``null`` (no security), ``plain`` (the run's secret, checked by pyzmq's ZAP
    handler) or ``curve`` (``keys``, any client key)."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 100)
    auth = None
    if mech == "plain":
        from zmq.auth.thread import ThreadAuthenticator

        auth = ThreadAuthenticator(ctx)
        auth.start()
        auth.configure_plain("*", {run_user(): run_secret().decode()})
        sock.plain_server = True
    elif mech == "curve":
        sock.curve_server = True
        sock.curve_publickey, sock.curve_secretkey = keys.public, keys.secret
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
        if auth is not None:
            auth.stop()
        ctx.term()


class EchoServer:
    """A spawned server process; ``endpoint`` is what it bound (the OS-picked port for tcp)."""

    def __init__(self, target: Callable, bind: str, timeout: float, extra: tuple = ()) -> None:
        ctx = mp.get_context("spawn")
        out = ctx.Queue()
        self.stop_event = ctx.Event()
        self.proc = ctx.Process(target=target, args=(bind, out, self.stop_event, *extra), daemon=True)
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


def summary(lat_s: list[float], cpu_s: float, n_tp: int, tp_s: float, nbytes: int) -> dict[str, float]:
    """One row: latency percentiles of ``lat_s``, client CPU per round trip (``cpu_s`` over the
    latency loop), throughput of ``n_tp`` round trips in ``tp_s``."""
    lat_us = np.asarray(lat_s) * 1e6
    return {
        "n": len(lat_s),
        "bytes": nbytes,
        "p50_us": float(np.percentile(lat_us, 50)),
        "p99_us": float(np.percentile(lat_us, 99)),
        "cpu_us": cpu_s / len(lat_s) * 1e6,
        "msgs_per_s": n_tp / tp_s,
        "mib_per_s": n_tp * nbytes / tp_s / (1 << 20),
    }


class AsyncBus:
    """This bus's asyncio client (default settings: it polls for a reply for up to
    ``spin_s`` after a send), on an event loop of its own."""

    spin_s = DEFAULT_SPIN_S

    def __init__(self, endpoint: str, msg: Message, args: Args) -> None:
        self.msg, self.args = msg, args
        self.loop = new_event_loop()  # what the runtime's loops are (uvloop where installed)
        self.ctx = zmq.asyncio.Context()
        self.client = Client(self.ctx, endpoint, name="bench", spin_s=self.spin_s)
        self._run(self._warmup())

    def _run(self, coro: Any) -> Any:
        return self.loop.run_until_complete(asyncio.wait_for(coro, self.args.timeout * 20))

    async def _warmup(self) -> None:
        for _ in range(self.args.warmup):
            reply = await self._one()
        check_echo(self.msg, reply)

    async def _one(self) -> Any:
        """One round trip."""
        return await self.client.request(self.msg, timeout=self.args.timeout)

    def latency(self, n: int) -> list[float]:
        async def go() -> list[float]:
            lat = []
            for _ in range(n):
                t = time.perf_counter()
                await self._one()
                lat.append(time.perf_counter() - t)
            return lat

        return self._run(go())

    def throughput(self, n: int) -> float:
        async def worker(count: int) -> None:
            for _ in range(count):
                await self._one()

        w = max(1, min(self.args.window, n))
        counts = [n // w + (i < n % w) for i in range(w)]

        async def go() -> float:
            t = time.perf_counter()
            await asyncio.gather(*(worker(c) for c in counts))
            return time.perf_counter() - t

        return self._run(go())

    def close(self) -> None:
        self.client.close()
        self._run(asyncio.sleep(0))  # let the cancelled heartbeat task finish
        self.ctx.destroy(linger=0)
        self.loop.close()


class AsyncBusPark(AsyncBus):
    """This bus's asyncio client with ``spin_s=0``: it parks on the socket's descriptor right
    after each send, so every reply costs an event-loop wake-up (less CPU, more latency)."""

    spin_s = 0.0


class SyncBus:
    """This bus's blocking client (CURVE when given ``keys``: its own pair and the server's)."""

    def __init__(self, endpoint: str, msg: Message, args: Args, keys: CurveKeys | None = None) -> None:
        self.msg, self.args, self.endpoint, self.keys = msg, args, endpoint, keys
        self.client = SyncClient(endpoint, name="bench-sync", connect_timeout=args.timeout, keys=keys)
        for _ in range(args.warmup):
            reply = self.client.request(msg, timeout=args.timeout)
        check_echo(msg, reply)

    def latency(self, n: int) -> list[float]:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            self.client.request(self.msg, timeout=self.args.timeout)
            lat.append(time.perf_counter() - t)
        return lat

    def throughput(self, n: int) -> float:
        c, t = self.client, time.perf_counter()
        window = [c.submit(self.msg) for _ in range(min(self.args.window, n))]
        for i in range(n):
            c.result(window[i], timeout=self.args.timeout)
            if len(window) < n:
                window.append(c.submit(self.msg))
        return time.perf_counter() - t

    def connect_once(self) -> float:
        """Seconds from a fresh client's creation (its handshake and Hello) to its first reply."""
        t = time.perf_counter()
        with SyncClient(self.endpoint, name="bench-connect", connect_timeout=self.args.timeout, keys=self.keys) as c:
            c.request(self.msg, timeout=self.args.timeout)
            return time.perf_counter() - t

    def close(self) -> None:
        self.client.close()


class RawZmq:
    """A synchronous DEALER sending the bus's frames, already encoded, to a raw echo with the
    security mechanism ``mech`` (``null``, ``plain``, ``curve`` with the server's ``keys``)."""

    def __init__(self, endpoint: str, msg: Message, args: Args, mech: str = "null",
                 keys: CurveKeys | None = None) -> None:
        self.frames = encode(msg, 1)
        self.args, self.endpoint, self.mech, self.keys = args, endpoint, mech, keys
        self.ctx = zmq.Context()
        self.sock = self._socket()
        for _ in range(args.warmup):
            reply = self._round_trip()
        assert len(reply) == len(self.frames) and sum(len(f) for f in reply) == frame_bytes(self.frames)
        self.window = args.window

    def _socket(self) -> zmq.Socket:
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, int(self.args.timeout * 1000))
        sock.setsockopt(zmq.SNDTIMEO, int(self.args.timeout * 1000))
        if self.mech == "plain":
            sock.plain_username, sock.plain_password = run_user().encode(), run_secret()
        elif self.mech == "curve":
            mine = CurveKeys.generate()
            sock.curve_publickey, sock.curve_secretkey = mine.public, mine.secret
            sock.curve_serverkey = self.keys.public
        sock.connect(self.endpoint)
        return sock

    def _round_trip(self, sock: zmq.Socket | None = None) -> list[zmq.Frame]:
        sock = sock or self.sock
        sock.send_multipart(self.frames, copy=False)
        return sock.recv_multipart(copy=False)  # zmq.Again after RCVTIMEO

    def connect_once(self) -> float:
        """Seconds from a fresh socket's connect (handshake included) to its first reply."""
        t = time.perf_counter()
        sock = self._socket()
        try:
            self._round_trip(sock)
            return time.perf_counter() - t
        finally:
            sock.close(linger=0)

    def latency(self, n: int) -> list[float]:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            self._round_trip()
            lat.append(time.perf_counter() - t)
        return lat

    def throughput(self, n: int) -> float:
        t, sent = time.perf_counter(), 0
        for _ in range(min(self.window, n)):
            self.sock.send_multipart(self.frames, copy=False)
            sent += 1
        for _ in range(n):
            self.sock.recv_multipart(copy=False)
            if sent < n:
                self.sock.send_multipart(self.frames, copy=False)
                sent += 1
        return time.perf_counter() - t

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class Echo:
    def echo(self, x: Any) -> Any:
        return x


class RayEcho:
    """A Ray actor call that returns its argument (the small message's bytes, or the array)."""

    def __init__(self, payload: Any, args: Args) -> None:
        import ray

        self.ray, self.payload, self.args = ray, payload, args
        self.actor = ray.remote(num_cpus=0)(Echo).remote()
        for _ in range(args.warmup):
            reply = ray.get(self.actor.echo.remote(payload), timeout=args.timeout * 2)
        assert len(reply) == len(payload)

    def latency(self, n: int) -> list[float]:
        lat = []
        for _ in range(n):
            t = time.perf_counter()
            self.ray.get(self.actor.echo.remote(self.payload), timeout=self.args.timeout)
            lat.append(time.perf_counter() - t)
        return lat

    def throughput(self, n: int) -> float:
        ray, t = self.ray, time.perf_counter()
        pending = [self.actor.echo.remote(self.payload) for _ in range(min(self.args.window, n))]
        sent = len(pending)
        for _ in range(n):
            ready, pending = ray.wait(pending, num_returns=1, timeout=self.args.timeout)
            if not ready:
                raise TimeoutError(f"ray echo: no reply in {self.args.timeout:.0f} s")
            ray.get(ready[0], timeout=self.args.timeout)
            if sent < n:
                pending.append(self.actor.echo.remote(self.payload))
                sent += 1
        return time.perf_counter() - t

    def close(self) -> None:
        self.ray.kill(self.actor)


def check_echo(msg: Message, reply: Message) -> None:
    if isinstance(msg, LogprobsResult):
        assert isinstance(reply, LogprobsResult) and reply.logprobs[0].nbytes == msg.logprobs[0].nbytes
    else:
        assert isinstance(reply, Ack), reply


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
    tmp = tempfile.mkdtemp(prefix="otbus-")
    servers: dict[tuple[str, str, str], EchoServer] = {}
    runners: dict[tuple[str, str, str], Any] = {}
    run_secret()  # made now, so the spawned servers inherit it with the environment
    server_keys = CurveKeys.generate()
    connect_s: dict[tuple[str, str], list[float]] = {}
    try:
        # Every server runs at once, each in its own process; the clients then take turns in
        # rounds (the order rotating), so a change in the machine's load hits every row alike.
        for kind in (k for k in kinds if k != "ray"):
            raw, mech = kind.startswith("raw_zmq"), MECH.get(kind, "plain")
            target = serve_raw if raw else serve_bus
            keys = server_keys if mech == "curve" else None
            extra = (mech, keys) if raw else (keys,)
            for transport in transports:
                key = (target.__name__, mech, transport)
                if key not in servers:
                    name = f"{target.__name__}_{mech}"
                    bind = f"ipc://{os.path.join(tmp, name)}.sock" if transport == "ipc" else LOOPBACK
                    servers[key] = EchoServer(target, bind, args.timeout * 2, extra)
                ep = servers[key].endpoint
                for payload in PAYLOADS:
                    if raw:
                        runner = RawZmq(ep, msgs[payload], args, mech, keys)
                    elif kind.startswith("bus_sync"):
                        runner = SyncBus(ep, msgs[payload], args, CurveKeys.generate().client_of(keys) if keys else None)
                    else:
                        runner = {"bus_async": AsyncBus, "bus_async_park": AsyncBusPark}[kind](ep, msgs[payload], args)
                    runners[(kind, transport, payload)] = runner
                if hasattr(runners[(kind, transport, "small")], "connect_once"):
                    connect_s[(kind, transport)] = []
        if "ray" in kinds:
            import ray

            ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
                     log_to_driver=False)
            small = b"".join(bytes(memoryview(f)) for f in encode(msgs["small"], 1))
            runners[("ray", "ray", "small")] = RayEcho(small, args)
            runners[("ray", "ray", "1MiB")] = RayEcho(msgs["1MiB"].logprobs[0], args)
        lat: dict[tuple[str, str, str], list[float]] = {k: [] for k in runners}
        tp_s: dict[tuple[str, str, str], float] = {k: 0.0 for k in runners}
        cpu_s: dict[tuple[str, str, str], float] = {k: 0.0 for k in runners}
        done: dict[tuple[str, str, str], int] = {k: 0 for k in runners}
        order = list(runners)
        for r in range(args.rounds):
            for key in order[r % len(order):] + order[: r % len(order)]:
                total = counts[key[2]]  # split exactly over the rounds
                n = total // args.rounds + (r < total % args.rounds)
                if n == 0:
                    continue
                cpu = time.process_time()
                lat[key] += runners[key].latency(n)
                cpu_s[key] += time.process_time() - cpu
                tp_s[key] += runners[key].throughput(n)
                done[key] += n
                if key[2] == "small" and (key[0], key[1]) in connect_s:
                    c = args.connects // args.rounds + (r < args.connects % args.rounds)
                    connect_s[(key[0], key[1])] += [runners[key].connect_once() for _ in range(c)]
        nbytes = {p: frame_bytes(encode(m, 1)) for p, m in msgs.items()}
        nbytes_ray = {"small": nbytes["small"], "1MiB": msgs["1MiB"].logprobs[0].nbytes}
        rows: list[dict[str, Any]] = []
        for key in runners:
            kind, transport, payload = key
            nb = nbytes_ray[payload] if kind == "ray" else nbytes[payload]
            conn = connect_s.get((kind, transport)) if payload == "small" else None
            rows.append({"kind": kind, "transport": transport, "payload": payload,
                         "mechanism": "ray" if kind == "ray" else MECH.get(kind, "plain"),
                         **summary(lat[key], cpu_s[key], done[key], tp_s[key], nb),
                         "connect_us": float(np.median(conn) * 1e6) if conn else None})
    finally:
        for runner in runners.values():
            runner.close()
        if "ray" in kinds:
            import ray

            ray.shutdown()
        for server in servers.values():
            server.close()
        shutil.rmtree(tmp, ignore_errors=True)

    raw = {(r["transport"], r["payload"]): r for r in rows if r["kind"] == "raw_zmq"}
    ray_p50 = {r["payload"]: r["p50_us"] for r in rows if r["kind"] == "ray"}
    for r in rows:
        t = r["transport"]
        if t == "ray":
            t = "tcp" if ("tcp", r["payload"]) in raw else next((tt for tt, p in raw if p == r["payload"]), "")
        base = raw.get((t, r["payload"]))
        r["vs_raw_zmq"] = r["p50_us"] / base["p50_us"] if base else None
        r["throughput_vs_raw_zmq"] = base["msgs_per_s"] / r["msgs_per_s"] if base else None
        r["ray_p50_over_this"] = ray_p50[r["payload"]] / r["p50_us"] if r["payload"] in ray_p50 else None

    table = Table(title=f"bus round trips (servers in other processes; {args.n} small / {args.n_large} x 1 MiB "
                        f"in {args.rounds} interleaved rounds, window {args.window}; MiB/s one way; "
                        "ray vs raw over tcp)")
    cols = ("kind", "mechanism", "transport", "payload", "p50 µs", "p99 µs", "CPU µs", "msgs/s", "MiB/s",
            "p50 vs raw", "throughput: raw / this", "Ray p50 / this", "connect µs")
    for col in cols:
        table.add_column(col, justify="left" if col in ("kind", "mechanism", "transport", "payload") else "right")

    def x(v: float | None) -> str:
        return "—" if v is None else f"{v:.2f}x"

    for r in rows:
        table.add_row(r["kind"], r["mechanism"], r["transport"], r["payload"], f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}",
                      f"{r['cpu_us']:.0f}", f"{r['msgs_per_s']:.0f}", f"{r['mib_per_s']:.1f}", x(r["vs_raw_zmq"]),
                      x(r["throughput_vs_raw_zmq"]), x(r["ray_p50_over_this"]),
                      "—" if r["connect_us"] is None else f"{r['connect_us']:.0f}")
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 150)
    console.print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, 1, "cpu"), "args": asdict(args), "results": rows}, f, indent=1)


if __name__ == "__main__":
    main()
