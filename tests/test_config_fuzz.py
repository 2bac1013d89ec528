"""Fuzz job configs (issue #14, configs checked before anything starts): 400 seeded mutations
of the default job (hostile values in any field, fields deleted or added, tables replaced by
scalars, policies duplicated or renamed) go through the same decoding and checks as
``opentinker run``. Each one is accepted, or refused with one :class:`ConfigError` line
``<field>: <reason>`` naming a field of the config; no other exception, no control character
in the message, no file written, no network lookup."""

from __future__ import annotations

import copy
import re

import msgspec
import numpy as np
import pytest

from opentinker.config import ConfigError, config_from_dict, load_config
from opentinker.control.config_checks import check_config

N_MUTATIONS = 400
HOSTILE = [
    float("inf"), float("-inf"), float("nan"), -1, 0, 1, 2**64, 10**30, -(2**63), 1e308, 1e-320, True, "",
    "x" * 5000, "../../etc", "a\nb\x1b[31mred", "/no/such/thing", "~", "cuda:99", "tcp://*:1", "ray://",
    "auto", "🙂", "kuhn_poker", "smollm2-135m", [], {}, [1, "two"], {"a": {"b": [1]}}, None,
]
FIELD = re.compile(r"(?:config|[a-z_]+(?:\.[a-z_0-9]+|\[[^\]\n]{0,200}\])*)")


def _paths(node, prefix=()):
    """Every (path, value) below ``node``, tables and lists included."""
    if isinstance(node, dict):
        for k, v in node.items():
            yield (*prefix, k), v
            yield from _paths(v, (*prefix, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield (*prefix, i), v
            yield from _paths(v, (*prefix, i))


def _parent(raw, path):
    for key in path[:-1]:
        raw = raw[key]
    return raw


def mutate(rng: np.random.Generator, base: dict) -> tuple[dict, str]:
    """One hostile change of ``base`` (a copy), and what it was."""
    raw = copy.deepcopy(base)
    paths = [p for p, _ in _paths(raw)]
    path = paths[int(rng.integers(len(paths)))]
    parent, key = _parent(raw, path), path[-1]
    kind = int(rng.integers(5))
    if kind <= 1:  # a hostile value anywhere
        value = HOSTILE[int(rng.integers(len(HOSTILE)))]
        parent[key] = value
        return raw, f"{path} = {value!r:.60}"
    if kind == 2 and isinstance(parent, dict):  # a field deleted
        del parent[key]
        return raw, f"del {path}"
    if kind == 3:  # an unknown field in a table
        tables = [p for p, v in _paths(raw) if isinstance(v, dict)] or [()]
        table = tables[int(rng.integers(len(tables)))]
        (_parent(raw, (*table, None)) if table else raw)[f"zz{int(rng.integers(100))}"] = 1
        return raw, f"unknown field in {table}"
    policies = raw.get("policies")
    if isinstance(policies, list) and policies:  # a policy twice, or renamed
        if rng.random() < 0.5:
            policies.append(copy.deepcopy(policies[0]))
            return raw, "a policy twice"
        policies[0]["name"] = HOSTILE[int(rng.integers(len(HOSTILE)))]
        return raw, f"policy renamed {policies[0]['name']!r:.60}"
    return raw, "unchanged"


def test_four_hundred_hostile_configs_are_accepted_or_refused_with_their_field(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")  # a model spec is never looked up on the network
    base = msgspec.to_builtins(load_config())
    base["out_dir"] = str(tmp_path / "runs")
    rng = np.random.default_rng(14)
    refused, fields = 0, set()
    for _ in range(N_MUTATIONS):
        raw, what = mutate(rng, base)
        try:
            check_config(config_from_dict(raw))
        except ConfigError as e:
            text = str(e)
            field, sep, reason = text.partition(": ")
            assert sep and reason and FIELD.fullmatch(field), (what, text)
            assert not re.search(r"[\x00-\x1f\x7f]", text), (what, text)
            refused += 1
            fields.add(field.split(".")[0].split("[")[0])
        except Exception as e:  # noqa: BLE001  (the point: nothing else may escape)
            pytest.fail(f"{what}: {type(e).__name__}: {e}")
    assert list(tmp_path.iterdir()) == []  # nothing written: no run folder, no out_dir
    assert refused > N_MUTATIONS // 2 and len(fields) >= 8, (refused, fields)
