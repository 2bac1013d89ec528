"""The service under hostile load (issue #36): what one client's attack costs the others.

Against a real scheduler behind the OpenAI endpoint (uvicorn on 127.0.0.1), in this process as
in ``opentinker serve``:

1. **Baseline.** A small completion (3 tokens), ``--small`` times in a row: its latency.
2. **Huge prompts.** Two ``--prompt_mb`` MB prompts to ``/v1/completions`` at once (one with a
   ``Content-Length``, one chunked), while the small request is sent again and again: the
   status of the huge ones, how long they took to be refused, the small request's latency
   meanwhile, and this process's peak resident memory above its level before. The attack on
   main 49019a2 measured every client waiting 25.2 s and the service growing from 400 to
   3,039 MB with one 20 MB prompt.
3. **A flood.** ``--flood`` parallel requests of ``n = --flood_n`` and ``max_tokens =
   --flood_tokens`` from 127.0.0.2, and, once the first runs, the small request from 127.0.0.1:
   its latency, and the flood's statuses. The attack measured a legitimate request timing out at
   300 s behind sixteen requests of ``n = 128``, ``max_tokens = 256``.
4. **A queued job's process.** One small run submitted to a service's queue: the peak resident
   memory of its ``opentinker run`` process, and the peak of its proportional set size (its
   share of pages shared with other processes, e.g. torch's libraries): what one more job
   process costs the machine, and what the queue charges each (``PROCESS_BYTES``).

    python benchmarks/hostile_load.py --json benchmarks/results/hostile_load.json   # ~2 minutes
"""

from __future__ import annotations

import _machine  # noqa: F401  # isort: skip  (before torch)
import json
import statistics
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx2
from _args import parse_args


@dataclass
class Args:
    model: str = "tiny-random"
    small: int = 20
    """Small requests in the baseline."""
    prompt_mb: int = 20
    flood: int = 16
    flood_n: int = 128
    flood_tokens: int = 256
    no_job: bool = False
    """Skip step 4 (a queued job's process)."""
    quick: bool = False
    json: str = ""


SMALL = {"model": "base", "prompt": "Bet or check?", "max_tokens": 3, "seed": 0}


def rss_mb(pid: str = "self", field: str = "VmRSS") -> float:
    """A process's resident memory (``VmRSS``), its peak (``VmHWM``), or its proportional set
    size (``Pss``: shared pages, e.g. torch's libraries, split among the processes mapping
    them: what one more process costs the machine), MB."""
    if field == "Private":  # private pages only: what the process alone holds (its unique set)
        return rss_mb(pid, "Private_Clean") + rss_mb(pid, "Private_Dirty")
    path = f"/proc/{pid}/smaps_rollup" if field in ("Pss", "Private_Clean", "Private_Dirty") else f"/proc/{pid}/status"
    for line in Path(path).read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return 0.0


def timed(client: httpx2.Client, url: str, body: dict) -> tuple[float, int]:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json=body)
    return time.perf_counter() - t0, r.status_code


def huge_prompts(url: str, mb: int) -> dict:
    """Step 2: two huge prompts at once, small requests meanwhile, peak memory."""
    huge = b'{"model": "base", "max_tokens": 1, "prompt": "' + b"a" * (mb << 20) + b'"}'
    before, peak, done = rss_mb(), [rss_mb()], threading.Event()
    answers: dict[str, tuple[float, int]] = {}

    def watch() -> None:
        while not done.is_set():
            peak.append(rss_mb())
            time.sleep(0.02)

    def send(name: str, content) -> None:
        t0 = time.perf_counter()
        r = httpx2.post(url + "/v1/completions", content=content, timeout=600,
                        headers={"content-type": "application/json"})
        answers[name] = (time.perf_counter() - t0, r.status_code)

    def chunks():
        for i in range(0, len(huge), 1 << 20):
            yield huge[i:i + (1 << 20)]

    threads = [threading.Thread(target=watch)] + [threading.Thread(target=send, args=a)
                                                    for a in (("declared", huge), ("chunked", chunks()))]
    for t in threads:
        t.start()
    small = []
    with httpx2.Client(timeout=600) as c:
        while any(t.is_alive() for t in threads[1:]) or not small:
            small.append(timed(c, url, SMALL)[0])
    done.set()
    for t in threads:
        t.join()
    return {"huge_status": {k: v[1] for k, v in answers.items()}, "huge_s": {k: v[0] for k, v in answers.items()},
            "small_during_s_max": max(small), "small_during_s_median": statistics.median(small),
            "small_during_n": len(small), "rss_before_mb": before, "rss_peak_growth_mb": max(peak) - before}


def flood(url: str, admission, n_requests: int, n: int, tokens: int) -> dict:
    """Step 3: the flood from 127.0.0.2, the small request from 127.0.0.1 once it runs."""
    flooder = httpx2.Client(transport=httpx2.HTTPTransport(local_address="127.0.0.2"), timeout=1200)
    body = {"model": "base", "prompt": "Bet", "n": n, "max_tokens": tokens, "seed": 1}
    results: list[tuple[float, int]] = []
    t0 = time.perf_counter()

    def attack() -> None:
        results.append((*timed(flooder, url, body),))

    threads = [threading.Thread(target=attack) for _ in range(n_requests)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 120
    while admission.running.rows < min(n, 128) and time.monotonic() < deadline:
        time.sleep(0.01)
    with httpx2.Client(timeout=1200) as c:
        small_s, small_status = timed(c, url, SMALL)
    for t in threads:
        t.join()
    flooder.close()
    statuses = [s for _, s in results]
    return {"small_during_flood_s": small_s, "small_status": small_status, "flood_s": time.perf_counter() - t0,
            "flood_200": statuses.count(200), "flood_429": statuses.count(429),
            "flood_served_s_max": max((s for s, code in results if code == 200), default=0.0)}


def job_process(model_path: str) -> dict:
    """Step 4: a small run in a service's queue; the peak resident memory of its process."""
    from opentinker.bus import SyncClient
    from opentinker.overrides import parse_overrides
    from opentinker.config import load_config, to_toml
    from opentinker.serve.service import Service
    from protocols.messages import ListQueue, SubmitJob

    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "service.json"
        service = Service(model_path, http_port=None, service_file=file, budget_mb=2000)
        info = service.start()
        sets = {"model.base": model_path, "model.threads": 1, "runtime.backend": "local", "runtime.env_runners": 1,
                "train.steps": 2, "train.groups_per_step": 2, "eval.every": 0, "sampling.max_tokens": 3,
                "out_dir": "runs"}
        toml = to_toml(load_config(None, parse_overrides([f"{k}={v}" for k, v in sets.items()]))).decode()
        peak = {"VmHWM": 0.0, "Pss": 0.0, "Private": 0.0}
        try:
            with SyncClient(info.endpoint, "bench", credentials=info.credentials()) as c:
                c.request(SubmitJob(config=toml), 120)
                deadline = time.monotonic() + 600
                while time.monotonic() < deadline:
                    for proc in Path(tmp).glob("jobs-*/q*/proc.json"):
                        for field, seen in list(peak.items()):
                            try:
                                peak[field] = max(seen, rss_mb(str(json.loads(proc.read_text())["pid"]), field))
                            except OSError:
                                pass
                    if all(e.state not in ("queued", "starting", "running") for e in c.request(ListQueue(), 60).entries):
                        break
                    time.sleep(0.1)
        finally:
            service.stop()
    return {"job_process_peak_rss_mb": peak["VmHWM"], "job_process_peak_pss_mb": peak["Pss"],
            "job_process_peak_private_mb": peak["Private"]}


def main() -> None:
    args, _ = parse_args(Args, __doc__, quick={"small": 5, "prompt_mb": 10, "flood": 4, "flood_n": 16,
                                                "flood_tokens": 16, "no_job": True})
    from _machine import script_provenance

    from opentinker.engine.model_specs import resolve_model
    from opentinker.engine.service import SchedulerService
    from opentinker.serve.openai_api import make_app, start_http

    model_path = resolve_model(args.model)
    sched = SchedulerService(model_path, threads=1)
    sched.start()
    app = make_app(sched.endpoint, model_path, timeout_s=1200)
    server = start_http(app)
    try:
        with httpx2.Client(timeout=600) as c:
            timed(c, server.url, SMALL)  # warm
            base = [timed(c, server.url, SMALL)[0] for _ in range(args.small)]
        out = {"small_baseline_s_median": statistics.median(base), "small_baseline_s_max": max(base)}
        out.update(huge_prompts(server.url, args.prompt_mb))
        out.update(flood(server.url, app.state.admission, args.flood, args.flood_n, args.flood_tokens))
    finally:
        server.stop()
        sched.stop()
    if not args.no_job:
        out.update(job_process(model_path))
    out["attack_before"] = {"huge_prompt_wait_s": 25.2, "rss_mb": [400, 3039], "flood_small_request": "timed out at 300 s",
                            "job_process_mb": 165}
    for k, v in out.items():
        print(f"{k:>28}: {v:.3f}" if isinstance(v, float) else f"{k:>28}: {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": script_provenance(args, threads=1), "args": asdict(args), **out}, f, indent=1)


if __name__ == "__main__":
    main()
