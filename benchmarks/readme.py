"""Render the README's result tables from the JSON under ``benchmarks/results/``.

A block in README.md is a pair of marker lines with the rendered markdown between them::

    <!-- results: NAME -->
    | ... |
    <!-- /results -->

``NAME`` is a key of ``RENDERERS``; its function (in ``_readme_learning.py`` or
``_readme_perf.py``) reads the results folder and returns the text between the markers. ``python benchmarks/readme.py`` rewrites every block in place;
``--check`` prints a unified diff and exits 1 when README.md differs from what it renders.

    python benchmarks/readme.py [--check] [--readme README.md] [--results benchmarks/results]
"""

from __future__ import annotations

import argparse
import difflib
import functools
import re
import sys
from collections.abc import Callable
from pathlib import Path

from _readme_common import ROOT, ReadmeError
from _readme_learning import (
    render_compare_learners,
    render_default_job,
    render_default_job_sweep,
    render_default_job_times,
    render_league_runs,
    render_learning_suite,
    render_lora_vs_full,
    render_tictactoe_exact,
    render_tictactoe_runs,
    render_tools_job,
    render_tools_warm_start,
)
from _readme_perf import (
    render_bus,
    render_codec,
    render_compute_thread,
    render_engine_overhead,
    render_exploring_replies,
    render_multiplex,
    render_pipeline_pace,
    render_rollout,
    render_shared_forward,
    render_threads,
)

__all__ = ["BLOCK", "README", "RENDERERS", "RESULTS", "ReadmeError", "check", "render", "write"]

README = ROOT / "README.md"
RESULTS = ROOT / "benchmarks" / "results"

OPEN = re.compile(r"^<!-- results: (?P<name>\S+) -->$", re.MULTILINE)
BLOCK = re.compile(r"^<!-- results: (?P<name>\S+) -->\n(?P<body>.*?)^<!-- /results -->$",
                   re.MULTILINE | re.DOTALL)


def _each(render: Callable[..., str], *names: str) -> dict[str, Callable[[Path], str]]:
    """A block for each results file ``<name>.json`` that ``render`` reads (``render(results,
    name)``): the probes and variants of one kind of result, each rendered as the main one."""
    return {name: functools.partial(render, name=name) for name in names}


RENDERERS: dict[str, Callable[[Path], str]] = {
    "default_job_times": render_default_job_times,
    "compare_learners": render_compare_learners,
    "lora_vs_full": render_lora_vs_full,
    **_each(render_lora_vs_full, "lora_vs_full_tools", "lora_vs_full_tools_warm"),
    "tools_job": render_tools_job,
    "learning_suite": render_learning_suite,
    "tictactoe_runs": render_tictactoe_runs,
    **_each(render_tictactoe_runs, "tictactoe_exact_gae", "tictactoe_move_values", "tictactoe_tree_forward",
            "tictactoe_seed1_probes", "tictactoe_seed2_probes", "tictactoe_mix_probes", "tictactoe_seed0_probes"),
    "tictactoe_exact": render_tictactoe_exact,
    **_each(render_learning_suite, "learning_suite_explore0", "learning_suite_liars_lr3e-4",
            "learning_suite_n3_20steps", "learning_suite_ttt_attention", "learning_suite_ttt_lr1e-3"),
    "tools_warm_start": render_tools_warm_start,
    **_each(render_league_runs, "leduc_league"),
    "default_job": render_default_job,
    "default_job_sweep": render_default_job_sweep,
    "pipeline_pace": render_pipeline_pace,
    "threads": render_threads,
    "compute_thread": render_compute_thread,
    "multiplex": render_multiplex,
    "engine_overhead": render_engine_overhead,
    "rollout": render_rollout,
    "shared_forward": render_shared_forward,
    "exploring_replies": render_exploring_replies,
    "bus": render_bus,
    "codec": render_codec,
}


# --- the README --------------------------------------------------------------------------

def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every block's body replaced by what its renderer returns."""
    opened = [m["name"] for m in OPEN.finditer(text)]
    closed = [m["name"] for m in BLOCK.finditer(text)]
    if opened != closed:
        raise ReadmeError(f"unclosed block(s): {sorted(set(opened) - set(closed))}")

    def body(m: re.Match[str]) -> str:
        name = m["name"]
        if name not in RENDERERS:
            raise ReadmeError(f"unknown block name: {name!r} (known: {', '.join(RENDERERS)})")
        try:
            rendered = RENDERERS[name](results)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise ReadmeError(f"block {name!r}: {type(e).__name__}: {e}") from e
        return f"<!-- results: {name} -->\n{rendered}<!-- /results -->"

    return BLOCK.sub(body, text)


def check(readme: Path = README, results: Path = RESULTS) -> str:
    """A unified diff from ``readme`` to what it renders; empty when they agree."""
    text = readme.read_text()
    return "".join(difflib.unified_diff(
        text.splitlines(keepends=True), render(text, results).splitlines(keepends=True),
        fromfile=str(readme), tofile=f"{readme} (rendered from {results})"))


def write(readme: Path = README, results: Path = RESULTS) -> bool:
    """Rewrite ``readme``'s blocks in place; whether anything changed."""
    text = readme.read_text()
    new = render(text, results)
    if new != text:
        readme.write_text(new)
    return new != text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="print a diff and exit 1 if README differs from its JSON")
    parser.add_argument("--readme", type=Path, default=README)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    try:
        if args.check:
            diff = check(args.readme, args.results)
            sys.stdout.write(diff)
            return 1 if diff else 0
        print(f"{args.readme}: {'updated' if write(args.readme, args.results) else 'unchanged'}")
    except ReadmeError as e:
        print(f"readme.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
