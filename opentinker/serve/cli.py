"""``opentinker serve`` (a shared scheduler with an OpenAI-compatible endpoint),
``opentinker status`` (what a running service holds) and ``opentinker jobs`` (its queue)."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

from opentinker.logs import escape_controls


def add_serve_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m", help="base model spec (default: smollm2-135m)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:<index>")
    p.add_argument("--host", default="127.0.0.1", help="HTTP bind address (anything but loopback needs --api-key-file)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (0: any free port)")
    p.add_argument("--no-http", action="store_true", help="serve the bus only, no HTTP endpoint")
    p.add_argument("--bus-host", default="127.0.0.1", help="where the scheduler's bus binds: an address other machines "
                   "reach puts it on CURVE, and a job there attaches with a copy of the service file (default 127.0.0.1)")
    p.add_argument("--bus-curve", action="store_true", help="the bus on CURVE on loopback too")
    p.add_argument("--api-key-file", metavar="FILE", help="a file of the API keys HTTP clients may send, one per line: each key is a client of "
                   "its own for the per-client bounds (default: a key made at start, in the service file)")
    p.add_argument("--adapter", action="append", default=[], metavar="NAME=PATH",
                   help="load a saved adapter at start, served under NAME (repeatable)")
    p.add_argument("--service-file", metavar="PATH", help="where to write the service file "
                   "(default: $OPENTINKER_HOME/service.json or ~/.opentinker/service.json)")
    p.add_argument("--ray", nargs="?", const="local", default="", metavar="ADDRESS",
                   help="run the scheduler and the job queue in a Ray actor: alone, a Ray instance started here; "
                   "with an ADDRESS (auto, host:port), on that cluster")
    p.add_argument("--max-rows", type=int, default=256, help="rows the engine runs at once (default 256); fewer "
                   "rows make jobs take turns at a finer grain on a CPU")
    p.add_argument("--kv-budget-mb", type=int, default=256, help="memory of the KV cache blocks (default 256)")
    p.add_argument("--fair-window-s", type=float, default=10.0, help="how long compute is remembered when sharing "
                   "it between sampling and training, and how long a job may be away and keep what it "
                   "is owed, at most that many seconds of compute (default 10)")
    p.add_argument("--fair-anticipate-s", type=float, default=0.25, help="how long a job whose work ran out still "
                   "shares compute: the jobs ahead of it wait that long for its next request (default 0.25)")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="tokens one engine step computes at most "
                   "(default 2048); fewer make steps shorter, so jobs take turns at a finer grain on a CPU")
    p.add_argument("--http-priority", type=float, default=1.0, help="the HTTP endpoint's share of compute against "
                   "jobs' runtime.priority (default 1)")
    p.add_argument("--budget-mb", type=float, default=0.0, help="memory the job queue may fill with running jobs "
                   "(default: half of this machine's memory); jobs also start only while free memory holds them")
    p.add_argument("--out-root", action="append", default=[], metavar="DIR", help="a folder queued runs may write "
                   "their out_dir in (repeatable; default: runs/ beside the service file; a relative out_dir lies in "
                   "the first)")


def add_status_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("address", nargs="?", help="the service's bus endpoint or service file (default: the service file "
                   "in $OPENTINKER_HOME or ~/.opentinker)")
    p.add_argument("--json", action="store_true", help="print JSON for scripts")


def serve_main(args: argparse.Namespace) -> int:
    from opentinker.serve.service import Service

    adapters = {}
    for item in args.adapter:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            print(f"opentinker serve: --adapter {escape_controls(item)!r}: expected NAME=PATH", file=sys.stderr)
            return 2
        adapters[name] = path
    api_key, more_keys = None, []
    if args.api_key_file:
        try:
            api_key, *more_keys = [k.strip() for k in Path(args.api_key_file).read_text().splitlines() if k.strip()]
        except (OSError, ValueError) as e:
            print(f"opentinker serve: --api-key-file: {escape_controls(str(e)) or 'empty file'}", file=sys.stderr)
            return 2
    try:
        service = Service(args.model, device=args.device, http_host=args.host,
                          http_port=None if args.no_http else args.port, api_key=api_key, api_keys=more_keys,
                          adapters=adapters,
                          service_file=Path(args.service_file) if args.service_file else None, budget_mb=args.budget_mb,
                          ray=args.ray, fair_window_s=args.fair_window_s,
                          fair_anticipate_s=args.fair_anticipate_s, owner_priority=args.http_priority,
                          bus_host=args.bus_host, bus_curve=args.bus_curve, out_roots=args.out_root,
                          engine_options={"max_rows": args.max_rows, "kv_budget_bytes": args.kv_budget_mb << 20,
                                          "max_batch_tokens": args.max_batch_tokens})
        info = service.start()
    except (ValueError, OSError) as e:
        print(f"opentinker serve: {escape_controls(str(e))}", file=sys.stderr)
        return 2
    print(f"opentinker serve: {info.model_path} on {info.device}\n"
          + (f"  bus:  {info.endpoint}  (CURVE: jobs attach with a copy of the service file, "
             f"opentinker run CONFIG --scheduler SERVICE_FILE)\n" if info.curve_server else
             f"  bus:  {info.endpoint}  (jobs: opentinker run CONFIG --scheduler {info.endpoint})\n")
          + (f"  http: {info.http}/v1  (OpenAI-compatible; model names: opentinker status; its API key is the "
             f"service file's api_key)\n" if info.http else "")
          + f"  service file: {service.service_file}\n  Ctrl-C stops it.", flush=True)
    try:
        service.wait()
    finally:
        service.stop()
    return 0


def status(address: str | None, timeout: float = 30.0, rate_s: float = 1.0) -> dict:
    """What the service at ``address`` holds: jobs, adapters (resident and spilled), the
    engine's queue, tokens per second (over ``rate_s``), memory, and every counter."""
    from opentinker.bus.sync import SyncClient
    from opentinker.control.attach import SERVICE_FILE, find_service, home
    from protocols.messages import ListAdapters, ListJobs, SchedulerStats

    info = find_service(address or str(home() / SERVICE_FILE))
    with SyncClient(info.endpoint, "status", credentials=info.credentials(), connect_timeout=timeout) as c:
        before, t0 = c.request(SchedulerStats(), timeout).counters, time.perf_counter()
        jobs = c.request(ListJobs(), timeout)
        adapters = c.request(ListAdapters(), timeout)
        time.sleep(max(0.0, rate_s - (time.perf_counter() - t0)))
        counters = c.request(SchedulerStats(), timeout).counters
        dt = time.perf_counter() - t0

    def rate(*keys: str) -> float:
        return sum(counters.get(k, 0) - before.get(k, 0) for k in keys) / dt

    mb = 2.0**20
    return {
        "endpoint": info.endpoint, "http": info.http, "model": info.model_path, "device": info.device,
        "pid": info.pid, "up_s": round(time.time() - info.started_at, 1),
        "jobs": [{"job": j.job, "name": j.name, "state": j.state, "priority": j.priority, "adapters": j.adapters,
                  "compute_s": j.compute_ms / 1000, "contended_s": j.contended_ms / 1000} for j in jobs.jobs],
        "adapters": [{"name": a.name, "version": a.version} for a in adapters.adapters],
        "adapters_resident": counters.get("engine/adapters_resident", len(adapters.adapters)),
        "adapters_spilled": counters.get("engine/adapters_spilled", 0),
        "queue_depth": counters.get("engine/queue_depth", 0),
        "tokens_per_s": {"decode": rate("engine/decode_tokens"), "prefill": rate("engine/prefill_tokens"),
                         "over_s": dt},
        "memory_mb": {"weights": counters.get("engine/weights_bytes", 0) / mb,
                      "kv_in_use": counters.get("engine/kv_bytes_in_use", 0) / mb,
                      "kv_total": counters.get("engine/kv_bytes_total", 0) / mb,
                      "adapters_resident": counters.get("engine/adapter_bytes_resident", 0) / mb},
        "counters": counters,
    }


def status_main(args: argparse.Namespace) -> int:
    try:
        report = status(args.address)
    except (ValueError, OSError, TimeoutError) as e:
        print(f"opentinker status: {escape_controls(str(e))}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"service {report['endpoint']}  http {report['http'] or '-'}  pid {report['pid']}  up {report['up_s']:.0f} s")
    print(f"model {report['model']} on {report['device']}")
    print(f"\n{'job':<24} {'state':<8} {'priority':>8} {'compute s':>10} {'contended s':>12}  adapters")
    for j in report["jobs"]:
        print(f"{j['job']:<24} {j['state']:<8} {j['priority']:>8g} {j['compute_s']:>10.1f} {j['contended_s']:>12.1f}  "
              f"{', '.join(j['adapters'])}")
    if not report["jobs"]:
        print("(no jobs)")
    print(f"\nadapters: {', '.join(a['name'] for a in report['adapters']) or '(none)'} "
          f"({report['adapters_resident']} resident, {report['adapters_spilled']} spilled)")
    t, m = report["tokens_per_s"], report["memory_mb"]
    print(f"rows waiting: {report['queue_depth']}   tokens/s: {t['decode']:.0f} decoded, {t['prefill']:.0f} prefilled "
          f"(over {t['over_s']:.1f} s)")
    print(f"memory ({report['device']}): weights {m['weights']:.0f} MB, KV {m['kv_in_use']:.0f} of {m['kv_total']:.0f} MB, "
          f"adapters {m['adapters_resident']:.1f} MB   (every counter: --json)")
    return 0


# ------------------------------------------------------------------------------- jobs


def add_jobs_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="jobs_command", required=True)
    submit = sub.add_parser("submit", help="queue a job on the service (it starts when the memory budget has room)")
    submit.add_argument("config", nargs="?", help="job config TOML, or the name of a bundled job")
    submit.add_argument("--eval", metavar="PATH", help="queue an evaluation (opentinker eval) of a run folder or a "
                        "saved adapter on the service's machine, instead of a run")
    submit.add_argument("--vs", help="with --eval: opponents, comma-separated (default: random and the scripted seats)")
    submit.add_argument("--game", default="", help="with --eval of a saved adapter: its game")
    submit.add_argument("--games-per-stratum", type=int, default=0, metavar="N",
                        help="with --eval: games per (start, seat) for each opponent (default: opentinker eval's)")
    submit.add_argument("--infer", metavar="PROMPTS", help="queue batch inference (opentinker infer) of a JSON Lines "
                        "file of prompts, on the service's machine")
    submit.add_argument("--adapter", default="", metavar="PATH",
                        help="with --infer: a saved adapter or a run folder of one policy (default: the base model)")
    submit.add_argument("--max-tokens", type=int, default=128, help="with --infer: most tokens per reply (default 128)")
    submit.add_argument("--temperature", type=float, default=1.0, help="with --infer: 0 is greedy (default 1)")
    submit.add_argument("--top-p", type=float, default=1.0, help="with --infer: nucleus mass (default 1: off)")
    submit.add_argument("--seed", type=int, default=0, help="with --infer: line i draws with seed + i (default 0)")
    submit.add_argument("--batch", type=int, default=32, help="with --infer: prompts per request (default 32)")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config field")
    submit.add_argument("--priority", type=float, default=1.0, help="the job's share of compute against others")
    submit.add_argument("--memory-mb", type=float, default=0.0, help="what it holds on the scheduler (default: estimated)")
    for name, what in (("list", "queued, running and ended jobs"), ("status", "one job"), ("cancel", "cancel a job")):
        q = sub.add_parser(name, help=what)
        if name != "list":
            q.add_argument("id", help="the job's queue id (q<n>, from submit or list)")
        if name != "cancel":
            q.add_argument("--json", action="store_true", help="print JSON for scripts")
    for q in sub.choices.values():
        q.add_argument("--service", metavar="ADDRESS", help="the service's bus endpoint or service file "
                       "(default: the service file in $OPENTINKER_HOME or ~/.opentinker)")


def _absolute(cfg):
    """``cfg`` with its paths absolute: the service runs the job from another folder. A relative
    ``out_dir`` stays relative: the service puts it in its first ``--out-root``."""
    import msgspec

    def absolute(path: str) -> str:
        return os.path.abspath(os.path.expanduser(path)) if path and ("/" in path or os.path.exists(path)) else path

    policies = [msgspec.structs.replace(p, init=absolute(p.init)) for p in cfg.policies]
    changes = {"out_dir": os.path.expanduser(cfg.out_dir), "policies": policies,
               "model": msgspec.structs.replace(cfg.model, base=absolute(cfg.model.base))}
    oc = cfg.offline_job()
    if oc is not None:
        changes["offline"] = msgspec.structs.replace(oc, data=absolute(oc.data))
    return msgspec.structs.replace(cfg, **changes)


def jobs_main(args: argparse.Namespace) -> int:
    import msgspec

    from opentinker.bus.common import RemoteError
    from opentinker.bus.sync import SyncClient
    from opentinker.control.attach import SERVICE_FILE, find_service, home
    from protocols.messages import CancelQueued, EvalJob, InferJob, ListQueue, SubmitJob

    try:
        msg: object = None
        if args.jobs_command == "submit":
            from opentinker.overrides import parse_overrides
            from opentinker.config import load_config, to_toml

            if args.eval and args.infer:
                raise ValueError("give one of --eval (an evaluation) and --infer (an inference)")
            if args.infer:
                if args.config or args.set:
                    raise ValueError("--infer PROMPTS queues an inference: give no config and no --set")
                try:
                    spec = msgspec.convert({
                        "prompts": os.path.abspath(args.infer), "max_tokens": args.max_tokens,
                        "adapter": os.path.abspath(args.adapter) if args.adapter else "", "temperature": args.temperature,
                        "top_p": args.top_p, "seed": args.seed, "batch": args.batch}, InferJob)
                except msgspec.ValidationError as e:
                    raise ValueError(f"--infer: {e}") from None
                msg = SubmitJob(infer=spec, priority=args.priority, memory_mb=args.memory_mb)
            elif args.eval:
                if args.config or args.set:
                    raise ValueError("--eval PATH queues an evaluation: give no config and no --set")
                msg = SubmitJob(eval=EvalJob(path=os.path.abspath(args.eval), vs=args.vs or "", game=args.game,
                                             games_per_stratum=args.games_per_stratum),
                                priority=args.priority, memory_mb=args.memory_mb)
            else:
                cfg = _absolute(load_config(args.config, parse_overrides(args.set)))
                msg = SubmitJob(config=to_toml(cfg).decode(), priority=args.priority, memory_mb=args.memory_mb)
        elif args.jobs_command == "cancel":
            msg = CancelQueued(id=args.id)
        else:
            msg = ListQueue()
        info = find_service(args.service or str(home() / SERVICE_FILE))
        with SyncClient(info.endpoint, "jobs", credentials=info.credentials(), connect_timeout=30) as c:
            reply = c.request(msg, 600)
    except (ValueError, OSError, TimeoutError, RemoteError) as e:
        text = str(e.error.message) if isinstance(e, RemoteError) else str(e)
        text = re.sub(r"^(ValueError|KeyError|OSError|TypeError): ", "", text)  # the service's reason, not our class
        print(f"opentinker jobs {args.jobs_command}: {escape_controls(text)}", file=sys.stderr)
        return 2
    if args.jobs_command in ("submit", "cancel"):
        print(f"{reply.id} {reply.state} ({escape_controls(reply.name)}, ~{reply.memory_mb:.0f} MB)")
        return 0
    entries = [e for e in reply.entries if args.jobs_command == "list" or e.id == args.id]
    if args.jobs_command == "status" and not entries:
        print(f"opentinker jobs status: no job {escape_controls(args.id)!r} in the queue", file=sys.stderr)
        return 2
    if args.json:
        out = msgspec.to_builtins(entries if args.jobs_command == "list" else entries[0])
        print(json.dumps({"budget_mb": reply.budget_mb, "used_mb": reply.used_mb, "jobs": out}
                         if args.jobs_command == "list" else out, indent=1))
        return 0
    print(f"budget {reply.budget_mb:.0f} MB, {reply.used_mb:.0f} MB held by running jobs")
    print(f"{'id':<6} {'state':<10} {'name':<24} {'job':<20} {'MB':>8} {'priority':>8}  exit")
    for e in entries:
        code = "" if e.returncode < 0 else str(e.returncode)
        print(f"{e.id:<6} {e.state:<10} {escape_controls(e.name):<24} {e.job or '-':<20} {e.memory_mb:>8.0f} "
              f"{e.priority:>8g}  {code}")
    if args.jobs_command == "status":
        what = {"eval": "report", "infer": "replies"}.get(entries[0].kind, "run")
        print(f"log: {entries[0].log}\n{what}: {entries[0].output}")
    return 0
