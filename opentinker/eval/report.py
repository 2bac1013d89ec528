"""Run outputs: ``metrics.jsonl`` and TensorBoard events, the learning-curve and cross-play
PNGs, and the final summary table."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np
from rich.table import Table

from games.evaluation import GameEval
from opentinker.config import SNAPSHOT_SUFFIX


class MetricsLog:
    """Appends one JSON object per line, ``{"step": s, "kind": "train"|"eval", ...}``, to
    ``path``, and every finite number of the row as a TensorBoard scalar (tag = the metric's
    name, e.g. ``eval/main/vs_random/hands``) to ``tb/`` beside it (``tensorboard --logdir runs``).
    Both are on disk when :meth:`write` returns.

    Args:
        path: the JSONL file (appended to).
        tensorboard: also write the scalars to ``tb/`` beside ``path``.
        purge_step: on resume, the first step written again: TensorBoard drops the events
            of that step and later ones that an earlier process wrote.
    """

    def __init__(self, path: Path, tensorboard: bool = True, purge_step: int | None = None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._tb: TensorBoardScalars | None = None
        if tensorboard:
            self._tb = TensorBoardScalars(path.parent / "tb", purge_step)

    def write(self, step: int, kind: str, metrics: dict[str, float]) -> None:
        row = {"step": step, "kind": kind, **{k: _clean(v) for k, v in metrics.items()}}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        self._add_tensorboard(row)

    def rewrite_tensorboard(self, rows: list[dict[str, Any]]) -> None:
        """Write ``rows`` (already in the JSONL file) to TensorBoard again: the rows of
        ``purge_step`` that a resume keeps (a step whose evaluation runs again)."""
        for row in rows:
            self._add_tensorboard(row)

    def _add_tensorboard(self, row: dict[str, Any]) -> None:
        if self._tb is not None:
            self._tb.add(int(row["step"]), {k: float(v) for k, v in row.items() if k not in ("step", "kind")
                                            and isinstance(v, (int, float)) and math.isfinite(v)})

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class TensorBoardScalars:
    """A TensorBoard event file of scalars, written synchronously (tensorboardX's
    ``SummaryWriter`` queues events for a thread, so a row could be lost with the process).

    Each writer makes its own file, whose name ends with the time in nanoseconds and the
    process id (TensorBoard reads the files of a folder in name order); ``purge_step`` writes a ``SessionLog.START`` at that
    step, on which TensorBoard drops the earlier files' events from that step on.
    """

    def __init__(self, folder: Path, purge_step: int | None = None) -> None:
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event, SessionLog

        folder.mkdir(parents=True, exist_ok=True)
        self._writer = EventsWriter(str(folder / "events"), filename_suffix=f".{time.time_ns():019d}.{os.getpid()}")
        if purge_step is not None:
            self._writer.write_event(Event(step=purge_step, wall_time=time.time(),
                                           session_log=SessionLog(status=SessionLog.START)))
        self._writer.flush()

    def add(self, step: int, scalars: dict[str, float]) -> None:
        """Write ``scalars`` (tag -> value) at ``step`` and flush."""
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=tag, simple_value=v) for tag, v in scalars.items()]
        self._writer.write_event(Event(step=step, wall_time=time.time(), summary=Summary(value=values)))
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def plot_learning_curves(rows: list[dict[str, Any]], policies: list[str], path: Path, game: str,
                         game_eval: GameEval) -> None:
    """Reward against the random opponent (eval, with 95% bands) and the training reward per
    step, plus the invalid-reply rate, one colour per policy; and, for a game with exact
    measures (its evaluation hook, e.g. an exploitability), each measure over steps."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    key = game_eval.unit
    measures = [m for m in game_eval.exact if any(r.get(f"{k}/{p}/{m.name}") is not None
                                                  for r in rows for p in policies for k in ("eval", "train"))]
    fig, axes = plt.subplots(1, 2 + len(measures), figsize=(11 + 4.5 * len(measures), 4))
    ax, ax2 = axes[0], axes[1]
    for i, p in enumerate(policies):
        color = f"C{i % 10}"
        tr = [r for r in rows if r["kind"] == "train" and r.get(f"train/{p}/reward") is not None]
        ev = [r for r in rows if r["kind"] == "eval" and r.get(f"eval/{p}/vs_random/{key}") is not None]
        if tr:
            x, y = [r["step"] for r in tr], [r[f"train/{p}/reward"] for r in tr]
            ax.plot(x, y, alpha=0.2, color=color)
            k = min(5, len(y))
            smooth = [sum(y[max(0, i - k + 1) : i + 1]) / len(y[max(0, i - k + 1) : i + 1]) for i in range(len(y))]
            ax.plot(x, smooth, color=color, lw=1.2, label=f"{p}: train reward (opponent mix), mean of last {k} steps")
            ax2.plot([r["step"] for r in tr], [r[f"train/{p}/invalid_rate"] for r in tr], color=color, alpha=0.6,
                     label=f"{p}: train")
        if ev:
            x = [r["step"] for r in ev]
            y = [r[f"eval/{p}/vs_random/{key}"] for r in ev]
            ci = [r.get(f"eval/{p}/vs_random/ci95") or 0.0 for r in ev]
            ax.plot(x, y, "o--", color=color, label=f"{p}: eval vs random (95% CI)")
            ax.fill_between(x, [a - b for a, b in zip(y, ci)], [a + b for a, b in zip(y, ci)], color=color, alpha=0.15)
            ax2.plot(x, [r[f"eval/{p}/vs_random/invalid_rate"] for r in ev], "o--", color=color, label=f"{p}: eval")
    ax.axhline(0.0, color="grey", lw=0.8)
    for j, (name, level) in enumerate(game_eval.references.items()):
        ax.axhline(level, color="green", lw=0.8, ls=("--", ":", "-.")[j % 3], label=f"{name} ({level:+.3f})")
    ax.set(xlabel="training step", ylabel=game_eval.label, title=f"{game}: learning curve")
    ax.legend(fontsize=7)
    ax2.set(xlabel="training step", ylabel="invalid-reply rate", title="Invalid replies", ylim=(-0.02, 1.02))
    ax2.legend(fontsize=7)
    for m, axm in zip(measures, axes[2:]):
        for i, p in enumerate(policies):
            pts = [(r["step"], r[f"eval/{p}/{m.name}"]) for r in rows
                   if r["kind"] == "eval" and r.get(f"eval/{p}/{m.name}") is not None]
            if pts:
                axm.plot(*zip(*pts), "o-", color=f"C{i % 10}", label=p)
            steps = [(r["step"], r[f"train/{p}/{m.name}"]) for r in rows
                     if r["kind"] == "train" and r.get(f"train/{p}/{m.name}") is not None]
            if steps:  # measured at every step (against the exploiter: its bare replies)
                axm.plot(*zip(*steps), color=f"C{i % 10}", lw=0.8, alpha=0.5, label=f"{p} (every step)")
        for j, (name, level) in enumerate(m.references.items()):
            axm.axhline(level, color="grey", lw=0.8, ls=("--", ":", "-.")[j % 3], label=f"{name} ({level:.3f})")
        axm.set(xlabel="training step", ylabel=m.name, title=f"{m.name} ({m.better} is better)")
        axm.set_ylim(bottom=min(0.0, axm.get_ylim()[0]))
        axm.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def opponents_of(ev: dict[str, Any], policy: str, policies: list[str], unit: str) -> list[str]:
    """The opponents ``policy`` was evaluated against in ``ev``, in the order random, the
    scripted policies, the base model, the job's other policies, league snapshots (by step)."""
    found = {k.split("/")[2][3:] for k in ev if k.startswith(f"eval/{policy}/vs_") and k.endswith(f"/{unit}")}
    return _ordered(found, policies)


def _ordered(found: set[str], policies: list[str]) -> list[str]:
    others = [q for q in policies if q in found]
    snaps = sorted((o for o in found if SNAPSHOT_SUFFIX.search(o)),
                   key=lambda o: (o.rsplit("__s", 1)[0], int(o.rsplit("__s", 1)[1])))
    scripted = sorted(found - {"random", "base", *others, *snaps})
    return [o for o in ("random", *scripted, "base") if o in found] + others + snaps


def cross_play_matrix(evals: list[tuple[str, dict[str, Any]]], policies: list[str], unit: str
                      ) -> tuple[list[str], list[str], np.ndarray, np.ndarray]:
    """Rows ``"<policy> (<label>)"`` for each evaluation ``(label, eval row)`` and policy;
    columns every opponent any of them met (:func:`opponents_of` order). Returns the labels
    and ``mean``, ``ci95``: float arrays ``[rows, cols]`` of the metric ``unit`` (the game's
    evaluation hook), NaN where a pair was not played."""
    cols = _ordered({o for _, ev in evals for p in policies for o in opponents_of(ev, p, policies, unit)}, policies)
    rows = []
    mean = np.full((len(evals) * len(policies), len(cols)), np.nan)
    ci = mean.copy()
    for i, (label, ev) in enumerate(evals):
        for j, p in enumerate(policies):
            r = i * len(policies) + j
            rows.append(f"{p} ({label})")
            for c, o in enumerate(cols):
                for arr, key in ((mean, unit), (ci, "ci95")):
                    v = ev.get(f"eval/{p}/vs_{o}/{key}")
                    if v is not None:
                        arr[r, c] = v
    return rows, cols, mean, ci


def plot_cross_play(evals: list[tuple[str, dict[str, Any]]], policies: list[str], path: Path,
                    game_eval: GameEval) -> None:
    """Heat map of :func:`cross_play_matrix`: each policy (before and after training) against
    each opponent, mean reward per game with its 95% half width; blank: not played."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, cols, mean, ci = cross_play_matrix(evals, policies, game_eval.unit)
    unit = game_eval.label
    if not cols:
        return
    fig, ax = plt.subplots(figsize=(max(6.5, 2.5 + 1.3 * len(cols)), max(3.2, 1.6 + 0.55 * len(rows))))
    lim = float(np.nanmax(np.abs(mean))) if np.isfinite(mean).any() else 1.0
    im = ax.imshow(np.ma.masked_invalid(mean), cmap="RdBu", vmin=-lim or -1, vmax=lim or 1, aspect="auto")
    for r in range(len(rows)):
        for c in range(len(cols)):
            if np.isfinite(mean[r, c]):
                text = f"{mean[r, c]:+.2f}" + (f"\n±{ci[r, c]:.2f}" if np.isfinite(ci[r, c]) else "")
                ax.text(c, r, text, ha="center", va="center", fontsize=7,
                        color="white" if abs(mean[r, c]) > 0.6 * lim else "black")
    ax.set_xticks(range(len(cols)), [f"vs {'base model' if o == 'base' else o}" for o in cols], rotation=30, ha="right")
    ax.set_yticks(range(len(rows)), rows)
    ax.set_title(f"cross-play: {unit} of the row against the column\n(mean ± 95% CI; blank: not played)", fontsize=10)
    fig.colorbar(im, ax=ax, label=unit)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(
    first: dict[str, float], last: dict[str, float], policies: list[str], steps: int, game_eval: GameEval
) -> Table:
    """Untrained start and trained policy side by side (rows a game does not report are left out)."""
    table = Table(title="OpenTinker: untrained start vs trained policy")
    table.add_column("policy")
    table.add_column("metric")
    table.add_column("untrained (step 0)", justify="right")
    table.add_column(f"trained (step {steps})", justify="right")

    def fmt(m: dict[str, float], key: str, ci: str | None = None, pct: bool = False) -> str:
        v = m.get(key)
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "-"
        if pct:
            return f"{100 * v:.1f}%"
        if ci and m.get(ci) is not None:
            if math.isnan(m[ci]):
                return f"{v:+.3f} (1 per stratum: no CI)"
            return f"{v:+.3f} ± {m[ci]:.3f}"
        return f"{v:.4f}"

    for p in policies:
        opponents = opponents_of({**first, **last}, p, policies, game_eval.unit)
        rows = []
        for o in opponents:
            name = "base model" if o == "base" else f"policy {o}" if o in policies else o
            rows += [(f"{game_eval.label} vs {name} (95% CI)", f"eval/{p}/vs_{o}/{game_eval.unit}",
                      f"eval/{p}/vs_{o}/ci95", False)]
            if o == "random":
                rows += [(f"{game_eval.per}s vs random", f"eval/{p}/vs_random/hands", None, False)]
            rows += [(f"invalid replies vs {o}", f"eval/{p}/vs_{o}/invalid_rate", None, True)]
            if any(run.get(f"eval/{p}/vs_{o}/opponent_invalid_rate") for run in (first, last)):  # an LLM opponent's
                rows += [(f"opponent's invalid replies vs {o}", f"eval/{p}/vs_{o}/opponent_invalid_rate", None, True)]
            rows += [(f"tool calls / {game_eval.per} vs {o}", f"eval/{p}/vs_{o}/tool_calls", None, False),
                     (f"invalid tool calls / {game_eval.per} vs {o}", f"eval/{p}/vs_{o}/invalid_tool_calls", None, False)]
        rows += [(m.description or m.name, f"eval/{p}/{m.name}", None, False) for m in game_eval.exact]
        rows += [("prob. mass on canonical replies", f"eval/{p}/canonical_mass", None, False)]
        for label, key, ci, pct in rows:
            if key not in first and key not in last:
                continue
            a, b = fmt(first, key, ci, pct), fmt(last, key, ci, pct)
            if key.endswith("/hands"):
                a = str(int(first[key])) if key in first else "-"
                b = str(int(last[key])) if key in last else "-"
            table.add_row(p, label, a, b)
    return table


def rating_history(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``[{"step", "ratings": {player: (rating, lo, hi)}}]`` from the evaluation rows'
    ``ratings/bt/<player>`` metrics (for :func:`~opentinker.eval.ratings.plot_ratings`)."""
    out = []
    for r in rows:
        if r.get("kind") != "eval":
            continue
        names = [k[len("ratings/bt/"):] for k in r if k.startswith("ratings/bt/") and k.count("/") == 2]
        if names:
            nan = float("nan")
            out.append({"step": r["step"], "ratings": {
                n: tuple(nan if r.get(k) is None else float(r[k])
                         for k in (f"ratings/bt/{n}", f"ratings/bt/{n}/lo", f"ratings/bt/{n}/hi")) for n in names}})
    return out


def ratings_table(ev: dict[str, Any], steps: int = 0, title: str | None = None) -> Table | None:
    """The league's ratings at an evaluation: Bradley-Terry (log-odds against ``random``, 95%
    bootstrap interval) and the running openskill table, best first; ``None`` without ratings."""
    history = rating_history([{"kind": "eval", "step": steps, **ev}])
    if not history:
        return None
    table = Table(title=title or f"Ratings at step {steps} (every evaluated pairing; random = 0)")
    table.add_column("player")
    table.add_column("Bradley-Terry (logits, 95% CI)", justify="right")
    table.add_column("P(beats random)", justify="right")
    table.add_column("openskill mu ± 1.96 sigma", justify="right")
    ratings = history[0]["ratings"]
    for name, (r, lo, hi) in sorted(ratings.items(), key=lambda kv: -kv[1][0] if math.isfinite(kv[1][0]) else math.inf):
        bt = f"{r:+.2f} [{lo:+.2f}, {hi:+.2f}]" if math.isfinite(lo) else f"{r:+.2f}"
        mu, sigma = ev.get(f"ratings/openskill/{name}"), ev.get(f"ratings/openskill/{name}/sigma")
        os_ = f"{mu:+.1f} ± {1.96 * sigma:.1f}" if mu is not None and sigma is not None else "-"
        table.add_row(name, bt, f"{1 / (1 + math.exp(-r)):.2f}" if math.isfinite(r) else "-", os_)
    return table
