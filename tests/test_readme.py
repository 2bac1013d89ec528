"""The README's figures against the JSON under benchmarks/results/: its tables are rendered
from it by benchmarks/readme.py, and every decimal in the prose of its results sections is a
value of a JSON file the paragraph names (one that names none: the files of the last paragraph
of its section that did, or else of the whole section)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import readme

RESULTS = ROOT / "benchmarks" / "results"
SECTIONS = ("## The default job", "## Comparing learners", "## Agents that use tools", "## Benchmarks")
NUMBER = re.compile(r"(\d+\.\d+)(%?)")
JSON_NAME = re.compile(r"([\w.-]+)\.json\b")
FENCE = re.compile(r"^```.*?^```[^\n]*$", re.MULTILINE | re.DOTALL)


def test_readme_blocks_match_their_json() -> None:
    diff = readme.check(readme.README, RESULTS)
    assert diff == "", ("README tables differ from benchmarks/results (run "
                        f"`python benchmarks/readme.py`):\n{diff}")


@pytest.mark.parametrize("name, path", [
    ("default_job", ("runs", 0, "last_eval", "eval/main/vs_random/chips")),
    ("default_job_sweep", ("runs", 1, "last_eval", "eval/main/vs_random/chips")),
    ("pipeline_pace", ("results", "ray", "comm_s")),
    ("threads", ("rows", 0, "ms_per_linear")),
    ("multiplex", ("rows", 0, "tokens_per_s")),
    ("rollout", ("rows", 1, "speedup")),
    ("shared_forward", ("batches", 1, "methods", "tree", "median_s")),
    ("shared_forward_recorded", ("batches", 0, "methods", "levels", "speedup")),
    ("bus", ("results", 0, "p50_us")),
    ("codec", ("results", 2, "encode_us")),
    ("default_job_twins", ("runs", 1, "wall_s")),
    ("compare_learners", ("summary", "rloo", "chips", "mean")),
    ("compare_learners", ("summary", "dpo", "learn_s_per_step")),
    ("lora_vs_full", ("ratios", "s_per_step", "mean")),
    ("tools_warm_start", ("rows", 1, "rl", "final", "success")),
    ("tools_warm_start", ("rows", 0, "sft", "wall_s")),
    ("leduc_league", ("runs", 0, "last_eval", "eval/main/exploitability")),
    ("leduc_league", ("runs", 0, "exact_curve", 9, "train/main/exploitability")),
])
def test_a_changed_json_fails_the_check(tmp_path: Path, name: str, path: tuple) -> None:
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    data = json.loads((results / f"{name}.json").read_text())
    *parents, last = path
    node = data
    for key in parents:
        node = node[key]
    node[last] = node[last] * 1.5 + 0.25
    (results / f"{name}.json").write_text(json.dumps(data))
    diff = readme.check(readme.README, results)
    assert diff, f"changing {name}.json {path} left the README's tables unchanged"
    assert readme.main(["--check", "--results", str(results)]) == 1


def test_rendering_rewrites_blocks_and_names_what_is_wrong(tmp_path: Path) -> None:
    doc = tmp_path / "README.md"
    doc.write_text("intro\n<!-- results: shared_forward -->\nstale\n<!-- /results -->\nend\n")
    assert readme.main(["--check", "--readme", str(doc)]) == 1
    assert readme.write(doc, RESULTS)
    assert "stale" not in doc.read_text() and doc.read_text().endswith("<!-- /results -->\nend\n")
    assert readme.check(doc, RESULTS) == ""
    doc.write_text("<!-- results: no_such_block -->\n<!-- /results -->\n")
    with pytest.raises(readme.ReadmeError, match="no_such_block"):
        readme.check(doc, RESULTS)
    doc.write_text("<!-- results: codec -->\n<!-- /results -->\n")
    with pytest.raises(readme.ReadmeError, match="codec.json"):
        readme.check(doc, tmp_path)


def test_result_files_the_readme_cites_exist() -> None:
    text = readme.README.read_text()
    missing = {n for n in re.findall(r"benchmarks/results/([\w.-]+\.json)", text)
               if not (RESULTS / n).is_file()}
    assert not missing, f"README cites result files that are not kept: {sorted(missing)}"


@cache
def shown(name: str, decimals: int, scale: int = 1) -> frozenset[str]:
    """Every number in ``name``.json times ``scale`` (100 for a percentage) as shown at
    ``decimals``, signs dropped."""
    out: set[str] = set()

    def walk(node: object) -> None:
        if isinstance(node, dict):
            node = list(node.values())
        if isinstance(node, list):
            for child in node:
                walk(child)
        elif isinstance(node, (int, float)) and not isinstance(node, bool):
            out.add(f"{abs(scale * node):.{decimals}f}")

    walk(json.loads((RESULTS / f"{name}.json").read_text()))
    return frozenset(out)


def cited(text: str) -> set[str]:
    """The kept result files ``text`` names, as ``benchmarks/results/X.json`` or ``X.json``."""
    return {n for n in JSON_NAME.findall(text) if (RESULTS / f"{n}.json").is_file()}


def sections(text: str) -> dict[str, str]:
    parts = re.split(r"^(?=## )", text, flags=re.MULTILINE)
    return {p.splitlines()[0]: p for p in parts if p.startswith(SECTIONS)}


def test_prose_numbers_trace_to_the_json_they_cite() -> None:
    found = sections(readme.README.read_text())
    assert sorted(found) == sorted(SECTIONS)
    bad = []
    for title, section in found.items():
        prose = FENCE.sub("", readme.BLOCK.sub("", section))
        files = cited(prose)  # until a paragraph names some: the section's
        for paragraph in re.split(r"\n\s*\n", prose):
            # a paragraph that names none continues the last one that did
            files = cited(paragraph) or files
            words = " ".join(paragraph.split()[:8])
            for number, percent in NUMBER.findall(re.sub(r"`[^`]*`", "", paragraph)):
                decimals, scale = len(number.split(".")[1]), 100 if percent else 1
                if not any(number in shown(f, decimals, scale) for f in files):
                    bad.append(f"{title} / {words!r}...: {number}{percent} is in none of "
                               f"{sorted(f + '.json' for f in files) or 'no cited JSON'}")
    assert not bad, "prose figures without a JSON behind them:\n" + "\n".join(bad)


def test_an_evaluation_without_the_base_match_renders_a_dash(tmp_path: Path) -> None:
    """Runs since the untrained policy stopped playing its own base model have no vs_base
    figures in their first evaluation (null or absent)."""
    data = json.loads((RESULTS / "default_job.json").read_text())
    first = data["runs"][0]["first_eval"]
    first["eval/main/vs_base/chips"] = None
    first.pop("eval/main/vs_base/ci95", None)
    (tmp_path / "default_job.json").write_text(json.dumps(data))
    rendered = readme.render_default_job(tmp_path)
    assert "| chips/hand vs base model (95% CI, 120 hands) | — | +0.983 ± 0.052 |" in rendered


def test_every_result_json_records_its_provenance() -> None:
    """Commit, command, config, versions and machine in every file the README draws on (files
    from before provenance was recorded say so in ``provenance.recorded``)."""
    need = {"commit", "command", "config", "versions", "cpu", "capability", "cores", "device"}
    for path in sorted(RESULTS.glob("*.json")):
        prov = json.loads(path.read_text()).get("provenance")
        assert prov is not None and need <= set(prov), f"{path.name}: {need - set(prov or {})} missing"
        assert prov["commit"] and prov["command"], path.name
