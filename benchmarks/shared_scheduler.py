"""One ``opentinker serve`` for several jobs and the OpenAI-compatible endpoint: are the
scheduler's per-job compute counters in proportion to the jobs' priorities, and does the
endpoint answer while jobs train? (Issue #16's two claims, measured in one run.)

One service (a subprocess, ``--port 0``, a temporary service file) serves every phase:

1. **Serving at idle** (the baseline). ``--requests`` sequential chat completions through the
   official ``openai`` client, ``--chat_max_tokens`` tokens, seeded, alternating the model
   ``base`` and a fresh adapter of the RL policy's rank, with nothing else running (after two
   warm-up requests).
2. **Backlogged loads** (the claim's own case), one per :data:`LOADS` shape. Two jobs opened
   with the owner's credentials, priorities ``--priorities`` (1 and 3), each sampling from its
   own adapter with more rows always waiting than the engine can hold (each reply replaced by
   a new request) for ``--synthetic_s`` seconds, then cancelled. ``ListJobs`` is read every
   ``--poll_s``; a job's *contended share* is its ``contended_ms`` (compute while another job
   also had work) over the two jobs' sum, against the configured ``p / sum(p)``; deviation
   ``|share / configured - 1|``. Reported over the whole load (the counters read just before
   it stops) and over its last two thirds (the start left out).
3. **RL jobs** (the realistic case). The bundled default job, small, twice at once with
   ``opentinker run --scheduler FILE`` at the two priorities (the same seed: the same work).
   While both train, ``--requests`` chat completions as in 1 (adapters: the RL jobs' own
   ``<job>/main``). Shares as in 2, over the whole run and over the windows with and without
   the chat requests (those are the owner's: a third party of priority 1 on the scheduler,
   which ``ListJobs`` does not list). An RL job alternates rollouts (sampling) and learning (a
   forward-backward), so it is not always backlogged: a job that asks for less than its share
   gets all it asks for, and the counters then say what it asked.
4. **Alone** (unless ``--no_alone``): the same two jobs one after the other, each with its own
   scheduler; the wall-clock of 3 (both at once) over the sum of these.

Writes a rich table, ``--json`` (provenance, config, per-phase counters, sampled series,
latencies, verdict lines) and ``--png`` (cumulative compute per job over time).

    ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 python benchmarks/shared_scheduler.py
    python benchmarks/shared_scheduler.py --quick    # tiny random model, about a minute
"""

from __future__ import annotations

import itertools
import json
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
from _args import parse_args
from rich.console import Console
from rich.table import Table

from _machine import script_provenance  # isort: skip  (first: before torch)
from _jobs import opentinker, run_logged

from opentinker.bus.auth import Credentials
from opentinker.bus.common import RemoteError
from opentinker.bus.sync import SyncClient
from opentinker.serve.cli import status
from opentinker.control.attach import ServiceInfo
from protocols.messages import (
    CloseJob,
    CreateAdapter,
    ListJobs,
    LoraSpec,
    OpenJob,
    SampleRequest,
    SamplingParams,
)

TOLERANCE = 0.05
"""The claim: each job's counter within 5% (relative) of its configured share."""
PROMPTS = ["You hold the King. Your opponent bets. Do you call or fold?",
           "You hold the Jack and act first. Check or bet?",
           "Name one card in Kuhn poker.", "What beats a Queen in Kuhn poker?"]


@dataclass
class Args:
    model: str = "smollm2-135m"
    priorities: str = "1,3"
    loads: str = "slots,kv"
    """Which backlogged loads of :data:`LOADS` to run, in order."""
    synthetic_s: float = 60.0
    """Seconds of each backlogged load."""
    max_rows: int = 32
    """The service's engine row slots (``serve --max-rows``): fewer than the default 256, so the
    jobs take turns at a grain of short steps on a CPU."""
    kv_budget_mb: int = 128
    """The service's KV cache (``serve --kv-budget-mb``): about 2,900 tokens of smollm2-135m."""
    max_batch_tokens: int = 256
    """Tokens one engine step computes at most (``serve --max-batch-tokens``): a step of the
    default 2,048 takes seconds on a CPU, and jobs can take turns only between steps."""
    anticipate_s: float = 0.25
    """``serve --fair-anticipate-s``: how long a job whose work ran out still shares compute."""
    steps: int = 10
    groups_per_step: int = 8
    requests: int = 16
    """Chat completions at idle, and again while the RL jobs train."""
    chat_max_tokens: int = 16
    poll_s: float = 0.5
    job_timeout_s: float = 600.0
    no_alone: bool = False
    out: str = "runs/shared_scheduler"
    json: str = "benchmarks/results/shared_scheduler.json"
    png: str = "benchmarks/results/shared_scheduler.png"
    quick: bool = False
    """A smoke run: the tiny random model, short phases (written under ``--out``)."""


QUICK = {"model": "tiny-random", "synthetic_s": 6.0, "steps": 2, "groups_per_step": 4, "requests": 6,
         "json": "runs/shared_scheduler/quick.json", "png": "runs/shared_scheduler/quick.png"}


@dataclass(frozen=True)
class Load:
    """A backlogged load's shape: each job keeps ``in_flight`` requests of ``rows`` rows
    waiting, each row ``prompt_tokens`` random tokens that draws ``max_tokens``."""

    name: str
    rows: int
    in_flight: int
    prompt_tokens: int
    max_tokens: int


LOADS = {"slots": Load("slots", 32, 8, 8, 8), "kv": Load("kv", 16, 8, 120, 8)}
"""``slots``: each job asks for 256 rows of 16 tokens: the service's 32 row slots bind (a job
may hold ``32 * p / sum(p)`` of them), its KV pool does not. ``kv``: each job asks for 128
rows of 128 tokens: on smollm2-135m the service's 128 MB KV pool (float32, 46 KB a token:
about 2,900 tokens) holds about 22 of them, so the pool binds before the row slots do (the
realistic case of RL rollouts, whose prompts are hundreds of tokens). On ``tiny-random``
neither binds."""


# ------------------------------------------------------------------------------ helpers

class JobSampler:
    """Reads ``ListJobs`` every ``period`` seconds on its own thread (its own client):
    ``samples`` is a list of (seconds since ``t0``, {job: (name, priority, state, compute_ms,
    contended_ms)})."""

    def __init__(self, info: ServiceInfo, t0: float, period: float, limit_s: float = 3600.0) -> None:
        self.info, self.t0, self.period, self.limit_s = info, t0, period, limit_s
        self.samples: list[tuple[float, dict[str, tuple]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def read(self, c: SyncClient) -> None:
        jobs = c.request(ListJobs(), 30).jobs
        self.samples.append((time.perf_counter() - self.t0, {
            j.job: (j.name, j.priority, j.state, j.compute_ms, j.contended_ms) for j in jobs}))

    def _run(self) -> None:
        with SyncClient(self.info.endpoint, "bench-sampler", credentials=self.info.credentials()) as c:
            end = time.monotonic() + self.limit_s
            while not self._stop.wait(self.period) and time.monotonic() < end:
                self.read(c)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(60)

    def latest(self) -> dict[str, tuple]:
        return self.samples[-1][1] if self.samples else {}


def shares(counters: dict[str, tuple[float, float]], priorities: dict[str, float]) -> dict[str, Any]:
    """Each job's share of the jobs' summed ``contended_ms`` (counters: job -> (compute_ms,
    contended_ms)) against its configured share, and the relative deviation."""
    total = sum(c for _, c in counters.values())
    weight = sum(priorities.values())
    out: dict[str, Any] = {}
    for job, (compute, contended) in counters.items():
        configured = priorities[job] / weight
        share = contended / total if total else None
        out[job] = {"priority": priorities[job], "compute_ms": compute, "contended_ms": contended, "share": share,
                    "configured": configured, "deviation": None if share is None else abs(share / configured - 1)}
    return out


def delta(samples: list, jobs: list[str], t_from: float, t_to: float) -> dict[str, tuple[float, float]]:
    """(compute_ms, contended_ms) gained by each job between the samples nearest to two times."""
    def at(t: float) -> dict[str, tuple]:
        return min(samples, key=lambda s: abs(s[0] - t))[1]
    a, b = at(t_from), at(t_to)
    return {j: (b[j][3] - a.get(j, (0, 0, 0, 0, 0))[3], b[j][4] - a.get(j, (0, 0, 0, 0, 0))[4]) for j in jobs}


def series(samples: list, jobs: list[str], points: int = 120) -> dict[str, Any]:
    """The sampled counters of ``jobs``, thinned to about ``points`` samples."""
    kept = [s for s in samples if all(j in s[1] for j in jobs)]
    kept = kept[:: max(1, len(kept) // points)]
    return {"t_s": [round(t, 2) for t, _ in kept],
            **{j: {"compute_ms": [s[j][3] for _, s in kept], "contended_ms": [s[j][4] for _, s in kept]} for j in jobs}}


def latency(rows: list[dict[str, Any]], by_model: bool = True) -> dict[str, Any]:
    """Requests sent, answered and failed, and the answered ones' latency percentiles (s), in
    all and per model kind (``base``, ``adapter``)."""
    ok = [r["latency_s"] for r in rows if r["ok"]]
    q = (lambda x: float(np.percentile(ok, x))) if ok else (lambda x: None)
    out = {"sent": len(rows), "answered": len(ok), "failed": len(rows) - len(ok), "p50_s": q(50), "p95_s": q(95),
           "max_s": max(ok, default=None), "errors": sorted({r["error"] for r in rows if not r["ok"]})}
    if by_model:
        out["by_model"] = {m: latency([r for r in rows if r["model"] == m], False) for m in ("base", "adapter")}
    return out


def largest_jump(samples: list, jobs: list[str]) -> float:
    """The largest compute (s) one job gained between two successive samples: about the
    longest engine step or operation, the grain at which the jobs take turns."""
    kept = [s for _, s in samples if all(j in s for j in jobs)]
    return max((b[j][3] - a[j][3] for a, b in itertools.pairwise(kept) for j in jobs), default=0) / 1e3


def chat_round(client: Any, n: int, adapters: list[str], max_tokens: int, going: Any = lambda: True,
               deadline_s: float = 600.0) -> list[dict[str, Any]]:
    """``n`` sequential chat completions, seeded by their index, alternating ``base`` and the
    ``adapters`` in turn; stops early when ``going()`` turns false, when an adapter is no
    longer listed (its job has ended), or after ``deadline_s``."""
    import openai

    out, end = [], time.monotonic() + deadline_s
    for i in range(n):
        if not going() or time.monotonic() > end:
            break
        model = "base" if i % 2 == 0 or not adapters else adapters[(i // 2) % len(adapters)]
        if model != "base" and model not in {m.id for m in client.models.list().data}:
            break
        t = time.perf_counter()
        try:
            r = client.chat.completions.create(model=model, max_tokens=max_tokens, seed=i, messages=[
                {"role": "user", "content": PROMPTS[i % len(PROMPTS)]}])
            ok, err, tokens = True, "", r.usage.completion_tokens
        except openai.OpenAIError as e:
            ok, err, tokens = False, f"{type(e).__name__}: {e}"[:300], 0
        out.append({"i": i, "model": "base" if model == "base" else "adapter", "latency_s": time.perf_counter() - t,
                    "ok": ok, "error": err, "completion_tokens": tokens, "during": going()})
    return out


def job_sets(args: Args, name: str, out: Path, priority: float | None) -> list[str]:
    """``--set`` flags of the small default job (one env runner, in one process, evaluations
    before and after only)."""
    sets = {"name": name, "model.base": args.model, "runtime.backend": "local", "runtime.env_runners": 1,
            "train.steps": args.steps, "train.groups_per_step": args.groups_per_step, "train.checkpoint_every": 0,
            "eval.every": 0, "eval.hands_per_stratum": 2, "eval.final_hands_per_stratum": 2,
            "eval.head_to_head_per_stratum": 0, "eval.exact": "false", "eval.ratings": "false", "out_dir": str(out)}
    if priority is not None:
        sets["runtime.priority"] = priority
    return [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]


# ------------------------------------------------------------------------------ phases

def backlogged(load: Load, args: Args, info: ServiceInfo, owner: SyncClient, prios: list[float],
               t0: float) -> dict[str, Any]:
    """Phase 1: two jobs that always have work waiting for ``args.synthetic_s`` seconds; their
    counters as read just before the loads stop, shares and rows served. At the end the loads'
    requests still in flight are cancelled (their rows leave at the next engine step) and the
    jobs closed."""
    opened = {p: owner.request(OpenJob(name=f"{load.name}_p{p:g}", priority=p)) for p in prios}
    clients = {p: SyncClient(info.endpoint, f"{load.name}{p:g}", credentials=Credentials(o.job, o.secret))
               for p, o in opened.items()}
    for p, c in clients.items():
        c.request(CreateAdapter(name="main", spec=LoraSpec(seed=int(p))), 120)
    params = SamplingParams(max_tokens=load.max_tokens, seed=1)
    rows_done = dict.fromkeys(prios, 0)
    failed: list[BaseException] = []
    sampler = JobSampler(info, t0, args.poll_s)
    start = time.perf_counter()
    deadline = start + args.synthetic_s

    def keep_busy(p: float) -> None:
        c, rng = clients[p], np.random.default_rng(int(p))

        def request() -> int:  # distinct prompts: no row reuses another's prefix
            prompts = [rng.integers(100, 20_000, load.prompt_tokens).astype(np.int32) for _ in range(load.rows)]
            return c.submit(SampleRequest(adapter="main", prompts=prompts, params=params))

        pending = [request() for _ in range(load.in_flight)]
        try:
            for _ in range(100_000):
                c.result(pending[0], max(0.01, deadline - time.perf_counter()))
                pending.pop(0)
                rows_done[p] += load.rows
                pending.append(request())
        except TimeoutError:  # the deadline: this request is cancelled on the scheduler, and so are the rest
            pending.pop(0)
        except BaseException as e:  # noqa: BLE001 - raised on the main thread
            failed.append(e)
        for rid in pending:
            try:
                c.result(rid, 0.001)
            except (TimeoutError, RemoteError):
                pass

    threads = [threading.Thread(target=keep_busy, args=(p,), daemon=True) for p in prios]
    for t in threads:
        t.start()
    time.sleep(max(0.0, deadline - 1.0 - time.perf_counter()))
    with SyncClient(info.endpoint, "bench-last", credentials=info.credentials()) as c:
        sampler.read(c)  # both still have work: the counters the claim is about
    end = time.perf_counter() - t0
    for t in threads:
        t.join(120)
    sampler.stop()
    for c in clients.values():
        c.close()
    jobs = [opened[p].job for p in prios]
    for j in jobs:
        owner.request(CloseJob(job=j), 120)
    if failed:
        raise failed[0]
    prio = dict(zip(jobs, prios))
    last = next(s for tt, s in reversed(sampler.samples) if tt <= end)
    begin = start - t0
    return {"load": asdict(load), "jobs": jobs, "names": {j: last[j][0] for j in jobs},
            "whole": shares({j: (last[j][3], last[j][4]) for j in jobs}, prio),
            "steady": shares(delta(sampler.samples, jobs, begin + (end - begin) / 3, end), prio),
            "rows_served": {opened[p].job: rows_done[p] for p in prios}, "window_s": [begin, end],
            "largest_jump_s": largest_jump([s for s in sampler.samples if s[0] <= end], jobs),
            "series": series([s for s in sampler.samples if s[0] <= end], jobs), "samples": len(sampler.samples)}


def rl_together(args: Args, info: ServiceInfo, file: Path, prios: list[float], out: Path, t0: float,
                client: Any) -> dict[str, Any]:
    """Phase 3: the two RL jobs at once on the service, the endpoint asked while both train."""
    sampler = JobSampler(info, t0, args.poll_s)
    names = {p: f"rl_p{p:g}" for p in prios}
    logs = {p: (out / f"{names[p]}.log").open("w") for p in prios}
    start = time.perf_counter()
    procs = {p: subprocess.Popen(opentinker("run", "default", "--scheduler", str(file),
                                            *job_sets(args, names[p], out / "runs", p)),
                                 stdout=logs[p], stderr=subprocess.STDOUT, text=True) for p in prios}
    walls: dict[float, float] = {}

    def watch(p: float) -> None:
        procs[p].wait()
        walls[p] = time.perf_counter() - start

    watchers = [threading.Thread(target=watch, args=(p,), daemon=True) for p in prios]
    for w in watchers:
        w.start()

    def going() -> bool:  # both processes alive and both jobs still open on the service
        listed = {s[0]: s[2] for s in sampler.latest().values()}
        return not walls and all(listed.get(names[p]) == "running" for p in prios)

    try:
        adapters: list[str] = []
        for _ in range(int(args.job_timeout_s / 0.5)):  # until both jobs' adapters exist
            live = {s[0]: job for job, s in sampler.latest().items() if s[2] == "running"}
            listed = {m.id for m in client.models.list().data}
            adapters = [f"{live[names[p]]}/main" for p in prios if names[p] in live]
            if (len(adapters) == len(prios) and set(adapters) <= listed) or walls:
                break
            time.sleep(0.5)
        serve_from = time.perf_counter() - t0
        served = chat_round(client, args.requests, adapters, args.chat_max_tokens, going, args.job_timeout_s)
        serve_to = time.perf_counter() - t0
        for w in watchers:
            w.join(max(1.0, args.job_timeout_s - (time.perf_counter() - start)))
        for p, pr in procs.items():
            if pr.poll() is None or pr.returncode != 0:
                raise RuntimeError(f"{names[p]} exited {pr.poll()}; its output: {out / f'{names[p]}.log'}")
    finally:
        for pr in procs.values():
            if pr.poll() is None:
                pr.kill()
        for f in logs.values():
            f.close()
        time.sleep(2 * args.poll_s)  # a sample after both jobs closed
        sampler.stop()
    end = time.perf_counter() - t0
    last = sampler.samples[-1][1]
    by_name = {s[0]: j for j, s in last.items()}
    jobs = [by_name[names[p]] for p in prios]
    prio = dict(zip(jobs, prios))
    return {
        "jobs": jobs, "names": {j: last[j][0] for j in jobs}, "wall_s": {names[p]: walls[p] for p in prios},
        "together_wall_s": max(walls.values()), "adapters": adapters,
        "whole": shares({j: (last[j][3], last[j][4]) for j in jobs}, prio),
        "while_serving": shares(delta(sampler.samples, jobs, serve_from, serve_to), prio),
        "after_serving": shares(delta(sampler.samples, jobs, serve_to, end), prio),
        "serving_window_s": [serve_from, serve_to], "window_s": [start - t0, end],
        "requests": served, "series": series(sampler.samples, jobs), "samples": len(sampler.samples),
        "largest_jump_s": largest_jump(sampler.samples, jobs),
    }


def rl_alone(args: Args, prios: list[float], out: Path) -> dict[str, float]:
    """Phase 4: each RL job alone with its own scheduler, one after the other; wall seconds."""
    walls = {}
    for p in prios:
        name = f"alone_p{p:g}"
        walls[name], _ = run_logged(opentinker("run", "default", *job_sets(args, name, out / "runs", None)),
                                    out / f"{name}.log", name)
    return walls


# ------------------------------------------------------------------------------ report

def pct(x: float | None, digits: int = 1) -> str:
    return "-" if x is None else f"{100 * x:.{digits}f}%"


def in_words(s: dict[str, Any], names: dict[str, str]) -> str:
    return ", ".join(f"{names[j]} {pct(v['share'])} (configured {pct(v['configured'], 0)}, deviation "
                     f"{pct(v['deviation'])})" for j, v in s.items())


def worst(s: dict[str, Any]) -> float | None:
    devs = [v["deviation"] for v in s.values() if v["deviation"] is not None]
    return max(devs) if devs else None


def verdicts(r: dict[str, Any]) -> list[str]:
    """The claim, half by half, in words from the measured figures."""
    lines = []
    for name, b in r["backlogged"].items():
        w, st = worst(b["whole"]), worst(b["steady"])
        lines.append(f"Backlogged loads '{name}' ({b['load']['rows'] * b['load']['in_flight']} rows of "
                     f"{b['load']['prompt_tokens'] + b['load']['max_tokens']} tokens asked per job, "
                     f"{r['args']['synthetic_s']:g} s): contended shares {in_words(b['whole'], b['names'])}: "
                     f"{'within' if w is not None and w <= TOLERANCE else 'NOT within'} {100 * TOLERANCE:.0f}% "
                     f"over the whole time both had work; over its last two thirds the max deviation is {pct(st)} "
                     f"({'within' if st is not None and st <= TOLERANCE else 'NOT within'}). One job's counter rose by "
                     f"up to {b['largest_jump_s']:.1f} s between two samples {r['args']['poll_s']:g} s apart (an "
                     "engine step's compute is charged when the step ends).")
    rl = r["rl"]
    w = worst(rl["whole"])
    frac = ", ".join(f"{rl['names'][j]} {pct(v['contended_ms'] / max(v['compute_ms'], 1), 0)}"
                     for j, v in rl["whole"].items())
    walls = ", ".join(f"{k} {v:.0f} s" for k, v in rl["wall_s"].items())
    lines.append(f"RL jobs: contended shares {in_words(rl['whole'], rl['names'])}: "
                 f"{'within' if w is not None and w <= TOLERANCE else 'not within'} {100 * TOLERANCE:.0f}%. "
                 f"Contended compute of each job's total: {frac}; wall-clock {walls}. RL jobs alternate rollouts "
                 "and learning and are not always backlogged: a job that asks for less than its share gets all it "
                 "asks for, so these counters say what each used while the other also had work, not a share it "
                 "was refused.")
    idle, train, sv = r["serving"]["idle"], r["serving"]["training"], r["serving"]
    n = r["args"]["requests"]
    if idle["failed"] or train["failed"]:
        answered = f"NOT every request was answered: {sorted(set(idle['errors']) | set(train['errors']))}."
    elif train["sent"] < n:
        answered = f"Every request sent was answered, but only {train['sent']} of {n} could be sent while both trained."
    else:
        answered = "Every request was answered."
    lines.append(f"Serving while training: {idle['answered']}/{idle['sent']} answered at idle, "
                 f"{train['answered']}/{train['sent']} while both RL jobs trained ({train['during']} finished with "
                 f"both still training); p50 {idle['p50_s']:.2f} s -> {train['p50_s']:.2f} s "
                 f"({sv['p50_ratio']:.1f}x), p95 {idle['p95_s']:.2f} s -> {train['p95_s']:.2f} s "
                 f"({sv['p95_ratio']:.1f}x). " + answered)
    if r.get("alone"):
        lines.append(f"Wall-clock: both RL jobs at once on the service {rl['together_wall_s']:.0f} s; one after "
                     f"the other, each with its own scheduler, {sum(r['alone'].values()):.0f} s (together / "
                     f"sequential = {r['alone_ratio']:.2f}).")
    return lines


def table(r: dict[str, Any]) -> Table:
    t = Table(title="Shared scheduler: compute per job by priority, and the endpoint while jobs train")
    for col in ("phase", "window", "job", "priority", "compute s", "contended s", "share", "configured", "deviation"):
        t.add_column(col, justify="right")
    phases = [(f"backlogged '{k}'", b) for k, b in r["backlogged"].items()] + [("RL jobs", r["rl"])]
    for phase, b in phases:
        for view in ("whole", "steady", "while_serving", "after_serving"):
            if view not in b or worst(b[view]) is None:
                continue
            for j, v in b[view].items():
                t.add_row(phase, view, b["names"][j], f"{v['priority']:g}", f"{v['compute_ms'] / 1e3:.1f}",
                          f"{v['contended_ms'] / 1e3:.1f}", pct(v["share"]), pct(v["configured"], 0),
                          pct(v["deviation"]))
    for k in ("idle", "training"):
        s = r["serving"][k]
        t.add_row(f"chat at {k}", f"{s['answered']}/{s['sent']} answered", "", "", f"p50 {s['p50_s']:.2f} s",
                  f"p95 {s['p95_s']:.2f} s", "", "", "")
    return t


def plot(r: dict[str, Any], path: Path) -> None:
    """Cumulative compute (solid) and contended compute (dashed) per job over each phase."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    phases = [(f"backlogged '{k}'", b) for k, b in r["backlogged"].items()] + [("RL jobs (+ chat)", r["rl"])]
    fig, axes = plt.subplots(1, len(phases), figsize=(5 * len(phases), 4), squeeze=False)
    for ax, (title, b) in zip(axes[0], phases):
        s = b["series"]
        if not s["t_s"]:
            continue
        t = np.asarray(s["t_s"]) - s["t_s"][0]
        for j in b["jobs"]:
            line, = ax.plot(t, np.asarray(s[j]["compute_ms"]) / 1e3, label=f"{b['names'][j]}")
            ax.plot(t, np.asarray(s[j]["contended_ms"]) / 1e3, "--", color=line.get_color())
        if "serving_window_s" in b:
            a, z = b["serving_window_s"]
            ax.axvspan(a - s["t_s"][0], z - s["t_s"][0], alpha=0.15, color="grey", label="chat requests")
        ax.set(title=title, xlabel="seconds", ylabel="cumulative compute, s (dashed: contended)")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main() -> None:
    args = parse_args(Args, __doc__, quick=QUICK)[0]
    import openai

    prios = [float(p) for p in args.priorities.split(",")]
    loads = [LOADS[k] for k in args.loads.split(",") if k]
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    result: dict[str, Any] = {"provenance": script_provenance(args), "args": asdict(args),
                              "loads": {ld.name: asdict(ld) for ld in loads}, "tolerance": TOLERANCE}
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "service.json"
        log = (out / "serve.log").open("w")
        serve = subprocess.Popen(opentinker("serve", "--model", args.model, "--port", "0", "--service-file", str(file),
                                            "--max-rows", str(args.max_rows), "--kv-budget-mb", str(args.kv_budget_mb),
                                            "--max-batch-tokens", str(args.max_batch_tokens),
                                            "--fair-anticipate-s", str(args.anticipate_s)),
                                 stdout=log, stderr=subprocess.STDOUT, text=True)
        try:
            for _ in range(600):
                if file.is_file() or serve.poll() is not None:
                    break
                time.sleep(0.5)
            if not file.is_file():
                raise RuntimeError(f"opentinker serve did not start; its output: {out / 'serve.log'}")
            info = ServiceInfo.read(file)
            result["service_start_s"] = time.perf_counter() - t0
            client = openai.OpenAI(base_url=info.http + "/v1", api_key=info.api_key, timeout=300, max_retries=0)
            with SyncClient(info.endpoint, "bench-owner", credentials=info.credentials()) as owner:
                print(f"service up in {result['service_start_s']:.0f} s; chat completions at idle", flush=True)
                chat = owner.request(OpenJob(name="chat_idle"), 60)
                with SyncClient(info.endpoint, "chat-idle", credentials=Credentials(chat.job, chat.secret)) as c:
                    c.request(CreateAdapter(name="main", spec=LoraSpec()), 120)  # the RL policy's rank and alpha
                adapter = [f"{chat.job}/main"]
                warm = chat_round(client, 2, adapter, args.chat_max_tokens)
                idle = chat_round(client, args.requests, adapter, args.chat_max_tokens)
                owner.request(CloseJob(job=chat.job), 60)
                result["backlogged"] = {}
                for load in loads:
                    print(f"backlogged load '{load.name}' for {args.synthetic_s:g} s", flush=True)
                    result["backlogged"][load.name] = backlogged(load, args, info, owner, prios, t0)
            print("two RL jobs on the service, chat completions while they train", flush=True)
            result["rl"] = rl_together(args, info, file, prios, out, t0, client)
            result["service_status"] = status(str(file))
        finally:
            serve.terminate()
            try:
                serve.wait(60)
            except subprocess.TimeoutExpired:
                serve.kill()
            log.close()
    train = result["rl"].pop("requests")
    result["serving"] = {"idle": latency(idle), "training": {**latency(train), "during": sum(r["during"] for r in train)},
                         "warmup_requests": warm, "idle_requests": idle, "training_requests": train}
    for q in ("p50", "p95"):
        a, b = result["serving"]["idle"][f"{q}_s"], result["serving"]["training"][f"{q}_s"]
        result["serving"][f"{q}_ratio"] = b / a if a and b else None
    if not args.no_alone:
        print("each RL job alone with its own scheduler, one after the other", flush=True)
        result["alone"] = rl_alone(args, prios, out)
        result["alone_ratio"] = result["rl"]["together_wall_s"] / sum(result["alone"].values())
    result["verdict"] = verdicts(result)
    result["wall_s"] = time.perf_counter() - t0
    Console(width=140).print(table(result))
    for line in result["verdict"]:
        print(line)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    if args.png:
        plot(result, Path(args.png))
    print(f"wrote {args.json}" + (f" and {args.png}" if args.png else "") + f" in {result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
