"""What the benchmark scripts that run whole jobs share (``compare_learners.py``,
``lora_vs_full.py``, ``tools_warm_start.py``, ``learning_suite.py``): running ``opentinker``
commands with their output kept and their peak memory sampled, running a job or reusing its
finished run, reading a run's metrics, and the statistics over seeds."""

from __future__ import annotations

import contextlib
import fcntl
import json
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import psutil

import games
from opentinker.config import JobConfig, load_config, to_toml
from opentinker.control.checkpoints import latest_checkpoint
from opentinker.serve.job_procs import die_with_parent, stop_all


def bootstrap_ci(values: list[float], n_boot: int = 10_000, seed: int = 0) -> tuple[float, float, float]:
    """Mean of ``values`` and the 95% percentile-bootstrap interval of the mean
    (``n_boot`` resamples with replacement); one value: its own interval."""
    x = np.asarray(values, dtype=np.float64)
    if len(x) == 1:
        return float(x[0]), float(x[0]), float(x[0])
    means = x[np.random.default_rng(seed).integers(0, len(x), (n_boot, len(x)))].mean(axis=1)
    return float(x.mean()), float(np.percentile(means, 2.5)), float(np.percentile(means, 97.5))


PEAK_KEYS = ("peak_rss_total_mb", "peak_rss_largest_mb")
"""The peak memory figures :class:`PeakRss` gives (and ``bench_job.json`` keeps)."""


class PeakRss:
    """Peak resident memory of a process and its descendants (Ray's workers included),
    sampled every ``period`` seconds on a thread: ``total_mb`` (the sum at one sample) and
    ``largest_mb`` (one process)."""

    def __init__(self, pid: int, period: float = 0.5) -> None:
        self.pid, self.period = pid, period
        self.total_mb = self.largest_mb = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._stop.wait(self.period):
            try:
                root = psutil.Process(self.pid)
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            sizes = []
            for p in procs:
                try:
                    sizes.append(p.memory_info().rss / 2**20)
                except psutil.Error:
                    pass
            if sizes:
                self.total_mb = max(self.total_mb, sum(sizes))
                self.largest_mb = max(self.largest_mb, max(sizes))

    def stop(self) -> dict[str, float]:
        self._stop.set()
        self._thread.join()
        return {"peak_rss_total_mb": self.total_mb, "peak_rss_largest_mb": self.largest_mb}


PASSED_ON = (signal.SIGINT, signal.SIGTERM)
"""The signals a script running a job passes on to it (:func:`forward_signals`)."""


class Forward:
    """The signals of :data:`PASSED_ON` that came, passed on to the attached process (those
    that came before it was attached, on attaching)."""

    def __init__(self) -> None:
        self.passed: list[int] = []
        self.proc: subprocess.Popen[str] | None = None

    def __call__(self, signum: int, frame: object) -> None:
        self.passed.append(signum)
        if self.proc is not None:
            self.proc.send_signal(signum)

    def attach(self, proc: subprocess.Popen[str]) -> None:
        self.proc = proc
        for signum in self.passed:  # came while it started
            proc.send_signal(signum)


class Stopped(RuntimeError):
    """A job stopped by a signal this script passed on to it (Ctrl-C, SIGTERM): a script that
    goes on to its next job after a failed one stops instead, as the person who sent it asked."""


@contextlib.contextmanager
def forward_signals() -> Iterator[Forward]:
    """Inside (on the main thread), SIGINT and SIGTERM to this script are passed on to the
    process attached to the yielded :class:`Forward` instead of stopping the script. An
    ``opentinker run`` then stops as it does on its own: SIGINT (Ctrl-C) after the step in
    progress, with a checkpoint of it (a second one: at once), SIGTERM at once with its newest
    checkpoint; either way it shuts its components down and names its resume command, which
    :func:`run_or_reuse` takes up the next time."""
    forward = Forward()
    if threading.current_thread() is not threading.main_thread():
        yield forward
        return
    before = {sig: signal.signal(sig, forward) for sig in PASSED_ON}
    try:
        yield forward
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def run_logged(cmd: list[str], log: Path, prefix: str) -> tuple[float, dict[str, float]]:
    """Run ``cmd``, echoing its lines with ``prefix`` and keeping them in ``log``; returns its
    wall time and peak memory. SIGINT and SIGTERM meanwhile are passed on to it
    (:func:`forward_signals`); it runs in a process group of its own, so a terminal's Ctrl-C
    reaches it once, through this script, and it gets SIGTERM when this script dies otherwise
    (SIGKILL, a closed terminal: ``PR_SET_PDEATHSIG``) or fails while it runs, so no job is
    left running unwatched. Raises ``RuntimeError`` naming the log when it fails or was
    stopped (:class:`Stopped` when a signal passed on stopped it; a job that finished although
    a signal came is a success). An earlier attempt's ``log`` is kept as ``log.N``."""
    t0 = time.perf_counter()
    _keep_earlier(log)
    with log.open("w", buffering=1) as f, forward_signals() as forward:  # line-buffered: a run shows its lines
        proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, bufsize=1, process_group=0,
                                preexec_fn=die_with_parent)  # noqa: PLW1509 - a ctypes call, no locks
        forward.attach(proc)
        peak: PeakRss | None = None
        try:
            peak = PeakRss(proc.pid)
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                if line.startswith(("step ", "started", "wrote", "offline ", "opentinker: ", "resumed ")):
                    print(f"  [{prefix}] {line.rstrip()}", flush=True)
            rc = proc.wait()
        except BaseException:
            stop_all([proc])  # its process group: what the job started stops with it
            raise
        finally:
            mem = peak.stop() if peak is not None else {}
    if rc != 0 and forward.passed:
        names = " then ".join(signal.Signals(s).name for s in forward.passed)
        raise Stopped(f"{prefix}: stopped; {names} passed on to `{shlex.join(cmd)}`, which exited {rc}; "
                           f"its output: {log}")
    if rc != 0:
        raise RuntimeError(f"{prefix}: `{shlex.join(cmd)}` exited {rc}; its output: {log}")
    return time.perf_counter() - t0, mem


def _runs(root: Path, name: str, seed: int, config: bytes | None) -> list[Path]:
    """The run folders of job ``name`` and ``seed`` under ``root``, oldest first (given
    ``config``, only those whose ``config.toml`` is exactly it)."""
    return sorted(p.parent for p in root.glob(f"*__{name}__{seed}__*/config.toml")
                  if config is None or p.read_bytes() == config)


def finished_run(root: Path, name: str, seed: int, config: bytes | None = None) -> Path | None:
    """The newest run folder of job ``name`` and ``seed`` under ``root`` with a ``summary.json``
    (and, given ``config``, whose ``config.toml`` is exactly it: a run of other settings, or of
    another game, is never reused)."""
    done = [p for p in _runs(root, name, seed, config) if (p / "summary.json").is_file()]
    return done[-1] if done else None


def stopped_run(root: Path, name: str, seed: int, config: bytes | None = None,
                verified: bool = True) -> tuple[Path, int] | None:
    """The newest run folder of job ``name`` and ``seed`` under ``root`` (of exactly ``config``
    where given) that stopped before its end with a checkpoint to go on from, and that
    checkpoint's step: the one ``opentinker run --resume`` takes, the newest that checks out
    against the run's own ``config.toml``
    (:func:`~opentinker.control.checkpoints.latest_checkpoint`); with ``verified`` False (a
    listing: no weights read) the newest with a readable ``state.json``. None when there is
    none (a run stopped before its first checkpoint, or whose checkpoints all fail their
    checks, has nothing to keep)."""
    for run in reversed(_runs(root, name, seed, config)):
        if (run / "summary.json").is_file():
            return None  # a newer run finished: nothing stopped after it
        try:
            return run, latest_checkpoint(run, load_config(run / "config.toml") if verified else None).step
        except (ValueError, OSError):
            continue
    return None


@contextlib.contextmanager
def claimed(lock: Path, label: str) -> Iterator[None]:
    """Hold an exclusive lock on the file ``lock`` (made where missing) while the body runs, so
    a second invocation making the same run stops with a clear error instead of taking the run
    in progress for a stopped one and resuming it beside itself. The lock goes with the
    process (a killed one leaves none behind). Raises ``RuntimeError`` when it is held."""
    lock.parent.mkdir(parents=True, exist_ok=True)
    with lock.open("a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RuntimeError(f"{label}: another invocation is making this run now (it holds {lock}); "
                               "let it finish or stop it first") from None
        yield


def run_or_reuse(cmd: list[str], root: Path, name: str, seed: int, log: Path, label: str,
                 config: bytes | None = None) -> tuple[Path, dict[str, Any]]:
    """The finished run of job ``name`` and ``seed`` under ``root`` (given ``config``, one whose
    ``config.toml`` is exactly it: :func:`finished_run`), made now by ``cmd`` (an
    :func:`opentinker` command; its output in ``log``) unless one is there; a run of it that
    was stopped (Ctrl-C, SIGTERM, a machine gone) goes on from its newest checkpoint
    (:func:`stopped_run`, ``opentinker run --resume``; the earlier output moves to
    ``log.1``, ``log.2``...) instead of starting again. Returns it with what ``bench_job.json``
    recorded when it was made: wall time (a resumed run's own, which counts the time up to the
    checkpoint it resumed from), the peak memory of the last attempt, the command line (the
    first attempt's), the step it resumed from and the command that did (``{}`` for a run made
    without this helper). Raises
    ``RuntimeError`` when the command fails or leaves no finished run, or when another
    invocation is making this run now (:func:`claimed`)."""
    with claimed(root / f".{name}-seed{seed}.lock", label):
        return _run_or_reuse(cmd, root, name, seed, log, label, config)


def _run_or_reuse(cmd: list[str], root: Path, name: str, seed: int, log: Path, label: str,
                  config: bytes | None) -> tuple[Path, dict[str, Any]]:
    run = finished_run(root, name, seed, config)
    if run is not None:
        print(f"  [{label}] reusing {run}", flush=True)
    else:
        stopped = stopped_run(root, name, seed, config)
        now, resumed = cmd, {}
        if stopped is not None:
            print(f"  [{label}] going on with {stopped[0]} from its checkpoint of step {stopped[1]}", flush=True)
            now = opentinker("run", "--resume", str(stopped[0]))
            resumed = {"resumed_from_step": stopped[1], "resumed_with": shlex.join(["opentinker", *now[3:]])}
            _keep_earlier(log)
        wall, mem = run_logged(now, log, label)
        run = finished_run(root, name, seed, config)
        if run is None:
            raise RuntimeError(f"{label}: `{shlex.join(now)}` finished but left no summary.json under {root}")
        if resumed:
            wall = json.loads((run / "summary.json").read_text())["wall_s"]
        shown = shlex.join(["opentinker", *cmd[3:]])
        (run / "bench_job.json").write_text(json.dumps({"wall_s": wall, **mem, "command": shown, **resumed}))
    info = run / "bench_job.json"
    return run, json.loads(info.read_text()) if info.is_file() else {}


def _keep_earlier(log: Path) -> None:
    """Move ``log`` (an earlier attempt's output) to the first free ``log.N``."""
    if log.is_file():
        n = next(i for i in range(1, 10_000) if not log.with_name(f"{log.name}.{i}").exists())
        log.rename(log.with_name(f"{log.name}.{n}"))


def run_config(config: JobConfig, out: Path, label: str) -> tuple[Path, dict[str, Any]]:
    """:func:`run_or_reuse` for a job config made in a script (its ``out_dir`` must be
    ``out / "runs"``): written to ``out/<name>_seed<seed>.toml``, its output in ``.log``
    beside it; a finished run of exactly this config is reused."""
    toml = to_toml(config)
    stem = out / f"{config.name}_seed{config.seed}"
    (out / "runs").mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".toml").write_bytes(toml)
    return run_or_reuse(opentinker("run", str(stem.with_suffix(".toml"))), out / "runs", config.name, config.seed,
                        stem.with_suffix(".log"), label, toml)


def run_commit(summary: dict[str, Any]) -> dict[str, Any]:
    """A run's code from its ``summary.json``: ``commit`` (the one it started from), and
    ``commit_at_end`` where the checkout moved while it ran."""
    return {"commit": summary.get("commit"),
            **({"commit_at_end": summary["commit_at_end"]} if "commit_at_end" in summary else {})}


def read_rows(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def train_clock(rows: list[dict[str, Any]]) -> dict[int, float]:
    """Step -> the job's training time up to its end (rollout + learning, evaluations left
    out); step 0 -> 0."""
    clock, elapsed = {0: 0.0}, 0.0
    for r in rows:
        if r["kind"] == "train":
            elapsed += r.get("timing_s/rollout", 0.0) + r.get("timing_s/learn", 0.0)
            clock[r["step"]] = elapsed
    return clock


def eval_curve(rows: list[dict[str, Any]], name: str, ev: games.GameEval, per_step: int) -> list[dict[str, Any]]:
    """Policy ``name``'s evaluations over a run: step, episodes played (``per_step`` a step),
    training wall-clock so far (:func:`train_clock`), the unit against random and the exact
    measures."""
    clock = train_clock(rows)
    exact = [m.name for m in ev.exact]
    return [{"step": r["step"], "episodes": r["step"] * per_step, "wall_s": clock[r["step"]],
             ev.unit: r[f"eval/{name}/vs_random/{ev.unit}"],
             **{m: r[f"eval/{name}/{m}"] for m in exact if f"eval/{name}/{m}" in r}}
            for r in rows if r["kind"] == "eval"]


def final_metrics(ev_row: dict[str, Any], name: str, ev: games.GameEval) -> dict[str, float]:
    """A learner's final evaluation: the unit against random with its interval and invalid
    rate, the exact measures with the canonical mass where the game has them, and the tool
    calls and invalid calls per game where it has tools."""
    p = f"eval/{name}/vs_random/"
    out = {ev.unit: ev_row[p + ev.unit], "ci95": ev_row[p + "ci95"], "invalid_rate": ev_row[p + "invalid_rate"],
           "hands": ev_row[p + "hands"]}
    for m in (*(x.name for x in ev.exact), "canonical_mass"):
        if ev_row.get(f"eval/{name}/{m}") is not None:
            out[m] = ev_row[f"eval/{name}/{m}"]
    for m in ("tool_calls", "invalid_tool_calls"):  # a game with tools: per game
        if ev_row.get(p + m) is not None:
            out[m] = ev_row[p + m]
    return out


def to_target(curve: list[dict[str, Any]], unit: str, target: float) -> dict[str, float | None]:
    """Episodes and wall-clock at the first evaluation at or above ``target`` (None: never)."""
    hit = next((c for c in curve if c[unit] >= target), None)
    return {"episodes_to_target": hit["episodes"] if hit else None, "wall_s_to_target": hit["wall_s"] if hit else None}


COMPUTE_OPS = ("SampleRequest", "ForwardBackward", "OptimStep")
"""The scheduler operations of a training step (the coordinator's ``perf/compute_s/*``)."""


def opponent_mix(spec: str) -> dict[str, float]:
    """``"random=0.75,self=0.25"`` -> ``{"random": 0.75, "self": 0.25}`` (a policy's opponents)."""
    return {k: float(v) for k, v in (item.split("=") for item in spec.split(","))}


def model_table(base: str, device: str, threads: int) -> dict[str, Any]:
    """A job's ``[model]`` table: the base model on ``device``, ``threads`` torch threads (0:
    the job's default)."""
    model: dict[str, Any] = {"base": base, "device": device}
    if threads:
        model["threads"] = threads
    return model


def job_phases(run: Path, mem: dict[str, float], wall_s: float) -> dict[str, float]:
    """A seed's job: median seconds per step by phase, its wall time and peak memory."""
    trains = [r for r in read_rows(run) if r["kind"] == "train"]
    med = lambda k: statistics.median(r.get(k, 0.0) for r in trains)
    compute = statistics.median(sum(r.get(f"perf/compute_s/{op}", 0.0) for op in COMPUTE_OPS) for r in trains)
    rollout, learn = med("timing_s/rollout"), med("timing_s/learn")
    return {"rollout_s": rollout, "learn_s": learn, "compute_s": compute, "rest_s": rollout + learn - compute,
            "wall_s": wall_s, **mem}


def write_result(result: dict[str, Any], *paths: str | Path) -> None:
    """Write ``result`` as indented JSON to each of ``paths`` (its folder made; an empty path
    skipped): a script's own copy in its output folder and the one ``--json`` names."""
    text = json.dumps(result, indent=1)
    for p in (Path(p) for p in paths if p):
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def opentinker(*argv: str) -> list[str]:
    """The ``opentinker`` command line with this interpreter (its environment's package)."""
    return [sys.executable, "-m", "opentinker.cli", *argv]


def fmt_ci(s: dict[str, Any] | None, digits: int = 3) -> str:
    return "n/a" if s is None else f"{s['mean']:+.{digits}f} [{s['lo']:+.{digits}f}, {s['hi']:+.{digits}f}]"
