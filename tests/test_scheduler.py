"""The scheduler over the bus, on the tiny-random model: sampling, log-probs, training,
idempotency, saving in PEFT format, and bad input."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import torch

from conftest import DEVICE, run, with_client
from opentinker.bus import RemoteError
from opentinker.rollout.render import SeatRenderer
from protocols.messages import (
    AdamParams, CreateAdapter, Datum, DropAdapter, ErrorCode, ForwardBackward, LoadAdapter,
    LogprobsRequest, LoraSpec, OptimStep, SampleRequest, SamplingParams, SaveAdapter,
    SchedulerStats, SnapshotAdapter, StopReason,
)


def _prompt(tok, text="Kuhn poker, cards J<Q<K. You have the K. Reply with one word: check or bet."):
    r = SeatRenderer(tok, "You are a poker player.")
    r.observe(text)
    return r.prompt()


def test_sampling_is_seeded_and_logprobs_match_the_trainer(scheduler, chat_tok):
    prompt = _prompt(chat_tok)
    params = SamplingParams(max_tokens=6, stop_token_ids=(chat_tok.eos_id,), seed=11)

    async def body(c):
        await c.request(CreateAdapter(name="alpha", spec=LoraSpec(rank=4)))
        one = await c.request(SampleRequest(adapter="alpha", prompts=[prompt, prompt], params=params))
        two = await c.request(SampleRequest(adapter="alpha", prompts=[prompt, prompt], params=params))
        seqs = [np.concatenate([prompt, t]) for t in one.tokens]
        lp = await c.request(LogprobsRequest(adapter="alpha", sequences=seqs))
        # Scoring the replies alone (``tail``): the same log-probs there, zeros before.
        tail = await c.request(LogprobsRequest(adapter="alpha", sequences=seqs, tail=3))
        long = await c.request(LogprobsRequest(adapter="alpha", sequences=seqs, tail=10_000))
        with pytest.raises(RemoteError, match=r"LogprobsRequest.tail must be >= 0 \(0: every token\), got -1"):
            await c.request(LogprobsRequest(adapter="alpha", sequences=seqs, tail=-1))
        return one, two, lp, tail, long

    one, two, lp, tail, long = run(with_client(scheduler, body))
    for full, part, whole in zip(lp.logprobs, tail.logprobs, long.logprobs):
        np.testing.assert_allclose(part[-3:], full[-3:], atol=1e-5)
        assert not part[:-3].any() and full[-4] != 0
        np.testing.assert_allclose(whole, full, atol=1e-5)
    assert [t.tolist() for t in one.tokens] == [t.tolist() for t in two.tokens]
    assert one.tokens[0].tolist() != one.tokens[1].tolist()  # rows have their own seeds
    assert one.adapter_version == 0
    for toks, lps, reason, teacher in zip(one.tokens, one.logprobs, one.stop_reasons, lp.logprobs):
        assert len(toks) == len(lps) <= 6
        assert reason is (StopReason.STOP if toks[-1] == chat_tok.eos_id else StopReason.LENGTH)
        np.testing.assert_allclose(teacher[len(prompt):], lps, atol=1e-4)


def test_mixed_adapter_batch_matches_single_requests(scheduler, chat_tok):
    prompt = _prompt(chat_tok)
    params = SamplingParams(max_tokens=5, seed=3)

    async def body(c):
        for name, seed in (("alpha", 1), ("beta", 2)):
            await c.request(CreateAdapter(name=name, spec=LoraSpec(rank=4, seed=seed)))
        # Make "alpha" differ from the base before comparing.
        d = _datum(prompt, np.array([5, 6, 7], np.int32), adv=1.0)
        await c.request(ForwardBackward(adapter="alpha", datums=[d], loss="ppo", normalizer=3.0))
        await c.request(OptimStep(adapter="alpha", params=AdamParams(lr=0.05)))
        together = await asyncio.gather(*(
            c.request(SampleRequest(adapter=a, prompts=[prompt], params=params, client=a or "base"))
            for a in ("alpha", "beta", None)
        ))
        alone = [await c.request(SampleRequest(adapter=a, prompts=[prompt], params=params)) for a in ("alpha", "beta", None)]
        stats = await c.request(SchedulerStats())
        return together, alone, stats

    together, alone, stats = run(with_client(scheduler, body))
    assert any(sorted(b) == ["alpha", "base", "beta"] for b in stats.batches), stats.batches
    for t, a in zip(together, alone):
        assert t.tokens[0].tolist() == a.tokens[0].tolist()
        np.testing.assert_allclose(t.logprobs[0], a.logprobs[0], atol=1e-5)
    assert together[0].adapter_version == 1 and together[2].adapter_version == -1


def _datum(prompt, reply, adv):
    tokens = np.concatenate([prompt, reply]).astype(np.int32)
    mask = np.r_[np.zeros(len(prompt)), np.ones(len(reply))].astype(np.float32)
    return Datum(tokens=tokens, loss_inputs={"mask": mask, "advantages": mask * adv, "sampler_logprobs": mask * -10.8})


def test_retried_forward_backward_is_applied_once_and_saved_adapter_reloads(scheduler, chat_tok, tiny_path, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    prompt = _prompt(chat_tok)
    reply = np.array(chat_tok.encode("bet") + [chat_tok.eos_id], np.int32)
    d = _datum(prompt, reply, adv=1.0)
    seq = d.tokens

    async def body(c):
        for name in ("once", "twice"):
            await c.request(CreateAdapter(name=name, spec=LoraSpec(rank=4)))
        fb = ForwardBackward(adapter="once", datums=[d], loss="ppo", normalizer=2.0)
        await c.request(fb)
        rid = c.next_request_id()
        fb2 = ForwardBackward(adapter="twice", datums=[d], loss="ppo", normalizer=2.0)
        r1 = await c.request(fb2, request_id=rid)
        r2 = await c.request(fb2, request_id=rid)  # a retry: answered, not applied again
        assert r1 == r2
        v = [await c.request(OptimStep(adapter=n, params=AdamParams(lr=0.02))) for n in ("once", "twice")]
        lps = await c.request(LogprobsRequest(adapter="twice", sequences=[seq]))
        lps_once = await c.request(LogprobsRequest(adapter="once", sequences=[seq]))
        base = await c.request(LogprobsRequest(adapter=None, sequences=[seq]))
        saved = await c.request(SaveAdapter(adapter="twice", path=str(tmp_path / "twice")))
        return v, lps.logprobs[0], lps_once.logprobs[0], base.logprobs[0], saved

    v, lp, lp_once, lp_base, saved = run(with_client(scheduler, body))
    assert [x.version for x in v] == [1, 1] and saved.version == 1
    np.testing.assert_allclose(lp, lp_once, atol=1e-6)  # the retry did not double the gradient
    assert np.abs(lp - lp_base).max() > 1e-2
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_path, dtype=torch.float32), str(tmp_path / "twice")).eval()
    with torch.no_grad():
        logits = model(torch.as_tensor(seq[None].astype(np.int64))).logits[0].float()
    ref = torch.log_softmax(logits[:-1], -1).gather(-1, torch.as_tensor(seq[1:].astype(np.int64))[:, None])[:, 0].numpy()
    np.testing.assert_allclose(ref, lp[1:], atol=1e-4)


def test_bad_requests_get_errors_and_the_scheduler_keeps_serving(scheduler, chat_tok):
    prompt = _prompt(chat_tok)

    async def body(c):
        errors = []
        for msg in (
            SampleRequest(adapter="nope", prompts=[prompt], params=SamplingParams()),
            SampleRequest(adapter=None, prompts=[np.array([10**7], np.int32)], params=SamplingParams()),
            SampleRequest(adapter=None, prompts=[prompt], params=SamplingParams(temperature=0.0)),
            OptimStep(adapter="nope", params=AdamParams()),
            ForwardBackward(adapter="nope", datums=[], loss="ppo", normalizer=0.0),
            LogprobsRequest(adapter=None, sequences=[np.array([], np.int32)]),
        ):
            with pytest.raises(RemoteError) as e:
                await c.request(msg)
            errors.append(e.value.error)
        ok = await c.request(SampleRequest(adapter=None, prompts=[prompt], params=SamplingParams(max_tokens=2)))
        return errors, ok

    errors, ok = run(with_client(scheduler, body))
    codes = [e.code for e in errors]
    assert codes == [ErrorCode.NOT_FOUND, ErrorCode.INVALID, ErrorCode.INVALID, ErrorCode.NOT_FOUND,
                     ErrorCode.INVALID, ErrorCode.INVALID], codes
    assert "nope" in errors[0].message and "out of range" in errors[1].message and "temperature" in errors[2].message
    assert "LogprobsRequest.sequences[0] is empty" in errors[-1].message
    assert len(ok.tokens[0]) >= 1


def test_prefix_sharing_and_dedup_are_exact(tiny_path, chat_tok):
    from opentinker.engine.host import ModelHost

    host = ModelHost(tiny_path, threads=2, device=DEVICE)
    host.create_adapter("alpha", LoraSpec(rank=4))
    rng = np.random.default_rng(0)
    datums = []
    for i in range(9):
        prompt = _prompt(chat_tok, f"Kuhn poker, cards J<Q<K. You have the {'JQK'[i % 3]}. Reply with one word: check or bet.")
        reply = rng.integers(100, 4000, size=1 + i % 3).astype(np.int32) if i % 2 else np.array([42, chat_tok.eos_id], np.int32)
        datums.append(_datum(prompt, reply, adv=float(rng.normal())))
    grads = []
    for share in (False, True):
        host.share_prefix = share
        loss, _ = host.forward_backward("alpha", datums, "ppo", {}, normalizer=10.0)
        grads.append((loss, torch.cat([p.grad.flatten() for p in host.adapters["alpha"].params]).cpu().clone()))
        for p in host.adapters["alpha"].params:
            p.grad = None
    assert grads[0][0] == pytest.approx(grads[1][0], abs=1e-6)
    torch.testing.assert_close(grads[0][1], grads[1][1], atol=1e-6, rtol=1e-4)
    assert grads[0][1].abs().sum() > 0


@pytest.fixture()
def peft_scheduler(tiny_path):
    from opentinker.engine.service import SchedulerService

    s = SchedulerService(tiny_path, threads=1, device=DEVICE, engine="peft")
    s.start()
    yield s
    s.stop()


def test_a_cancelled_queued_optim_step_never_runs(peft_scheduler, chat_tok):
    """PEFT path: while the compute thread samples a long reply, an OptimStep waits in the
    queue; its caller gives up, the scheduler drops it, and the adapter's version never moves.
    (The engine's step loop runs operations between steps: tests/test_engine.py.)"""
    scheduler = peft_scheduler
    prompt = _prompt(chat_tok)
    long = SamplingParams(max_tokens=150, seed=3)  # no stop token: 150 forward steps

    async def body(c):
        await c.request(CreateAdapter(name="gamma", spec=LoraSpec(rank=4)))
        sampling = asyncio.ensure_future(c.request(SampleRequest(adapter=None, prompts=[prompt], params=long)))
        for _ in range(500):  # the compute thread has taken the sample
            if not scheduler._jobs:
                break
            await asyncio.sleep(0.01)
        step = asyncio.ensure_future(c.request(OptimStep(adapter="gamma", params=AdamParams())))
        for _ in range(500):
            if len(scheduler._jobs) == 1:
                break
            await asyncio.sleep(0.01)
        assert not sampling.done(), "the long sample finished before the test could queue behind it"
        step.cancel()
        for _ in range(500):
            if scheduler.compute_counters["cancelled_queued"]:
                break
            await asyncio.sleep(0.01)
        await sampling
        stats = await c.request(SchedulerStats())
        return stats

    stats = run(with_client(scheduler, body))
    assert stats.counters["cancelled_queued"] == 1 and stats.counters["cancelled"] == 1
    assert "OptimStep" not in stats.counters and scheduler.host.version("gamma") == 0


def test_adapter_lifecycle_over_the_bus(scheduler, chat_tok, tmp_path):
    """snapshot, save, load (retried: applied once), drop, each a bus request; a snapshot
    refuses training; a dropped adapter is not_found."""
    prompt = _prompt(chat_tok)
    seq = np.concatenate([prompt, np.asarray(chat_tok.encode("bet"), np.int32)])
    datum = Datum(tokens=seq, loss_inputs={
        "mask": np.r_[np.zeros(len(prompt)), np.ones(len(seq) - len(prompt))].astype(np.float32),
        "advantages": np.r_[np.zeros(len(prompt)), np.ones(len(seq) - len(prompt))].astype(np.float32),
        "sampler_logprobs": np.zeros(len(seq), np.float32),
    })

    async def body(c):
        await c.request(CreateAdapter(name="life", spec=LoraSpec(rank=4)))
        await c.request(ForwardBackward(adapter="life", datums=[datum], loss="importance_sampling", normalizer=1.0))
        await c.request(OptimStep(adapter="life", params=AdamParams(lr=1e-2)))
        snap = await c.request(SnapshotAdapter(adapter="life", name="life_snap"))
        saved = await c.request(SaveAdapter(adapter="life", path=str(tmp_path / "life")))
        rid = c.next_request_id()
        loaded = await c.request(LoadAdapter(path=str(tmp_path / "life"), name="life_copy"), request_id=rid)
        again = await c.request(LoadAdapter(path=str(tmp_path / "life"), name="life_copy"), request_id=rid)
        lps = [(await c.request(LogprobsRequest(adapter=a, sequences=[seq]))).logprobs[0]
               for a in ("life", "life_snap", "life_copy", None)]
        with pytest.raises(RemoteError) as frozen:
            await c.request(ForwardBackward(adapter="life_snap", datums=[datum], loss="importance_sampling", normalizer=1.0))
        dropped = await c.request(DropAdapter(name="life_snap"))
        with pytest.raises(RemoteError) as gone:
            await c.request(LogprobsRequest(adapter="life_snap", sequences=[seq]))
        stats = await c.request(SchedulerStats())
        return snap, saved, loaded, again, lps, frozen.value.error, dropped, gone.value.error, stats

    snap, saved, loaded, again, lps, frozen, dropped, gone, stats = run(with_client(scheduler, body))
    assert snap.version == saved.version == loaded.version == 1 and again == loaded
    assert stats.counters["dedup"] == 1  # the retried load was answered, not applied again
    np.testing.assert_allclose(lps[1], lps[0], atol=1e-6)  # the snapshot is the adapter at version 1
    np.testing.assert_allclose(lps[2], lps[0], atol=1e-5)  # and so is the saved-then-loaded copy
    assert np.abs(lps[0] - lps[3]).max() > 1e-3  # trained: not the base model
    assert frozen.code is ErrorCode.INVALID and "life_snap" in frozen.message
    assert dropped.version == -1 and gone.code is ErrorCode.NOT_FOUND and "life_snap" in gone.message


def test_a_sequence_that_prefixes_all_others_scores_as_if_alone(tiny_path):
    """Shared-prefix forwards keep every sequence's tail non-empty: [A, A + more] (e.g. a DPO
    pair where one hand ended a turn earlier) gives each row what it gets alone."""
    from opentinker.engine.host import ModelHost

    host = ModelHost(tiny_path, threads=1, device=DEVICE)
    host.create_adapter("p", LoraSpec(rank=4, seed=1, value_head=True))
    rng = np.random.default_rng(0)
    a = rng.integers(10, 2000, 8).astype(np.int32)
    b = np.concatenate([a, rng.integers(10, 2000, 6).astype(np.int32)])
    together = host.logprobs("p", [a, b])
    alone = [host.logprobs("p", [s])[0] for s in (a, b)]
    for x, y in zip(together, alone):
        np.testing.assert_allclose(x, y, atol=1e-5)
    vt = host.values("p", [a, b])
    for x, s in zip(vt, (a, b)):
        np.testing.assert_allclose(x, host.values("p", [s])[0], atol=1e-5)
    mask = [np.r_[np.zeros(5), np.ones(len(s) - 5)].astype(np.float32) for s in (a, b)]
    datums = [Datum(tokens=s, loss_inputs={"mask": m, "advantages": m, "sampler_logprobs": -m})
              for s, m in zip((a, b), mask)]
    loss, _ = host.forward_backward("p", datums, "ppo", {}, 10.0)
    assert np.isfinite(loss)


def test_the_trainer_scores_at_the_sampling_temperature(tiny_path, chat_tok):
    """Replies sampled at T = 0.5 carry log-probs of softmax(logits / 0.5); forward_backward
    with loss_config temperature 0.5 scores the same distribution (sampler = trainer), while
    scoring at T = 1 would put every on-policy ratio away from 1."""
    from opentinker.engine.host import ModelHost

    host = ModelHost(tiny_path, threads=1, device=DEVICE)
    host.create_adapter("t", LoraSpec(rank=4))
    prompt = _prompt(chat_tok)
    params = SamplingParams(temperature=0.5, max_tokens=6, seed=3)
    rows = host.sample(["t"] * 4, [prompt] * 4, [params] * 4, [3, 4, 5, 6])
    datums = []
    for r in rows:
        seq = np.concatenate([prompt, r.tokens]).astype(np.int32)
        mask = np.r_[np.zeros(len(prompt)), np.ones(len(r.tokens))].astype(np.float32)
        datums.append(Datum(tokens=seq, loss_inputs={
            "mask": mask, "advantages": mask,
            "sampler_logprobs": np.r_[np.zeros(len(prompt)), r.logprobs].astype(np.float32)}))
    _, at_t = host.forward_backward("t", datums, "ppo", {"temperature": 0.5}, 24.0)
    _, at_1 = host.forward_backward("t", datums, "ppo", {}, 24.0)
    assert at_t["logp_diff_max"] < 1e-4 and at_t["clip_frac"] == 0.0
    assert at_1["logp_diff_mean"] > 0.1
    with pytest.raises(ValueError, match="temperature must be > 0"):
        host.forward_backward("t", datums, "ppo", {"temperature": 0.0}, 24.0)


def test_the_scheduler_loads_and_computes_on_one_thread_and_a_failed_load_raises(tiny_path, monkeypatch, tmp_path):
    """Every torch call of a scheduler runs on its compute thread, the model's load included
    (a second thread pool beside the caller's slows each parallel op: benchmarks/compute_thread.py);
    a load that fails raises from ``start()`` on the caller's thread."""
    import threading

    from opentinker.engine import host as host_module
    from opentinker.engine.service import SchedulerService

    seen: dict[str, str] = {}
    real_fb = host_module.ModelHost.forward_backward
    real_init = host_module.ModelHost.__init__

    def init(self, *a, **k):
        seen["load"] = threading.current_thread().name
        real_init(self, *a, **k)

    def fb(self, *a, **k):
        seen["train"] = threading.current_thread().name
        return real_fb(self, *a, **k)

    monkeypatch.setattr(host_module.ModelHost, "__init__", init)
    monkeypatch.setattr(host_module.ModelHost, "forward_backward", fb)
    s = SchedulerService(tiny_path, threads=1, device=DEVICE)
    s.start()
    toks = np.arange(3, 12, dtype=np.int32)
    datum = Datum(tokens=toks, loss_inputs={"mask": np.r_[np.zeros(6), np.ones(3)].astype(np.float32),
                                            "sampler_logprobs": np.zeros(9, np.float32),
                                            "advantages": np.ones(9, np.float32)})

    async def body(c):
        await c.request(CreateAdapter(name="pol", spec=LoraSpec(rank=2)))
        return await c.request(ForwardBackward(adapter="pol", datums=[datum], loss="importance_sampling", normalizer=3.0))

    try:
        got = run(with_client(s, body, "thread-test"))
    finally:
        s.stop()
    assert np.isfinite(got.loss)
    assert seen == {"load": "scheduler-compute", "train": "scheduler-compute"}
    assert threading.current_thread().name != "scheduler-compute"

    bad = SchedulerService(str(tmp_path / "no-model-here"), threads=1, device=DEVICE)
    with pytest.raises(OSError):
        bad.start()
    assert not bad._worker.is_alive()
    bad.stop()
