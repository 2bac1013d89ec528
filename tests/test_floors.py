"""Every import in ``opentinker/`` runs down the floors of ``docs/architecture.md``.

An AST pass over the source (nothing is imported): module-level and function-level imports
alike, but not those under ``if TYPE_CHECKING:``, which never run. A room may import its own
modules and rooms on lower floors; never a room on its own floor or above. No import cycle,
even inside a room, and ``games``, ``learners`` and ``protocols`` never name the runtime.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "architecture.md"


@dataclass(frozen=True)
class Edge:
    src: str
    dst: str
    line: int
    in_function: bool


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports_of(path: Path, known: set[str], name: str = "") -> list[Edge]:
    """The modules of ``known`` that ``path`` (module ``name``, by default its own) imports
    (``from a import b`` names ``a.b`` when that is a module, else ``a``)."""
    name = name or module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[Edge] = []

    def target(base: str) -> str | None:
        while base and base not in known:
            base = base.rpartition(".")[0]
        return base or None

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if _type_checking(child):
                for sub in child.orelse:
                    visit(sub, in_function)
                continue
            names: list[str] = []
            if isinstance(child, ast.Import):
                names = [a.name for a in child.names]
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    up = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in child.names]
            for n in names:
                t = target(n)
                if t is not None and t != name:
                    out.append(Edge(name, t, child.lineno, in_function))
            visit(child, in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)))

    visit(ast.parse(path.read_text(), str(path)), False)
    return out


def all_modules(package: str) -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / package).rglob("*.py"))}


@dataclass(frozen=True)
class Room:
    floor: int
    name: str
    members: tuple[str, ...]
    """Folders (``bus/``) and modules (``logs``, ``eval/cli_eval``), relative to ``opentinker/``."""


def floors() -> list[Room]:
    """The rows of the doc's floor table: ``| floor | room | members |``."""
    section = DOC.read_text().split("## Floors", 1)
    assert len(section) == 2, f"{DOC}: no '## Floors' section"
    rooms = []
    for line in section[1].split("\n## ", 1)[0].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 3 and cells[0].isdigit():
            rooms.append(Room(int(cells[0]), cells[1].strip("`"), tuple(re.findall(r"`([\w/]+)`", cells[2]))))
    assert rooms, f"{DOC}: the floor table has no rows"
    return rooms


def room_of(module: str, rooms: list[Room]) -> Room:
    """The room of an ``opentinker`` module: a module named alone wins over its folder."""
    rel = module.removeprefix("opentinker").lstrip(".").replace(".", "/") or "__init__"
    best = None
    for room in rooms:
        for m in room.members:
            if rel == m or (m.endswith("/") and rel.startswith(m)) or (m.endswith("/") and rel == m[:-1]):
                if best is None or len(m) > len(best[1]) or (not m.endswith("/") and best[1].endswith("/")):
                    best = (room, m)
    assert best is not None, f"{module} is in no room of {DOC}'s floor table: add it"
    return best[0]


def test_the_floor_table_names_every_module_once():
    rooms = floors()
    names = [r.name for r in rooms]
    assert len(names) == len(set(names)), f"a room named twice: {names}"
    members = [m for r in rooms for m in r.members]
    assert len(members) == len(set(members)), "a module or folder in two rooms"
    for m in members:
        path = ROOT / "opentinker" / (m if m.endswith("/") else f"{m}.py")
        assert path.exists(), f"{DOC}: {m} names nothing under opentinker/"
    for module in all_modules("opentinker"):
        room_of(module, rooms)


def test_every_import_runs_down_a_floor():
    rooms = floors()
    modules = all_modules("opentinker")
    wrong = []
    for module, path in modules.items():
        here = room_of(module, rooms)
        for e in imports_of(path, set(modules)):
            there = room_of(e.dst, rooms)
            if there is not here and there.floor >= here.floor:
                wrong.append(f"{path.relative_to(ROOT)}:{e.line} {module} ({here.name}, floor {here.floor}) -> "
                             f"{e.dst} ({there.name}, floor {there.floor})")
    assert not wrong, "imports up or across a floor:\n" + "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        x = stack.pop()
                        on.discard(x)
                        comp.append(x)
                        if x == v:
                            break
                    if len(comp) > 1:
                        out.append(sorted(comp))
            elif w not in index:
                index[w] = low[w] = len(index)
                stack.append(w)
                on.add(w)
                work.append((w, iter(sorted(graph[w]))))
            elif w in on:
                low[v] = min(low[v], index[w])
    return out


def test_cycles_finds_a_cycle_through_a_function_import(tmp_path):
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []
    # The AST pass sees an import inside a function, and skips one under TYPE_CHECKING.
    known = {"opentinker.bus.auth", "opentinker.bus.common", "opentinker.config"}
    src = tmp_path / "probe.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from opentinker import config\n"
                   "import opentinker.config as c\n"
                   "def f():\n    from .auth import x\n    from opentinker.bus import common\n")
    edges = imports_of(src, known, "opentinker.bus.probe")
    assert [(e.dst, e.in_function) for e in edges] == [
        ("opentinker.config", False), ("opentinker.bus.auth", True), ("opentinker.bus.common", True)]


@pytest.mark.parametrize("package", ["opentinker", "games", "learners", "protocols"])
def test_no_import_cycle(package):
    modules = all_modules(package)
    graph = {m: {e.dst for e in imports_of(p, set(modules))} for m, p in modules.items()}
    found = cycles(graph)
    assert not found, "import cycles (function-level imports included):\n" + "\n".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("package, forbidden", [
    ("protocols", ("opentinker", "games", "learners")),
    ("games", ("opentinker", "learners", "protocols")),
    ("learners", ("opentinker", "games")),
])
def test_outer_layers_never_name_the_runtime(package, forbidden):
    wrong = []
    for module, path in all_modules(package).items():
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            wrong += [f"{module}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in forbidden]
    assert not wrong, "\n".join(wrong)
