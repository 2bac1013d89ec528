"""The OpenAI-compatible endpoint on a real scheduler (tiny-random model), through uvicorn on
127.0.0.1 and the official ``openai`` client: the same tokens and log-probs as the scheduler's
own ``SampleRequest``, streaming (``n`` choices, stop strings, whole characters), adapters as
models, errors, the API key, concurrent requests batched, and clients that go away freeing
their rows."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import httpx2
import numpy as np
import openai
import pytest
from conftest import DEVICE

from opentinker.bus import RemoteError, SyncClient
from opentinker.serve.detokenize import ChoiceText, TokenText
from opentinker.serve.openai_api import _api_error, make_app, start_http
from protocols.messages import (
    AdamParams,
    CreateAdapter,
    Datum,
    Error,
    ErrorCode,
    ForwardBackward,
    LoraSpec,
    OptimStep,
    SampleRequest,
    SamplingParams,
    SchedulerStats,
)

ADAPTER = "tuned"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a card game."}]
WAIT_S = 20.0


@pytest.fixture(scope="module")
def sched(tiny_path):
    """One scheduler for the module, with an adapter trained one step away from the base."""
    from opentinker.engine.service import SchedulerService

    s = SchedulerService(tiny_path, threads=1, device=DEVICE)
    s.start()
    with SyncClient(s.endpoint, name="setup") as c:
        c.request(CreateAdapter(name=ADAPTER, spec=LoraSpec(rank=4)), WAIT_S)
        tokens = np.arange(10, 30, dtype=np.int32)
        mask = np.r_[np.zeros(12), np.ones(8)].astype(np.float32)
        d = Datum(tokens=tokens, loss_inputs={"mask": mask, "advantages": mask, "sampler_logprobs": mask * -10.8})
        c.request(ForwardBackward(adapter=ADAPTER, datums=[d], loss="ppo", normalizer=8.0), WAIT_S)
        c.request(OptimStep(adapter=ADAPTER, params=AdamParams(lr=0.05)), WAIT_S)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(sched, tiny_path):
    server = start_http(make_app(sched.endpoint, tiny_path, timeout_s=WAIT_S))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def api(http):
    return openai.OpenAI(base_url=http.url + "/v1", api_key="unused", max_retries=0, timeout=WAIT_S)


def direct(sched, prompt, adapter, seed, max_tokens, eos):
    """The scheduler's own sample of ``prompt``: (tokens without the stop token, their log-probs) per row."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, stop_token_ids=(eos,), seed=seed)
    with SyncClient(sched.endpoint, name="direct") as c:
        res = c.request(SampleRequest(adapter=adapter, prompts=[np.asarray(prompt, np.int32)], params=params), WAIT_S)
    out = []
    for toks, lps in zip(res.tokens, res.logprobs):
        keep = len(toks) - int(len(toks) > 0 and toks[-1] == eos)
        out.append((toks[:keep].tolist(), lps[:keep]))
    return out


def chat_prompt(tok):
    return tok.encode(tok.render(MESSAGES, add_generation_prompt=True))


def test_chat_matches_the_schedulers_own_sample(sched, api, chat_tok):
    r = api.chat.completions.create(model=ADAPTER, messages=MESSAGES, logprobs=True, seed=7, temperature=1,
                                    max_tokens=12)
    (toks, lps), = direct(sched, chat_prompt(chat_tok), ADAPTER, 7, 12, chat_tok.eos_id)
    choice = r.choices[0]
    assert choice.message.content == chat_tok.decode(toks) and choice.message.role == "assistant"
    got = np.array([c.logprob for c in choice.logprobs.content])
    diff = np.abs(got - lps).max()
    print(f"max |logprob(http) - logprob(scheduler)| = {diff:.2e} over {len(toks)} tokens")
    assert len(got) == len(toks) and diff < 1e-5
    assert b"".join(bytes(c.bytes) for c in choice.logprobs.content) == choice.message.content.encode()
    assert all(c.top_logprobs == [] for c in choice.logprobs.content)
    assert choice.finish_reason == ("length" if len(toks) == 12 else "stop")
    assert r.usage.prompt_tokens == len(chat_prompt(chat_tok)) and r.usage.completion_tokens >= len(toks)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # The adapter is what sampled: the base model draws other log-probs with the same seed.
    (base_toks, base_lps), = direct(sched, chat_prompt(chat_tok), None, 7, 12, chat_tok.eos_id)
    assert base_toks != toks or np.abs(base_lps - lps).max() > 1e-3
    # Greedy (temperature 0) is reproducible whatever the seed.
    greedy = [api.chat.completions.create(model=ADAPTER, messages=MESSAGES, temperature=0, seed=s, max_tokens=6)
              for s in (1, 2)]
    assert greedy[0].choices[0].message.content == greedy[1].choices[0].message.content


def test_streaming_equals_the_whole_reply_also_with_n_and_stop_strings(api):
    kw = {"model": ADAPTER, "messages": MESSAGES, "seed": 5, "max_tokens": 16, "n": 2}
    whole = api.chat.completions.create(**kw)
    texts = [c.message.content for c in whole.choices]
    assert texts[0] != texts[1]  # row i draws with seed + i

    def streamed(**extra):
        parts, finish, usage = {0: [], 1: []}, {}, None
        for ev in api.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}, **extra):
            usage = ev.usage or usage
            for c in ev.choices:
                parts[c.index].append(c.delta.content or "")
                if c.finish_reason:
                    assert c.index not in finish
                    finish[c.index] = c.finish_reason
        return ["".join(parts[i]) for i in (0, 1)], finish, usage

    got, finish, usage = streamed()
    assert got == texts and finish == {i: c.finish_reason for i, c in enumerate(whole.choices)}
    assert usage.completion_tokens == whole.usage.completion_tokens
    # A stop string from the middle of choice 0: cut before it, the same streamed or not.
    stop = texts[0][len(texts[0]) // 2:][:3]
    cut = api.chat.completions.create(**kw, stop=[stop])
    assert cut.choices[0].message.content == texts[0][:texts[0].index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    got, finish, _ = streamed(stop=[stop])
    assert got == [c.message.content for c in cut.choices] and finish[0] == "stop"


def test_models_list_adapters_and_unknown_models_are_404(api):
    ids = [m.id for m in api.models.list().data]
    assert ids[0] == "base" and ADAPTER in ids
    with pytest.raises(openai.NotFoundError) as e:
        api.chat.completions.create(model="no-such-adapter", messages=MESSAGES)
    assert e.value.code == "model_not_found" and e.value.status_code == 404
    for bad in ({"top_logprobs": 2, "logprobs": True}, {"temperature": -1}, {"messages": []},
                {"max_tokens": 10 ** 6}, {"presence_penalty": 0.5}, {"stop": [""]}):
        with pytest.raises(openai.BadRequestError):
            api.chat.completions.create(**{"model": "base", "messages": MESSAGES, **bad})
    # A format or tools the server cannot honour are refused by name, never silently ignored.
    for field, value in (("response_format", {"type": "json_object"}), ("tools", [{"type": "function"}])):
        with pytest.raises(openai.BadRequestError) as e:
            api.chat.completions.create(model="base", messages=MESSAGES, max_tokens=2, **{field: value})
        assert e.value.body["param"] == field and "not supported" in e.value.body["message"]
    ok = api.chat.completions.create(model="base", messages=MESSAGES, max_tokens=2, response_format={"type": "text"})
    assert len(ok.choices) == 1


def test_scheduler_errors_map_to_http_statuses():
    def status(code):
        return _api_error(RemoteError(Error(code=code, message="m"))).status

    assert [status(c) for c in (ErrorCode.INVALID, ErrorCode.BUSY, ErrorCode.NOT_FOUND, ErrorCode.INTERNAL)] == [
        400, 503, 404, 500]
    assert _api_error(TimeoutError()).status == 504 and _api_error(ConnectionError()).status == 503


def test_concurrent_requests_are_batched_and_draw_what_they_draw_alone(sched, api):
    def ask(seed):
        r = api.chat.completions.create(model=ADAPTER, messages=MESSAGES, seed=seed, max_tokens=8, logprobs=True)
        return r.choices[0].message.content, [c.logprob for c in r.choices[0].logprobs.content]

    alone = [ask(s) for s in range(4)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(ask, range(4)))
    for (text_a, lps_a), (text_t, lps_t) in zip(alone, together):
        assert text_a == text_t and np.abs(np.array(lps_a) - lps_t).max() < 1e-5
    with SyncClient(sched.endpoint, name="stats") as c:
        batches = c.request(SchedulerStats(), WAIT_S).batches
    assert any(b.count("openai-api") >= 2 for b in batches), batches  # rows of several HTTP requests in one step


def test_completions_of_token_ids_match_the_scheduler(sched, api, chat_tok):
    prompt = chat_tok.encode("Kuhn poker: you hold the king. You")
    r = api.completions.create(model="base", prompt=prompt, max_tokens=10, seed=3, logprobs=0)
    (toks, lps), = direct(sched, prompt, None, 3, 10, chat_tok.eos_id)
    c = r.choices[0]
    assert c.text == chat_tok.decode(toks)
    assert np.abs(np.array(c.logprobs.token_logprobs) - lps).max() < 1e-5
    assert len(c.logprobs.tokens) == len(toks) and c.logprobs.text_offset[0] == 0
    assert c.logprobs.text_offset == sorted(c.logprobs.text_offset) and not c.logprobs.top_logprobs
    assert r.usage.prompt_tokens == len(prompt)
    text = api.completions.create(model="base", prompt="Kuhn poker: you hold the king. You", max_tokens=10, seed=3)
    assert text.choices[0].text == c.text  # a string prompt is tokenized the same way
    with pytest.raises(openai.BadRequestError):
        api.completions.create(model="base", prompt=prompt, logprobs=2)


def test_api_key_is_required_when_set_and_public_hosts_need_one(sched, tiny_path):
    server = start_http(make_app(sched.endpoint, tiny_path, api_key="s3cret", timeout_s=WAIT_S))
    try:
        wrong = openai.OpenAI(base_url=server.url + "/v1", api_key="guess", max_retries=0, timeout=WAIT_S)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        assert httpx2.get(server.url + "/v1/models", timeout=WAIT_S).status_code == 401  # no header at all
        assert all(httpx2.get(server.url + page, timeout=WAIT_S).status_code in (401, 404)
                   for page in ("/docs", "/redoc", "/openapi.json"))  # FastAPI's own pages are not open
        right = openai.OpenAI(base_url=server.url + "/v1", api_key="s3cret", max_retries=0, timeout=WAIT_S)
        assert right.chat.completions.create(model="base", messages=MESSAGES, max_tokens=3).choices[0].message
    finally:
        server.stop()
    with pytest.raises(ValueError, match="without an API key"):
        start_http(make_app(sched.endpoint, tiny_path), host="0.0.0.0")


def test_clients_gone_mid_request_free_their_rows(sched, http, api):
    """Streaming (one event read, then closed) and not (an HTTP timeout): the scheduler counts
    the request cancelled, long before its 1500 tokens could be drawn, and serves the next."""
    def cancelled() -> int:
        with SyncClient(sched.endpoint, name="stats") as c:
            counters = c.request(SchedulerStats(), WAIT_S).counters
        return counters.get("cancelled_running", 0) + counters.get("cancelled_queued", 0)

    def wait_for_cancel(before: int) -> float:
        t0 = time.monotonic()
        while cancelled() == before:
            assert time.monotonic() - t0 < WAIT_S, "the scheduler never saw the request cancelled"
            time.sleep(0.05)
        return time.monotonic() - t0

    body = {"model": "base", "messages": MESSAGES, "max_tokens": 1500, "seed": 1}
    before = cancelled()
    with httpx2.stream("POST", http.url + "/v1/chat/completions", json={**body, "stream": True},
                       timeout=WAIT_S) as resp:
        assert resp.status_code == 200
        assert next(resp.iter_lines()).startswith("data: ")  # one event, then the client goes away
    streamed = wait_for_cancel(before)
    before = cancelled()
    with pytest.raises(httpx2.ReadTimeout):
        httpx2.post(http.url + "/v1/chat/completions", json=body, timeout=0.5)
    whole = wait_for_cancel(before)
    t0 = time.monotonic()
    r = api.chat.completions.create(model="base", messages=MESSAGES, max_tokens=4)
    assert r.choices[0].finish_reason in ("length", "stop")
    print(f"cancelled after {streamed:.2f} s (stream) and {whole:.2f} s (timed-out request); "
          f"next request served in {time.monotonic() - t0:.2f} s")


def test_incremental_decoding_keeps_characters_whole_and_holds_back_stop_strings(tiny_path):
    tokens = TokenText(tiny_path)
    tok = tokens.tok
    text = "日本語 ok é 🎉 naïve"
    ids = np.array(tok.encode(text), np.int32)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some tokens hold part of a character
    for stops, want in (([], text), ([" ok"], "日本語"), (["🎉", "na"], "日本語 ok é ")):
        row, parts = ChoiceText(tok, stops, max_tokens=len(ids)), []
        for t in ids:
            row.push(np.array([t]), np.array([-1.0], np.float32))
            delta, _ = row.take()
            assert "\ufffd" not in delta
            parts.append(delta)
        assert "".join(parts) == row.text == want and row.finish == ("stop" if stops else "length")
        assert b"".join(tokens.bytes_of(t) for t in row.ids).decode().startswith(want)
        assert row.offsets == sorted(row.offsets) and row.drawn <= len(ids)
