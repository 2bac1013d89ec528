"""Tools a seat can call: declarations, the call format, and running a call under limits.

The shapes are OpenAI's and Hugging Face's function calling:

* a **declaration** (what a chat template's ``tools=`` takes) is
  ``{"type": "function", "function": {"name", "description", "parameters"}}``, where
  ``parameters`` is a JSON schema of an object (:meth:`Tool.schema`);
* a **call** is ``{"name": ..., "arguments": {...}}``. In a reply it is written between
  ``<tool_call>`` and ``</tool_call>`` (the Hermes / Qwen2.5 format, which the templates that
  render ``tools=`` ask for), one block per call; a reply that is nothing but one such JSON
  object is a call too (the Llama 3.1 habit). Text around the blocks is ignored. A reply with
  neither is not a call: it goes to the game as the seat's move (:func:`parse_calls`).

For a model whose chat template does not render ``tools=`` (SmolLM2's), the runtime puts
:func:`tool_instructions` in the system prompt instead: the declarations and the format above,
in plain text. Either way the reply is parsed the same way.

**Running a call** (:func:`run_call`). The arguments are validated against the tool's JSON
schema (``jsonschema``), then the tool's Python function runs with them as keyword arguments
in a worker thread, under the tool's ``timeout_s`` (a deadline checked on every line of Python
it runs, so a runaway loop stops; a call stuck in C code is abandoned to its daemon thread).
Unless the tool says ``io=True``, the thread may not reach the file system, the network or
other processes: an audit hook (:pep:`578`) refuses ``open``, ``os.*``, ``socket.*``,
``subprocess.*``, ``shutil.*``, ``ctypes.*`` and ``urllib.*`` events raised from it. (This
guards against a game's tool doing I/O by accident; it is not a sandbox for hostile Python.
The model never supplies code: only JSON arguments, which the schema checks.) The result is
the function's return value, as is for a string, else as JSON, escaped to printable characters
and cut to the tool's ``max_output`` characters (the cut is marked and counted, not invalid).

Every call has one :class:`Outcome`; all but ``OK`` are **invalid calls**: ``MALFORMED`` (no
JSON object with a string ``name`` and an object ``arguments``), ``UNKNOWN_TOOL``,
``BAD_ARGUMENTS`` (schema validation failed), ``FAILED`` (the function raised, I/O refused
included) and ``TIMEOUT``. An invalid call still returns a result, an ``Error: ...`` line that
says what was wrong, as the OpenAI and Hugging Face agent loops hand errors back to the model.
How calls fit in a game's turns is :mod:`games.tool_use`.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import jsonschema

from games.bridge import printable

CALL_OPEN, CALL_CLOSE = "<tool_call>", "</tool_call>"
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_BLOCK = re.compile(re.escape(CALL_OPEN) + r"(.*?)(?:" + re.escape(CALL_CLOSE) + r"|$)", re.DOTALL)
_IO_EVENTS = ("open", "os.", "socket.", "subprocess.", "shutil.", "ctypes.", "urllib.", "http.", "ftplib.",
              "smtplib.", "webbrowser.", "glob.", "sqlite3.", "pty.")
"""Audit events (prefixes) refused inside a tool that may not do I/O."""


class Outcome(StrEnum):
    """How one call went; every outcome but ``OK`` counts as an invalid call."""

    OK = "ok"
    MALFORMED = "malformed"
    UNKNOWN_TOOL = "unknown_tool"
    BAD_ARGUMENTS = "bad_arguments"
    FAILED = "failed"
    TIMEOUT = "timeout"


@dataclass(frozen=True)
class Tool:
    """A function a seat may call: its declaration and its Python implementation."""

    name: str
    """1-64 letters, digits, ``_`` or ``-`` (OpenAI's rule)."""
    description: str
    """What the tool does, for the model."""
    parameters: Mapping[str, Any]
    """JSON schema of the arguments object, e.g. ``{"type": "object", "properties": {"x":
    {"type": "string"}}, "required": ["x"]}``."""
    fn: Callable[..., Any]
    """Called with the validated arguments as keyword arguments; returns the result."""
    timeout_s: float = 1.0
    """Longest a call may run (seconds)."""
    max_output: int = 512
    """Longest result (characters, after escaping to printable); longer ones are cut."""
    io: bool = False
    """The game lets this tool reach the file system, the network and other processes."""

    def __post_init__(self) -> None:
        if not _NAME.fullmatch(self.name):
            raise ValueError(f"tool name {self.name!r}: use 1-64 letters, digits, '_' or '-'")
        if not self.description:
            raise ValueError(f"tool {self.name!r}: the description must be non-empty")
        if dict(self.parameters).get("type") != "object":
            raise ValueError(f"tool {self.name!r}: parameters must be a JSON schema with type 'object'")
        try:
            jsonschema.validators.validator_for(self.parameters).check_schema(self.parameters)
        except jsonschema.SchemaError as e:
            raise ValueError(f"tool {self.name!r}: parameters is not a valid JSON schema: {e.message}") from None
        if not 0 < self.timeout_s <= 60 or not 16 <= self.max_output <= 65536:
            raise ValueError(f"tool {self.name!r}: need 0 < timeout_s <= 60 and 16 <= max_output <= 65536, got "
                             f"{self.timeout_s!r} and {self.max_output!r}")

    def schema(self) -> dict[str, Any]:
        """The declaration ``{"type": "function", "function": {name, description, parameters}}``."""
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": json.loads(json.dumps(self.parameters))}}


@dataclass(frozen=True)
class Call:
    """One call as the reply wrote it: a parsed ``{"name", "arguments"}`` or why it is malformed."""

    name: str = ""
    arguments: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""
    """Non-empty: the call is malformed, and this says why."""


@dataclass(frozen=True)
class Result:
    """What running one call gave: the text the seat reads next, and how it went."""

    name: str
    outcome: Outcome
    content: str
    """Printable, at most the tool's ``max_output`` characters (plus the cut mark)."""
    cut: bool = False

    @property
    def ok(self) -> bool:
        return self.outcome is Outcome.OK


def format_call(name: str, arguments: Mapping[str, Any]) -> str:
    """The canonical reply for one call: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""
    return f"{CALL_OPEN}{json.dumps({'name': name, 'arguments': dict(arguments)})}{CALL_CLOSE}"


def parse_calls(reply: str) -> list[Call] | None:
    """The calls of ``reply`` in order, or None when it makes none (then it is a move).

    A ``<tool_call>`` block (a missing ``</tool_call>`` at the end is forgiven: a reply cut by
    its token limit) holds one JSON object ``{"name": str, "arguments": object}``; a reply that
    is only such an object, with both keys, is one call. A block that does not parse is a
    :class:`Call` with ``error`` set."""
    blocks = _BLOCK.findall(reply)
    if not blocks:
        stripped = reply.strip()
        if not (stripped.startswith("{") and stripped.endswith("}")):
            return None
        try:
            obj = json.loads(stripped)
        except json.JSONDecodeError:
            return None
        if not (isinstance(obj, dict) and "name" in obj and "arguments" in obj):
            return None
        blocks = [stripped]
    return [_parse_one(b) for b in blocks]


def _parse_one(block: str) -> Call:
    try:
        obj = json.loads(block.strip())
    except json.JSONDecodeError as e:
        return Call(error=f"the call is not JSON ({e.msg} at character {e.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return Call(error='the call must be a JSON object {"name": ..., "arguments": {...}}')
    args = obj.get("arguments", {})
    if isinstance(args, str):  # OpenAI's wire form: arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return Call(name=obj["name"], error="arguments is a string that is not JSON")
    if not isinstance(args, dict):
        return Call(name=obj["name"], error="arguments must be a JSON object")
    return Call(name=obj["name"], arguments=args)


def tool_instructions(schemas: Sequence[Mapping[str, Any]]) -> str:
    """The plain-text form of ``tools=`` for a chat template without it: the declarations, one
    JSON per line, and how to call them (goes after the system prompt)."""
    lines = "\n".join(json.dumps(s) for s in schemas)
    return ("You may call these tools:\n" + lines + "\nTo call a tool, reply with only "
            f'{CALL_OPEN}{{"name": <tool name>, "arguments": <arguments object>}}{CALL_CLOSE}. '
            "The result comes back in the next message.")


def run_call(tools: Mapping[str, Tool], call: Call) -> Result:
    """Run ``call`` with the tool of its name, under the tool's limits; see the module docstring
    for the outcomes. Never raises for anything the call or the tool does."""
    if call.error:
        return Result(call.name, Outcome.MALFORMED, f"Error: malformed tool call: {call.error}.")
    tool = tools.get(call.name)
    if tool is None:
        known = ", ".join(sorted(tools)) or "none"
        return Result(call.name, Outcome.UNKNOWN_TOOL,
                      printable(f"Error: unknown tool {call.name!r}; tools: {known}.", 256))
    errors = sorted(jsonschema.validators.validator_for(tool.parameters)(tool.parameters).iter_errors(
        dict(call.arguments)), key=lambda e: list(e.path))
    if errors:
        where = "/".join(map(str, errors[0].path)) or "arguments"
        return Result(tool.name, Outcome.BAD_ARGUMENTS,
                      _limit(f"Error: bad arguments for {tool.name} ({where}: {errors[0].message}).", tool)[0])
    outcome, value = _run_guarded(tool, dict(call.arguments))
    if outcome is Outcome.TIMEOUT:
        return Result(tool.name, outcome, f"Error: {tool.name} took longer than {tool.timeout_s:g} s.")
    if outcome is Outcome.FAILED:
        return Result(tool.name, outcome, _limit(f"Error: {tool.name} failed: {value}", tool)[0])
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    content, cut = _limit(text, tool)
    return Result(tool.name, Outcome.OK, content, cut)


def _limit(text: str, tool: Tool) -> tuple[str, bool]:
    text = printable(text)
    if len(text) <= tool.max_output:
        return text, False
    return text[: tool.max_output] + f" [cut: {len(text) - tool.max_output} more characters]", True


_guard = threading.local()
_hook_lock = threading.Lock()
_hook_installed = False


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if getattr(_guard, "no_io", False) and event.startswith(_IO_EVENTS):
        raise PermissionError(f"a tool may not reach files, the network or processes ({event})")


def _install_hook() -> None:
    global _hook_installed
    with _hook_lock:
        if not _hook_installed:
            sys.addaudithook(_audit)  # for the life of the process; it checks one thread-local flag
            _hook_installed = True


class _Deadline(BaseException):
    """Raised inside a tool's thread at its deadline (a BaseException, so the tool's own
    ``except Exception`` cannot swallow it)."""


def _run_guarded(tool: Tool, arguments: dict[str, Any]) -> tuple[Outcome, Any]:
    """``(OK, value)``, ``(FAILED, "Type: message")`` or ``(TIMEOUT, None)``."""
    if not tool.io:
        _install_hook()
    box: dict[str, Any] = {}
    deadline = time.monotonic() + tool.timeout_s

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if time.monotonic() > deadline:
            raise _Deadline
        return tracer

    def target() -> None:
        _guard.no_io = not tool.io
        sys.settrace(tracer)
        try:
            box["value"] = tool.fn(**arguments)
        except _Deadline:
            box["timeout"] = True
        except Exception as e:  # noqa: BLE001 (whatever a tool raises is the call's outcome)
            box["error"] = f"{type(e).__name__}: {e}"
        finally:
            sys.settrace(None)
            _guard.no_io = False

    thread = threading.Thread(target=target, name=f"tool-{tool.name}", daemon=True)
    thread.start()
    thread.join(tool.timeout_s + 0.1)
    if thread.is_alive() or box.get("timeout"):
        return Outcome.TIMEOUT, None
    if "error" in box:
        return Outcome.FAILED, box["error"]
    return Outcome.OK, box.get("value")
