"""``transcripts.txt`` of a run: a few episodes of every training step as text: what each LLM
seat saw, what it replied and how the episode ended, under a ``## step N`` header."""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

from protocols.messages import EpisodeSummary

PER_STEP = 4
"""Episodes of a step written (the lowest ids: the first groups')."""

_STEP = re.compile(r"^## step (\d+)$")


def render(step: int, summaries: Sequence[EpisodeSummary]) -> list[str]:
    """Step ``step``'s first :data:`PER_STEP` episodes as the lines of ``transcripts.txt``."""
    lines = [f"## step {step}"]
    for s in sorted(summaries, key=lambda s: s.episode_id)[:PER_STEP]:
        lines += [f"# episode {s.episode_id} (group {s.group_id}, seed {s.seed})", *s.transcript, ""]
    return lines


def append(path: str | Path, lines: Sequence[str]) -> None:
    """Append a step's :func:`render` ed lines to ``path``."""
    with open(path, "a", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def truncate(path: str | Path, step: int) -> None:
    """Keep the steps up to ``step`` (a resume plays the later ones again)."""
    path = Path(path)
    if not path.is_file():
        return
    keep, dropping = [], False
    for line in path.read_text(encoding="utf-8").splitlines(keepends=True):
        m = _STEP.match(line.rstrip("\n"))
        if m:
            dropping = int(m.group(1)) > step
        if not dropping:
            keep.append(line)
    path.write_text("".join(keep), encoding="utf-8")
