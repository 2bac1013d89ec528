"""The README's blocks for the systems benchmarks (:mod:`readme` renders them): the pipeline's
pace, threads, LoRA multiplexing, the engine's overhead, rollout, the shared forward, the bus
and the codec."""

from __future__ import annotations

from pathlib import Path

from _readme_common import load, table, x

PACE_BACKENDS = {
    "single": "single-process loop (baseline: host called directly, no bus, no actors)",
    "local": 'the components over the bus in one process (`backend = "local"`)',
    "ray": "Ray actors over the bus (the default)",
}
RAY_COMPONENTS = ("scheduler", "env_runner", "learner", "coordinator")
WORDS = dict(enumerate(("zero", "one", "two", "three", "four", "five", "six", "seven")))


def render_pipeline_pace(results: Path) -> str:
    """Seconds per step and its phases per backend; then the CPU seconds per step."""
    data = load(results, "pipeline_pace")
    res = data["results"]
    phases = ("median_s", "rollout_s", "learn_s", "compute_s", "comm_s", "eval_s")
    steps = table(
        ["runtime", "s/step", "rollout", "learning", "compute", "comm", "eval",
         "vs single-process"],
        [[label, *(f"{res[b][p]:.2f}" for p in phases), x(res[b]["ratio"])]
         for b, label in PACE_BACKENDS.items()])
    single, local, ray = (res[b] for b in PACE_BACKENDS)
    (local_proc,) = local["cpu_s"]
    ray_cpu = ray["cpu_s"]
    daemons = sum(v for k, v in ray_cpu.items() if k not in RAY_COMPONENTS)
    cpu = table(
        ["CPU s per step", "single", "local", "Ray"],
        [["the model (scheduler, or the loop's process)",
          f"{sum(single['cpu_s'].values()):.2f}",
          f"{local['cpu_s'][local_proc]:.2f} (all {WORDS[len(local_proc.split('+'))]} components)",
          f"{ray_cpu['scheduler']:.2f}"],
         [f"env runners ({ray['processes']['env_runner']}) / learner / coordinator", "", "",
          " / ".join(f"{ray_cpu[k]:.2f}" for k in RAY_COMPONENTS[1:])],
         ["Ray's daemons (raylet, gcs_server, log monitor) and the driver", "", "",
          f"{daemons:.2f}"],
         [f"total (share of {data['provenance']['cores']} cores x wall)",
          *(f"{r['cpu_total_s']:.2f} ({r['cpu_util']:.0%})" for r in (single, local, ray))]])
    return steps + "\n" + cpu


THREAD_BUSY = {"idle": "nothing", "python": "one busy Python process",
               "torch": "one 2-thread torch process"}
THREAD_SETTINGS = {"1 thread": "1 thread",
                   "2 threads, libgomp default": "2 threads, libgomp's default",
                   "2 threads, GOMP_SPINCOUNT=1000": "2 threads, `GOMP_SPINCOUNT=1000`"}


def render_threads(results: Path, rows: int = 32) -> str:
    """ms per decode-sized linear (``rows`` rows) per thread setting, beside each load."""
    by = {(r["busy"], r["setting"]): r["ms_per_linear"]
          for r in load(results, "threads")["rows"] if r["rows"] == rows}
    return table(["beside it", *THREAD_SETTINGS.values()],
                 [[label, *(f"{by[busy, s]:.3f} ms" for s in THREAD_SETTINGS)]
                  for busy, label in THREAD_BUSY.items()])


def render_compute_thread(results: Path) -> str:
    """One ``forward_backward``'s median seconds per way of placing the scheduler's threads."""
    rows = load(results, "compute_thread")["rows"]
    return table(["way (fresh process each)", "median s", "vs main thread", "CPU / wall"],
                 [[r["label"], f"{r['median_s']:.2f}", x(r["vs_main"]), f"{r['cpu_per_wall']:.2f}"] for r in rows])


MULTIPLEX_METHODS = {  # method: (label in the first batch's rows, label after)
    "engine": (("the engine (continuous batching, batched LoRA `bgmv` on the slot store, "
                "own forward)"), "the engine"),
    "peft_mixed": ("PEFT's mixed-adapter batch (the path before the engine; baseline)",
                   "PEFT's mixed-adapter batch"),
    "swap": ("one adapter at a time (PEFT)",) * 2,
    "copies": ("K model copies, one adapter each (engine)",) * 2,
}


def render_multiplex(results: Path) -> str:
    """tokens/s per K, ratio to PEFT's mixed batch, peak RSS and memory ratio, per batch."""
    data = load(results, "multiplex")["rows"]
    by = {(r["method"], r["batch"], r["K"]): r for r in data}
    ks = sorted({r["K"] for r in data})
    batches = sorted({r["batch"] for r in data})
    top = ks[-1]
    header = ["method", "batch", f"K={ks[0]} tokens/s", *(f"K={k}" for k in ks[1:]),
              f"vs PEFT mixed at K={top}", f"peak RSS at K={top}",
              "mem ratio at K=" + " / ".join(map(str, ks))]
    rows = []
    for i, batch in enumerate(batches):
        for method, labels in MULTIPLEX_METHODS.items():
            cells = [by[method, batch, k] for k in ks]
            mem = (" / ".join(f"{c['mem_ratio']:.2f}" for c in cells)
                   if "mem_ratio" in cells[0] else "")
            rows.append([labels[min(i, 1)], str(batch),
                         *(f"{c['tokens_per_s']:.1f}" for c in cells),
                         x(cells[-1]["vs_peft_mixed"]),
                         f"{cells[-1]['peak_bytes'] / 2**30:.2f} GiB", mem])
    return table(header, rows)


def render_engine_overhead(results: Path) -> str:
    """Ops and time of one decode step per model, LoRA method, batch and adapter count."""
    data = load(results, "engine_overhead")["rows"]
    header = ["model", "LoRA", "batch", "adapters", "ops dispatched", "ATen ops (composites included)",
              "step ms", "decode tokens/s", "vs `bgmv`"]
    labels = {"slots": "fused ops (now)", "bgmv": "`bgmv` stacks (before; baseline)"}
    rows = [[r["model"], labels.get(r["method"], r["method"]), str(r["batch"]), str(r["adapters"]), str(r["ops"]),
             str(r["aten_ops"]), f"{r['step_ms']:.1f}", f"{r['decode_tokens_per_s']:.0f}",
             x(r.get("speedup_vs_bgmv", 1.0))] for r in data]
    return table(header, rows)


ROLLOUT_JOBS = {
    "default": "default (Kuhn poker, {episodes:.0f} hands, {reply:.0f}-token replies)",
    "negotiation": "negotiation ({episodes:.0f} episodes, ~{turns:.0f} LLM turns)",
}
ROLLOUT_PATHS = {"before": "PEFT (before)", "engine": "engine"}


def render_rollout(results: Path) -> str:
    """Seconds per rollout phase and prompt tokens computed per turn, per job and path."""
    data = load(results, "rollout")["rows"]
    rows = []
    for job, fmt in ROLLOUT_JOBS.items():
        mine = [r for r in data if r["job"] == job]
        steps = mine[0]["steps"]
        label = fmt.format(episodes=mine[0]["episodes"] / steps,
                           reply=mine[0]["reply_tokens_per_turn"],
                           turns=sum(r["llm_turns"] for r in mine) / len(mine) / steps)
        for path, name in ROLLOUT_PATHS.items():
            (r,) = (r for r in mine if r["path"] == path)
            rows.append([label, name, f"{r['s_per_step']:.2f}", x(r["speedup"]),
                         f"{r['prefill_tokens_per_turn']:.1f}",
                         f"{r['new_tokens_per_turn']:.1f}", f"{r['prefill_over_new']:.2f}"])
    return table(["job", "path", "s/step", "speedup", "prompt tokens computed per turn",
                  "new tokens per turn", "computed / new"], rows)


def render_shared_forward(results: Path) -> str:
    """One ``forward_backward`` per batch: the plain padded batch, the three shared levels and
    the prefix tree, on the synthetic batches and a recorded step's (``shared_forward_recorded.json``)."""
    rows = []
    for b in load(results, "shared_forward")["batches"] + load(results, "shared_forward_recorded")["batches"]:
        for m in b["methods"].values():
            rows.append([(f"{b['batch']} ({b['rows']} sequences, {b['tokens']:,} tokens, "
                          f"{b['tree_tokens']:,} distinct prefixes)"), m["label"], f"{m['median_s']:.2f}",
                         f"{m['speedup']:.2f}x"])
    return table(["batch", "method", "median s", "vs plain"], rows)


def render_exploring_replies(results: Path) -> str:
    """An exploring reply scored the old way (a dense ``LogprobsRequest``) against a forced
    engine row, alone and with its turn's rows (``exploring_replies.json``)."""
    r = load(results, "exploring_replies")["result"]
    labels = {"dense": "`LogprobsRequest` of the whole conversation (before)",
              "forced": "forced engine row, alone", "forced_turn": "forced engine rows, a turn's together"}
    rows = [[labels[w], f"{m['total_s']:.2f}", f"{1000 * m['median_per_reply_s']:.0f}", f"{m['tokens_computed']:,}",
             f"{m['speedup']:.2f}x"] for w, m in r["ways"].items()]
    return table([f"way ({r['replies']} replies, {r['batch']})", "total s", "median ms / reply", "tokens computed",
                  "vs before"], rows)


BUS_KINDS = {
    "raw_zmq": "raw pyzmq DEALER/ROUTER echo, same frames, no security (baseline)",
    "raw_zmq_plain": "raw pyzmq echo behind PLAIN + a ZAP handler",
    "raw_zmq_curve": "raw pyzmq echo behind CURVE",
    "bus_sync": "this bus, `SyncClient` (PLAIN, the default)",
    "bus_async": "this bus, asyncio `Client` (PLAIN)",
    "bus_async_park": "this bus, asyncio `Client(spin_s=0)` (never polls; PLAIN)",
    "bus_sync_curve": "this bus, `SyncClient` with CURVE keys",
    "ray": "Ray actor call",
}


def render_bus(results: Path, transport: str = "ipc") -> str:
    """Round trips per client over ``transport`` (Ray's own for the Ray row)."""
    by = {(r["kind"], r["payload"]): r for r in load(results, "bus")["results"]
          if r["transport"] in (transport, "ray")}
    rows = []
    for kind, label in BUS_KINDS.items():
        small, big = by[kind, "small"], by[kind, "1MiB"]
        connect = small["connect_us"]
        rows.append([label, f"{small['p50_us']:.0f} µs", x(small["vs_raw_zmq"]),
                     x(small["ray_p50_over_this"], 1), f"{small['cpu_us']:.0f} µs",
                     f"{big['p50_us']:.0f} µs", f"{big['msgs_per_s']:.0f}",
                     x(big["throughput_vs_raw_zmq"]),
                     "—" if connect is None else f"{connect:.0f} µs"])
    return table(["client", "small p50", "vs raw pyzmq", "Ray call p50 / this",
                  "client CPU per round trip", "1 MiB p50", "1 MiB msgs/s (32 in flight)",
                  "raw pyzmq's msgs/s / this", "connect"], rows)


CODEC_MESSAGES = {"1 MiB array": "`LogprobsResult`, one 1 MiB array",
                  "16 prompts": "`SampleRequest`, 16 prompts",
                  "64 datums x 4 arrays": "`ForwardBackward`, 64 datums x 4 arrays"}


def _us(value: float) -> str:
    """µs: one decimal below 100, whole above."""
    return f"{value:.0f}" if value >= 100 else f"{value:.1f}"


def render_codec(results: Path) -> str:
    """Median µs to encode and decode each message, and pickle 5's."""
    by = {r["message"]: r for r in load(results, "codec")["results"]}
    rows = [[label, str(r["arrays"]),
             f"{_us(r['encode_us'])} ({r['encode_vs_pickle']:.2f}x)", _us(r["pickle_encode_us"]),
             f"{_us(r['decode_us'])} ({r['decode_vs_pickle']:.2f}x)", _us(r["pickle_decode_us"])]
            for message, label in CODEC_MESSAGES.items() for r in [by[message]]]
    return table(["message", "arrays", "encode", "pickle", "decode", "pickle"], rows)
