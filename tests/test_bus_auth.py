"""Every bus socket authenticates its peers (issue #14): a process without the run's secret gets
no frame decoded by a server or a puller, refusals are counted and logged, a process given the
secret is served, and a bad secret is refused with the reason."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap

import pytest
import zmq
import zmq.asyncio
from conftest import offer, run, until

from opentinker.bus import Client, CurveKeys, Puller, Pusher, Server, auth
from opentinker.bus.auth import SECRET_ENV, USERNAME, run_secret
from protocols.codec import encode
from protocols.messages import PROTOCOL_VERSION, Ack, AdamParams, Hello, OptimStep, Trajectory


async def _echo(msg):
    return Ack()


def _stranger(ctx: zmq.asyncio.Context, ep: str, how: str) -> zmq.asyncio.Socket:
    """A DEALER that says Hello and sends a request: with no credentials, a wrong secret, or
    CURVE (to a PLAIN server)."""
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    if how == "wrong":
        s.plain_username, s.plain_password = USERNAME.encode(), b"x" * 43
    elif how == "curve":
        public, secret = zmq.curve_keypair()
        s.curve_publickey, s.curve_secretkey, s.curve_serverkey = public, secret, zmq.curve_keypair()[0]
    s.connect(ep)
    return s


def test_peers_without_the_secret_get_nothing_decoded(caplog):
    async def main():
        ctx = zmq.asyncio.Context()
        server = Server(_echo, heartbeat_s=None, name="guarded")
        ep = await server.start(ctx)
        strangers = [_stranger(ctx, ep, how) for how in ("none", "wrong", "curve")]
        for s in strangers:  # queued where the connection is not refused yet
            offer(s, encode(Hello(version=PROTOCOL_VERSION, peer="stranger"), 1))
            offer(s, encode(OptimStep(adapter="a", params=AdamParams()), 2))
        good = Client(ctx, ep, name="good", heartbeat_s=None)
        assert isinstance(await good.request(OptimStep(adapter="b", params=AdamParams()), 10), Ack)
        await until(lambda: server.counters["auth_denied"] >= 1, "the wrong secret refused")
        for s in strangers:
            assert await s.poll(300, zmq.POLLIN) == 0  # no reply, not even an error
            s.close(0)
        # Only the good client's frames were ever decoded: one handshake, one request.
        assert server.counters["handshakes"] == 1 and server.counters["recv/OptimStep"] == 1
        assert not [k for k in server.counters if k.startswith(("error/", "dropped/"))]
        good.close()
        await server.stop()
        ctx.destroy(0)

    with caplog.at_level("WARNING", logger="opentinker.bus.auth"):
        run(main())
    assert "refused a connection to guarded: wrong credentials" in caplog.text
    assert run_secret().decode() not in caplog.text


def _trajectory(episode: int) -> Trajectory:
    return Trajectory(episode_id=episode, group_id=0, seat="player_0", seed=0, policy="p", turns=[], total_reward=0.0)


def test_a_puller_takes_only_authenticated_pushes():
    async def main():
        ctx = zmq.asyncio.Context()
        puller = Puller(ctx)
        bad = ctx.socket(zmq.PUSH)
        bad.setsockopt(zmq.LINGER, 0)
        bad.plain_username, bad.plain_password = USERNAME.encode(), b"y" * 40
        bad.connect(puller.endpoint)
        offer(bad, encode(_trajectory(1), 0))
        good = Pusher(ctx, puller.endpoint)
        await good.send(_trajectory(2))
        got = await asyncio.wait_for(puller.recv(), 10)
        assert got.episode_id == 2
        await until(lambda: puller.counters["auth_denied"] >= 1, "the bad pusher refused")
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(puller.recv(), 0.3)
        bad.close(0)
        good.close()
        puller.close()
        ctx.destroy(0)

    run(main())


CONNECT = textwrap.dedent('''
    import sys
    from opentinker.bus import SyncClient
    from protocols.messages import OptimStep, AdamParams
    try:
        with SyncClient(sys.argv[1], "other-process", connect_timeout=1.5) as c:
            print(type(c.request(OptimStep(adapter="z", params=AdamParams()), timeout=3)).__name__)
    except TimeoutError:
        print("timeout")
''')


@pytest.mark.slow
def test_another_process_needs_the_runs_secret(tmp_path):
    """A process started without the secret (another user's, or one that made its own) cannot
    be served; the same program given the secret in its environment is."""
    from opentinker.bus import LoopThread

    lt = LoopThread("guarded")
    server = Server(_echo, heartbeat_s=None, name="guarded")
    ep = lt.run(server.start(lt.ctx))
    try:
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        outside = subprocess.run([sys.executable, "-c", CONNECT, ep], env=env, capture_output=True, text=True,
                                 timeout=120, cwd=tmp_path)
        inside = subprocess.run([sys.executable, "-c", CONNECT, ep], env={**env, SECRET_ENV: run_secret().decode()},
                                capture_output=True, text=True, timeout=120, cwd=tmp_path)
    finally:
        lt.run(server.stop())
        lt.stop()
    assert outside.stdout.strip() == "timeout", outside.stderr[-2000:]
    assert inside.stdout.strip() == "Ack", inside.stderr[-2000:]
    assert server.counters["handshakes"] == 1 and server.counters["auth_denied"] >= 1


def test_bad_secrets_are_refused_with_the_reason(monkeypatch):
    monkeypatch.setattr(auth, "_secret", None)
    monkeypatch.setenv(SECRET_ENV, "short")
    with pytest.raises(ValueError, match=r"\$OPENTINKER_BUS_SECRET: a bus secret is 32 to 255 printable ASCII characters \(got 5"):
        run_secret()
    with pytest.raises(ValueError, match="printable ASCII"):
        auth.set_run_secret("é" * 40)
    monkeypatch.setenv(SECRET_ENV, "s" * 40)
    assert run_secret() == b"s" * 40


def test_zap_handlers_stop_with_their_last_socket():
    async def main():
        ctx = zmq.asyncio.Context()
        before = auth.handlers_running()
        a, b = Server(_echo, heartbeat_s=None, name="a"), Server(_echo, heartbeat_s=None, name="b")
        await a.start(ctx)
        await b.start(ctx)
        assert auth.handlers_running() == before + 1  # one per context
        await a.stop()
        assert auth.handlers_running() == before + 1
        await b.stop()
        assert auth.handlers_running() == before
        ctx.destroy(0)

    run(main())


@pytest.fixture
def run_on_curve():
    """This process's sockets on a fresh run CURVE pair (servers bound to 127.0.0.1), PLAIN again after."""
    keys = CurveKeys.generate()
    pair = (keys.public.decode(), keys.secret.decode())
    auth.set_run_curve(pair, host="127.0.0.1")
    try:
        yield pair
    finally:
        auth.set_run_curve(None)


def test_a_run_on_curve_takes_only_its_own_key(run_on_curve):
    """With the run's CURVE pair set (a job with ``runtime.curve`` or on a cluster), servers and
    pullers made without keys are CURVE servers that accept only the run's key: a client and a
    pusher made without keys talk to them; a PLAIN peer with the run's secret and a CURVE peer
    with another key get nothing decoded (the other key is refused by ZAP, counted)."""
    from opentinker.bus.common import run_keys

    async def main():
        ctx = zmq.asyncio.Context()
        server = Server(_echo, heartbeat_s=None, name="curved")
        ep = await server.start(ctx)
        assert server.keys == run_keys() and server.keys.public == run_on_curve[0].encode()
        assert ep.startswith("tcp://127.0.0.1:")
        plain = ctx.socket(zmq.DEALER)  # the run's secret, but PLAIN
        plain.setsockopt(zmq.LINGER, 0)
        plain.plain_username, plain.plain_password = USERNAME.encode(), run_secret()
        plain.connect(ep)
        other = ctx.socket(zmq.DEALER)  # knows the server's public key, has a key pair of its own
        other.setsockopt(zmq.LINGER, 0)
        other.curve_publickey, other.curve_secretkey = zmq.curve_keypair()
        other.curve_serverkey = run_on_curve[0].encode()
        other.connect(ep)
        for s in (plain, other):
            offer(s, encode(Hello(version=PROTOCOL_VERSION, peer="stranger"), 1))
        good = Client(ctx, ep, name="good", heartbeat_s=None)
        assert isinstance(await good.request(OptimStep(adapter="b", params=AdamParams()), 10), Ack)
        await until(lambda: server.counters["auth_denied"] >= 1, "the other key refused")
        for s in (plain, other):
            assert await s.poll(300, zmq.POLLIN) == 0
            s.close(0)
        assert server.counters["handshakes"] == 1
        puller = Puller(ctx)
        pusher = Pusher(ctx, puller.endpoint)
        await pusher.send(_trajectory(3))
        assert (await asyncio.wait_for(puller.recv(), 10)).episode_id == 3
        for c in (good, pusher, puller):
            c.close()
        await server.stop()
        ctx.destroy(0)

    run(main())
    auth.set_run_curve(None)
    with pytest.raises(ValueError, match="run CURVE secret key: 40 Z85 characters"):
        auth.set_run_curve((run_on_curve[0], "short"))
    with pytest.raises(ValueError, match="bind host"):
        auth.set_run_curve(run_on_curve, host="0.0.0.0/8")
