"""Shared fixtures: the tiny-random model folder, the engine's and the PEFT host on it, a
scheduler on the bus, and one Ray session for the few tests that go through Ray
(../shared/DESIGN.md §7)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

import opentinker  # noqa: F401  (before any test loads torch: it sets GOMP_SPINCOUNT)
import zmq.asyncio
from opentinker.bus import Client

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

DEVICE = os.environ.get("OPENTINKER_TEST_DEVICE", "cpu")
"""Torch device of the model in tests (``cuda`` on a GPU machine; CI has none)."""


@pytest.fixture(scope="session")
def tiny_path() -> str:
    """The tiny-random model folder (``OPENTINKER_TEST_MODEL`` points at a copy elsewhere)."""
    from opentinker.engine.model_specs import resolve_model

    return os.environ.get("OPENTINKER_TEST_MODEL") or resolve_model("tiny-random")


@pytest.fixture(scope="module")
def hosts(tiny_path):
    """The engine's host and the PEFT host on the tiny model, with the same adapter ``"pol"``
    (rank 4, its B weights nonzero)."""
    import torch

    from opentinker.engine.host import ModelHost
    from protocols.messages import LoraSpec

    own = ModelHost(tiny_path, threads=1, device=DEVICE, engine="own",
                    engine_options={"kv_budget_bytes": 16 << 20, "block_size": 4})
    peft = ModelHost(tiny_path, threads=1, device=DEVICE, engine="peft")
    for h in (own, peft):
        h.create_adapter("pol", LoraSpec(rank=4, seed=5))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for k, p in own.adapters["pol"].named.items():
            if "lora_B" in k:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
            peft.adapters["pol"].named[k].copy_(p)
    return own, peft


@pytest.fixture(scope="session")
def chat_tok(tiny_path):
    from opentinker.rollout.render import ChatTokenizer

    return ChatTokenizer(tiny_path)


@pytest.fixture()
def scheduler(tiny_path):
    from opentinker.engine.service import SchedulerService

    s = SchedulerService(tiny_path, threads=1, device=DEVICE)  # 2 torch threads spin on a busy 2-core box
    s.start()
    yield s
    s.stop()


@pytest.fixture(scope="session")
def ray_session():
    ray = pytest.importorskip("ray")
    ray.init(  # "local": a new instance, never the cluster another run's file names
        address="local", _node_ip_address="127.0.0.1", include_dashboard=False, num_cpus=2,
        object_store_memory=100 * 1024 * 1024, log_to_driver=False, configure_logging=False,
    )
    yield ray
    ray.shutdown()


@contextlib.contextmanager
def private_ray_tmp() -> Iterator[Path]:
    """A folder for a Ray started in a subprocess (its ``RAY_TMPDIR``), removed afterwards:
    the ``ray_current_cluster`` a cluster writes there is never seen by a plain ``ray.init()``
    elsewhere on the machine, even if the test is killed. Short (under ``/tmp``): Ray's socket
    paths must fit 107 bytes."""
    root = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))
    try:
        yield root
    finally:
        shutil.rmtree(root, ignore_errors=True)


def with_overrides(raw: dict, over: dict) -> dict:
    """``raw`` (a job config's tables) with ``over``'s tables merged in, other keys replaced."""
    for k, v in over.items():
        if isinstance(v, dict):
            raw.setdefault(k, {}).update(v)
        else:
            raw[k] = v
    return raw


def run(coro, timeout: float = 120.0):
    """Run a coroutine to completion with a bound on its time."""
    return asyncio.run(asyncio.wait_for(coro, timeout))


async def until(predicate, what: str, n: int = 500) -> None:
    """Yield to the loop until ``predicate()``: at most ``n`` times 10 ms."""
    for _ in range(n):
        if predicate():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def offer(sock: zmq.Socket, frames: list[bytes]) -> bool:
    """Queue ``frames`` on a stranger's socket without waiting: True when queued, False when it
    has no connection to queue on. A socket whose handshake a server refused can be left with
    none (libzmq drops the connection and may not reconnect), and a blocking send on it would
    wait for ever: under load the refusal can come before the stranger's first send."""
    try:
        zmq.Socket.shadow(sock.underlying).send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        return False
    return True


async def with_client(server, body, name: str = "test"):
    """``await body(client)`` with a fresh bus client of ``server.endpoint`` (its own ZeroMQ
    context), closed afterwards whatever happens."""
    ctx = zmq.asyncio.Context()
    client = Client(ctx, server.endpoint, name=name)
    try:
        return await body(client)
    finally:
        client.close()
        ctx.destroy(0)


def play_to_end(env, replies, max_iter: int = 100):
    """Step ``replies`` in order for whoever is to act, then drain the dead steps; return each
    agent's total reward, checking every observation lies in its space and every reply is used."""
    totals = {a: 0.0 for a in env.possible_agents}
    pending = list(replies)
    for agent in env.agent_iter(max_iter=max_iter):
        obs, reward, term, trunc, _ = env.last()
        assert env.observation_space(agent).contains(obs), obs
        totals[agent] += reward
        env.step(None if term or trunc else pending.pop(0))
    assert not pending and not env.agents
    return totals


def read_tensorboard(folder) -> dict[str, list[tuple[int, float]]]:
    """Scalars by tag, ``[(step, value), ...]``, from every TensorBoard event file in ``folder``
    as TensorBoard shows them: files in name (= time) order, each record's CRCs checked, and a
    ``SessionLog.START`` at step s (a resumed writer's ``purge_step``) drops what came before it
    at step >= s."""
    import struct
    from pathlib import Path

    from tensorboardX.proto.event_pb2 import Event, SessionLog
    from tensorboardX.record_writer import masked_crc32c

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(Path(folder).glob("events.out.tfevents.*")):
        data = path.read_bytes()
        at = 0
        while at < len(data):
            header = data[at:at + 8]
            (n,) = struct.unpack("<Q", header)
            assert struct.unpack("<I", data[at + 8:at + 12])[0] == masked_crc32c(header), path
            body = data[at + 12:at + 12 + n]
            assert struct.unpack("<I", data[at + 12 + n:at + 16 + n])[0] == masked_crc32c(body), path
            at += 16 + n
            ev = Event.FromString(body)
            if ev.HasField("session_log") and ev.session_log.status == SessionLog.START:
                scalars = {t: kept for t, pts in scalars.items() if (kept := [(s, v) for s, v in pts if s < ev.step])}
            for v in ev.summary.value:
                scalars.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return scalars


PROVENANCE = {"commit", "dirty", "command", "config", "versions", "cpu", "capability", "cores", "device", "torch",
              "torch_threads", "date", "env"}
"""What every benchmark result JSON records about where its figures come from."""


def check_provenance(report: dict, script: str) -> None:
    """``report["provenance"]`` names the commit, the command (``script`` and its flags), the
    config, the package versions and the machine."""
    prov = report["provenance"]
    assert PROVENANCE <= set(prov), PROVENANCE - set(prov)
    assert prov["command"].split()[0] == script and prov["cores"] >= 1 and prov["versions"]["torch"]
    assert prov["commit"] == "unknown" or len(prov["commit"]) == 40
    assert isinstance(prov["config"], dict) and prov["capability"]


@pytest.fixture
def one_request_per_batch(monkeypatch):
    """The PEFT path batches the sample requests that arrive together, and a row's numbers
    depend, at float rounding, on its batch-mates, so which requests met depended on timing
    (about one run in three replayed a step with other tokens). One request per batch makes
    sampling independent of arrival times: what differs then is only what a resume restores."""
    from opentinker.engine import service

    init = service.SchedulerService.__init__

    def alone(self, *args, **kwargs):
        init(self, *args, **{**kwargs, "max_batch_rows": 1, "batch_window_s": 0.0})

    monkeypatch.setattr(service.SchedulerService, "__init__", alone)


def start_serve(file, *args: str, **popen):
    """``opentinker serve --no-http --service-file FILE ARGS`` in a process of its own,
    returned once its service file is written (asserted within 120 s)."""
    import subprocess
    import sys
    import time

    proc = subprocess.Popen([sys.executable, "-m", "opentinker.cli", "serve", "--no-http", "--service-file", str(file),
                             *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, **popen)
    deadline = time.monotonic() + 120
    while not file.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not file.is_file():
        proc.kill()
        raise AssertionError(f"no service file: {proc.communicate(timeout=60)[0][-3000:]}")
    return proc
