"""``--set key=value`` overrides (``opentinker run``, ``opentinker jobs submit``) as the nested
dict :func:`opentinker.config.load_config` applies over a job file."""

from __future__ import annotations

import json
import re

from opentinker.config import ConfigError

_NON_FINITE = re.compile(r"[+-]?(inf|nan)", re.IGNORECASE)
"""TOML's spelling of infinities and NaN (JSON has none): ``--set train.lr=inf`` is the float,
refused by the config's bounds, as ``lr = inf`` in a file is."""

MAX_SET_DEPTH = 8
"""Dotted parts of a ``--set`` key (the deepest config field is three tables down)."""


_INDEXED = re.compile(r"(\w+)\[(\d{1,4})\]")
"""A ``--set`` key part naming an element of a list, e.g. ``policies[0]``."""


def parse_overrides(items: list[str]) -> dict:
    """``["train.steps=3", "runtime.backend=local"]`` -> nested dict (values parsed as JSON
    where they parse, ``inf`` and ``nan`` as floats, else kept as strings). Raises :class:`~opentinker.config.ConfigError`
    (``--set: ...``) for an item that is not ``key=value``, a key with an empty part or more
    than :data:`MAX_SET_DEPTH` parts, a key under one already set to a value, or a JSON value
    nested too deep to parse."""
    out: dict = {}
    for item in items:
        if "=" not in item:
            raise ConfigError("--set", f"{item!r}: expected key=value")
        key, raw = item.split("=", 1)
        parts = key.split(".")
        if not all(parts) or len(parts) > MAX_SET_DEPTH:
            raise ConfigError("--set", f"{key!r}: expected a dotted field name such as train.steps")
        try:
            value = float(raw) if _NON_FINITE.fullmatch(raw) else json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        except RecursionError:
            raise ConfigError("--set", f"{key}: the value is nested too deep") from None
        node = out
        steps: list[str | int] = []
        for part in parts:  # policies[0] -> "policies", 0 (an int key: the list's element)
            m = _INDEXED.fullmatch(part)
            steps += [m.group(1), int(m.group(2))] if m else [part]
        *parents, leaf = steps
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError("--set", f"{key!r}: {part!r} is already set to a value")
        node[leaf] = value
    return out
