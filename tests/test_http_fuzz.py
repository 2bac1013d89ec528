"""Fuzz the OpenAI endpoint of a real scheduler (tiny-random, uvicorn on 127.0.0.1) with hostile
bodies of every class issue #36's attack sent: numbers past every range (``max_tokens =
10**30``, token ids ``2**40``), wrong types, non-finite floats, megabyte strings, deep nesting,
bodies that are not JSON or not UTF-8. Every request is answered with a 2xx or a 4xx in
OpenAI's error format naming no class of ours, never a 500; the endpoint serves a good request
afterwards."""

from __future__ import annotations

import json
import random

import httpx2
import pytest
from conftest import DEVICE

N_BODIES = 300
HOSTILE_VALUES = [
    10**30, -(10**30), 2**31, 2**31 - 1, 2**63, -1, 0, 2**40, 1e308, -1e308, 1e-320, -0.0, 0.5, True, None,
    "", "x" * 5000, "\x00\n\x1b[2J", "\ud800", [], {}, [2**40], [-1], [49152], [[1, 2], [2**40]], [[]], ["a", 3],
    {"role": "user"}, [{"role": "user", "content": 7}], [{"type": "image_url"}], [[[[[]]]]],
]
FIELDS = ["model", "prompt", "messages", "max_tokens", "max_completion_tokens", "n", "seed", "top_k", "top_p",
          "temperature", "stop", "stream", "logprobs", "top_logprobs", "stream_options", "best_of", "echo"]
RAW_BODIES = [b"", b"{", b"not json", b"[" * 10_000 + b"]" * 10_000, b'{"model": "base", "prompt": "\xff\xfe"}',
              b'{"model": "base", "prompt": "a", "temperature": Infinity}',
              b'{"model": "base", "prompt": "a", "top_p": NaN}', b'{"a":' * 5000 + b"1" + b"}" * 5000, b"null", b"[]",
              b'"text"', b"1e999"]
OUR_NAMES = ("Traceback", "Error:", "pydantic", "numpy", "int32", "opentinker", "Validation")


@pytest.fixture(scope="module")
def endpoint(tiny_path):
    from opentinker.engine.service import SchedulerService
    from opentinker.serve.openai_api import make_app, start_http

    s = SchedulerService(tiny_path, threads=1, device=DEVICE)
    s.start()
    server = start_http(make_app(s.endpoint, tiny_path, timeout_s=120))
    yield server
    server.stop()
    s.stop()


def _bodies(rng: random.Random) -> list[tuple[str, bytes]]:
    """``N_BODIES`` (route, body): a good body with one to three fields made hostile, or a raw one."""
    out = []
    for i in range(N_BODIES):
        chat = rng.random() < 0.5
        route = "/v1/chat/completions" if chat else "/v1/completions"
        if i % 10 == 0:
            out.append((route, rng.choice(RAW_BODIES)))
            continue
        body: dict = {"model": "base", "max_tokens": 2, "seed": i}
        body.update({"messages": [{"role": "user", "content": "Bet?"}]} if chat else {"prompt": [1, 2, 3]})
        for field in rng.sample(FIELDS, rng.randint(1, 3)):
            body[field] = rng.choice(HOSTILE_VALUES)
        out.append((route, json.dumps(body).encode()))
    return out


def test_fuzzing_the_endpoint_never_gets_a_500(endpoint):
    statuses: dict[int, int] = {}
    with httpx2.Client(base_url=endpoint.url, timeout=120) as client:
        for route, raw in _bodies(random.Random(36)):
            r = client.post(route, content=raw, headers={"content-type": "application/json"})
            statuses[r.status_code] = statuses.get(r.status_code, 0) + 1
            assert r.status_code < 500, (route, raw[:300], r.text[:500])
            if r.status_code >= 400:
                message = r.json()["error"]["message"]
                assert not any(name in message for name in OUR_NAMES), (raw[:300], message)
        good = client.post("/v1/completions", json={"model": "base", "prompt": "Bet?", "max_tokens": 3})
    print(f"statuses of {N_BODIES} hostile bodies: {dict(sorted(statuses.items()))}")
    assert good.status_code == 200 and statuses.get(400, 0) > N_BODIES // 2
