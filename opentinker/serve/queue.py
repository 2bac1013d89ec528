"""The job queue of a service: jobs submitted to ``opentinker serve``, run in turn within its
memory budget.

``opentinker jobs submit CONFIG`` sends the resolved job config (``SubmitJob``); the service
checks it as ``opentinker run`` would, estimates what the job holds on the scheduler
(:func:`estimate_bytes`), and refuses a job that could never fit the budget with the numbers.
Otherwise the job waits in the queue (first come, first served) until the jobs running leave
room, then runs as ``opentinker run CONFIG --scheduler SERVICE_FILE`` in its own process, a
tenant of the scheduler opened for it (its credentials handed over in the environment). A job
that ends, fails or is cancelled is closed on the scheduler (its adapters freed) and the next
one starts: nothing a job does blocks the queue.

An evaluation (``opentinker jobs submit --eval PATH``, an :class:`~protocols.messages.EvalJob`)
queues the same way and runs as ``opentinker eval PATH --scheduler SERVICE_FILE --json
REPORT``; its memory is estimated from the job its evaluation plays (:func:`eval_config`), and
it may write only in its own folder of the queue (where it stages the adapters it loads).
Batch inference (``opentinker jobs submit --infer PROMPTS``, an
:class:`~protocols.messages.InferJob`) runs as ``opentinker infer PROMPTS --out REPLIES
--model SERVICE_MODEL --scheduler SERVICE_FILE`` the same way, its replies in its folder; its
memory is its adapter's weights and the KV cache of one batch (:func:`infer_config`).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opentinker.control.attach import JOB_ENV
from opentinker.files import root_holding
from opentinker.logs import escape_controls
from opentinker.serve import job_procs
from protocols.messages import EvalJob, InferJob, QueueEntry

log = logging.getLogger(__name__)

"""``<job id>:<secret>`` of the tenant a queued job runs as (set by the queue for its process)."""
FLOAT_BYTES = 4
ADAM_COPIES = 4
"""A trained fp32 tensor's bytes, times: the weights, the gradient and AdamW's two moments."""
PROCESS_BYTES = 300 << 20
"""What one process of a job costs the machine beside the scheduler, which the budget did not
count (200 jobs of "1 MB" filled 23 GB): an ``opentinker run`` attached to a service peaked at
309 MB proportional set size (288 MB of its own pages, 394 MB resident) with the tiny model
(``benchmarks/hostile_load.py``; the attack measured 165 MB a process with 200 of them
sharing libraries)."""
MAX_MEMORY_MB = 1 << 24
"""The largest ``memory_mb`` a job may declare (16 TB): past any machine, short of overflow."""
RESERVE_FRACTION = 0.05
"""Of the machine's memory, what is left free when jobs start (and at least 256 MB)."""
STARTUP_S = 60.0
"""How long after its start a job is assumed not to hold its memory yet: free memory is
counted less what such jobs will still take."""


def job_processes(cfg: Any) -> int:
    """The processes a run starts: one on the local backend; on Ray, the driver, each env
    runner, a learner per trained policy and the coordinator."""
    if cfg.runtime.backend == "local":
        return 1
    return 2 + cfg.runtime.env_runners + sum(1 for p in cfg.policies if not p.frozen)


def estimate_bytes(cfg: Any, model_config: dict, processes: int | None = None) -> dict[str, int]:
    """What a job holds, from its config and the model's ``config.json``: its own processes
    (``processes``, default :func:`job_processes`, of :data:`PROCESS_BYTES` each) and, on the
    scheduler, each policy's trained tensors with their gradients and AdamW moments (LoRA: rank
    x (in + out) per adapted module and layer; ``full``: every weight), its league snapshots
    (weights only), and the KV cache of one step's rows (``groups_per_step x group_size`` rows
    of at most ``sampling.max_tokens`` plus a prompt of ``prompt_tokens``). An estimate: the
    scheduler's own counters say what a running job really holds."""
    h = int(model_config["hidden_size"])
    layers = int(model_config["num_hidden_layers"])
    heads = int(model_config["num_attention_heads"])
    kv = int(model_config.get("num_key_value_heads") or heads) * int(model_config.get("head_dim") or h // heads)
    inter = int(model_config.get("intermediate_size") or 4 * h)
    shapes = {"q_proj": (h, h), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (h, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    total = layers * (2 * h * h + 2 * h * kv + 3 * h * inter) + int(model_config.get("vocab_size", 0)) * h
    n = job_processes(cfg) if processes is None else processes
    out: dict[str, int] = {f"{n} process{'es' if n > 1 else ''}": n * PROCESS_BYTES}
    snapshots = cfg.league.keep if cfg.league.snapshot_every else 0
    for p in cfg.policies:
        if p.kind == "full":
            params = total
        else:
            params = layers * sum(p.lora_rank * sum(shapes.get(m, (h, h))) for m in p.target_modules)
        trained = 0 if p.frozen else ADAM_COPIES - 1
        out[f"policy {p.name}"] = params * FLOAT_BYTES * (1 + trained + snapshots)
    prompt_tokens = 512
    rows = cfg.train.groups_per_step * cfg.train.group_size * max(1, len(cfg.policies))
    out["kv cache"] = rows * (prompt_tokens + cfg.sampling.max_tokens) * layers * 2 * kv * FLOAT_BYTES
    return out


@dataclass
class _Entry:
    id: str
    name: str
    folder: Path
    """Its own folder in the queue's: its config (a run), its log, its report (an evaluation)."""
    priority: float
    need: int
    """Bytes the job is estimated to hold (:func:`estimate_bytes`, or as submitted)."""
    roots: list[str] = field(default_factory=list)
    """Where its adapters may be written (its ``out_dir``) and read (its warm starts too)."""
    read_roots: list[str] = field(default_factory=list)
    state: str = "queued"
    job: str = ""
    """Its tenant id once it runs."""
    submitted_at: float = field(default_factory=time.time)
    started_at: float = 0.0
    ended_at: float = 0.0
    returncode: int | None = None
    proc: subprocess.Popen | None = None
    command: list[str] = field(default_factory=list)
    """The ``opentinker`` command line it runs (less ``--scheduler SERVICE_FILE``)."""
    kind: str = "run"
    output: str = ""
    """Its run folder, or its evaluation's JSON report."""

    @property
    def log(self) -> Path:
        """Its process's output."""
        return self.folder / "job.log"

    def info(self) -> QueueEntry:
        return QueueEntry(id=self.id, name=self.name, state=self.state, priority=self.priority,
                          memory_mb=self.need / 2**20, job=self.job, submitted_at=self.submitted_at,
                          started_at=self.started_at, ended_at=self.ended_at,
                          returncode=-1 if self.returncode is None else self.returncode,
                          log=str(self.log), kind=self.kind, output=self.output)


def _job_name(prefix: str, text: str) -> str:
    """A safe job name: ``prefix`` and ``text`` with what a name may not hold replaced."""
    return prefix + re.sub(r"[^\w.+-]", "_", text)[:100]


def eval_config(spec: EvalJob, model_path: str, out_dir: str) -> Any:
    """The job an evaluation of ``spec.path`` plays (``opentinker eval``'s own, its policies
    frozen), for its memory estimate; ``ValueError`` saying what is wrong with the path or
    the game."""
    from opentinker.control import sources

    try:
        source = sources.read_source(spec.path)
        game, _ = sources.source_game(source, spec.game, spec.path)
        return sources.job_config(source, game, model_path, None, 1, None, out_dir,
                                   policies=[{"name": p, "frozen": True} for p in source.adapters])
    except sources.CliError as e:
        raise ValueError(f"--eval {spec.path}: {e}") from None


def infer_config(spec: InferJob, model_path: str, out_dir: str) -> Any:
    """What an inference holds, as a job config for :func:`estimate_bytes`: its adapter frozen
    (rank and modules from its ``adapter_config.json``) and ``spec.batch`` rows of
    ``spec.max_tokens``; ``ValueError`` naming a path that is not there."""
    import msgspec

    from opentinker.config import JobConfig
    from opentinker.control import sources

    for what, path in (("--infer", spec.prompts), ("--adapter", spec.adapter)):
        if path and not os.path.isabs(path):
            raise ValueError(f"{what} {path}: give an absolute path (on the service's machine)")
    if not os.path.isfile(spec.prompts):
        raise ValueError(f"--infer {spec.prompts}: no such file")
    policy: dict[str, Any] = {"name": "main", "frozen": True}
    if spec.adapter:
        try:
            (folder,) = sources.read_source(spec.adapter).adapters.values()
            lora = json.loads((folder / "adapter_config.json").read_text())
            policy.update(lora_rank=int(lora["r"]), target_modules=list(lora["target_modules"]))
        except (sources.CliError, OSError, ValueError, KeyError, TypeError) as e:
            raise ValueError(f"--adapter {spec.adapter}: {e}") from None
    try:
        return msgspec.convert({"out_dir": out_dir, "model": {"base": model_path}, "policies": [policy],
                                "sampling": {"max_tokens": spec.max_tokens},
                                "train": {"groups_per_step": spec.batch, "group_size": 1}}, JobConfig)
    except msgspec.ValidationError as e:
        raise ValueError(f"--adapter {spec.adapter}: {e}") from None


def check_budget_mb(budget_mb: float) -> None:
    """``ValueError`` unless ``budget_mb`` is 0 (half the machine's memory) or from 1 MB to the
    machine's memory (``nan``, ``-5`` and ``1e-6`` were taken)."""
    total = _total_bytes() / 2**20
    if not (budget_mb == 0 or 1 <= budget_mb <= total):
        raise ValueError(f"--budget-mb must be 0 (half of this machine's memory) or from 1 to {total:.0f} (this "
                         f"machine's memory, MB), got {budget_mb}")


def _total_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def free_bytes() -> int | None:
    """Memory the machine can still give (``MemAvailable``), or None where it is not known."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError):
        pass
    return None


def confine_out_dir(out_dir: str, roots: list[str]) -> str:
    """A queued run's ``out_dir``, resolved: relative to the first of ``roots``, and lying in
    one of them (as an adapter path must lie in its run's folder); ``ValueError`` naming it
    otherwise, before anything is made (a run's ``out_dir=/etc/...`` was made)."""
    real = os.path.realpath(os.path.join(roots[0], os.path.expanduser(out_dir)))
    if root_holding(real, roots) is None:
        raise ValueError(f"out_dir: {out_dir!r} lies outside the folders this service writes runs in "
                         f"({', '.join(roots)}; opentinker serve --out-root DIR adds one)")
    return real


class JobQueue:
    """Jobs submitted to a service, run within ``budget_bytes`` (None: not bounded) and the
    machine's free memory.

    ``open_job(name, roots, read_roots, priority) -> Credentials`` and ``close_job(job)`` open and close
    tenants on the scheduler; ``service_file`` is what the jobs attach to; a run's ``out_dir``
    must lie in ``out_roots``. Every job is started from the queue's one thread
    (:mod:`opentinker.serve.job_procs`: it dies with the service)."""

    def __init__(self, folder: Path, service_file: Path, model_config: dict, budget_bytes: int | None,
                 open_job: Any, close_job: Any, poll_s: float = 0.5, out_roots: list[str] | None = None) -> None:
        if budget_bytes is not None and budget_bytes < 2**20:
            raise ValueError(f"JobQueue: budget_bytes must be at least 1 MB, got {budget_bytes}")
        self.folder, self.service_file = folder, service_file
        self.model_config, self.budget = model_config, budget_bytes
        self.out_roots = [os.path.realpath(r) for r in (out_roots or [str(service_file.parent / "runs")])]
        for root in self.out_roots:
            os.makedirs(root, exist_ok=True)
        self._open, self._close = open_job, close_job
        self.entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._n = 0
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._pumped = threading.Condition()
        self._passes = 0
        job_procs.clean_orphans(folder.parent)
        job_procs.claim(folder)
        self._thread = threading.Thread(target=self._watch, args=(poll_s,), name="job-queue", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------------------- requests

    def submit(self, config_toml: str, priority: float, memory_mb: float = 0.0,
               evaluation: EvalJob | None = None, model_path: str = "",
               inference: InferJob | None = None) -> QueueEntry:
        """Queue a run (``config_toml``), an evaluation (``evaluation``, of adapters made for
        ``model_path``) or an inference (``inference``, on ``model_path``): ``ValueError``
        naming the field for a bad config or path, or the numbers for a job the budget can
        never hold."""
        from opentinker.config import ConfigError, load_config
        from opentinker.control.config_checks import check_config

        if not (0 < priority <= 1e6):
            raise ValueError(f"SubmitJob.priority must be in (0, 1e6], got {priority}")
        if not (memory_mb == 0 or 1 <= memory_mb <= MAX_MEMORY_MB):  # nan, -5, 1e-6 and inf fail
            raise ValueError(f"SubmitJob.memory_mb must be 0 (estimated) or from 1 to {MAX_MEMORY_MB} MB, got "
                             f"{memory_mb}")
        if bool(config_toml) + (evaluation is not None) + (inference is not None) != 1:
            raise ValueError("SubmitJob: give exactly one of config (a run), eval (an evaluation) and infer "
                             "(an inference)")
        import tempfile

        self.folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        folder = Path(tempfile.mkdtemp(prefix=".submitted-", dir=self.folder))
        try:
            if evaluation is not None:
                if not os.path.isabs(evaluation.path):
                    raise ValueError(f"--eval {evaluation.path}: give an absolute path (on the service's machine)")
                cfg = eval_config(evaluation, model_path, str(folder))
            elif inference is not None:
                cfg = infer_config(inference, model_path, str(folder))
            else:
                import msgspec

                from opentinker.config import to_toml

                (folder / "config.toml").write_text(config_toml)
                cfg = load_config(folder / "config.toml")
                cfg = msgspec.structs.replace(cfg, out_dir=confine_out_dir(cfg.out_dir, self.out_roots))
                check_config(cfg)
                if model_path:  # a job runs on the service's model: its config must say so (as run --scheduler)
                    from opentinker.engine.model_specs import resolve_model

                    if os.path.realpath(resolve_model(cfg.model.base)) != os.path.realpath(model_path):
                        raise ConfigError("model.base", f"the service serves {model_path}, this job names "
                                                        f"{cfg.model.base!r}: set model.base to the service's "
                                                        f"(--set model.base={model_path})")
                (folder / "config.toml").write_bytes(to_toml(cfg))  # the out_dir it runs in, resolved
        except (ConfigError, OSError, ValueError) as e:
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(f"bad config: {e}" if config_toml else str(e)) from None
        parts = estimate_bytes(cfg, self.model_config, processes=1 if inference is not None else None)
        # What it declares is a floor, never less than what it costs (200 jobs of 1e-6 MB all ran).
        need = max(int(memory_mb * 2**20), sum(parts.values()))
        if self.budget is not None and need > self.budget:
            detail = ", ".join(f"{k} {v / 2**20:.1f} MB" for k, v in parts.items())
            detail += f"; declared {memory_mb:g} MB" if memory_mb else ""
            shutil.rmtree(folder, ignore_errors=True)
            raise ValueError(f"job {cfg.name!r} needs about {need / 2**20:.1f} MB on the scheduler ({detail}); the "
                             f"service's budget is {self.budget / 2**20:.1f} MB: it can never run here")
        with self._lock:
            self._n += 1
            qid = f"q{self._n}"
        folder = folder.rename(self.folder / qid)
        if evaluation is not None:  # it stages what it loads in its own folder, the one it may write
            report = folder / "eval.json"
            command = ["eval", evaluation.path, "--json", str(report), *(["--vs", evaluation.vs] if evaluation.vs else []),
                       *(["--game", evaluation.game] if evaluation.game else []),
                       *(["--games-per-stratum", str(evaluation.games_per_stratum)]
                         if evaluation.games_per_stratum else [])]
            name = _job_name("eval_", Path(evaluation.path).name)
            entry = _Entry(qid, name, folder, priority, need, roots=[str(folder)], command=command, kind="eval",
                           output=str(report))
        elif inference is not None:  # the service's own model; its adapter staged in its folder
            i, replies = inference, folder / "replies.jsonl"
            command = ["infer", i.prompts, "--out", str(replies), "--model", model_path, "--max-tokens", str(i.max_tokens),
                       "--temperature", repr(i.temperature), "--top-p", repr(i.top_p), "--seed", str(i.seed),
                       "--batch", str(i.batch), *(["--adapter", i.adapter] if i.adapter else [])]
            name = _job_name("infer_", Path(i.prompts).stem)
            entry = _Entry(qid, name, folder, priority, need, roots=[str(folder)], command=command, kind="infer",
                           output=str(replies))
        else:
            os.makedirs(cfg.out_dir, exist_ok=True)
            run_dir = str(cfg.run_dir())  # once: its name holds the time
            entry = _Entry(qid, cfg.name, folder, priority, need, roots=[os.path.abspath(cfg.out_dir)],
                           read_roots=[p.init for p in cfg.policies if p.init],
                           command=["run", str(folder / "config.toml"), "--run-dir", run_dir], output=run_dir)
        with self._lock:
            self.entries[qid] = entry
        self._pump()
        return entry.info()

    def cancel(self, qid: str) -> QueueEntry:
        with self._lock:
            entry = self.entries.get(qid)
            if entry is None:
                raise KeyError(f"no job {qid!r} in the queue")
            if entry.state == "queued":
                entry.state, entry.ended_at = "cancelled", time.time()
                return entry.info()
            proc = entry.proc
        if entry.state == "running" and proc is not None:
            entry.state = "cancelling"
            job_procs.stop_all([proc])  # its process group: what it started goes too
            self._ended(entry, "cancelled")
        return entry.info()

    def listing(self) -> list[QueueEntry]:
        with self._lock:
            return [e.info() for e in self.entries.values()]

    def used(self) -> int:
        """Bytes held for the jobs starting or running."""
        return sum(e.need for e in list(self.entries.values()) if e.state in ("starting", "running", "cancelling"))

    # ------------------------------------------------------------------------------- running

    def _pump(self) -> None:
        """Have the queue's thread start what fits, and wait (a bounded while) until it has
        looked: jobs are started only from that thread (their death signal follows it)."""
        with self._pumped:
            target = self._passes + 1
            self._wake.set()
            self._pumped.wait_for(lambda: self._passes >= target or self._stop.is_set(), timeout=120)

    def _fits(self, entry: _Entry) -> bool:
        """``entry`` fits the budget beside the jobs running, and the machine's free memory,
        less what jobs started within :data:`STARTUP_S` will still take, and a reserve."""
        if self.budget is not None and self.used() + entry.need > self.budget:
            return False
        free = free_bytes()
        if free is None:
            return True
        now = time.time()
        growing = sum(e.need for e in list(self.entries.values())
                      if e.state in ("starting", "running") and now - e.started_at < STARTUP_S)
        reserve = max(256 << 20, int(RESERVE_FRACTION * _total_bytes()))
        return free - growing - reserve >= entry.need

    def _start_fitting(self) -> None:
        """Start queued jobs in order while they fit (the lock is not held while a job is opened
        on the scheduler: the scheduler's loop may be reading the listing)."""
        while not self._stop.is_set():
            with self._lock:
                entry = next((e for e in self.entries.values() if e.state == "queued"), None)
                # First come, first served: a small job does not overtake a large one.
                if entry is None or not self._fits(entry):
                    return
                entry.state, entry.started_at = "starting", time.time()  # counted in used()
            self._start(entry)

    def _start(self, entry: _Entry) -> None:
        try:
            credentials = self._open(entry.name, entry.roots, entry.read_roots, entry.priority)
            job = credentials.user
        except Exception as e:  # noqa: BLE001 - the entry fails, the queue goes on
            log.warning("job %s could not be opened on the scheduler: %s", entry.id, e)
            entry.state, entry.ended_at = "failed", time.time()
            return
        from opentinker.bus.auth import SECRET_ENV, USER_ENV

        # The job's own components get a run secret of their own, never the service owner's.
        env = {k: v for k, v in os.environ.items() if k not in (SECRET_ENV, USER_ENV)}
        env[JOB_ENV] = json.dumps(list(credentials.pair()))
        env["TMPDIR"] = str(entry.folder)  # an evaluation's staged adapters: inside its roots
        entry.proc = job_procs.start([sys.executable, "-m", "opentinker.cli", *entry.command, "--scheduler",
                                      str(self.service_file)], entry.folder, entry.log, env)
        entry.job, entry.state, entry.started_at = job, "running", time.time()
        log.info("queue: started %s (%s) as job %s, pid %d", entry.id, entry.name, job, entry.proc.pid)

    def _ended(self, entry: _Entry, state: str) -> None:
        entry.returncode = entry.proc.returncode if entry.proc is not None else None
        entry.state, entry.ended_at = state, time.time()
        try:
            self._close(entry.job)  # its adapters freed, if the job did not close itself
        except Exception as e:  # noqa: BLE001 - already closed
            log.debug("close %s: %s", entry.job, e)
        self._wake.set()

    def _watch(self, poll_s: float) -> None:
        """The queue's thread: notes jobs that ended, starts what fits."""
        while not self._stop.is_set():
            self._wake.wait(poll_s)
            self._wake.clear()
            for entry in list(self.entries.values()):
                if entry.state == "running" and entry.proc is not None and entry.proc.poll() is not None:
                    self._ended(entry, "done" if entry.proc.returncode == 0 else "failed")
            try:
                self._start_fitting()
            except Exception as e:  # noqa: BLE001 - e.g. a full disk starting one: the queue goes on
                log.warning("queue: %s", escape_controls(str(e)))
            with self._pumped:
                self._passes += 1
                self._pumped.notify_all()

    def stop(self) -> None:
        """Stop every running job at once (their process groups: SIGTERM, then SIGKILL after
        :data:`~opentinker.serve.job_procs.GRACE_S`), then the queue's thread."""
        self._stop.set()
        self._wake.set()
        self._thread.join(60)
        running = [e for e in list(self.entries.values()) if e.state in ("running", "cancelling") and e.proc]
        job_procs.stop_all([e.proc for e in running if e.proc is not None])
        for entry in running:
            self._ended(entry, "cancelled")


def read_model_config(model_path: str) -> dict:
    return json.loads((Path(model_path) / "config.json").read_text())
