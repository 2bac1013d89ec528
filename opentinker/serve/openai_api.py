"""An OpenAI-compatible HTTP endpoint in front of the scheduler, as vLLM and SGLang serve one.

:func:`make_app` builds a FastAPI app that talks to the scheduler with its own bus
:class:`~opentinker.bus.Client` (made on uvicorn's loop, in the lifespan); :func:`start_http`
serves it with uvicorn in a background thread. The routes, and what they send on the bus:

* ``GET /v1/models``: ``base`` (the bare base model), then every adapter of ``ListAdapters``.
* ``POST /v1/chat/completions``: ``messages`` rendered by the model folder's chat template
  (:class:`~opentinker.rollout.render.ChatTokenizer`, ``add_generation_prompt=True``).
* ``POST /v1/completions``: ``prompt`` a string, token ids, or a list of either.

Each HTTP request is one ``SampleRequest``. ``model`` picks the adapter (``base``: none); the
``n`` choices of a prompt are rows (row ``i`` draws with ``seed + i``; ``seed`` defaults to 0,
so a request without one is reproducible); ``temperature`` 0 is greedy (temperature 1 with
``top_k`` 1); ``top_p``, ``top_k`` and ``max_tokens`` / ``max_completion_tokens`` pass through.
The tokenizer's eos is the stop token: drawn and counted in ``usage``, but in neither the text
nor the log-probs. A ``stop`` string cuts the text before its first occurrence (finish reason
``stop``); the log-probs keep the tokens that start before the cut.

Log-probs are the sampler's, of the drawn token only (``log_softmax(logits / temperature)``
before top-k / top-p): chat ``logprobs=true`` and completions ``logprobs=0``; a request for
alternatives (``top_logprobs`` or ``logprobs`` > 0) is refused with 400.

``stream=true`` relays the ``SampleChunk`` partials as Server-Sent Events in OpenAI's chunk
format, decoded incrementally (a multi-byte character goes out whole, and text that may begin
a stop string is held back until it cannot), then ``data: [DONE]``. A client that goes away,
streaming or not, has its request cancelled on the scheduler (the bus client sends ``Cancel``
when the awaiting task is cancelled), which frees its rows at the next step.

Errors are OpenAI's ``{"error": {message, type, param, code}}``: a bad field or a scheduler
``invalid`` error 400, a missing or wrong API key 401, an unknown model 404
(``model_not_found``), a body over the bound 413, a client over its share 429, a busy
scheduler 503, others 500 (whose message never names our code: the cause is logged).

Hostile load (``docs/security.md``): a body is bounded before it is parsed, a text prompt
before it is tokenized (:mod:`opentinker.serve.admission`); parsing, tokenizing and decoding
run in worker threads, so the event loop answers every client while one sends megabytes; each
client (per API key, or per peer address) holds a bounded number of rows and tokens in flight,
and clients waiting for room are served fewest-rows first; every number is range-checked
(:mod:`opentinker.serve.openai_bodies`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

import fastapi
import numpy as np
import uvicorn
import zmq.asyncio
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from opentinker.bus import Client, RemoteError, is_loopback
from opentinker.bus.auth import Credentials
from opentinker.serve.admission import (
    NO_KEY,
    Admission,
    BodyLimit,
    Limits,
    Refused,
    max_prompt_chars,
)
from opentinker.serve.detokenize import (
    ChoiceText,
    TokenText,
    reply_params,
)
from opentinker.serve.openai_bodies import (
    MAX_ROWS,
    MAX_STOPS,
    ApiError,
    BaseBody,
    ChatBody,
    CompletionBody,
    bad_body,
    parse_body,
)
from opentinker.serve.openai_replies import EventStream, Reply, api_error, events, whole
from protocols.messages import (
    AdapterList,
    ListAdapters,
    SampleChunk,
    SampleRequest,
)

log = logging.getLogger(__name__)
T = TypeVar("T")
B = TypeVar("B", bound=BaseBody)
WORKERS = 2
"""Threads that parse bodies, tokenize prompts and decode replies, off the event loop."""
MAX_CONNECTIONS = 128
"""Open HTTP connections uvicorn serves at once (beyond: 503)."""

BASE = "base"
"""The model name of the bare base model (an adapter of that name is not reachable here)."""
_UNSUPPORTED = {"tools": None, "functions": None, "logit_bias": None, "presence_penalty": None,
                "frequency_penalty": None, "repetition_penalty": 1, "echo": None, "suffix": None, "best_of": 1,
                "response_format": {"type": "text"}, "tool_choice": "none"}
"""Fields this server cannot honour -> the one value besides unset (falsy) that it accepts."""


async def _unless_gone(request: fastapi.Request, work: Awaitable[T]) -> T:
    """``await work``, cancelled if the HTTP client disconnects first (once the body is read,
    uvicorn's ``receive`` waits for the disconnect)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()  # the bus client cancels the request on the scheduler
    if task.cancelled():
        raise ApiError(499, "the client closed the request", code="client_closed")
    return task.result()


class _Api:
    """What the routes share: the tokenizer and its bounds, the worker threads, the admission of
    clients, the bus client (made in the lifespan), the defaults."""

    def __init__(self, model_path: str, timeout_s: float, max_tokens: int, limits: Limits) -> None:
        self.model_path = model_path
        self.tokens = TokenText(model_path)
        self.tok = self.tokens.tok
        self.timeout_s, self.max_tokens = timeout_s, max_tokens
        config = json.loads((Path(model_path) / "config.json").read_text())
        self.vocab_size = int(config.get("vocab_size") or self.tok.vocab_size)
        self.max_context = int(config.get("max_position_embeddings") or 1 << 20)
        longest = max(len(self.tokens.bytes_of(i)) for i in range(self.tok.vocab_size))
        self.max_chars = max_prompt_chars(self.max_context, longest)
        """A text prompt (or a conversation's text) longer than this cannot fit the context."""
        self.admission = Admission(limits)
        self.pool = ThreadPoolExecutor(WORKERS, thread_name_prefix="openai-api-cpu")
        self.client: Client

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` in the worker threads: the event loop keeps answering other clients."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    async def body(self, request: fastapi.Request, kind: type[B]) -> B:
        """The request's body as ``kind``, parsed in the worker threads (its size is bounded by
        :class:`~opentinker.serve.admission.BodyLimit` before it is read)."""
        return await self.off_loop(parse_body, await request.body(), kind)

    def check_text(self, chars: int, param: str) -> None:
        if chars > self.max_chars:
            raise ApiError(400, f"{param}: {chars} characters cannot fit the model's context of {self.max_context} "
                           "tokens", param=param, code="context_length_exceeded")

    def check_ids(self, ids: list[int]) -> None:
        if len(ids) > self.max_context:
            raise ApiError(400, f"prompt: {len(ids)} tokens cannot fit the model's context of {self.max_context} "
                           "tokens", param="prompt", code="context_length_exceeded")
        if ids and max(ids) >= self.vocab_size:
            raise ApiError(400, f"prompt: token id {max(ids)} is not in the vocabulary (0 to {self.vocab_size - 1})",
                           param="prompt")

    async def adapters(self) -> list[str]:
        reply = await self.client.request(ListAdapters(), self.timeout_s)
        assert isinstance(reply, AdapterList)
        return [a.name for a in reply.adapters]

    async def serve(self, request: fastapi.Request, client: str, body: BaseBody, prompts: list[np.ndarray],
                    limit: int | None, logprobs: bool) -> Any:
        """``body.n`` choices of each prompt for ``client``: the whole reply, or its SSE stream."""
        for name, ok in _UNSUPPORTED.items():
            if (value := (body.model_extra or {}).get(name)) and value != ok:
                raise ApiError(400, f"{name} is not supported by this server", param=name)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        if len(stops) > MAX_STOPS or not all(stops):
            raise ApiError(400, f"stop: at most {MAX_STOPS} non-empty strings", param="stop")
        if len(prompts) * body.n > MAX_ROWS:
            raise ApiError(400, f"at most {MAX_ROWS} choices (prompts times n) per request", param="n")
        if body.model != BASE and body.model not in await self.adapters():
            raise ApiError(404, f"the model {body.model!r} does not exist (GET /v1/models lists them)", param="model",
                           code="model_not_found")
        params = reply_params(body.temperature, body.top_p, body.top_k, limit or self.max_tokens, self.tok.eos_id,
                              body.seed or 0)
        req = SampleRequest(adapter=None if body.model == BASE else body.model, params=params, client="openai-api",
                            prompts=[p for p in prompts for _ in range(body.n)], stream=body.stream)
        tokens = sum(len(p) + params.max_tokens for p in req.prompts)
        ticket = await _unless_gone(request, self.admission.admit(client, len(req.prompts), tokens))
        try:
            rows = [ChoiceText(self.tok, stops, params.max_tokens) for _ in req.prompts]
            reply = Reply(self.tokens, body, rows, sum(map(len, prompts)), logprobs)
            if not body.stream:
                result = await _unless_gone(request, self.client.request(req, self.timeout_s))
                return await self.off_loop(whole, reply, result)
            queue: asyncio.Queue[SampleChunk | None] = asyncio.Queue()
            task = asyncio.ensure_future(self.client.request(req, self.timeout_s, on_partial=queue.put_nowait))
            task.add_done_callback(lambda _: queue.put_nowait(None))
            try:  # wait for the first tokens, so that a request the scheduler refuses is an HTTP error
                first = await _unless_gone(request, queue.get())
                if first is None:
                    task.result()
            except BaseException:
                task.cancel()
                raise
            usage = (body.stream_options or {}).get("include_usage", False)
            stream = EventStream(events(self.off_loop, reply, task, queue, first, usage, ticket),
                                  media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            ticket = None  # the stream gives it back when it ends
            return stream
        finally:
            if ticket is not None:
                ticket.release()


def make_app(endpoint: str, model_path: str, *, api_key: str | None = None, timeout_s: float = 600.0,
             max_tokens: int = 256, credentials: Credentials | None = None, api_keys: Sequence[str] = (),
             limits: Limits | None = None) -> fastapi.FastAPI:
    """The OpenAI-compatible app in front of the scheduler at bus ``endpoint``.

    Args:
        endpoint: the scheduler's bus endpoint (what ``SchedulerService.start()`` returned).
        model_path: the model folder the scheduler serves (for its tokenizer and chat template).
        api_key: when set, every route needs ``Authorization: Bearer <api_key>``.
        timeout_s: the bound on one bus request; a sample still running then is cancelled.
        max_tokens: tokens drawn per choice when the request names no limit.
        credentials: what it presents to the scheduler (default: this process's own; the
            owner's CURVE pair for a service on CURVE).
        api_keys: further keys, each a client of its own: with two or more keys, what a client
            may hold in flight (``limits``) is counted per key; else per peer address.
        limits: the bounds on bodies and on what clients hold in flight (default :class:`Limits`).
    """
    limits = limits or Limits()
    api = _Api(model_path, timeout_s, max_tokens, limits)
    keys = _Keys([k.encode() for k in ([api_key] if api_key else []) + list(api_keys)])
    # FastAPI's own pages answer without the route dependencies: with a key, they are not served.
    pages = {} if not keys.keys else {"docs_url": None, "redoc_url": None, "openapi_url": None}
    app = fastapi.FastAPI(title="OpenTinker", lifespan=_lifespan(api, endpoint, credentials),
                          dependencies=[fastapi.Depends(_authorize)], **pages)
    # A client without the key is refused before a byte of its body is read.
    app.add_middleware(BodyLimit, max_bytes=limits.max_body_bytes,
                       allowed=lambda authorization: keys.index(authorization) is not None)
    app.state.api_key = api_key or (api_keys[0] if api_keys else None)
    app.state.admission = api.admission
    app.state.api = api  # the routes' shared state (its tokenizer, pool, admission), for inspection
    app.state.keys = keys
    for kind in (ApiError, Refused, RemoteError, TimeoutError, ConnectionError):
        app.add_exception_handler(kind, _on_error)
    app.add_exception_handler(RequestValidationError, _on_bad_body)  # type: ignore[arg-type]
    app.get("/v1/models")(list_models)
    app.post("/v1/chat/completions", openapi_extra=_schema(ChatBody))(chat_completions)
    app.post("/v1/completions", openapi_extra=_schema(CompletionBody))(completions)
    return app


def _lifespan(api: _Api, endpoint: str, credentials: Credentials | None
              ) -> Callable[[fastapi.FastAPI], contextlib.AbstractAsyncContextManager[None]]:
    """The app's lifespan: the bus client to the scheduler at ``endpoint`` made on uvicorn's
    loop; at the end, the client, its context and the worker threads closed."""

    @contextlib.asynccontextmanager
    async def lifespan(_: fastapi.FastAPI) -> AsyncIterator[None]:
        ctx = zmq.asyncio.Context()
        api.client = Client(ctx, endpoint, name="openai-api", credentials=credentials)
        try:
            yield
        finally:
            api.client.close()
            ctx.destroy(linger=0)
            api.pool.shutdown(wait=False, cancel_futures=True)

    return lifespan


class _Keys:
    """The API keys a client may present (none: every client is let in)."""

    def __init__(self, keys: list[bytes]) -> None:
        self.keys = keys

    def index(self, authorization: str) -> int | None:
        """Which key an ``Authorization`` header carries (0 when none is needed), or None."""
        if not self.keys:
            return 0
        scheme, _, given = authorization.partition(" ")
        # Compared with every key, so that the time taken says nothing about which one is near.
        hits = [hmac.compare_digest(given.strip().encode(), k) for k in self.keys]
        return hits.index(True) if scheme.lower() == "bearer" and any(hits) else None


async def _authorize(request: fastapi.Request) -> str:
    """Every route's dependency: the client's name for admission, its key's index with several
    keys, else its address (401 without a key the app takes)."""
    keys: _Keys = request.app.state.keys
    index = keys.index(request.headers.get("authorization", ""))
    if index is None:
        raise ApiError(401, NO_KEY, "authentication_error", code="invalid_api_key")
    if len(keys.keys) > 1:
        return f"key {index}"
    return request.client.host if request.client else "?"


async def _on_error(_: fastapi.Request, e: Exception) -> JSONResponse:
    """An error a route raised, as OpenAI's error body (:func:`api_error`)."""
    err = api_error(e)
    return JSONResponse(err.body, status_code=err.status)


async def _on_bad_body(_: fastapi.Request, e: RequestValidationError) -> JSONResponse:
    """A body FastAPI's validation refused, as OpenAI's 400 error body."""
    err = bad_body(list(e.errors()))
    return JSONResponse(err.body, 400)


async def list_models(request: fastapi.Request) -> dict[str, Any]:
    """OpenAI's model list: ``base``, then every adapter of the scheduler."""
    api: _Api = request.app.state.api
    now = int(time.time())
    names = [BASE, *(n for n in await api.adapters() if n != BASE)]
    return {"object": "list", "data": [{"id": n, "object": "model", "created": now, "owned_by": "opentinker",
                                        "root": api.model_path, "parent": None if n == BASE else BASE} for n in names]}


async def chat_completions(request: fastapi.Request, client: str = fastapi.Depends(_authorize)) -> Any:
    """A chat completion (or its SSE stream) of the conversation, rendered by the chat template."""
    api: _Api = request.app.state.api
    body = await api.body(request, ChatBody)
    if body.top_logprobs:
        raise ApiError(400, "top_logprobs > 0 is not supported: only the drawn token's log-prob is known",
                       param="top_logprobs")
    messages = [{"role": m.role, "content": m.text()} for m in body.messages]
    api.check_text(sum(len(m["content"]) + len(m["role"]) for m in messages), "messages")
    ids = await api.off_loop(lambda: api.tok.encode(api.tok.render(messages, add_generation_prompt=True)))
    api.check_ids(ids)
    return await api.serve(request, client, body, [np.asarray(ids, np.int32)],
                           body.max_completion_tokens or body.max_tokens, bool(body.logprobs))


async def completions(request: fastapi.Request, client: str = fastapi.Depends(_authorize)) -> Any:
    """A completion (or its SSE stream) of each prompt: text, or token ids as given."""
    api: _Api = request.app.state.api
    body = await api.body(request, CompletionBody)
    if body.logprobs:
        raise ApiError(400, "logprobs > 0 asks for alternatives, which are not computed: logprobs=0 gives the "
                       "drawn tokens' log-probs", param="logprobs")
    p = body.prompt
    many = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
    if len(many) > MAX_ROWS:
        raise ApiError(400, f"at most {MAX_ROWS} prompts per request", param="prompt")
    for x in many:
        api.check_text(len(x), "prompt") if isinstance(x, str) else api.check_ids(x)
    ids = await api.off_loop(lambda: [api.tok.encode(x) if isinstance(x, str) else x for x in many])
    for x in ids:
        api.check_ids(x)
    if not ids or not all(ids):
        raise ApiError(400, "prompt is empty", param="prompt")
    return await api.serve(request, client, body, [np.asarray(x, np.int32) for x in ids], body.max_tokens,
                           body.logprobs is not None)


def _schema(kind: type[BaseBody]) -> dict[str, Any]:
    """The OpenAPI entry of a body the route parses itself (off the event loop)."""
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": kind.model_json_schema()}}}}


class HttpServer:
    """A uvicorn server running an app in a daemon thread."""

    def __init__(self, server: uvicorn.Server, thread: threading.Thread, url: str) -> None:
        self.server, self.thread = server, thread
        self.url = url
        """``http://host:port`` as bound (the port the OS picked when asked for 0)."""

    def stop(self, timeout: float = 30.0) -> None:
        """Stop accepting, close open streams after a few seconds' grace, and join the thread."""
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            log.warning("openai api: the HTTP server did not stop within %.0f s", timeout)


def start_http(app: fastapi.FastAPI, host: str = "127.0.0.1", port: int = 0, *, log_level: str = "warning",
               start_timeout: float = 30.0) -> HttpServer:
    """Serve ``app`` with uvicorn in a daemon thread; return once it listens.

    Raises:
        ValueError: ``host`` is not a loopback address and the app has no API key.
        RuntimeError: the server did not start within ``start_timeout`` s (e.g. the port is taken).
    """
    if not is_loopback(f"tcp://{host}:0") and not getattr(app.state, "api_key", None):
        raise ValueError(f"refusing to serve on {host} without an API key: a non-loopback address is reachable "
                         "from the network (opentinker serve --api-key-file FILE; from Python, make_app(..., "
                         "api_key=...)), or serve on 127.0.0.1")
    # Connections beyond MAX_CONNECTIONS are answered 503 at once: each may hold a body of up
    # to Limits.max_body_bytes while it is read.
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, log_config=None, access_log=False,
                            timeout_graceful_shutdown=3, limit_concurrency=MAX_CONNECTIONS)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="openai-api-http", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            server.should_exit = True
            raise RuntimeError(f"the HTTP server on {host}:{port} did not start")
        time.sleep(0.01)
    bound = server.servers[0].sockets[0].getsockname()[1]
    return HttpServer(server, thread, f"http://{f'[{host}]' if ':' in host else host}:{bound}")


_api_error = api_error  # the name tests and callers used before the replies had a module of their own
