"""What one HTTP client of the OpenAI endpoint may hold, so that no client can deny service to
the others (vLLM's server leaves this to a proxy; ours is reachable by every local user).

Three bounds, applied in this order, each before the work it guards:

* :class:`BodyLimit`, an ASGI middleware: a request body over ``max_bytes`` is refused with
  413 before it is parsed (a declared ``Content-Length`` before a byte is read; else once the
  bytes read pass the bound), so a 20 MB prompt never reaches the JSON parser or the tokenizer.
* :func:`max_prompt_chars`: a text prompt longer than the model's context times the longest
  token's bytes cannot fit the context, whatever it encodes to, and is refused before it is
  tokenized. (A string of ``c`` characters is at least ``c`` UTF-8 bytes, and no token covers
  more than ``longest`` bytes, so it is at least ``c / longest`` tokens.)
* :class:`Admission`: each client (per API key when the service has several, else per peer
  address) holds at most ``client_rows`` rows and ``client_tokens`` tokens (prompt plus
  ``max_tokens``, per row) in flight, queued or running; past that a request is refused at once
  with 429. All clients together hold at most ``total_rows`` and ``total_tokens``; past that a
  request waits, and when room frees the waiting request of the client holding the fewest rows
  goes first (then the oldest), so a client that floods cannot take another's turn; a request
  that waits longer than ``wait_s`` gets 503.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass, field
from typing import Any

NO_KEY = "missing or wrong API key (Authorization: Bearer <key>)"
Scope = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[MutableMapping[str, Any]]]
Send = Callable[[MutableMapping[str, Any]], Awaitable[None]]


class Refused(Exception):
    """A request admission refuses: its HTTP ``status``, OpenAI ``code`` and ``message``."""

    def __init__(self, status: int, message: str, code: str) -> None:
        super().__init__(message)
        self.status, self.code = status, code


@dataclass(frozen=True)
class Limits:
    """The bounds of :class:`BodyLimit` and :class:`Admission` (defaults: the endpoint's)."""

    max_body_bytes: int = 8 << 20
    """A request body's bytes: 128 prompts of 2,048 token ids fit with room to spare."""
    client_rows: int = 128
    """Rows (prompts times ``n``) one client holds in flight: one request of the most rows."""
    client_tokens: int = 128 * 4096
    """Tokens (each row's prompt plus ``max_tokens``) one client holds in flight."""
    total_rows: int = 256
    """Rows of all clients in flight: the engine's rows (``serve --max-rows``), so every
    admitted row runs at once instead of waiting behind another client's."""
    total_tokens: int = 256 * 4096
    """Tokens of all clients in flight."""
    wait_s: float = 60.0
    """How long a request waits for room among all clients before a 503."""

    def __post_init__(self) -> None:
        for name in ("max_body_bytes", "client_rows", "client_tokens", "total_rows", "total_tokens"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"Limits.{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.wait_s < float("inf"):
            raise ValueError(f"Limits.wait_s must be positive and finite, got {self.wait_s}")


def max_prompt_chars(max_context: int, longest_token_bytes: int) -> int:
    """The most characters a text prompt may have and still fit ``max_context`` tokens, when
    no token covers more than ``longest_token_bytes`` bytes (see the module docstring)."""
    return max_context * max(1, longest_token_bytes)


class BodyLimit:
    """ASGI middleware: a request whose ``Authorization`` header ``allowed`` refuses is
    answered 401, and a body over ``max_bytes`` 413 (OpenAI's error format), without reading
    (more of) the body; a body within it is read whole and handed on."""

    def __init__(self, app: Any, max_bytes: int, allowed: Callable[[str], bool] | None = None) -> None:
        self.app, self.max_bytes, self.allowed = app, max_bytes, allowed

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if self.allowed is not None and not self.allowed(headers.get(b"authorization", b"").decode("latin-1")):
            await _refuse(send, 401, NO_KEY, "authentication_error", "invalid_api_key")
            return
        declared = headers.get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.max_bytes):
            await self._too_large(send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_bytes:
                await self._too_large(send)
                return
            chunks.append(chunk)
            if not message.get("more_body"):
                break
        body, handed = b"".join(chunks), False

        async def replay() -> MutableMapping[str, Any]:
            nonlocal handed
            if handed:
                return await receive()  # after the body: the disconnect, when it comes
            handed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send) -> None:
        await _refuse(send, 413, f"the request body is over {self.max_bytes} bytes", "invalid_request_error",
                      "body_too_large")


async def _refuse(send: Send, status: int, message: str, kind: str, code: str) -> None:
    """Answer ``status`` in OpenAI's error format and close the connection (its body unread)."""
    text = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": code}})
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": text.encode()})


@dataclass
class _Held:
    rows: int = 0
    tokens: int = 0


@dataclass(order=True)
class _Waiter:
    key: tuple[int, int]
    client: str = field(compare=False)
    rows: int = field(compare=False)
    tokens: int = field(compare=False)
    granted: asyncio.Future = field(compare=False)


class Ticket:
    """Rows and tokens a request holds; :meth:`release` (idempotent) gives them back."""

    def __init__(self, admission: Admission, client: str, rows: int, tokens: int) -> None:
        self._admission, self.client, self.rows, self.tokens = admission, client, rows, tokens
        self._released = False

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._give_back(self)


class Admission:
    """Per-client and total bounds on rows and tokens in flight, with a fair wait for room.

    Used from one event loop only (uvicorn's), so it needs no lock."""

    def __init__(self, limits: Limits) -> None:
        self.limits = limits
        self.clients: dict[str, _Held] = {}
        """What each client holds, running or waiting (a client holding nothing is absent)."""
        self.running = _Held()
        self._waiting: list[_Waiter] = []
        self._order = itertools.count()
        self.refused = 0
        """Requests refused with 429 (the counter the tests and ``status`` read)."""

    async def admit(self, client: str, rows: int, tokens: int) -> Ticket:
        """A :class:`Ticket` for ``rows`` rows of ``tokens`` tokens in all, once all clients'
        total has room; :class:`Refused` (400: never; 429: not now; 503: waited too long)."""
        lim = self.limits
        if rows > lim.client_rows or tokens > lim.client_tokens:
            raise Refused(400, f"the request asks for {rows} rows and {tokens} tokens (prompts and max_tokens, "
                          f"per row); one client may hold at most {lim.client_rows} rows and {lim.client_tokens} "
                          "tokens", "request_too_large")
        held = self.clients.setdefault(client, _Held())
        if held.rows + rows > lim.client_rows or held.tokens + tokens > lim.client_tokens:
            self.refused += 1
            if not held.rows:
                del self.clients[client]
            raise Refused(429, f"this client already has {held.rows} rows and {held.tokens} tokens in flight; at "
                          f"most {lim.client_rows} rows and {lim.client_tokens} tokens: wait for its requests to "
                          "end", "rate_limit_exceeded")
        held.rows, held.tokens = held.rows + rows, held.tokens + tokens
        ticket = Ticket(self, client, rows, tokens)
        if not self._waiting and self._fits(rows, tokens):
            self._run(rows, tokens)
            return ticket
        waiter = _Waiter((held.rows - rows, next(self._order)), client, rows, tokens,
                         asyncio.get_running_loop().create_future())
        self._waiting.append(waiter)
        try:
            await asyncio.wait_for(asyncio.shield(waiter.granted), lim.wait_s)
        except BaseException as e:
            if waiter.granted.done() and not waiter.granted.cancelled():
                ticket.release()  # granted as it timed out or was cancelled: give it back whole
            else:
                waiter.granted.cancel()
                self._waiting.remove(waiter)
                self._unhold(client, rows, tokens)
                self._grant()
            if isinstance(e, TimeoutError):
                raise Refused(503, f"the service is busy: no room for {rows} rows within {lim.wait_s:g} s",
                              "server_busy") from None
            raise
        return ticket

    def _fits(self, rows: int, tokens: int) -> bool:
        return (self.running.rows + rows <= self.limits.total_rows
                and self.running.tokens + tokens <= self.limits.total_tokens)

    def _run(self, rows: int, tokens: int) -> None:
        self.running.rows += rows
        self.running.tokens += tokens

    def _unhold(self, client: str, rows: int, tokens: int) -> None:
        held = self.clients[client]
        held.rows, held.tokens = held.rows - rows, held.tokens - tokens
        if held.rows <= 0:
            del self.clients[client]

    def _give_back(self, ticket: Ticket) -> None:
        self.running.rows -= ticket.rows
        self.running.tokens -= ticket.tokens
        self._unhold(ticket.client, ticket.rows, ticket.tokens)
        self._grant()

    def _grant(self) -> None:
        """Start waiting requests while they fit: first the one whose client runs the fewest
        rows (then the oldest); a request that does not fit holds the line (no starving it)."""
        while self._waiting:
            for w in self._waiting:  # what each client runs now, not what it ran on arrival
                running = self.clients[w.client].rows - sum(x.rows for x in self._waiting if x.client == w.client)
                w.key = (running, w.key[1])
            first = min(self._waiting)
            if not self._fits(first.rows, first.tokens):
                return
            self._waiting.remove(first)
            self._run(first.rows, first.tokens)
            first.granted.set_result(None)
