"""A benchmark's command line from its ``Args`` dataclass: one ``--field`` flag per field."""

from __future__ import annotations

import argparse
from dataclasses import asdict, replace
from typing import Any, TypeVar

T = TypeVar("T")


def parse_args(cls: type[T], doc: str | None, quick: dict[str, Any] | None = None,
               hidden: dict[str, dict[str, Any]] | None = None) -> tuple[T, dict[str, Any]]:
    """Parse ``sys.argv`` into ``cls`` (a dataclass whose every field has a default).

    A bool field is a switch (``--quick``); any other field takes a value of its default's
    type. With ``quick`` given and ``--quick`` set, each field of ``quick`` still at its
    default takes ``quick``'s value (a flag given explicitly wins). ``hidden`` adds flags left
    out of ``--help`` (name -> ``add_argument`` keywords, e.g. a script's ``--one`` for the
    child process it starts); their values come back in the dict, by name.
    """
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for k, v in asdict(cls()).items():
        if isinstance(v, bool):
            p.add_argument(f"--{k}", action="store_true")
        else:
            p.add_argument(f"--{k}", type=type(v), default=v)
    for k, kw in (hidden or {}).items():
        p.add_argument(f"--{k}", help=argparse.SUPPRESS, **kw)
    ns = vars(p.parse_args())
    extra = {k: ns.pop(k) for k in hidden or {}}
    args = cls(**ns)
    if quick and getattr(args, "quick", False):
        default = cls()
        args = replace(args, **{k: v for k, v in quick.items() if getattr(args, k) == getattr(default, k)})
    return args, extra
