"""The request bodies of the OpenAI endpoint (:mod:`opentinker.serve.openai_api`), every field
bounded, and :class:`ApiError`, the error every route answers in OpenAI's format.

Every number has a range, every float is finite, and token ids lie in the vocabulary, so a
hostile value (``max_tokens = 10**30``, a token id ``2**40``, ``temperature = Infinity``) is a
400 naming the field instead of an overflow deep in the stack. Bodies are parsed from their raw
bytes (:func:`parse_body`) by the caller's worker thread, off the event loop.
"""

from __future__ import annotations

from typing import Annotated, Any, TypeVar

import pydantic
from pydantic import BaseModel, ConfigDict, Field

MAX_ROWS = 128
"""Choices (prompts times ``n``) one HTTP request may ask for."""
MAX_TOKENS = (1 << 31) - 1
"""The widest ``max_tokens`` the wire takes; the scheduler refuses (400) what its context cannot hold."""
MAX_TEMPERATURE = 100.0
"""Far past any useful temperature (at 100 the softmax of a 135M model is uniform to 1e-3)."""
MAX_STOPS = 4
MAX_TEXT_FIELD = 1 << 10
"""Characters of a short text field (``model``, a stop string, a role)."""
TokenId = Annotated[int, Field(ge=0, lt=1 << 31)]
B = TypeVar("B", bound=BaseModel)


class ApiError(Exception):
    """An error answered in OpenAI's format, with HTTP status ``status``."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.body = {"error": {"message": message, "type": kind, "param": param, "code": code}}


class BaseBody(BaseModel):
    """Fields of both routes; other fields are ignored, except those the routes refuse."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)
    model: str = Field(max_length=MAX_TEXT_FIELD)
    temperature: float | None = Field(None, ge=0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0, lt=1 << 31)
    """vLLM's extension: keep the k most likely tokens (0 or unset: all)."""
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    n: int = Field(1, ge=1, le=MAX_ROWS)
    seed: int | None = Field(None, ge=0, lt=1 << 62)
    stop: Annotated[str, Field(max_length=MAX_TEXT_FIELD)] | list[Annotated[str, Field(max_length=MAX_TEXT_FIELD)]] \
        | None = None
    stream: bool = False
    stream_options: dict[str, bool] | None = None


class _Message(BaseModel):
    role: str = Field(max_length=MAX_TEXT_FIELD)
    content: str | list[dict[str, Any]] | None = None

    def text(self) -> str:
        parts = self.content if isinstance(self.content, list) else [{"type": "text", "text": self.content or ""}]
        if any(p.get("type") != "text" or not isinstance(p.get("text"), str) for p in parts):
            raise ApiError(400, "only text content parts are supported", param="messages")
        return "".join(p["text"] for p in parts)


class ChatBody(BaseBody):
    """``POST /v1/chat/completions``."""

    messages: list[_Message] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0)


class CompletionBody(BaseBody):
    """``POST /v1/completions``."""

    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    logprobs: int | None = Field(None, ge=0)


def bad_body(errors: list[Any]) -> ApiError:
    """The 400 of a body that does not validate, naming the field and the reason, without the
    value (which may be megabytes) or the names of our classes. A field of several forms (a
    ``prompt``) has an error per form: the one that got furthest into the value is given."""
    if not errors:
        return ApiError(400, "body: invalid")
    locs = [[x for x in e.get("loc", ()) if x != "body"] for e in errors]
    field = str(locs[0][0]) if locs[0] else None
    same = [(len(loc), e) for loc, e in zip(locs, errors) if loc and str(loc[0]) == field] or [(0, errors[0])]
    deepest = max(same, key=lambda x: x[0])[1]
    return ApiError(400, f"{field or 'body'}: {deepest.get('msg', 'invalid')}", param=field)


def parse_body(raw: bytes, kind: type[B]) -> B:
    """``raw`` (a request's body) as ``kind``; :class:`ApiError` 400 naming the first bad field."""
    try:
        return kind.model_validate_json(raw)
    except pydantic.ValidationError as e:
        raise bad_body(e.errors(include_url=False, include_input=False)) from None
