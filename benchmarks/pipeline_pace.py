"""Pace of a training step through the pipeline (Ray actors and the ZeroMQ bus; the same
components in one process over the bus) against a single-process loop that calls the model
host directly (no bus, no actors, no threads), in one run on one machine.

All three play the same episodes (the job's ``train_episodes``), with the same game code
(``play_episode``), the same batching of decisions, the same learner functions and the same
model host; the ratio is the price of the runtime.

Where a step's time goes (per backend, the median over the measured steps):

* ``rollout_s``: playing the step's episodes; on the bus backends the coordinator's own
  ``timing_s/rollout`` (from handing out the episodes until every runner has answered).
* ``learn_s``: training on them; the coordinator's ``timing_s/learn`` (the learners' steps,
  from the end of the rollout until every learner has answered). In the single-process loop:
  assembling the batch, one forward-backward and one optimizer step.
* ``compute_s``: time the model host spent computing in the step, the scheduler's
  ``perf/compute_s/{SampleRequest,ForwardBackward,OptimStep}`` summed (the compute thread's
  time inside those operations). In the single-process loop: the time inside the same three
  calls of the host, timed around them.
* ``comm_s`` = the step's wall time (``median_s``, measured by the driver around the call)
  minus ``compute_s``: everything that is not model compute. On the bus backends that is
  transport, encoding, queueing and batching waits, the driver's call of the coordinator
  (a Ray call on ``ray``), thread hand-offs -- and the game code, rendering and advantage
  assembly, which the single-process loop pays too. The single-process loop has no transport,
  so its ``comm_s`` is that in-process floor (near 0 on a real model, where compute
  dominates); ``comm_s`` minus the single loop's is the runtime's own cost.
* ``eval_s``: one evaluation after the measured steps, of the policy against the random
  opponent, ``--eval_hands_per_stratum`` hands per stratum (``strata_episodes``); on the bus
  backends the coordinator's ``timing_s/eval``, in the single-process loop the same episodes
  played by its loop. Not part of the steps above; ``--eval_hands_per_stratum 0``: none.

CPU seconds: for every process of the job -- this driver, and on ``ray`` each actor
(scheduler, env runners, learners, coordinator) and Ray's own processes (gcs_server, raylet,
idle workers, agents), found as descendants of this process with psutil -- ``cpu_s`` is the
user+system CPU time it used over the step (read just before and just after the driver's call).
A process that holds several components (all of them on ``local``) is one kind named after
all its roles. ``cpu_s[kind]`` is the median over steps of that kind's processes' sum;
``cpu_total_s`` the median of the total; ``cpu_util`` the median of total / (wall x cores).

    python benchmarks/pipeline_pace.py --model smollm2-135m --steps 4 --json pace.json
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import psutil
from rich.console import Console
from rich.table import Table

from _args import parse_args
from _jobs import COMPUTE_OPS
from _machine import machine, script_provenance
from learners import assemble, loss_token_count
from opentinker.config import JobConfig, load_config
from opentinker.control.coordinator import EVAL_STEP_BASE
from opentinker.control.runtime import Job
from opentinker.engine.host import ModelHost
from opentinker.engine.model_specs import resolve_model
from opentinker.rollout.episodes import play_episode, strata_episodes, train_episodes
from opentinker.rollout.render import ChatTokenizer
from protocols.messages import (
    AdamParams, EpisodeSpec, EpisodeSummary, PolicyKind, PolicyRef, RunEpisodes, SampleResult, SamplingParams,
    Trajectory,
)

NAMES = {"single": "single-process loop (baseline)", "local": "components over the bus, one process",
         "ray": "Ray actors over the bus"}


@dataclass
class Args:
    model: str = "smollm2-135m"
    steps: int = 4
    warmup: int = 1
    groups: int = 16
    group_size: int = 4
    backends: str = "single,local,ray"
    device: str = "cpu"
    eval_hands_per_stratum: int = 2
    lr: float = 1e-12
    """The policy's learning rate: tiny by default, so every step on every backend plays the same
    episodes with the same policy. With the job's own rate each backend's policy drifts its own
    way (rows share engine steps by arrival, so float rounding differs between backends), its
    hands get longer or shorter, and the work per step changes, not the runtime's price: over 8
    steps with lr 3e-4 the Ray run's steps 5-9 computed 1.25-1.3x the single loop's."""
    json: str = ""


def parse() -> Args:
    return parse_args(Args, __doc__)[0]


def job_config(args: Args, backend: str) -> JobConfig:
    """The default job (``opentinker/configs/default.toml``: its policy, opponents, sampling
    and algorithm) with this run's model, device, backend and step size."""
    return load_config("default", {
        "model": {"base": args.model, "device": args.device},
        "runtime": {"backend": "local" if backend == "single" else backend},
        "train": {"groups_per_step": args.groups, "group_size": args.group_size, "lr": args.lr},
        # The evaluation timed is games against the random opponent only (no logprobs
        # pass for exploitability), so the single-process loop can play the same one.
        "eval": {"exact": False},
    })


class SingleProcessLoop:
    """The baseline: one process, the model host called directly, decisions of all
    episodes batched together by an in-process queue. Its steps and evaluations return the
    coordinator's metric names (``timing_s/*``, ``perf/compute_s/*``), timed the same way."""

    def __init__(self, cfg: JobConfig, path: str) -> None:
        self.cfg = cfg
        self.host = ModelHost(path, threads=os.cpu_count(), device=cfg.model.device)
        p = cfg.policies[0]
        self.host.create_adapter(p.name, cfg.lora_spec(p.name))
        self.tok = ChatTokenizer(path)
        self.compute_s = dict.fromkeys(COMPUTE_OPS, 0.0)

    def _timed(self, op: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call the host, adding the call's time to ``compute_s[op]`` (the scheduler's
        ``compute_ms/<op>`` counts the same span: the host call alone)."""
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.compute_s[op] += time.perf_counter() - t

    async def _play(self, specs: list[EpisodeSpec], step: int, train: bool) -> list[tuple[EpisodeSummary, list[Trajectory]]]:
        queue: list[tuple[PolicyRef, np.ndarray, SamplingParams, asyncio.Future]] = []

        async def sample(ref: PolicyRef, prompt: np.ndarray, params: SamplingParams) -> SampleResult:
            fut = asyncio.get_running_loop().create_future()
            queue.append((ref, prompt, params, fut))
            return await fut

        s = self.cfg.sampling
        msg = RunEpisodes(
            episodes=specs,
            sampling=SamplingParams(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens),
            system_prompt=self.cfg.system_prompt, learners={"main": ""} if train else {}, step=step,
        )
        games_ = asyncio.gather(*(play_episode(spec, msg, self.tok, sample) for spec in msg.episodes))
        while not games_.done():
            await asyncio.sleep(0)  # let every episode run up to its next decision
            if queue:
                batch, queue[:] = list(queue), []
                adapters = [r.name if r.kind is PolicyKind.ADAPTER else None for r, *_ in batch]
                rows = self._timed("SampleRequest", self.host.sample, adapters, [b[1] for b in batch],
                                   [b[2] for b in batch], [b[2].seed for b in batch])
                for (ref, _, _, fut), row, a in zip(batch, rows, adapters):
                    fut.set_result(SampleResult(tokens=[row.tokens], logprobs=[row.logprobs], stop_reasons=[row.stop_reason],
                                                adapter_version=self.host.version(a), batch_id=0))
        return await games_

    def train_step(self, step: int) -> dict[str, float]:
        self.compute_s = dict.fromkeys(COMPUTE_OPS, 0.0)
        t0 = time.perf_counter()
        results = asyncio.run(self._play(train_episodes(self.cfg, step), step, train=True))
        t1 = time.perf_counter()
        trajectories = [t for _, ts in results for t in ts]
        tc = self.cfg.train
        datums, _, _ = assemble(trajectories, tc.advantage, tc.advantage_config())
        self._timed("ForwardBackward", self.host.forward_backward, "main", datums, tc.loss, tc.loss_config(),
                    float(max(loss_token_count(datums), 1)))
        self._timed("OptimStep", self.host.optim_step, "main", AdamParams(lr=tc.lr, grad_clip=tc.grad_clip))
        t2 = time.perf_counter()
        return {"timing_s/rollout": t1 - t0, "timing_s/learn": t2 - t1,
                **{f"perf/compute_s/{k}": v for k, v in self.compute_s.items()}}

    def evaluate(self, step: int, hands_per_stratum: int) -> dict[str, float]:
        """The coordinator's evaluation against the random opponent: the same episodes
        (ids included), played by this loop."""
        t0 = time.perf_counter()
        specs = strata_episodes(self.cfg, "main", PolicyRef(kind=PolicyKind.SCRIPTED, name="random"),
                                hands_per_stratum, EVAL_STEP_BASE + step * 1_000_000)
        asyncio.run(self._play(specs, step, train=False))
        return {"timing_s/eval": time.perf_counter() - t0}


# ------------------------------------------------------------------------------ CPU seconds

def _role(component: str) -> str:
    """A component's kind: ``env_runner1`` -> ``env_runner``, ``learner_main`` -> ``learner``."""
    if component.startswith("env_runner"):
        return "env_runner"
    return "learner" if component.startswith("learner_") else component


def _ray_kind(p: psutil.Process) -> str:
    """The kind of a process of Ray's own (or ``other:<name>``)."""
    try:
        name, cmd = p.name(), " ".join(p.cmdline())
    except psutil.Error:
        return "gone"
    if name in ("gcs_server", "raylet"):
        return name
    # (agents run under a process title, ``ray::DashboardAgent``; older Rays show a script)
    for marker, kind in (("DashboardAgent", "dashboard_agent"), ("dashboard/agent.py", "dashboard_agent"),
                         ("RuntimeEnvAgent", "runtime_env_agent"), ("runtime_env/agent", "runtime_env_agent"),
                         ("dashboard/dashboard.py", "dashboard"), ("log_monitor.py", "log_monitor"),
                         ("autoscaler/_private/monitor.py", "monitor")):
        if marker in cmd:
            return kind
    if cmd.startswith("ray::") or name.startswith("ray::") or "default_worker.py" in cmd:
        return "ray_worker"  # ray::IDLE: pre-started workers (the actors are named by their role)
    return f"other:{name}"


class CpuMeter:
    """User+system CPU seconds of the job's processes: this one and its descendants (on Ray,
    the actors and Ray's daemons), each named by its kind."""

    def __init__(self, roles: dict[int, list[str]]) -> None:
        # pid -> kind for the processes holding components: their roles, in order, joined
        self.kinds = {pid: "+".join(dict.fromkeys(rs)) for pid, rs in roles.items()}
        self.me = psutil.Process()

    def snapshot(self) -> dict[tuple[int, float], tuple[str, float]]:
        """(pid, create time) -> (kind, CPU seconds so far); the create time tells a reused pid."""
        out = {}
        procs = {self.me.pid: self.me, **{p.pid: p for p in self.me.children(recursive=True)}}
        for pid in self.kinds.keys() - procs.keys():  # a component outside this tree (not expected)
            try:
                procs[pid] = psutil.Process(pid)
            except psutil.Error:
                pass
        for pid, p in procs.items():
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    out[pid, p.create_time()] = (self.kinds.get(pid) or _ray_kind(p), t.user + t.system)
            except psutil.Error:  # ended meanwhile
                continue
        return out

    @staticmethod
    def delta(before: dict, after: dict) -> tuple[dict[str, float], dict[str, int]]:
        """Per kind: CPU seconds used between two snapshots (a process born in between counts
        from its start; one that ended in between is lost), and the number of processes."""
        cpu: dict[str, float] = {}
        count: dict[str, int] = {}
        for key, (kind, s) in after.items():
            cpu[kind] = cpu.get(kind, 0.0) + s - before.get(key, (kind, 0.0))[1]
            count[kind] = count.get(kind, 0) + 1
        return cpu, count


# ------------------------------------------------------------------------------ the run

def measure(backend: str, args: Args, path: str) -> dict[str, Any]:
    """Warm-up and measured steps, then one evaluation, on one backend; the per-step records
    summarised (medians) as ``results[backend]``."""
    cfg = job_config(args, backend)
    last = args.warmup + args.steps
    job: Job | None = None
    if backend == "single":
        loop = SingleProcessLoop(cfg, path)
        step_fn: Callable[[int], dict[str, float]] = loop.train_step
        eval_fn: Callable[[], dict[str, float]] = lambda: loop.evaluate(last, args.eval_hands_per_stratum)  # noqa: E731
        roles = {os.getpid(): ["driver", "model_host"]}
    else:
        job = Job(cfg, path)
        step_fn = lambda s: job.coordinator("train_step", s)  # noqa: E731
        eval_fn = lambda: job.coordinator("evaluate", last, False, args.eval_hands_per_stratum)  # noqa: E731
        roles = {os.getpid(): ["driver"]}
        for name, info in job.info().items():  # Component.info() carries each component's pid
            roles.setdefault(info["pid"], []).append(_role(name))
    meter = CpuMeter(roles)
    steps: list[dict[str, Any]] = []
    counts: dict[str, int] = {}
    try:
        for step in range(1, last + 1):
            before = meter.snapshot()
            t = time.perf_counter()
            m = step_fn(step)
            wall = time.perf_counter() - t
            cpu, counts = meter.delta(before, meter.snapshot())
            if step <= args.warmup:
                continue
            compute = sum(m.get(f"perf/compute_s/{k}", 0.0) for k in COMPUTE_OPS)
            steps.append({
                "wall_s": wall, "rollout_s": m["timing_s/rollout"], "learn_s": m["timing_s/learn"],
                "sample_compute_s": m.get("perf/compute_s/SampleRequest", 0.0),
                "train_compute_s": compute - m.get("perf/compute_s/SampleRequest", 0.0),
                "compute_s": compute, "comm_s": wall - compute,
                # the driver's call and the coordinator's bookkeeping around the two phases
                "call_s": wall - m["timing_s/rollout"] - m["timing_s/learn"],
                "cpu_s": cpu, "cpu_total_s": sum(cpu.values()),
                "cpu_util": sum(cpu.values()) / (wall * (os.cpu_count() or 1)),
            })
        eval_s = eval_fn()["timing_s/eval"] if args.eval_hands_per_stratum > 0 else None
    finally:
        if job is not None:
            job.shutdown()
    med = lambda k: statistics.median(s[k] for s in steps)  # noqa: E731
    walls = [s["wall_s"] for s in steps]
    return {
        "median_s": statistics.median(walls), "min_s": min(walls), "max_s": max(walls), "steps": len(steps),
        **{k: med(k) for k in ("rollout_s", "learn_s", "sample_compute_s", "train_compute_s", "compute_s", "comm_s",
                               "call_s", "cpu_total_s", "cpu_util")},
        "eval_s": eval_s, "eval_hands_per_stratum": args.eval_hands_per_stratum,
        "cpu_s": {k: statistics.median(s["cpu_s"].get(k, 0.0) for s in steps) for k in counts},
        "processes": counts,
        "per_step": steps,
    }


def tables(args: Args, results: dict[str, dict[str, Any]]) -> tuple[Table, Table]:
    pace = Table(title=f"seconds per training step ({args.groups}x{args.group_size} hands, {args.model}; "
                       f"median of {args.steps})",
                 caption="; ".join(f"{k}: {NAMES[k]}" for k in results) + ". comm = median - compute")
    for col in ("runtime", "median", "min", "max", "rollout", "learn", "compute", "comm", "eval", "vs single-process"):
        pace.add_column(col, justify="right")
    for k, r in results.items():
        ev = "" if r["eval_s"] is None else f"{r['eval_s']:.2f}"
        pace.add_row(k, *(f"{r[x]:.2f}" for x in ("median_s", "min_s", "max_s", "rollout_s", "learn_s",
                                                          "compute_s", "comm_s")), ev, f"{r['ratio']:.2f}x")
    cpu = Table(title=f"CPU seconds per training step, by process (median; {os.cpu_count()} cores; "
                      "(n): processes of that kind)")
    cpu.add_column("process", justify="left")
    for k in results:
        cpu.add_column(k, justify="right")
    kinds = list(dict.fromkeys(kind for r in results.values() for kind in r["cpu_s"]))
    for kind in kinds:
        cells = []
        for r in results.values():
            n = r["processes"].get(kind, 0)
            cells.append(f"{r['cpu_s'][kind]:.2f}" + (f" ({n})" if n > 1 else "") if kind in r["cpu_s"] else "")
        cpu.add_row(kind, *cells)
    cpu.add_row("total", *(f"{r['cpu_total_s']:.2f}" for r in results.values()))
    cpu.add_row("cpu util (total / wall x cores)", *(f"{r['cpu_util']:.0%}" for r in results.values()))
    return pace, cpu


def main() -> None:
    args = parse()
    path = resolve_model(args.model)
    results: dict[str, dict[str, Any]] = {}
    for backend in args.backends.split(","):
        results[backend] = measure(backend, args, path)
        if backend == "ray":
            import ray

            ray.shutdown()
    base = results.get("single", next(iter(results.values())))["median_s"]
    for r in results.values():
        r["ratio"] = r["median_s"] / base
    console = Console(width=max(Console().width, 110))  # not squeezed to 80 columns in a log
    for t in tables(args, results):
        console.print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, os.cpu_count(), args.device), "args": asdict(args), "results": results},
                      f, indent=1)


if __name__ == "__main__":
    main()
