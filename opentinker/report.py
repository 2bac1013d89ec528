"""Run outputs: ``metrics.jsonl`` and TensorBoard events, the learning-curve PNG, and the final
summary table."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Any

from rich.table import Table


class MetricsLog:
    """Appends one JSON object per line, ``{"step": s, "kind": "train"|"eval", ...}``, to
    ``path``, and every finite number of the row as a TensorBoard scalar (tag = the metric's
    name, e.g. ``eval/main/vs_random/chips``) to ``tb_dir`` (``tensorboard --logdir runs``).
    Both are on disk when :meth:`write` returns.

    Args:
        path: the JSONL file (appended to).
        tb_dir: the TensorBoard folder; default ``tb/`` beside ``path``; None: no events.
        purge_step: on resume, the first step written again: TensorBoard drops the events
            of that step and later ones that an earlier process wrote.
    """

    def __init__(self, path: Path, tb_dir: Path | None | bool = True, purge_step: int | None = None) -> None:
        self.path = path
        self.rows: list[dict[str, Any]] = []
        self._tb: TensorBoardScalars | None = None
        if tb_dir is not None and tb_dir is not False:
            self._tb = TensorBoardScalars(path.parent / "tb" if tb_dir is True else Path(tb_dir), purge_step)

    def write(self, step: int, kind: str, metrics: dict[str, float]) -> None:
        row = {"step": step, "kind": kind, **{k: _clean(v) for k, v in metrics.items()}}
        self.rows.append(row)
        with open(self.path, "a") as f:
            f.write(json.dumps(row) + "\n")
        if self._tb is not None:
            self._tb.add(step, {k: float(v) for k, v in row.items() if k not in ("step", "kind")
                                and isinstance(v, (int, float)) and math.isfinite(v)})

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
            self._tb = None


class TensorBoardScalars:
    """A TensorBoard event file of scalars, written synchronously (tensorboardX's
    ``SummaryWriter`` queues events for a thread, so a row could be lost with the process).

    Each writer makes its own file, named by the time in nanoseconds (TensorBoard reads the
    files of a folder in name order); ``purge_step`` writes a ``SessionLog.START`` at that
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


def plot_learning_curves(rows: list[dict[str, Any]], policies: list[str], path: Path) -> None:
    """Chips per hand against the random opponent (eval, with 95% bands) and the training
    reward per step, plus the invalid-reply rate, for each policy."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in policies:
        tr = [r for r in rows if r["kind"] == "train" and r.get(f"train/{p}/reward") is not None]
        ev = [r for r in rows if r["kind"] == "eval" and r.get(f"eval/{p}/vs_random/chips") is not None]
        if tr:
            x, y = [r["step"] for r in tr], [r[f"train/{p}/reward"] for r in tr]
            ax.plot(x, y, alpha=0.25, color="tab:blue", label=f"{p}: train reward (mixed opponents)")
            k = min(5, len(y))
            smooth = [sum(y[max(0, i - k + 1) : i + 1]) / len(y[max(0, i - k + 1) : i + 1]) for i in range(len(y))]
            ax.plot(x, smooth, color="tab:blue", lw=1.5, label=f"{p}: train reward, mean of last {k} steps")
            ax2.plot([r["step"] for r in tr], [r[f"train/{p}/invalid_rate"] for r in tr], alpha=0.6, label=f"{p}: train")
        if ev:
            x = [r["step"] for r in ev]
            y = [r[f"eval/{p}/vs_random/chips"] for r in ev]
            ci = [r[f"eval/{p}/vs_random/ci95"] or 0.0 for r in ev]
            ax.plot(x, y, "o-", color="tab:orange", label=f"{p}: eval vs random (95% CI)")
            ax.fill_between(x, [a - b for a, b in zip(y, ci)], [a + b for a, b in zip(y, ci)], color="tab:orange", alpha=0.2)
            ax2.plot(x, [r[f"eval/{p}/vs_random/invalid_rate"] for r in ev], "o-", label=f"{p}: eval")
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.axhline(0.458, color="green", lw=0.8, ls="--", label="best response to random (+0.458)")
    ax.set(xlabel="training step", ylabel="chips per hand", title="Kuhn poker: learning curve")
    ax.legend(fontsize=7)
    ax2.set(xlabel="training step", ylabel="invalid-reply rate", title="Invalid replies", ylim=(-0.02, 1.02))
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary_table(
    first: dict[str, float], last: dict[str, float], policies: list[str], steps: int, unit: str = "chips/hand"
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
        # Opponents in the order random, the scripted partners, the base model.
        found = {k.split("/")[2][3:] for k in (*first, *last) if k.startswith(f"eval/{p}/vs_") and k.endswith("/chips")}
        opponents = [o for o in ("random", *sorted(found - {"random", "base"}), "base") if o in found]
        rows = []
        for o in opponents:
            name = "base model" if o == "base" else o
            rows += [(f"{unit} vs {name} (95% CI)", f"eval/{p}/vs_{o}/chips", f"eval/{p}/vs_{o}/ci95", False)]
            if o == "random":
                rows += [(f"{'hands' if unit == 'chips/hand' else 'games'} vs random", f"eval/{p}/vs_random/hands", None, False)]
            rows += [(f"invalid replies vs {o}", f"eval/{p}/vs_{o}/invalid_rate", None, True)]
        rows += [
            ("exploitability (NashConv/2)", f"eval/{p}/exploitability", None, False),
            ("prob. mass on canonical replies", f"eval/{p}/canonical_mass", None, False),
        ]
        for label, key, ci, pct in rows:
            if key not in first and key not in last:
                continue
            a, b = fmt(first, key, ci, pct), fmt(last, key, ci, pct)
            if key.endswith("/hands"):
                a = str(int(first[key])) if key in first else "-"
                b = str(int(last[key])) if key in last else "-"
            table.add_row(p, label, a, b)
    return table
