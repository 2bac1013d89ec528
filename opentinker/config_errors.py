"""A config's errors: :class:`ConfigError` (``"<field>: <reason>"``) and the translation of
msgspec's validation errors into it (:func:`config_error`).

msgspec says ``Expected `int` >= 1 - at `$.policies[0].lora_rank```; a user reads
``policies[main].lora_rank: expected `int` >= 1, got 0``: the path becomes the field (a policy
by its name), an unknown field is named with the closest known one, a literal's choices are
listed and the offending value is quoted. Kept apart from the schema (:mod:`opentinker.config`)
so that module holds the fields and their checks.
"""

from __future__ import annotations

import difflib
import re
from typing import Any

import msgspec
import msgspec.inspect


class ConfigError(ValueError):
    """A config field that cannot work; ``str(e)`` is ``"<field>: <reason>"``."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}" if field else reason)
        self.field = field
        self.reason = reason


_AT = re.compile(r"(?P<msg>.*?)(?: - at (?P<key>`key` in )?`\$(?P<path>[^`]*)`)?", re.DOTALL)
_STEP = re.compile(r"\.(?P<key>[^.\[]+)|\[(?P<index>\d+)\]|\[\.\.\.\]")
_RELATIVE = re.compile(r"[A-Za-z_][^\s:]*")
"""The ``<field>`` of a ``"<field>: <reason>"`` message raised in a ``__post_init__``."""
_MISSING = object()


def config_error(e: msgspec.ValidationError, raw: Any, root: type, where: str = "") -> ConfigError:
    """``e`` (msgspec's ``<message> - at `$.path```) as ``<field>: <reason>``: the path becomes
    the field (``policies[0]`` becomes ``policies[<its name>]``), an unknown field is named with
    the closest known one, and the offending value is quoted. ``raw`` was decoded as the
    struct type ``root``; ``where`` goes in front (the table ``raw`` was decoded at)."""
    m = _AT.fullmatch(str(e))
    assert m is not None
    msg, path = m["msg"], m["path"] or ""
    field = _join(where, _field_name(path, raw))
    unknown = re.fullmatch(r"Object contains unknown field `(.*)`", msg, re.DOTALL)
    if unknown:
        known = _known_fields(path, root)
        close = difflib.get_close_matches(unknown[1], known, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else (f" (known: {', '.join(known)})" if known else "")
        return ConfigError(_join(field, unknown[1]), f"unknown field{hint}")
    if m["key"]:  # a table's key (msgspec: "- at `key` in `$.path`")
        keys = _lookup(raw, path)
        shown = repr(list(keys) if isinstance(keys, dict) else keys)
        return ConfigError(field, f"each key: {msg[:1].lower() + msg[1:]}, got keys "
                                  f"{shown if len(shown) <= 80 else shown[:77] + '...'}")
    missing = re.fullmatch(r"Object missing required field `(.*)`", msg, re.DOTALL)
    if missing:
        return ConfigError(_join(field, missing[1]), "required field missing")
    head, sep, rest = msg.partition(": ")
    # "<field>: <reason>" from a __post_init__: JobConfig's come without a path (msgspec adds
    # none at the root), the nested tables' name a field of the table.
    if sep and (m["path"] is None or _RELATIVE.fullmatch(head)):
        return ConfigError(_join(field, head), rest)
    reason = msg[:1].lower() + msg[1:]
    literal = _type_at(path, root)
    if isinstance(literal, msgspec.inspect.LiteralType):
        reason += f" (one of: {', '.join(map(str, literal.values))})"
    value = _lookup(raw, path)
    if value is not _MISSING and ", got " not in reason and f"value {value!r}" not in reason:
        shown = repr(value)
        reason += f", got {shown if len(shown) <= 80 else shown[:77] + '...'}"
    return ConfigError(field or "config", reason)


def _join(a: str, b: str) -> str:
    return f"{a}.{b}" if a and b and not b.startswith("[") else (a + b)


def _steps(path: str) -> list[re.Match[str]]:
    return list(_STEP.finditer(path))


def _field_name(path: str, raw: Any) -> str:
    """``.policies[0].lora_rank`` -> ``policies[main].lora_rank`` (the policy's name where it
    has one that is an identifier)."""
    out, node = "", raw
    for step in _steps(path):
        if step["key"] is not None:
            out = _join(out, step["key"])
            node = node.get(step["key"], _MISSING) if isinstance(node, dict) else _MISSING
        elif step["index"] is not None:
            i = int(step["index"])
            node = node[i] if isinstance(node, list) and i < len(node) else _MISSING
            name = node.get("name", "main") if isinstance(node, dict) and out == "policies" else None
            out += f"[{name}]" if isinstance(name, str) and name.isidentifier() else f"[{i}]"
        else:
            out += "[...]"
            node = _MISSING
    return out


def _lookup(raw: Any, path: str) -> Any:
    node = raw
    for step in _steps(path):
        if step["key"] is not None and isinstance(node, dict) and step["key"] in node:
            node = node[step["key"]]
        elif step["index"] is not None and isinstance(node, list) and int(step["index"]) < len(node):
            node = node[int(step["index"])]
        else:
            return _MISSING
    return node


def _type_at(path: str, root: type) -> Any:
    """msgspec's description of the type at ``path`` of the struct type ``root``, a struct
    for a ``struct | UNSET`` field; ``None`` where the path leaves the schema."""

    def struct_of(info: Any) -> Any:
        if isinstance(info, msgspec.inspect.UnionType):
            structs = [t for t in info.types if isinstance(t, msgspec.inspect.StructType)]
            return structs[0] if structs else info
        return info

    info: Any = msgspec.inspect.type_info(root)
    for step in _steps(path):
        info = struct_of(info)
        if step["key"] is not None and isinstance(info, msgspec.inspect.StructType):
            info = {f.name: f.type for f in info.fields}.get(step["key"])
        elif step["index"] is not None and isinstance(info, msgspec.inspect.ListType):
            info = info.item_type
        else:
            return None
    return struct_of(info)


def _known_fields(path: str, root: type) -> list[str]:
    """The field names of the struct at ``path`` (see :func:`_type_at`)."""
    info = _type_at(path, root)
    return [f.name for f in info.fields] if isinstance(info, msgspec.inspect.StructType) else []
