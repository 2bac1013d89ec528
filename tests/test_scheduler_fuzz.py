"""Fuzz a real scheduler (tiny-random) with hostile requests of every class of issue #14 that
reaches it, from an authenticated peer: work no bound allows (``max_tokens`` of 0 or 10**9,
prompts over the context), bad arrays (2-D, float, empty, out of the vocabulary; a move term's
ids), adapter paths
outside the run's folder, dropping another peer's adapter, ``Shutdown`` from a non-owner,
unknown adapters and losses, non-finite optimizer settings, and request ids reused from
another peer. Every request gets a typed error or a reply, never ``internal``; the owner's
requests keep being served with its adapter intact; nothing is written outside the run's
folder."""

from __future__ import annotations

import asyncio
import collections

import numpy as np
import pytest
import zmq
import zmq.asyncio
from conftest import DEVICE, run

from opentinker.bus import Client, RemoteError
from protocols.messages import (
    AdamParams,
    CreateAdapter,
    Datum,
    DropAdapter,
    ErrorCode,
    ForwardBackward,
    LoadAdapter,
    LogprobsRequest,
    LogprobsResult,
    LoraSpec,
    OptimStep,
    SampleRequest,
    SamplingParams,
    SaveAdapter,
    Shutdown,
)

N_REQUESTS = 240
OWNER_EVERY = 20


def hostile(rng: np.random.Generator, run_dir: str, outside: str, n: int):
    """One hostile request of a class chosen by ``rng`` (``n``: a fresh name)."""
    toks = np.arange(1, 9, dtype=np.int32)
    kind = int(rng.integers(11))
    if kind == 0:  # work no bound allows
        return SampleRequest(adapter="pol", prompts=[toks], params=SamplingParams(max_tokens=int(rng.choice([10**9, 65, 2048]))))
    if kind == 1:
        return SampleRequest(adapter=None, prompts=[np.ones(int(rng.choice([2047, 5000])), np.int32)],
                             params=SamplingParams(max_tokens=8))
    if kind == 2:  # bad arrays
        bad = [np.stack([toks, toks]), toks.astype(np.float32), np.zeros(0, np.int32), toks + 10**6, -toks, toks > 3]
        return LogprobsRequest(adapter=None, sequences=[toks, bad[int(rng.integers(len(bad)))]])
    if kind == 3 and rng.random() < 0.5:
        return ForwardBackward(adapter="pol", loss=str(rng.choice(["ppo", "no_such_loss"])), normalizer=1.0,
                               datums=[Datum(tokens=toks, loss_inputs={"mask": np.ones(int(rng.integers(1, 12)), np.float32)})])
    if kind == 3:  # the move_values term's [T, M] inputs: ids out of the vocabulary, floats, 1-D, missing
        mask = np.ones(8, np.float32)
        ids = [np.full((8, 3), 10**6, np.int32), np.full((8, 3), 2.5, np.float32), np.ones(8, np.int32),
               np.full((8, 3), -7, np.int32), None][int(rng.integers(5))]
        moves = {} if ids is None else {"move_tokens": ids, "move_weights": np.zeros(np.shape(ids), np.float32)}
        return ForwardBackward(adapter="pol", loss="ppo", normalizer=1.0, loss_config={"move_values": 1.0},
                               datums=[Datum(tokens=toks, loss_inputs={"mask": mask, "advantages": mask,
                                                                       "sampler_logprobs": -mask, **moves})])
    if kind == 4:  # paths outside the run's folder
        path = str(rng.choice([f"{outside}/x{n}", f"{run_dir}/../outside/y{n}", f"{run_dir}/link/z{n}", f"rel{n}", "/"]))
        return SaveAdapter(adapter="pol", path=path)
    if kind == 5:
        return LoadAdapter(path=str(rng.choice([outside, f"{run_dir}/link", "/etc", f"{run_dir}/missing"])), name=f"l{n}")
    if kind == 6:  # another peer's adapter, or none at all
        return DropAdapter(name=str(rng.choice(["pol", f"ghost{n}"])))
    if kind == 7:  # only owners stop a server
        return Shutdown(reason="fuzz")
    if kind == 8:  # unknown adapter, or settings no optimizer can take
        return OptimStep(adapter=str(rng.choice(["pol", f"ghost{n}"])),
                         params=AdamParams(lr=float(rng.choice([1e-3, -1.0, float("inf"), float("nan")]))))
    if kind == 9:
        return SampleRequest(adapter=f"ghost{n}", prompts=[toks], params=SamplingParams(max_tokens=2, temperature=float(rng.choice([1.0, -1.0, float("nan")]))))
    return CreateAdapter(name=f"f{n}", spec=LoraSpec(rank=int(rng.choice([2, 0, 10**6]))))


@pytest.mark.slow
def test_fuzzing_a_real_scheduler_never_stops_it(tiny_path, tmp_path):
    from opentinker.engine.service import SchedulerService

    run_dir, outside = tmp_path / "run", tmp_path / "outside"
    run_dir.mkdir()
    outside.mkdir()
    (run_dir / "link").symlink_to(outside)
    s = SchedulerService(tiny_path, threads=1, device=DEVICE, adapter_roots=[str(run_dir)])
    s.start()
    seq = np.arange(1, 7, dtype=np.int32)
    try:
        async def main():
            ctxs = [zmq.asyncio.Context() for _ in range(2)]
            owner, fuzzer = (Client(c, s.endpoint, name=n) for c, n in zip(ctxs, ("coordinator", "fuzzer")))
            await owner.request(CreateAdapter(name="pol", spec=LoraSpec(rank=2, seed=3)))
            before = (await owner.request(LogprobsRequest(adapter="pol", sequences=[seq]))).logprobs[0]
            rng = np.random.default_rng(14)
            codes: collections.Counter = collections.Counter()
            owner_rids = []
            for n in range(N_REQUESTS):
                msg = hostile(rng, str(run_dir), str(outside), n)
                # Every fifth request reuses a request id the owner used: it is the fuzzer's own.
                rid = owner_rids[int(rng.integers(len(owner_rids)))] if owner_rids and n % 5 == 0 else None
                try:
                    reply = await fuzzer.request(msg, timeout=60, request_id=rid)
                    codes[f"ok/{type(reply).__name__}"] += 1
                except RemoteError as e:
                    codes[e.error.code.value] += 1
                if n % OWNER_EVERY == OWNER_EVERY - 1:
                    rid = owner.next_request_id()
                    owner_rids.append(rid)
                    got = await owner.request(LogprobsRequest(adapter="pol", sequences=[seq]), request_id=rid)
                    assert isinstance(got, LogprobsResult)
                    np.testing.assert_allclose(got.logprobs[0], before, atol=1e-6)  # nobody changed it
            after = await owner.request(LogprobsRequest(adapter="pol", sequences=[seq]))
            for c in (owner, fuzzer):
                c.close()
            for c in ctxs:
                c.destroy(0)
            return codes, after

        codes, after = run(main(), timeout=600)
    finally:
        s.stop()
    print(dict(codes))
    assert codes[ErrorCode.INTERNAL.value] == 0 and s.server.counters["error/internal"] == 0
    assert codes[ErrorCode.INVALID.value] > N_REQUESTS // 3 and codes[ErrorCode.NOT_FOUND.value] > 0
    assert isinstance(after, LogprobsResult)
    assert sorted(p.name for p in outside.iterdir()) == []  # nothing written outside the run's folder


def test_a_saved_adapter_with_a_hostile_spec_is_refused_before_allocation(scheduler, tmp_path):
    """A checkpoint folder whose ``opentinker.json`` was edited to rank 10**6 (it used to be
    allocated: gigabytes) is refused as ``invalid`` naming the file; the scheduler keeps serving."""
    import json

    from conftest import with_client

    folder = tmp_path / "pol"

    async def body(c):
        await c.request(CreateAdapter(name="pol", spec=LoraSpec(rank=2)))
        await c.request(SaveAdapter(adapter="pol", path=str(folder)))
        meta = json.loads((folder / "opentinker.json").read_text())
        meta["spec"]["rank"] = 10**6
        (folder / "opentinker.json").write_text(json.dumps(meta))
        with pytest.raises(RemoteError) as e:
            await c.request(LoadAdapter(path=str(folder), name="big"))
        ok = await c.request(LogprobsRequest(adapter="pol", sequences=[np.arange(1, 5, dtype=np.int32)]))
        return e.value.error, ok

    err, ok = run(with_client(scheduler, body))
    assert err.code is ErrorCode.INVALID and "opentinker.json: LoraSpec.rank must be in [1," in err.message, err
    assert isinstance(ok, LogprobsResult)
