"""The JSON Schema of every message, and the message tables of ``docs/protocol.md``.

    python -m protocols.schema                  # the JSON Schema, on stdout
    python -m protocols.schema --json docs/protocol.schema.json --doc docs/protocol.md

The schema is msgspec's, with two additions: an array field is an :class:`ArrayRef`
``[dtype, shape, index]`` naming the extra frame that holds its bytes, and each field carries
the docstring written under it in :mod:`protocols.messages`. The tables between the markers of
``docs/protocol.md`` are generated from the schema; a test fails when they differ.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from protocols import messages as m
from protocols.codec import ALLOWED_DTYPES

REPLIES: dict[type, type] = {
    m.Hello: m.Welcome,
    m.Heartbeat: m.Heartbeat,
    m.Cancel: m.Ack,
    m.Shutdown: m.Ack,
    m.SampleRequest: m.SampleResult,
    m.LogprobsRequest: m.LogprobsResult,
    m.ValuesRequest: m.ValuesResult,
    m.CreateAdapter: m.AdapterInfo,
    m.DropAdapter: m.AdapterInfo,
    m.SnapshotAdapter: m.AdapterInfo,
    m.SaveAdapter: m.Saved,
    m.LoadAdapter: m.AdapterInfo,
    m.ForwardBackward: m.ForwardBackwardResult,
    m.OptimStep: m.OptimStepResult,
    m.DiscardGradients: m.AdapterInfo,
    m.SchedulerStats: m.SchedulerStats,
    m.RunEpisodes: m.EpisodesDone,
    m.LearnerStep: m.LearnerStepResult,
    m.TrajectoryAck: m.TrajectoriesHeld,
    m.ResendTrajectories: m.Resent,
    m.ListAdapters: m.AdapterList,
    m.OpenJob: m.JobOpened,
    m.CloseJob: m.JobInfo,
    m.ListJobs: m.JobList,
    m.SubmitJob: m.QueueEntry,
    m.ListQueue: m.QueueList,
    m.CancelQueued: m.QueueEntry,
}
"""Request -> its reply (any request may instead be answered with ``Error``)."""

SERVED_BY: dict[type, str] = {
    m.Hello: "every server", m.Heartbeat: "every server", m.Cancel: "every server",
    m.Shutdown: "every server", m.SampleRequest: "scheduler", m.LogprobsRequest: "scheduler",
    m.ValuesRequest: "scheduler", m.CreateAdapter: "scheduler", m.DropAdapter: "scheduler",
    m.SnapshotAdapter: "scheduler", m.SaveAdapter: "scheduler", m.LoadAdapter: "scheduler",
    m.ForwardBackward: "scheduler",
    m.OptimStep: "scheduler", m.DiscardGradients: "scheduler", m.SchedulerStats: "scheduler", m.RunEpisodes: "env runner",
    m.LearnerStep: "learner", m.TrajectoryAck: "learner", m.ResendTrajectories: "env runner",
    m.ListAdapters: "scheduler", m.OpenJob: "shared scheduler (its owner)", m.CloseJob: "shared scheduler (its owner)",
    m.ListJobs: "shared scheduler (its owner)", m.SubmitJob: "service (its owner)", m.ListQueue: "service (its owner)",
    m.CancelQueued: "service (its owner)",
}

PARTIAL_OF: dict[type, tuple[type, str]] = {
    m.SampleChunk: (m.SampleRequest, "stream"),
}
"""Partial message -> (the request it answers in part, the request's field that asks for it);
every type of ``messages.PARTIALS`` is here."""

ONE_WAY: dict[type, str] = {
    m.Trajectory: "env runner -> learner (PUSH/PULL)",
    m.Metrics: "env runner -> the driver's progress bar (PUSH/PULL, to RunEpisodes.progress)",
}

ARRAY_REF = {
    "title": "ArrayRef",
    "description": "An array travelling as an extra frame: [dtype, shape, index of the frame after the body].",
    "type": "array",
    "prefixItems": [
        {"enum": sorted(ALLOWED_DTYPES)},
        {"type": "array", "items": {"type": "integer", "minimum": 0}},
        {"type": "integer", "minimum": 0},
    ],
    "minItems": 3,
    "maxItems": 3,
}

BEGIN, END = "<!-- BEGIN GENERATED: python -m protocols.schema -->", "<!-- END GENERATED -->"


def _hook(tp: Any) -> dict[str, Any]:
    if tp is np.ndarray:
        return {"$ref": "#/$defs/ArrayRef"}
    raise NotImplementedError(f"no schema for {tp}")


def field_docs() -> dict[str, dict[str, str]]:
    """``{class: {field: docstring}}`` from the string literals written under fields."""
    tree = ast.parse(inspect.getsource(m))
    out: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        docs: dict[str, str] = {}
        for a, b in zip(node.body, node.body[1:]):
            if (isinstance(a, (ast.AnnAssign, ast.Assign)) and isinstance(b, ast.Expr)
                    and isinstance(b.value, ast.Constant) and isinstance(b.value.value, str)):
                target = a.target if isinstance(a, ast.AnnAssign) else a.targets[0]
                if isinstance(target, ast.Name):
                    docs[target.id] = inspect.cleandoc(b.value.value)
        out[node.name] = docs
    return out


def schema() -> dict[str, Any]:
    """The JSON Schema (2020-12) of a message body: one of ``$defs`` by its ``type`` tag."""
    (root,), defs = msgspec.json.schema_components([m.Message], schema_hook=_hook)
    docs = field_docs()
    for name, d in defs.items():
        for field, text in docs.get(name, {}).items():
            if field in d.get("properties", {}):
                d["properties"][field]["description"] = text
    defs["ArrayRef"] = ARRAY_REF
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": f"OpenTinker protocol {m.PROTOCOL_VERSION}",
        "protocol_version": m.PROTOCOL_VERSION,
        **root,
        "$defs": defs,
    }


def _type(s: dict[str, Any]) -> str:
    if "$ref" in s:
        name = s["$ref"].rsplit("/", 1)[-1]
        return "array" if name == "ArrayRef" else f"[{name}](#{name.lower()})"
    if "anyOf" in s:
        return " \\| ".join(_type(x) for x in s["anyOf"])
    if "enum" in s:
        return " \\| ".join(f'"{v}"' for v in s["enum"])
    t = s.get("type")
    if t == "array":
        if "prefixItems" in s:
            return "[" + ", ".join(_type(x) for x in s["prefixItems"]) + ", ...]"
        return f"list[{_type(s.get('items', {}))}]"
    if t == "object":
        return f"dict[str, {_type(s.get('additionalProperties', {}))}]"
    return {"integer": "int", "number": "float", "string": "str", "boolean": "bool", "null": "None"}.get(t, "any")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def markdown(sch: dict[str, Any]) -> str:
    """The generated part of ``docs/protocol.md``: who serves what, and every message's fields."""
    lines = ["### Requests and replies", "",
             "| request | served by | reply | state-changing (idempotent by request id) |", "|---|---|---|---|"]
    for req, rep in REPLIES.items():
        changing = "yes" if issubclass(req, m.STATE_CHANGING) else ""
        lines.append(f"| [{req.__name__}](#{req.__name__.lower()}) | {SERVED_BY[req]} | "
                     f"[{rep.__name__}](#{rep.__name__.lower()}) | {changing} |")
    lines += ["", "Any request may be answered with [Error](#error) instead.", "",
              "### Partial results", "", "| partial | of request | sent when the request sets |", "|---|---|---|"]
    lines += [f"| [{p.__name__}](#{p.__name__.lower()}) | [{req.__name__}](#{req.__name__.lower()}) | "
              f"`{flag}: true` |" for p, (req, flag) in PARTIAL_OF.items()]
    lines += ["", "### One-way messages", "", "| message | from -> to |", "|---|---|"]
    lines += [f"| [{t.__name__}](#{t.__name__.lower()}) | {way} |" for t, way in ONE_WAY.items()]
    lines += ["", "### Messages and their fields", ""]
    for name, d in sch["$defs"].items():
        lines += [f"#### {name}", ""]
        if d.get("description"):
            lines += [_cell(d["description"].split("\n\n")[0]), ""]
        if "enum" in d:
            lines += ["Values: " + ", ".join(f"`{v}`" for v in d["enum"]), ""]
            continue
        if name == "ArrayRef":
            lines += ["`[dtype, shape, index]`; dtype one of " + ", ".join(f"`{v}`" for v in sorted(ALLOWED_DTYPES)), ""]
            continue
        props = d.get("properties", {})
        required = set(d.get("required", []))
        lines += ["| field | type | default | description |", "|---|---|---|---|"]
        for field, p in props.items():
            if field == "type" and "enum" in p:
                lines.append(f'| `type` | `"{p["enum"][0]}"` | (tag) | the message type |')
                continue
            default = "required" if field in required else f"`{json.dumps(p.get('default'))}`"
            lines.append(f"| `{field}` | {_type(p)} | {default} | {_cell(p.get('description', ''))} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_doc(doc: str, sch: dict[str, Any]) -> str:
    """``doc`` with the text between the generated markers replaced."""
    if BEGIN not in doc or END not in doc:
        raise ValueError(f"the document has no {BEGIN!r} ... {END!r} section")
    head, rest = doc.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n\n{markdown(sch)}\n{END}{tail}"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", help="write the JSON Schema here (default: stdout)")
    p.add_argument("--doc", help="rewrite the generated section of this markdown file")
    args = p.parse_args(argv)
    sch = schema()
    text = json.dumps(sch, indent=1, sort_keys=False) + "\n"
    if args.json:
        Path(args.json).write_text(text)
    elif not args.doc:
        sys.stdout.write(text)
    if args.doc:
        path = Path(args.doc)
        path.write_text(render_doc(path.read_text(), sch))


if __name__ == "__main__":
    main()
