"""The replies of the OpenAI endpoint (:mod:`opentinker.serve.openai_api`): a whole completion
(:func:`whole`), its Server-Sent Events (:func:`events`, each chunk decoded by
:func:`step_event` in the endpoint's worker threads), and the HTTP error of any failure
(:func:`api_error`: a 500 never names our code; its cause is logged, once a second per kind).
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import fastapi
from fastapi.responses import StreamingResponse

from opentinker.bus import RemoteError
from opentinker.bus.logs import LogEvery
from opentinker.serve.admission import Refused, Ticket
from opentinker.serve.detokenize import ChoiceText, TokenText, finish_choices
from opentinker.serve.openai_bodies import ApiError, BaseBody, ChatBody
from protocols.messages import ErrorCode, SampleChunk, SampleResult

log = logging.getLogger("opentinker.serve.openai_api")
_log = LogEvery(log)
"""Lines a client can repeat at will: at most one a second per kind."""

_STATUS = {ErrorCode.INVALID: 400, ErrorCode.TOO_LARGE: 400, ErrorCode.NOT_FOUND: 404, ErrorCode.BUSY: 503}


def api_error(e: Exception) -> ApiError:
    """The HTTP error for a failure: an admission refusal by its status, a scheduler ``Error``
    by its code, a bus timeout 504, an unreachable scheduler 503, anything else 500. What
    reaches the client never names our code (a 500's cause is logged here, in one line)."""
    if isinstance(e, ApiError):
        return e
    if isinstance(e, Refused):
        return ApiError(e.status, str(e), "invalid_request_error" if e.status < 500 else "server_error", code=e.code)
    if isinstance(e, RemoteError):
        status = _STATUS.get(e.error.code, 500)
        if status == 500:
            _log.error("scheduler", "openai api: the scheduler failed: %s", e)
            return ApiError(500, "the scheduler failed on this request (its log has the cause)", "server_error",
                            code=e.error.code.value)
        code = "model_not_found" if status == 404 else e.error.code.value
        return ApiError(status, _plain(e.error.message), "invalid_request_error" if status < 500 else "server_error",
                        code=code)
    if isinstance(e, (TimeoutError, ConnectionError)):
        timeout = isinstance(e, TimeoutError)
        return ApiError(504 if timeout else 503, "the scheduler did not answer in time" if timeout else
                        "the scheduler cannot be reached", "server_error", code="timeout" if timeout else "unavailable")
    _log.error(type(e).__name__, "openai api: unexpected error", exc_info=e)
    return ApiError(500, "internal error (the server's log has the cause)", "server_error")


def _plain(message: str) -> str:
    """A scheduler's error as an HTTP client reads it: without the exception's class and the
    message classes the fields belong to (``ValueError: SamplingParams.max_tokens ...`` ->
    ``max_tokens ...``)."""
    message = re.sub(r"^\w+(Error|Exception): ", "", message)
    return re.sub(r"\b(SamplingParams|SampleRequest)\.", "", message)


class Reply:
    """The JSON of one response: its head, each choice (text, log-probs, finish) and the usage."""

    def __init__(self, tokens: TokenText, body: BaseBody, rows: list[ChoiceText], prompt_tokens: int, logprobs: bool) -> None:
        self.tokens, self.rows, self.prompt_tokens, self.logprobs = tokens, rows, prompt_tokens, logprobs
        self.chat = isinstance(body, ChatBody)
        self.head = {"id": f"{'chatcmpl' if self.chat else 'cmpl'}-{uuid.uuid4().hex}", "created": int(time.time()),
                     "model": body.model}

    def choice(self, i: int, text: str, toks: range, delta: bool = False) -> dict[str, Any]:
        row, lp = self.rows[i], None
        pieces = [self.tokens.bytes_of(row.ids[k]) for k in toks]
        if self.logprobs and self.chat:
            lp = {"content": [{"token": b.decode(errors="replace"), "logprob": row.logprobs[k], "bytes": list(b),
                               "top_logprobs": []} for k, b in zip(toks, pieces)]}
        elif self.logprobs:
            lp = {"tokens": [b.decode(errors="replace") for b in pieces], "token_logprobs": [row.logprobs[k] for k in toks],
                  "text_offset": [row.offsets[k] for k in toks], "top_logprobs": None}
        out = ({"delta": {"content": text}} if delta else {"message": {"role": "assistant", "content": text}}) \
            if self.chat else {"text": text}
        return {"index": i, **out, "logprobs": lp, "finish_reason": row.finish}

    def usage(self) -> dict[str, int]:
        drawn = sum(r.drawn for r in self.rows)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": drawn, "total_tokens": self.prompt_tokens + drawn}

    def whole(self) -> dict[str, Any]:
        return {**self.head, "object": "chat.completion" if self.chat else "text_completion", "usage": self.usage(),
                "choices": [self.choice(i, *r.take()) for i, r in enumerate(self.rows)]}

    def event(self, choices: list[dict[str, Any]], usage: dict[str, int] | None = None) -> str:
        """One SSE event of the stream (with ``usage``: the last one, with no choices)."""
        body = {**self.head, "object": "chat.completion.chunk" if self.chat else "text_completion", "choices": choices}
        return f"data: {json.dumps({**body, 'usage': usage} if usage else body, ensure_ascii=False)}\n\n"


def step_event(reply: Reply, event: SampleChunk | None, task: asyncio.Task, state: dict[str, Any]) -> list[dict[str, Any]]:
    """Take one partial ``event`` (``None``: ``task`` has the reply) into the rows; the choices
    whose text grew. Decoding is CPU work: this runs in the endpoint's worker threads."""
    rows = reply.rows
    if event is None:
        finish_choices(rows, task.result())
    elif event.seq == state["seq"] and not state["lossy"]:
        for i, tokens_T, logprobs_T in zip(event.rows, event.tokens, event.logprobs):
            rows[i].push(tokens_T, logprobs_T)
        state["seq"] += 1
    else:
        state["lossy"] = True  # a chunk was dropped (a slow reader): the rest comes with the reply
    out = []
    for i, row in enumerate(rows):
        if not row.reported and ((taken := row.take())[0] or taken[1] or row.finish):
            out.append(reply.choice(i, *taken, delta=True))
            row.reported = row.finish is not None
    return out


async def events(off_loop: Callable[..., Awaitable[Any]], reply: Reply, task: asyncio.Task, queue: asyncio.Queue,
                 event: SampleChunk | None, usage: bool, ticket: Ticket) -> AsyncIterator[str]:
    """The SSE stream of a request, from its first partial ``event`` on (then the others from
    ``queue``; ``None``: ``task`` has the reply); ``ticket`` is given back when it ends."""
    rows, state = reply.rows, {"seq": 0, "lossy": False}
    try:
        if reply.chat:
            yield reply.event([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                "finish_reason": None} for i in range(len(rows))])
        while True:
            out = await off_loop(step_event, reply, event, task, state)
            if out:
                yield reply.event(out)
            if all(r.finish for r in rows) and (event is None or any(r.cut for r in rows)):
                break
            event = await queue.get()
        if usage:
            yield reply.event([], reply.usage())
    except Exception as e:  # noqa: BLE001 - the stream has begun: the error is its last event
        yield f"data: {json.dumps(api_error(e).body)}\n\n"
    finally:
        task.cancel()  # every choice met a stop string, or the client went away: free the rows
        ticket.release()
    yield "data: [DONE]\n\n"


class EventStream(StreamingResponse):
    """SSE whose generator is closed however the response ends, so its request is cancelled."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


def whole(reply: Reply, result: SampleResult) -> fastapi.Response:
    """The whole reply, as the response's bytes: decoding every row and encoding the JSON (128
    rows of log-probs is megabytes) run in the worker threads, not on the event loop."""
    finish_choices(reply.rows, result)
    return fastapi.Response(json.dumps(reply.whole(), ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode(),
                            media_type="application/json")  # as FastAPI's JSONResponse encodes
