"""The engine on the tiny-random model: continuous batching through the scheduler, prefix
reuse across turns, batch-invariant seeded sampling, sampler = trainer, the engine against the
PEFT path, streaming, cancellation, fairness between sampling and training, and bad input."""

from __future__ import annotations

import asyncio
import collections
import time

import numpy as np
import pytest
import torch

from conftest import DEVICE, run, with_client
from opentinker.bus import RemoteError
from protocols.messages import (
    AdamParams, CreateAdapter, Datum, ErrorCode, ForwardBackward, LoraSpec, OptimStep,
    SampleChunk, SampleRequest, SamplingParams, SchedulerStats, StopReason,
)

SPEC = LoraSpec(rank=4, seed=5)


def _prompts(n: int, seed: int = 0, lo: int = 6, hi: int = 40) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(10, 4000, size=int(rng.integers(lo, hi))).astype(np.int32) for _ in range(n)]


def test_engine_host_matches_the_peft_host(hosts):
    """Same base fingerprint, same initial adapter, log-probs within 1e-5, forward_backward
    gradients equal, saved adapters load across the two paths."""
    own, peft = hosts
    assert own.base_fingerprint == peft.base_fingerprint
    seqs = _prompts(4, seed=1)
    for a in ("pol", None):
        for x, y in zip(own.logprobs(a, seqs), peft.logprobs(a, seqs)):
            np.testing.assert_allclose(x, y, atol=1e-5)
    d = Datum(tokens=seqs[0], loss_inputs={"mask": np.r_[np.zeros(3), np.ones(len(seqs[0]) - 3)].astype(np.float32),
                                           "advantages": np.ones(len(seqs[0]), np.float32),
                                           "sampler_logprobs": np.full(len(seqs[0]), -10.8, np.float32)})
    grads = []
    for h in (own, peft):
        h.forward_backward("pol", [d], "ppo", {}, 10.0)
        grads.append({k: p.grad.clone() for k, p in h.adapters["pol"].named.items()})
        for p in h.adapters["pol"].params:
            p.grad = None
        h.adapters["pol"].pending_grad = False
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=1e-6, rtol=1e-4)


def test_adapters_saved_by_one_path_load_in_the_other(hosts, tmp_path):
    own, peft = hosts
    seq = _prompts(1, seed=2)
    for src, dst, name in ((own, peft, "from_own"), (peft, own, "from_peft")):
        src.save("pol", str(tmp_path / name))
        dst.load(str(tmp_path / name), name)
        np.testing.assert_allclose(dst.logprobs(name, seq)[0], src.logprobs("pol", seq)[0], atol=1e-5)
        dst.drop_adapter(name)
    from peft import PeftModel  # the files are PEFT's own format
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(own.model_path)
    model = PeftModel.from_pretrained(base, str(tmp_path / "from_own"))
    ids = torch.as_tensor(seq[0][None].astype(np.int64))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    np.testing.assert_allclose(logp.numpy(), own.logprobs("pol", seq)[0][1:], atol=1e-5)


def test_seeded_rows_draw_the_same_whatever_the_batch(hosts):
    """A row draws the same tokens (log-probs within 1e-5) alone, among 31 others, and when it
    joins a batch that is already running."""
    own, _ = hosts
    eng = own.engine
    params = SamplingParams(max_tokens=10, temperature=1.3, top_p=0.95)
    prompts = _prompts(32, seed=3)
    target = prompts[7]
    alone = eng.add("pol", target, params, seed=99)
    eng.run_until_done([alone])
    crowd = [eng.add("pol" if i % 3 else None, p, params, seed=1000 + i) for i, p in enumerate(prompts)]
    among = eng.add("pol", target, params, seed=99)
    eng.run_until_done(crowd + [among])
    early = [eng.add(None, p, params, seed=2000 + i) for i, p in enumerate(prompts[:8])]
    for _ in range(4):
        eng.step()
    late = eng.add("pol", target, params, seed=99)
    eng.run_until_done(early + [late])
    for other in (among, late):
        assert other.out_tokens == alone.out_tokens
        np.testing.assert_allclose(other.out_logprobs, alone.out_logprobs, atol=1e-5)
    assert len({tuple(s.out_tokens) for s in crowd}) == len(crowd)  # rows have their own randomness


def test_sampler_logprobs_equal_the_trainers(hosts):
    own, _ = hosts
    rows = own.sample(["pol", None, "pol"], _prompts(3, seed=4), [SamplingParams(max_tokens=8)] * 3, [1, 2, 3])
    for a, p, r in zip(["pol", None, "pol"], _prompts(3, seed=4), rows):
        teacher = own.logprobs(a, [np.concatenate([p, r.tokens])])[0][len(p):]
        np.testing.assert_allclose(teacher, r.logprobs, atol=1e-5)
    # At another temperature too: the teacher scores softmax(logits / T), as the sampler drew.
    hot = own.sample(["pol"], _prompts(1, seed=6), [SamplingParams(max_tokens=8, temperature=2.0)], [4])[0]
    p = _prompts(1, seed=6)[0]
    seq = [np.concatenate([p, hot.tokens])]
    np.testing.assert_allclose(own.logprobs("pol", seq, temperature=2.0)[0][len(p):], hot.logprobs, atol=1e-5)
    assert not np.allclose(own.logprobs("pol", seq)[0][len(p):], hot.logprobs, atol=1e-3)


def test_a_seats_next_turn_prefills_only_its_new_tokens(hosts):
    own, _ = hosts
    eng = own.engine
    params = SamplingParams(max_tokens=6)
    prompt = _prompts(1, seed=5, lo=60, hi=61)[0]
    first = eng.add("pol", prompt, params, seed=1)
    eng.run_until_done([first])
    new_obs = np.arange(100, 113, dtype=np.int32)
    turn2 = np.concatenate([prompt, np.asarray(first.out_tokens, np.int32), new_obs])
    before = eng.stats.prefill_tokens
    second = eng.add("pol", turn2, params, seed=2)
    eng.run_until_done([second])
    computed = eng.stats.prefill_tokens - before
    new_tokens = len(new_obs) + 1  # plus the last sampled token, whose KV was never computed
    assert new_tokens <= computed < new_tokens + eng.block_size
    # Another adapter version never reuses it: after an optimizer step the prefix is gone.
    assert second.num_cached > 0
    d = Datum(tokens=turn2, loss_inputs={"mask": np.r_[np.zeros(len(turn2) - 3), np.ones(3)].astype(np.float32),
                                         "advantages": np.ones(len(turn2), np.float32),
                                         "sampler_logprobs": np.full(len(turn2), -10.8, np.float32)})
    own.forward_backward("pol", [d], "ppo", {}, 3.0)
    own.optim_step("pol", AdamParams(lr=1e-3))
    third = eng.add("pol", turn2, params, seed=2)
    eng.run_until_done([third])
    assert third.num_cached == 0 and third.version == second.version + 1


def test_bad_requests_get_typed_errors_and_the_engine_keeps_serving(hosts):
    own, _ = hosts
    ok = _prompts(1, seed=6)[0]
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        own.sample(["nope"], [ok], [SamplingParams()], [0])
    with pytest.raises(ValueError, match="exceeds the model's context of 2048"):
        own.sample([None], [np.full(2040, 5, np.int32)], [SamplingParams(max_tokens=16)], [0])
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        own.sample([None], [ok], [SamplingParams(max_tokens=0)], [0])
    with pytest.raises(ValueError, match=r"SampleRequest.prompts\[0\] must be a 1-D integer array"):
        own.sample([None], [ok.astype(np.float32)], [SamplingParams()], [0])
    # Training and scoring take the same check as sampling (and the bus): float ids are refused.
    with pytest.raises(ValueError, match=r"ForwardBackward.datums.tokens\[0\] must be a 1-D integer array"):
        own.forward_backward("pol", [Datum(tokens=ok.astype(np.float32), loss_inputs={
            "mask": np.ones(len(ok), np.float32), "advantages": np.ones(len(ok), np.float32),
            "sampler_logprobs": np.zeros(len(ok), np.float32)})], "ppo", {}, 1.0)
    with pytest.raises(ValueError, match=r"LogprobsRequest.sequences\[1\]: token id 50000 out of range"):
        own.logprobs(None, [ok, np.array([1, 50000])])
    bad = Datum(tokens=ok, loss_inputs={"mask": np.ones(len(ok), np.float32),
                                        "advantages": np.full(len(ok), np.nan, np.float32),
                                        "sampler_logprobs": np.zeros(len(ok), np.float32)})
    with pytest.raises(ValueError, match=r"advantages.*not finite"):
        own.forward_backward("pol", [bad], "ppo", {}, 1.0)
    assert len(own.sample([None], [ok], [SamplingParams(max_tokens=3)], [0])[0].tokens) == 3


def test_a_kv_budget_too_small_for_one_request_is_refused(tiny_path):
    from opentinker.engine.host import ModelHost

    host = ModelHost(tiny_path, threads=1, device=DEVICE, engine="own",
                     engine_options={"kv_budget_bytes": 64 * 1024, "block_size": 4})  # 32 blocks of 4
    with pytest.raises(ValueError, match="KV blocks"):
        host.sample([None], [np.arange(10, 150, dtype=np.int32)], [SamplingParams(max_tokens=8)], [0])
    assert len(host.sample([None], [np.arange(10, 40, dtype=np.int32)], [SamplingParams(max_tokens=4)], [0])[0].tokens) == 4


# ---------------------------------------------------------------------------------------------
# Through the scheduler's step loop


@pytest.fixture()
def sched(tiny_path):
    from opentinker.engine.service import SchedulerService

    s = SchedulerService(tiny_path, threads=1, device=DEVICE, engine="own", fair_window_s=0.5,
                  engine_options={"kv_budget_bytes": 16 << 20, "block_size": 4})
    s.start()
    yield s
    s.stop()


def test_a_request_joins_a_running_batch_and_streams(sched):
    """A short request sent while a long one runs finishes first (it joined the running batch);
    streamed chunks arrive in order before the final reply and add up to it."""
    long = SamplingParams(max_tokens=120, seed=1)
    short = SamplingParams(max_tokens=4, seed=2)
    chunks: list[SampleChunk] = []

    async def body(c):
        slow = asyncio.ensure_future(c.request(SampleRequest(adapter=None, prompts=_prompts(1, 7), params=long,
                                                             client="slow")))
        for _ in range(400):
            if sched.compute_counters["engine_steps"] >= 3:
                break
            await asyncio.sleep(0.01)
        fast = await c.request(SampleRequest(adapter=None, prompts=_prompts(2, 8), params=short, client="fast",
                                             stream=True), on_partial=chunks.append)
        assert not slow.done(), "the long request ended before the short one: no continuous batching"
        return fast, await slow, await c.request(SchedulerStats())

    fast, slow, stats = run(with_client(sched, body, "engine-test"))
    assert [len(t) for t in slow.tokens] == [120] and [len(t) for t in fast.tokens] == [4, 4]
    assert any(set(b) == {"slow", "fast"} for b in stats.batches)
    assert [c.seq for c in chunks] == list(range(len(chunks))) and len(chunks) >= 2
    for row in (0, 1):
        got = np.concatenate([t for c in chunks for r, t in zip(c.rows, c.tokens) if r == row])
        np.testing.assert_array_equal(got, fast.tokens[row])
    assert stats.counters["engine/running_rows"] == 0 and stats.counters["engine/kv_blocks_in_use"] == 0


def test_a_cancelled_request_frees_its_rows_at_the_next_step(sched):
    long = SamplingParams(max_tokens=500, seed=1)

    async def body(c):
        task = asyncio.ensure_future(c.request(SampleRequest(adapter=None, prompts=_prompts(3, 9), params=long)))
        for _ in range(400):
            if sched.compute_counters["engine_steps"] >= 3:
                break
            await asyncio.sleep(0.01)
        task.cancel()
        for _ in range(400):
            if sched.host.engine.stats.cancelled == 3:
                break
            await asyncio.sleep(0.01)
        return await c.request(SchedulerStats())

    stats = run(with_client(sched, body, "engine-test"))
    assert sched.host.engine.stats.cancelled == 3
    assert stats.counters["engine/running_rows"] == 0 and stats.counters["engine/kv_blocks_in_use"] == 0
    assert stats.counters["engine/decode_tokens"] < 3 * 500


def _datum(n: int = 40) -> Datum:
    tokens = np.arange(10, 10 + n, dtype=np.int32)
    mask = np.r_[np.zeros(n // 2), np.ones(n - n // 2)].astype(np.float32)
    return Datum(tokens=tokens, loss_inputs={"mask": mask, "advantages": mask,
                                             "sampler_logprobs": np.full(n, -10.8, np.float32)})


def test_sampling_and_training_do_not_starve_each_other(sched):
    """A steady stream of sampling requests (always one waiting) does not keep a
    forward_backward waiting until the stream ends, and a queue of forward_backwards does not
    keep a sample request waiting until the queue is empty."""
    stream = SamplingParams(max_tokens=40, seed=3)

    async def body(c):
        await c.request(CreateAdapter(name="pol", spec=SPEC))
        stop = asyncio.Event()
        served = []

        async def sampler():
            i = 0
            while not stop.is_set() and i < 200:
                await c.request(SampleRequest(adapter=None, prompts=_prompts(4, 100 + i), params=stream))
                served.append(time.perf_counter())
                i += 1

        streams = [asyncio.ensure_future(sampler()) for _ in range(2)]
        await asyncio.sleep(0.3)
        fb = await c.request(ForwardBackward(adapter="pol", datums=[_datum()] * 8, loss="ppo", normalizer=20.0))
        n_during = len(served)
        stop.set()
        await asyncio.gather(*streams)
        await asyncio.sleep(1.0)  # the sampling history decays (fair_window_s = 0.5)
        # The reverse: many training calls queued, then one sample request.
        fbs = [asyncio.ensure_future(c.request(ForwardBackward(adapter="pol", datums=[_datum(120)] * 16, loss="ppo",
                                                               normalizer=20.0))) for _ in range(12)]
        await asyncio.sleep(0.05)
        sample = await c.request(SampleRequest(adapter=None, prompts=_prompts(1, 7), params=SamplingParams(max_tokens=4)))
        pending = sum(not f.done() for f in fbs)
        await asyncio.gather(*fbs)
        await c.request(OptimStep(adapter="pol", params=AdamParams(lr=1e-3)))
        return fb, n_during, served, sample, pending

    fb, n_during, served, sample, pending = run(with_client(sched, body, "engine-test"), timeout=300)
    assert fb.loss == fb.loss  # it ran
    assert n_during < len(served), "the forward_backward waited for the sampling stream to end"
    assert len(sample.tokens[0]) == 4
    assert pending > 0, "the sample request waited for the whole training queue"


def test_an_optim_step_waits_for_its_adapters_running_rows(sched):
    """No reply straddles two versions: rows admitted at version 0 finish at version 0."""
    async def body(c):
        await c.request(CreateAdapter(name="pol", spec=SPEC))
        await c.request(ForwardBackward(adapter="pol", datums=[_datum()], loss="ppo", normalizer=20.0))
        rows = asyncio.ensure_future(c.request(SampleRequest(adapter="pol", prompts=_prompts(2, 11),
                                                             params=SamplingParams(max_tokens=60, seed=1))))
        for _ in range(400):
            if sched.compute_counters["engine_steps"] >= 2:
                break
            await asyncio.sleep(0.01)
        step = await c.request(OptimStep(adapter="pol", params=AdamParams(lr=1e-2)))
        assert rows.done(), "the optimizer step ran while the adapter's rows were still decoding"
        return await rows, step

    rows, step = run(with_client(sched, body, "engine-test"))
    assert rows.adapter_version == 0 and step.version == 1
    assert [len(t) for t in rows.tokens] == [60, 60] and set(rows.stop_reasons) == {StopReason.LENGTH}


def test_one_bad_request_does_not_fail_its_batch_mates(sched):
    async def body(c):
        good = asyncio.ensure_future(c.request(SampleRequest(adapter=None, prompts=_prompts(2, 12),
                                                             params=SamplingParams(max_tokens=5))))
        bad = c.request(SampleRequest(adapter=None, prompts=[np.zeros((2, 3), np.int32)], params=SamplingParams()))
        with pytest.raises(RemoteError) as e:
            await bad
        return await good, e.value

    good, err = run(with_client(sched, body, "engine-test"))
    assert [len(t) for t in good.tokens] == [5, 5]
    assert err.error.code is ErrorCode.INVALID and "1-D integer array" in str(err)


def test_adapters_beyond_the_memory_budget_spill_and_come_back_unchanged(tiny_path):
    """A device budget with room for two adapters (with AdamW moments) serves four: the least
    recently used spill to host memory and return on demand; samples, log-probs and training
    equal those of an unbounded host."""
    from opentinker.engine.host import ModelHost
    from opentinker.engine.memory import adapter_bytes

    opts = {"kv_budget_bytes": 4 << 20, "block_size": 4}
    free = ModelHost(tiny_path, threads=1, device=DEVICE, engine="own", engine_options=opts)
    names = ["pa", "pb", "pc", "pd"]
    d = _datum(30)

    def prepare(h):
        for i, n in enumerate(names):
            h.create_adapter(n, LoraSpec(rank=4, seed=i))
            h.forward_backward(n, [d], "ppo", {}, 10.0)
            h.optim_step(n, AdamParams(lr=0.05))  # B nonzero, AdamW moments exist

    prepare(free)
    one = adapter_bytes(free.adapters["pa"])
    weights = sum(p.numel() * p.element_size() for p in free.registry.decoder.parameters())
    budget = weights + free.engine.pool.nbytes + int(2.5 * one)
    tight = ModelHost(tiny_path, threads=1, device=DEVICE, engine="own",
                      engine_options={**opts, "device_budget_bytes": budget})
    prepare(tight)
    mem = tight.registry.memory
    assert len(mem.resident) == 2 and len(mem.spilled) == 2 and mem.spills >= 2
    prompts = _prompts(4, seed=20)
    params = [SamplingParams(max_tokens=5)] * 4
    for order in (names, names[::-1]):
        a = tight.sample(order, prompts, params, [1, 2, 3, 4])
        b = free.sample(order, prompts, params, [1, 2, 3, 4])
        for x, y in zip(a, b):
            assert x.tokens.tolist() == y.tokens.tolist()
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-6)
    for h in (tight, free):  # train one that had spilled: its moments came back too
        h.forward_backward("pa", [d], "ppo", {}, 10.0)
        h.optim_step("pa", AdamParams(lr=0.05))
    for k, p in free.adapters["pa"].named.items():
        torch.testing.assert_close(tight.adapters["pa"].named[k], p, atol=0, rtol=0)
    m = tight.engine.metrics()
    assert m["engine/adapters_resident"] == 2 and m["engine/adapters_spilled"] == 2
    assert m["engine/adapter_restores"] >= 4 and m["engine/adapter_bytes_resident"] <= int(2.5 * one)
    # The slot store grew only as far as the adapter budget holds (spilled adapters gave theirs up).
    assert 0 < m["engine/lora_store_bytes"] <= tight.registry.memory.budget_bytes
    assert len(tight.registry.slots) == 2
    with pytest.raises(ValueError, match="device budget"):
        ModelHost(tiny_path, threads=1, device=DEVICE, engine="own",
                  engine_options={**opts, "device_budget_bytes": weights})


def test_a_full_parameter_policy_trains_every_weight_and_saves_safetensors(tiny_path, tmp_path):
    """kind = "full": a private copy of the base on the same scheduler. It samples batched
    with LoRA rows (one forward per model copy), equals the base before training, trains
    every weight with AdamW (the shared base never moves), and saves a checkpoint transformers
    loads as a plain model."""
    from transformers import AutoModelForCausalLM

    from opentinker.engine.host import ModelHost

    host = ModelHost(tiny_path, threads=1, device=DEVICE, engine="own",
                     engine_options={"kv_budget_bytes": 4 << 20, "block_size": 4})
    host.create_adapter("fullp", LoraSpec(full=True))
    host.create_adapter("lorap", SPEC)
    base_before = {k: v.clone() for k, v in host.registry.decoder.state_dict().items()}
    prompts = _prompts(3, seed=30)
    params = [SamplingParams(max_tokens=4)] * 3
    mixed = host.sample(["fullp", "lorap", None], prompts, params, [1, 2, 3])
    alone = host.sample([None, None, None], prompts, params, [1, 2, 3])
    assert mixed[0].tokens.tolist() == alone[0].tokens.tolist()  # an untrained copy is the base
    d = _datum(30)
    host.forward_backward("fullp", [d], "ppo", {}, 10.0)
    _, norm = host.optim_step("fullp", AdamParams(lr=1e-3))
    assert norm > 0
    moved = {k for k, p in host.adapters["fullp"].named.items() if not torch.equal(p, base_before[k])}
    assert "model.embed_tokens.weight" in moved and "model.layers.1.mlp.down_proj.weight" in moved
    for k, v in host.registry.decoder.state_dict().items():
        assert torch.equal(v, base_before[k]), k
    seq = [np.concatenate([prompts[0], mixed[0].tokens])]
    after = host.logprobs("fullp", seq)[0]
    assert not np.allclose(after, host.logprobs(None, seq)[0])
    host.save("fullp", str(tmp_path / "full"))
    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "full"))
    ids = torch.as_tensor(seq[0][None].astype(np.int64))
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1).gather(-1, ids[0, 1:, None])[:, 0]
    np.testing.assert_allclose(logp.numpy(), after[1:], atol=1e-5)
    assert host.load(str(tmp_path / "full"), "fullq") == 1
    np.testing.assert_allclose(host.logprobs("fullq", seq)[0], after, atol=1e-6)
    peft = ModelHost(tiny_path, threads=1, device=DEVICE, engine="peft")
    with pytest.raises(ValueError, match="full-parameter policies need the engine"):
        peft.create_adapter("fullp", LoraSpec(full=True))


def _alone(eng, adapter, prompt, params, seed):
    """What ``seed`` draws from ``prompt`` as the only row of its step."""
    row = eng.add(adapter, prompt, params, seed=seed)
    eng.run_until_done([row])
    return row


def test_rows_with_the_same_prompt_compute_it_once(hosts):
    """A group's first turns (one prompt, several seeds) arrive together: one row computes the
    prompt; its twins take its keys and values and its last logits, and then draw what each
    seed draws alone (so the copied KV is right)."""
    own, _ = hosts
    eng = own.engine
    prompt = _prompts(1, seed=40, lo=50, hi=51)[0]  # 50 tokens: 12 whole blocks of 4 and a part
    params = SamplingParams(max_tokens=6, temperature=1.2)
    before, twinned, twin_tokens = eng.stats.prefill_tokens, eng.stats.twinned, eng.stats.twin_tokens
    rows = [eng.add("pol", prompt, params, seed=s) for s in (1, 2, 3, 4)]
    eng.run_until_done(rows)
    assert eng.stats.prefill_tokens - before == len(prompt)  # not 4 x 50
    assert eng.stats.twinned - twinned == 3
    assert eng.stats.twin_tokens - twin_tokens == 3 * (len(prompt) - 48)  # the part block after 12 cached
    assert len({tuple(r.out_tokens) for r in rows}) > 1
    for r in rows:
        alone = _alone(eng, "pol", prompt, params, r.seed)
        assert r.out_tokens == alone.out_tokens
        np.testing.assert_allclose(r.out_logprobs, alone.out_logprobs, atol=1e-5)


def test_twins_outlive_a_cancelled_leader_and_leave_when_cancelled(hosts):
    """The row computing a prompt is cancelled half-way (the prompt comes in chunks): its twins
    wait again, one of them computes the prompt, and each draws what it draws alone; a twin
    cancelled while it waits leaves at the next step without tokens."""
    own, _ = hosts
    eng = own.engine
    prompt = _prompts(1, seed=41, lo=30, hi=31)[0]
    params = SamplingParams(max_tokens=4)
    budget = eng.max_batch_tokens
    eng.max_batch_tokens = 8
    try:
        leader, *twins = [eng.add(None, prompt, params, seed=s) for s in (5, 6, 7, 8)]
        eng.step()
        assert leader.num_computed == 8 and [t.leader for t in twins] == [leader] * 3
        eng.cancel([leader, twins[2]])
        eng.step()
        assert leader.finished and leader.stop_reason is None and not leader.out_tokens
        assert twins[2].finished and twins[2].stop_reason is None and not twins[2].out_tokens
        eng.run_until_done(twins[:2])
    finally:
        eng.max_batch_tokens = budget
    assert eng.scheduler._n_twins == 0 and not eng.running and not eng.waiting
    for t in twins[:2]:
        alone = _alone(eng, None, prompt, params, t.seed)
        assert t.out_tokens == alone.out_tokens
        np.testing.assert_allclose(t.out_logprobs, alone.out_logprobs, atol=1e-5)


def test_paused_rows_sit_steps_out_and_draw_what_they_draw_alone(hosts):
    """Rows the engine's ``pause`` predicate names keep their place (and KV blocks) while the
    other rows compute; when every running row is paused all compute; pausing changes no draw."""
    own, _ = hosts
    eng = own.engine
    a_prompt, b_prompt = _prompts(2, seed=42, lo=12, hi=13)
    a_params, b_params = SamplingParams(max_tokens=3, temperature=1.0), SamplingParams(max_tokens=8, temperature=1.0)
    a = eng.add("pol", a_prompt, a_params, seed=11)
    b = eng.add("pol", b_prompt, b_params, seed=12)
    try:
        eng.pause = lambda seq: seq is a
        eng.step()
        assert a in eng.running and a.num_computed == 0 and b.num_computed == len(b_prompt)
        for _ in range(3):
            eng.step()
        assert a.num_computed == 0 and not a.out_tokens and len(b.out_tokens) == 4
        eng.pause = lambda seq: True  # every running row paused: all compute
        eng.step()
        assert a.num_computed == len(a_prompt) and len(b.out_tokens) == 5
        eng.pause = None
        eng.run_until_done([a, b])
    finally:
        eng.pause = None
    for row, prompt, params in ((a, a_prompt, a_params), (b, b_prompt, b_params)):
        alone = _alone(eng, "pol", prompt, params, row.seed)
        assert row.out_tokens == alone.out_tokens
        np.testing.assert_allclose(row.out_logprobs, alone.out_logprobs, atol=1e-5)


def test_a_failing_step_fails_its_requests_and_the_scheduler_keeps_serving(sched, monkeypatch):
    engine = sched.host.engine
    real = engine.runner.execute
    calls = {"n": 0}

    def flaky(batch):
        calls["n"] += 1
        if calls["n"] == 2:
            raise RuntimeError("injected fault in a forward")
        return real(batch)

    monkeypatch.setattr(engine.runner, "execute", flaky)

    async def body(c):
        with pytest.raises(RemoteError, match="injected fault"):
            await c.request(SampleRequest(adapter=None, prompts=_prompts(2, 50), params=SamplingParams(max_tokens=5)))
        return await c.request(SampleRequest(adapter=None, prompts=_prompts(2, 51), params=SamplingParams(max_tokens=5)))

    after = run(with_client(sched, body, "engine-test"))
    assert [len(t) for t in after.tokens] == [5, 5]
    assert not engine.running and engine.blocks.stats().blocks_in_use == 0  # the failed rows left


def test_bf16_engine_samples_and_trains_close_to_fp32(hosts, tiny_path):
    """bf16 weights and activations, fp32 LoRA masters and AdamW: log-probs within 0.1 of the
    fp32 engine's on the same adapter (the decoder's own tolerance test is tighter), and a
    training step moves the fp32 masters."""
    from opentinker.engine.host import ModelHost

    own, _ = hosts
    half = ModelHost(tiny_path, threads=1, device=DEVICE, engine="own",
                     engine_options={"kv_budget_bytes": 4 << 20, "block_size": 4, "dtype": "bfloat16"})
    half.create_adapter("pol", SPEC)
    with torch.no_grad():
        for k, p in half.adapters["pol"].named.items():
            p.copy_(own.adapters["pol"].named[k])
    assert next(iter(half.adapters["pol"].named.values())).dtype == torch.float32
    seqs = _prompts(2, seed=60)
    for x, y in zip(half.logprobs("pol", seqs), own.logprobs("pol", seqs)):
        assert np.abs(x - y).max() < 0.1
    rows = half.sample(["pol"], seqs[:1], [SamplingParams(max_tokens=4)], [0])
    assert len(rows[0].tokens) == 4 and np.isfinite(rows[0].logprobs).all()
    before = {k: p.clone() for k, p in half.adapters["pol"].named.items()}
    half.forward_backward("pol", [_datum(20)], "ppo", {}, 10.0)
    half.optim_step("pol", AdamParams(lr=1e-2))
    assert any(not torch.equal(p, before[k]) for k, p in half.adapters["pol"].named.items())


def test_waiting_rows_are_admitted_fairly_over_peers(tiny_path):
    """One peer's flood of rows does not queue another peer's few behind it: waiting rows are
    admitted round-robin over the scheduler's peers, fewest running first (the attack's case:
    a 3-token request behind 512 maximum-length rows of one peer)."""
    from opentinker.engine.host import ModelHost

    host = ModelHost(tiny_path, threads=1, engine="own", engine_options={"max_rows": 4})
    eng = host.engine
    eng.scheduler.fair_key = lambda seq: seq.owner
    long, short = SamplingParams(max_tokens=50), SamplingParams(max_tokens=3)
    flood = [eng.add(None, p, long, i, owner="flood") for i, p in enumerate(_prompts(12, seed=1))]
    eng.step()  # four of the flood run; eight wait
    polite = eng.add(None, _prompts(1, seed=2)[0], short, 99, owner="polite")
    done_at, steps = None, 0
    while done_at is None and steps < 200:
        _, finished = eng.step()
        steps += 1
        if polite in finished:
            done_at = steps
    assert done_at is not None and polite.stop_reason is not None
    # It went in at the first free row, ahead of the flood's eight waiting rows: done long
    # before the first of those (which need 50 tokens after a row frees) could be.
    assert sum(1 for s in flood if s.status.name == "FINISHED") <= 4 and done_at < 60
    eng.cancel(flood)
    eng.step()
    # Without fairness the same arrival order waits behind the flood.
    eng.scheduler.fair_key = None
    flood = [eng.add(None, p, long, i, owner="flood") for i, p in enumerate(_prompts(12, seed=3))]
    eng.step()
    polite = eng.add(None, _prompts(1, seed=4)[0], short, 98, owner="polite")
    steps = 0
    while polite.stop_reason is None and steps < 200:
        eng.step()
        steps += 1
    assert steps > done_at + 40


def _play_conversations(tiny_path, n: int = 8, turns: int = 6, fit: int = 3, patience: int | None = None,
                        monkeypatch=None):
    """``n`` seats' conversations of ``turns`` turns on an engine whose KV pool holds about
    ``fit`` finished conversations: each seat's next prompt (its conversation so far, its
    reply, a 12-token observation) is queued the moment its reply is drawn, as a rollout
    against a scripted opponent does. Returns the engine's stats and the finished rows."""
    from opentinker.engine import scheduler as scheduler_mod
    from opentinker.engine.host import ModelHost

    if patience is not None:
        monkeypatch.setattr(scheduler_mod, "WARM_FIRST_PATIENCE", patience)
    probe = ModelHost(tiny_path, threads=1, engine="own", engine_options={"kv_budget_bytes": 1 << 20, "block_size": 4})
    per_block = probe.engine.pool.bytes_per_block
    first_len, obs_len, reply_len = 30, 12, 4
    blocks = fit * -(-(first_len + turns * (obs_len + reply_len)) // 4)
    host = ModelHost(tiny_path, threads=1, engine="own",
                     engine_options={"kv_budget_bytes": blocks * per_block, "block_size": 4})
    eng = host.engine
    rng = np.random.default_rng(5)
    params = SamplingParams(max_tokens=reply_len)
    left = {i: turns for i in range(n)}
    rows = {eng.add(None, rng.integers(10, 4000, size=first_len).astype(np.int32), params, i): i for i in range(n)}
    done, steps = [], 0
    while rows and steps < 3000:
        _, finished = eng.step()
        steps += 1
        for seq in finished:
            i = rows.pop(seq)
            done.append(seq)
            left[i] -= 1
            if left[i]:
                nxt = np.concatenate([seq.prompt, np.asarray(seq.out_tokens, np.int32),
                                      rng.integers(10, 4000, size=obs_len).astype(np.int32)])
                rows[eng.add(None, nxt, params, 100 * i + left[i])] = i
    assert not rows, f"{len(rows)} conversations unfinished after {steps} steps"
    return eng.stats, done


def test_warm_rows_go_first_while_the_kv_pool_is_short(tiny_path, monkeypatch):
    """Eight seats' conversations on a pool that holds about three: admitted warm first (the
    longest cached prefix), a seat's next turn finds its conversation still cached; in arrival
    order (patience 0: every row overdue) it queues behind the others, which evict it. Every
    conversation finishes either way, with the same number of prompt tokens."""
    warm, done_warm = _play_conversations(tiny_path)
    fifo, done_fifo = _play_conversations(tiny_path, patience=0, monkeypatch=monkeypatch)
    assert len(done_warm) == len(done_fifo) == 8 * 6
    assert warm.prompt_tokens == fifo.prompt_tokens
    hit_warm, hit_fifo = warm.cached_tokens / warm.prompt_tokens, fifo.cached_tokens / fifo.prompt_tokens
    assert hit_warm > hit_fifo + 0.2, (hit_warm, hit_fifo)
    assert warm.prefill_tokens < 0.7 * fifo.prefill_tokens


def test_warm_first_order_keeps_each_peers_places_and_gives_way_to_overdue_rows(tiny_path, monkeypatch):
    """The order itself, on a real prefix index: a row whose prompt extends a finished one's
    (cached) goes before a cold row that came first; with peers, each peer keeps the places the
    fair order gave it and only its own rows trade them; a row passed over
    ``WARM_FIRST_PATIENCE`` times goes first again; a pool that is not short keeps arrival order;
    only the first ``WARM_FIRST_WINDOW`` waiting rows are ranked."""
    from opentinker.engine import scheduler as scheduler_mod
    from opentinker.engine.host import ModelHost
    from opentinker.engine.scheduler import WARM_FIRST_PATIENCE

    eng = ModelHost(tiny_path, threads=1, engine="own",
                    engine_options={"kv_budget_bytes": 4 << 20, "block_size": 4}).engine
    sch = eng.scheduler
    a, b, c = _prompts(3, seed=7, lo=30, hi=31)
    params = SamplingParams(max_tokens=2)
    first = eng.add(None, a, params, 0)
    eng.run_until_done([first])
    warm_prompt = np.concatenate([a, np.asarray(first.out_tokens, np.int32), b[:5]])
    cold = eng.add(None, b, params, 1, owner="x")
    other = eng.add(None, c, params, 2, owner="y")
    warm = eng.add(None, warm_prompt, params, 3, owner="x")
    assert sch._cached_prefix(warm) >= 28 and sch._cached_prefix(cold) == 0
    queued = [cold, other, warm]

    def order(fair_key=None, kv_full=True):
        sch.waiting, sch.kv_full, sch.fair_key = collections.deque(queued), kv_full, fair_key
        sch._warm_first()
        return list(sch.waiting)

    assert order(kv_full=False) == queued
    assert order() == [warm, cold, other]
    assert order(lambda s: s.owner) == [warm, other, cold]  # x keeps places 0 and 2, y place 1
    monkeypatch.setattr(scheduler_mod, "WARM_FIRST_WINDOW", 2)
    assert order() == queued  # the warm row is third: outside the window
    monkeypatch.setattr(scheduler_mod, "WARM_FIRST_WINDOW", 3)
    cold.waited = WARM_FIRST_PATIENCE
    assert order() == [cold, warm, other] and order(lambda s: s.owner) == [cold, other, warm]
    sch.waiting, sch.kv_full, sch.fair_key = collections.deque(), False, None
    eng.cancel(queued)
