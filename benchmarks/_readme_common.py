"""What the README's renderers share (:mod:`readme`): loading a results file, markdown tables,
number formats, and a run's machine as one line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


class ReadmeError(Exception):
    """A block that cannot be rendered: unknown name, missing JSON, missing key."""


def load(results: Path, name: str) -> dict[str, Any]:
    """``results/NAME.json``, parsed; a missing file is a ``ReadmeError`` naming it."""
    path = results / f"{name}.json"
    if not path.is_file():
        raise ReadmeError(f"missing JSON file: {path}")
    return json.loads(path.read_text())


def table(header: list[str], rows: list[list[str]]) -> str:
    """A markdown table, one line per row, ending in a newline; an empty cell is ``| |``."""
    def line(cells: list[str]) -> str:
        return "|" + "|".join(f" {c} " if c else " " for c in cells) + "|\n"

    return line(header) + "|" + "---|" * len(header) + "\n" + "".join(map(line, rows))


def x(value: float, digits: int = 2) -> str:
    """A ratio: ``1.28x``."""
    return f"{value:.{digits}f}x"


def pct(value: float) -> str:
    """A rate in [0, 1] as a percentage with one decimal."""
    return f"{100 * value:.1f}%"


def machine_label(m: dict[str, Any] | None) -> str:
    """``AMD EPYC, 2 cores, AVX2 kernels (forced: ATEN_CPU_CAPABILITY=avx2 ...)``."""
    if not m:
        return "not recorded"
    forced = [f"{k}={m['env'][k]}" for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA") if k in m.get("env", {})]
    cap = m.get("cpu_capability") or m.get("capability")
    return f"{m['cpu']}, {m['cores']} cores, {cap} kernels" + (f" (forced: {' '.join(forced)})" if forced else "")
