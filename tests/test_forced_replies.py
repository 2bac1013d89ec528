"""Forced replies (``SampleRequest.forced``): a reply given instead of drawn, scored in the
engine's running batch. Its log-probs are the trainer's (and the PEFT path's), it reuses its
prompt's cached prefix and leaves itself cached for the next turn, its batch-mates draw what
they draw alone, and a bad one is refused by name while the scheduler keeps serving. An
exploring seat's replies go this way (``EnvRunner._score``)."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import DEVICE, run, with_client

from opentinker.bus import RemoteError
from opentinker.engine.request_checks import check_request
from protocols.messages import (
    ErrorCode,
    SampleRequest,
    SamplingParams,
    StopReason,
)

VOCAB = 49152


def _prompt(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(10, 4000, size=n).astype(np.int32)


def test_a_forced_reply_has_the_trainers_logprobs_and_its_batch_mates_draw_as_alone(hosts):
    own, peft = hosts
    prompts = [_prompt(n, s) for n, s in ((30, 1), (17, 2), (42, 3))]
    hot = SamplingParams(max_tokens=6, temperature=1.5, stop_token_ids=(7,))
    topk = SamplingParams(max_tokens=6, top_k=5, seed=4)
    reply = np.array([900, 31, 7], np.int32)  # ends on the stop token
    adapters, params, seeds = ["pol", None, "pol"], [topk, SamplingParams(max_tokens=5), hot], [11, 12, 13]
    drawn = own.sample(adapters, prompts, params, seeds)
    mixed = own.sample(adapters, prompts, params, seeds, forced=[None, None, reply])
    # The drawing rows draw what they drew without a forced batch-mate.
    for a, b in zip(drawn[:2], mixed[:2]):
        np.testing.assert_array_equal(a.tokens, b.tokens)
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
    got = mixed[2]
    np.testing.assert_array_equal(got.tokens, reply)
    assert got.stop_reason is StopReason.STOP
    seq = [np.concatenate([prompts[2], reply])]
    teacher = own.logprobs("pol", seq, temperature=1.5, tail=len(reply))[0][-len(reply):]
    np.testing.assert_allclose(got.logprobs, teacher, atol=1e-5)
    assert not np.allclose(own.logprobs("pol", seq, tail=len(reply))[0][-len(reply):], got.logprobs, atol=1e-3)
    # Without the engine the same row is scored teacher-forced: the same numbers.
    via_peft = peft.sample(adapters, prompts, params, seeds, forced=[None, None, reply])[2]
    np.testing.assert_array_equal(via_peft.tokens, reply)
    np.testing.assert_allclose(via_peft.logprobs, got.logprobs, atol=1e-5)
    assert via_peft.stop_reason is StopReason.STOP
    # A forced reply without a stop token ends after its last token (LENGTH), under top-k too.
    (short,) = own.sample(["pol"], [prompts[0]], [topk], [5], forced=[np.array([55, 66], np.int32)])
    assert list(short.tokens) == [55, 66] and short.stop_reason is StopReason.LENGTH
    # Scored before top-k's truncation, as drawn tokens are (the sampler's distribution).
    teacher = own.logprobs("pol", [np.concatenate([prompts[0], short.tokens])], tail=2)[0][-2:]
    np.testing.assert_allclose(short.logprobs, teacher, atol=1e-5)


def test_a_forced_reply_reuses_its_cached_prompt_and_caches_itself(hosts):
    """A seat's next turn after an exploring reply: the forced row prefills only the new
    observation, and the turn after it finds the forced reply in the prefix cache."""
    own, _ = hosts
    eng = own.engine
    params = SamplingParams(max_tokens=4)
    first = eng.add("pol", _prompt(40, 9), params, seed=1)
    eng.run_until_done([first])
    obs = np.arange(100, 109, dtype=np.int32)
    turn2 = np.concatenate([first.tokens, obs]).astype(np.int32)
    before = eng.stats.prefill_tokens
    forced = eng.add("pol", turn2, params, seed=2, forced=np.array([321, 654, 987], np.int32))
    eng.run_until_done([forced])
    computed = eng.stats.prefill_tokens - before
    assert forced.out_tokens == [321, 654, 987] and forced.num_cached > 0
    assert len(obs) + 1 <= computed < len(obs) + 1 + eng.block_size
    turn3 = np.concatenate([forced.tokens, obs]).astype(np.int32)
    third = eng.add("pol", turn3, params, seed=3)
    eng.run_until_done([third])
    # The forced reply's last token was never fed: everything before it is cached.
    assert third.num_cached >= (len(turn2) + 2) // eng.block_size * eng.block_size


def test_a_forced_twin_takes_its_reply_and_its_leader_draws_as_alone(hosts):
    own, _ = hosts
    eng = own.engine
    prompt = _prompt(26, 21)
    params = SamplingParams(max_tokens=5, temperature=1.2)
    twinned = eng.stats.twinned
    lead = eng.add("pol", prompt, params, seed=8)
    twin = eng.add("pol", prompt, params, seed=9, forced=np.array([44, 45], np.int32))
    eng.run_until_done([lead, twin])
    assert eng.stats.twinned - twinned == 1
    alone = eng.add("pol", prompt, params, seed=8)
    eng.run_until_done([alone])
    assert lead.out_tokens == alone.out_tokens and twin.out_tokens == [44, 45]
    teacher = own.logprobs("pol", [np.concatenate([prompt, [44, 45]]).astype(np.int32)], temperature=1.2, tail=2)[0]
    np.testing.assert_allclose(twin.out_logprobs, teacher[-2:], atol=1e-5)


def test_bad_forced_replies_are_refused_by_name(hosts):
    prompts = [_prompt(10, 1), _prompt(12, 2)]
    p = SamplingParams(max_tokens=3, stop_token_ids=(2,))
    ok = np.array([5, 2], np.int32)
    check_request(SampleRequest(adapter=None, prompts=prompts, params=p, forced=[ok, ok]), VOCAB)
    cases = [
        ([ok], r"forced has 1 replies for 2 prompts"),
        ([ok, np.array([1, 2, 3, 4], np.int32)], r"forced\[1\] has 4 tokens, more than 3"),
        ([ok, np.array([5, 2, 6], np.int32)], r"forced\[1\] has a stop token at 1, before its end"),
        ([np.array([VOCAB], np.int32), ok], r"forced\[0\]: token id 49152 out of range"),
        ([ok, np.array([], np.int32)], r"forced\[1\] is empty"),
        ([ok, np.array([1.0, 2.0])], r"forced\[1\] must be a 1-D integer array"),
    ]
    for forced, why in cases:
        with pytest.raises(ValueError, match=why):
            check_request(SampleRequest(adapter=None, prompts=prompts, params=p, forced=forced), VOCAB)
    # In process too (no bus): the host names the reply, and the engine keeps serving.
    own, peft = hosts
    for host in (own, peft):
        with pytest.raises(ValueError, match=r"forced\[0\]: token id 49152 out of range"):
            host.sample([None], prompts[:1], [p], [0], forced=[np.array([VOCAB], np.int32)])
        with pytest.raises(ValueError, match=r"forced has 2 replies for 1 prompts"):
            host.sample([None], prompts[:1], [p], [0], forced=[ok, ok])
        with pytest.raises(ValueError, match=r"forced\[0\] has 4 tokens, more than 3"):
            host.sample([None], prompts[:1], [p], [0], forced=[np.array([1, 3, 4, 5], np.int32)])
    assert len(own.sample([None], prompts[:1], [p], [0], forced=[ok])[0].tokens) == 2


def test_the_scheduler_serves_forced_replies_and_refuses_a_bad_one(tiny_path):
    """Over the bus: a forced reply beside drawn ones in the step loop, a bad one refused with
    the field named, and the next request served."""
    from opentinker.engine.service import SchedulerService

    s = SchedulerService(tiny_path, threads=1, device=DEVICE, engine="own",
                         engine_options={"kv_budget_bytes": 16 << 20, "block_size": 4})
    s.start()
    reply = np.array([70, 71, 72], np.int32)

    async def body(c):
        got = await c.request(SampleRequest(adapter=None, prompts=[_prompt(20, 5), _prompt(9, 6)],
                                            params=SamplingParams(max_tokens=4, seed=3), forced=[reply, reply[:1]]))
        with pytest.raises(RemoteError) as e:
            await c.request(SampleRequest(adapter=None, prompts=[_prompt(20, 5)], params=SamplingParams(max_tokens=2),
                                          forced=[reply]))
        after = await c.request(SampleRequest(adapter=None, prompts=[_prompt(20, 5)], params=SamplingParams(max_tokens=2)))
        return got, e.value, after

    try:
        got, err, after = run(with_client(s, body, "forced-test"))
    finally:
        s.stop()
    assert [list(t) for t in got.tokens] == [[70, 71, 72], [70]]
    assert got.stop_reasons == [StopReason.LENGTH, StopReason.LENGTH]
    assert all(np.all(lp < 0) for lp in got.logprobs)
    assert err.error.code is ErrorCode.INVALID and "forced[0] has 3 tokens, more than 2" in str(err)
    assert len(after.tokens[0]) == 2
