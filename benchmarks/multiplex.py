"""Throughput of one base model serving many LoRA adapters, four ways, in one run.

K adapters (LoRA rank 8 on q/k/v/o, B drawn from N(0, 0.01) so they change the output) share a
batch of distinct random prompts; row i uses adapter i % K; every row draws exactly
``--new_tokens`` tokens (no stop tokens):

* ``engine``: the engine's own forward (``ModelHost(engine="own")``), one ``sample`` call;
* ``peft_mixed``: PEFT's mixed-adapter batch (``engine="peft"``), one call (today's path);
* ``swap``: the PEFT host, one call per adapter with that adapter's rows, in turn;
* ``copies``: K model copies (K ``engine="own"`` hosts with one adapter each), one call each,
  in turn: what running a copy per adapter costs in memory.

tokens/s = generated tokens / wall time of the calls (prefill included; each host is warmed
up with a tiny call first, untimed; the median of ``--repeats`` timed calls of the same rows,
the engines' prefix cache emptied before each). Each measurement runs in a fresh process (the script
calls itself with ``--one METHOD K BATCH``), so ``peak_bytes`` (``ru_maxrss``) is that
method's alone. FLOPs are estimated as 2 x the parameters each token touches (decoder
linears + one adapter's LoRA for every forwarded token, prefill included; the vocabulary
projection only for drawn tokens; attention scores and the embedding lookup left out) and
compared with this machine's plain fp32 ``torch.mm`` rate at the same thread count.

Memory (engine rows): the target is ``peak - rss_before_model <= 1.1 x (weights + K x adapter +
KV peak)``; ``mem_ratio`` is the left side over the parenthesis (<= 1.10 meets it).
``rss_before_model`` is the process after the runtime ran once on the tiny random model (same
code path, K adapters, freed, heap trimmed): imports, code pages and first-call caches are the
runtime's, not the model's. ``mem_ratio_cold`` charges them too (baseline ``rss_cold``: after
``import torch`` and the engine's modules only). The row also breaks the peak down:
``load_peak_bytes`` (``ru_maxrss`` once the base is loaded, before any adapter), the RSS after
the adapters, after the warm-up and after the timed call (``steady_rss_bytes``; glibc keeps
freed heap, so it is more than what is live), ``lora_store_bytes`` (the adapters' slot store,
which is the adapters themselves) and ``lora_stack_bytes`` (any stacked copy of them: 0 when
the store is read in place).

    python benchmarks/multiplex.py --json multiplex.json     # ~20 minutes on 2 cores
    python benchmarks/multiplex.py --quick                   # tiny-random, < 1 minute
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console
from rich.progress import Progress
from rich.table import Table

from _args import parse_args
from _machine import machine, script_provenance
from opentinker.engine.host import ModelHost
from opentinker.engine.model_specs import resolve_model
from protocols.messages import LoraSpec, SamplingParams

METHODS = ("engine", "peft_mixed", "swap", "copies")
MM_SHAPE = (2048, 576, 1536)  # [M, K] x [K, N]: SmolLM2-135M's hidden and MLP widths


@dataclass
class Args:
    model: str = "smollm2-135m"
    ks: str = "1,4,16"
    batches: str = "32,64"
    prompt_len: int = 64
    new_tokens: int = 16
    rank: int = 8
    threads: int = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    device: str = "cpu"
    mm_reps: int = 20
    seed: int = 0
    repeats: int = 3
    """Timed calls per row (the same rows each time, after the warm-up): tokens/s from the
    median; on a shared 2-core VM one call's wall time varies by 10-20%."""
    quick: bool = False
    json: str = ""


QUICK = {"model": "tiny-random", "ks": "1,4", "batches": "8", "prompt_len": 16, "new_tokens": 4, "mm_reps": 3,
         "repeats": 1}
"""What ``--quick`` changes (flags given explicitly win)."""


def parse() -> tuple[Args, list[str] | None]:
    args, extra = parse_args(Args, __doc__, QUICK, {"one": {"nargs": 3, "metavar": ("METHOD", "K", "BATCH")}})
    return args, extra["one"]


# ------------------------------------------------------------------------ one measurement (child)

def maxrss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def rss_bytes() -> int:
    """Resident memory now (``/proc/self/statm``); the peak so far where there is no /proc."""
    try:
        return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return maxrss_bytes()


def tensor_bytes(obj, seen: set[int] | None = None) -> int:
    """Bytes of the distinct tensor storages in a nest of dicts, tuples and lists."""
    seen = set() if seen is None else seen
    if isinstance(obj, torch.Tensor):
        ptr = obj.untyped_storage().data_ptr()
        if ptr in seen:
            return 0
        seen.add(ptr)
        return obj.untyped_storage().nbytes()
    if isinstance(obj, dict):
        obj = list(obj.values())
    if isinstance(obj, (tuple, list)):
        return sum(tensor_bytes(x, seen) for x in obj)
    return 0


def model_config(path: str) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


def make_prompts(vocab: int, batch: int, length: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, length).astype(np.int32) for _ in range(batch)]
    assert len({p.tobytes() for p in prompts}) == batch, "prompts must be distinct (no prefix sharing)"
    return prompts


def make_host(path: str, args: Args, engine: str, adapters: list[int], marks: dict | None = None) -> ModelHost:
    """A host with adapters ``a{j}``; adapter j has the same weights on every host and engine
    (A from PEFT's seeded init, B from a generator seeded by j, in sorted-name order).
    ``marks["load_peak_bytes"]``, if not set yet: ``ru_maxrss`` once the base is loaded,
    before any adapter."""
    host = ModelHost(path, threads=args.threads, device=args.device, engine=engine)
    if marks is not None:
        marks.setdefault("load_peak_bytes", maxrss_bytes())
    for j in adapters:
        host.create_adapter(f"a{j}", LoraSpec(rank=args.rank, seed=j))
        g = torch.Generator().manual_seed(1000 + j)
        named = host.adapters[f"a{j}"].named
        with torch.no_grad():
            for name in sorted(named):
                if "lora_B" in name:
                    named[name].copy_(torch.randn(named[name].shape, generator=g) * 0.01)
    return host


def base_module(host: ModelHost) -> torch.nn.Module:
    return host.registry.decoder if host.engine is not None else host.base


def weight_bytes(host: ModelHost) -> int:
    """Bytes of the base weights (tied embeddings counted once; PEFT's injected LoRA excluded)."""
    return sum(p.numel() * p.element_size() for n, p in base_module(host).named_parameters() if "lora_" not in n)


def adapter_bytes(host: ModelHost) -> int:
    return sum(p.numel() * p.element_size() for s in host.adapters.values() for p in s.named.values())


def kv_peak_bytes(host: ModelHost, adapters: list[str], prompts, params, seeds) -> int:
    """Most KV bytes in use at once, recorded after every step of an untimed replay of the
    same rows driven step by step (the engine reserves each row's prompt + max_tokens blocks
    at admission, so this is the timed call's peak too)."""
    eng = host.engine
    seqs = [eng.add(a, p, q, s) for a, p, q, s in zip(adapters, prompts, params, seeds)]
    peak = 0
    while not all(s.finished for s in seqs):
        eng.step()
        peak = max(peak, eng.blocks.stats().bytes_in_use)
    return peak


def warm_runtime(args: Args, engine: str, K: int) -> None:
    """Run the same code path once on the tiny random model (K adapters, a short sample), free
    it and trim the heap: the libraries' lazy imports, code pages and first-call caches are then
    in the baseline, not charged to the model's memory."""
    import gc

    from opentinker.engine.memory import trim_heap

    tiny = ModelHost(resolve_model("tiny-random"), threads=args.threads, device=args.device, engine=engine)
    for j in range(K):
        tiny.create_adapter(f"a{j}", LoraSpec(rank=args.rank, seed=j))
    prompts = make_prompts(tiny.registry.vocab_size, 8, 8, args.seed + 1)
    tiny.sample([f"a{i % K}" for i in range(8)], prompts, [SamplingParams(max_tokens=2)] * 8, list(range(8)))
    del tiny, prompts
    gc.collect()
    trim_heap()


def run_one(args: Args, method: str, K: int, batch: int) -> dict:
    path = resolve_model(args.model)
    cfg = model_config(path)
    rss_cold = rss_bytes()
    if args.model != "tiny-random":
        warm_runtime(args, "own" if method in ("engine", "copies") else "peft", K)
    rss_before = rss_bytes()
    prompts = make_prompts(cfg["vocab_size"], batch, args.prompt_len, args.seed)
    params = SamplingParams(max_tokens=args.new_tokens)  # no stop tokens: every row runs to the end
    seeds = [args.seed + i for i in range(batch)]
    groups = [[i for i in range(batch) if i % K == j] for j in range(K)]  # rows of adapter j
    marks: dict = {}
    if method == "copies":
        hosts = [make_host(path, args, "own", [j], marks) for j in range(K)]
        calls = [(hosts[j], groups[j]) for j in range(K)]
    else:
        host = make_host(path, args, "own" if method == "engine" else "peft", list(range(K)), marks)
        hosts = [host]
        calls = [(host, g) for g in groups] if method == "swap" else [(host, list(range(batch)))]
    rss_adapters = rss_bytes()
    for h, rows in calls:  # warm-up: the same call pattern, one short row per adapter
        firsts = sorted({i % K: i for i in reversed(rows)}.values())
        h.sample([f"a{i % K}" for i in firsts], [prompts[i][:4] for i in firsts],
                 [SamplingParams(max_tokens=2)] * len(firsts), [seeds[i] for i in firsts])
    rss_warm = rss_bytes()
    engines = [h.engine for h in hosts if h.engine is not None]
    before = [e.metrics() for e in engines]
    walls = []
    for _ in range(args.repeats):  # the same call again: the median wall, and memory must not grow
        for e in engines:  # no prefix-cache hits on the rows of the last call (PEFT has no cache)
            e.blocks.retire_all()
        t0 = time.perf_counter()
        outs = [h.sample([f"a{i % K}" for i in rows], [prompts[i] for i in rows], [params] * len(rows),
                         [seeds[i] for i in rows]) for h, rows in calls]
        walls.append(time.perf_counter() - t0)
    wall = statistics.median(walls)
    steady = rss_bytes()
    generated = sum(len(r.tokens) for out in outs for r in out)
    assert generated == batch * args.new_tokens, (generated, batch * args.new_tokens)
    # FLOPs: decoder linears (+ one adapter's LoRA) per forwarded token, lm_head per drawn token.
    body = sum(p.numel() for n, p in base_module(hosts[0]).named_parameters()
               if not any(s in n for s in ("embed_tokens", "lm_head", "lora_")))
    lora = sum(p.numel() for p in hosts[0].adapters["a0"].named.values())
    forwarded = batch * (args.prompt_len + args.new_tokens - 1)  # the last drawn token is never fed back
    flops = 2 * (body + lora) * forwarded + 2 * cfg["vocab_size"] * cfg["hidden_size"] * generated
    row = {
        "method": method, "K": K, "batch": batch, "tokens_per_s": generated / wall, "wall_s": wall,
        "walls_s": walls,
        "generated_tokens": generated, "prompt_tokens": batch * args.prompt_len,
        "peak_bytes": maxrss_bytes(), "rss_before_model_bytes": rss_before, "rss_cold_bytes": rss_cold,
        "load_peak_bytes": marks["load_peak_bytes"], "rss_after_adapters_bytes": rss_adapters,
        "rss_after_warmup_bytes": rss_warm, "steady_rss_bytes": steady,
        "weights_bytes": sum(weight_bytes(h) for h in hosts), "adapter_bytes": sum(adapter_bytes(h) for h in hosts),
        "flops_per_forwarded_token": 2 * (body + lora), "flops": flops, "gflops_per_s": flops / wall / 1e9,
    }
    if engines:
        after = [e.metrics() for e in engines]
        row["engine_steps"] = sum(a["engine/steps"] - b["engine/steps"] for a, b in zip(after, before)) / args.repeats
        row["engine_forward_s"] = sum(a["engine/forward_ms"] - b["engine/forward_ms"]
                                      for a, b in zip(after, before)) / 1000 / args.repeats  # per call
        row["kv_pool_bytes"] = sum(e.pool.nbytes for e in engines)
        # copies: the sum of each copy's peak (copies serving at once hold them all).
        row["kv_peak_bytes"] = sum(kv_peak_bytes(h, [f"a{i % K}" for i in rows], [prompts[i] for i in rows],
                                                 [params] * len(rows), [seeds[i] for i in rows]) for h, rows in calls)
        row["kv_peak_how"] = "max of blocks.stats().bytes_in_use over the steps of an untimed replay"
        # Copies of the adapters' matrices beyond the adapters themselves: the stacks cached by the
        # legacy LoRA methods (the fused ops read the slot store in place: 0 here).
        row["lora_stack_bytes"] = sum(tensor_bytes([v for _, v in e.runner._stacks._sets.values()]) for e in engines)
        row["lora_store_bytes"] = sum(e.registry.slots.nbytes for e in engines)
        # The engine's memory target: peak <= (weights + K x adapter + KV in use) + 10%.
        need = row["weights_bytes"] + row["adapter_bytes"] + row["kv_peak_bytes"]
        row["mem_ratio"] = (row["peak_bytes"] - rss_before) / need
        row["mem_ratio_cold"] = (row["peak_bytes"] - rss_cold) / need
    if args.device.startswith("cuda"):
        row["device_peak_bytes"] = torch.cuda.max_memory_allocated()
    return row


# ------------------------------------------------------------------------ the grid (parent)

def mm_gflops(args: Args) -> float:
    """Median GFLOP/s of fp32 ``torch.mm`` on ``MM_SHAPE`` at ``args.threads`` threads."""
    torch.set_num_threads(args.threads)
    M, Kd, N = MM_SHAPE
    a, b = torch.randn(M, Kd, device=args.device), torch.randn(Kd, N, device=args.device)
    sync = torch.cuda.synchronize if args.device.startswith("cuda") else (lambda: None)
    times = []
    for i in range(args.mm_reps + 2):
        sync()
        t = time.perf_counter()
        torch.mm(a, b)
        sync()
        if i >= 2:  # two warm-up calls
            times.append(time.perf_counter() - t)
    return 2 * M * Kd * N / statistics.median(times) / 1e9


def machine_info(args: Args, mm: float) -> dict:
    return {**machine(args.threads, args.device), "mm_shape": list(MM_SHAPE), "mm_gflops_per_s": mm}


def k_sweep(args: Args, batch: int, rounds: int = 5) -> dict:
    """The engine's tokens/s at each K of ``--ks`` measured interleaved in one process (one
    host with max(K) adapters; round after round, one call per K, the prefix cache emptied
    before each): the ratios to K=1 do not drift with the machine's speed as rows measured
    minutes apart in separate processes do. Medians over ``rounds``."""
    ks = [int(k) for k in args.ks.split(",")]
    path = resolve_model(args.model)
    cfg = model_config(path)
    host = make_host(path, args, "own", list(range(max(ks))))
    prompts = make_prompts(cfg["vocab_size"], batch, args.prompt_len, args.seed)
    params = [SamplingParams(max_tokens=args.new_tokens)] * batch
    seeds = [args.seed + i for i in range(batch)]
    host.sample(["a0"], [prompts[0][:4]], [SamplingParams(max_tokens=2)], [0])  # warm-up
    walls: dict[int, list[float]] = {K: [] for K in ks}
    for _ in range(rounds):
        for K in ks:
            host.engine.blocks.retire_all()
            t0 = time.perf_counter()
            out = host.sample([f"a{i % K}" for i in range(batch)], prompts, params, seeds)
            walls[K].append(time.perf_counter() - t0)
            assert sum(len(r.tokens) for r in out) == batch * args.new_tokens
    tps = {K: batch * args.new_tokens / statistics.median(w) for K, w in walls.items()}
    return {"method": "engine_k_sweep", "batch": batch, "rounds": rounds, "walls_s": walls,
            "tokens_per_s": tps, "vs_k1": {K: tps[K] / tps[ks[0]] for K in ks}}


def measure(args: Args, method: str, K: int, batch: int) -> dict:
    """One row, in a fresh process; an ``error`` row if it failed (e.g. killed for memory)."""
    fwd = [x for k, v in asdict(args).items() if k not in ("batches", "quick", "json")
           for x in (f"--{k}", str(v))]
    proc = subprocess.run([sys.executable, __file__, "--one", method, str(K), str(batch), *fwd],
                          capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        return {"method": method, "K": K, "batch": batch, "error": f"rc {proc.returncode}: {proc.stderr[-600:]}"}
    return json.loads(lines[-1][len("RESULT "):])


def add_ratios(rows: list[dict], mm: float) -> None:
    ok = {(r["method"], r["K"], r["batch"]): r for r in rows if "error" not in r}
    for r in ok.values():
        r["mm_share"] = r["gflops_per_s"] / mm
        base = ok.get(("peft_mixed", r["K"], r["batch"]))
        r["vs_peft_mixed"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        if r["method"] == "engine":
            one = ok.get(("engine", 1, r["batch"]))
            r["vs_engine_k1"] = r["tokens_per_s"] / one["tokens_per_s"] if one else None


def table(args: Args, rows: list[dict], machine: dict) -> Table:
    t = Table(title=f"{args.model}: K LoRA adapters, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
                    f"{args.threads} threads ({machine['cpu']}, {machine['cpu_capability']})")
    for col in ("K", "batch", "method", "tokens/s", "vs peft_mixed", "engine vs K=1", "GFLOP/s", "% of mm",
                "peak RSS MiB", "weights+adapters MiB", "KV peak/pool MiB", "mem ratio (cold)"):
        t.add_column(col, justify="left" if col == "method" else "right")
    mib = 1 << 20
    for r in rows:
        if "error" in r:
            t.add_row(str(r["K"]), str(r["batch"]), r["method"], "failed", *[""] * 8)
            continue
        ratio = lambda x: f"{x:.2f}x" if x else ""  # noqa: E731
        mem = f"{r['weights_bytes'] / mib:.0f}+{r['adapter_bytes'] / mib:.2f}"
        kv = f"{r['kv_peak_bytes'] / mib:.1f}/{r['kv_pool_bytes'] / mib:.0f}" if "kv_peak_bytes" in r else ""
        t.add_row(str(r["K"]), str(r["batch"]), r["method"], f"{r['tokens_per_s']:.1f}", ratio(r["vs_peft_mixed"]),
                  ratio(r.get("vs_engine_k1")), f"{r['gflops_per_s']:.2f}", f"{100 * r['mm_share']:.1f}%",
                  f"{r['peak_bytes'] / mib:.0f}", mem, kv,
                  f"{r['mem_ratio']:.2f} ({r['mem_ratio_cold']:.2f})" if "mem_ratio" in r else "")
    return t


def main() -> None:
    args, one = parse()
    if one:
        row = (k_sweep(args, int(one[2])) if one[0] == "sweep" else run_one(args, one[0], int(one[1]), int(one[2])))
        print("RESULT " + json.dumps(row), flush=True)
        return
    resolve_model(args.model)  # build the cached folder once, before the children race for it
    mm = mm_gflops(args)
    machine = machine_info(args, mm)
    prov = script_provenance(args, args.threads, args.device, mm_shape=list(MM_SHAPE), mm_gflops_per_s=mm)
    grid = [(m, K, b) for K in map(int, args.ks.split(",")) for b in map(int, args.batches.split(",")) for m in METHODS]
    rows: list[dict] = []
    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("measuring", total=len(grid))
        for method, K, batch in grid:
            progress.update(task, description=f"K={K} batch={batch} {method}")
            rows.append(measure(args, method, K, batch))
            add_ratios(rows, mm)
            if args.json:  # after every row: a killed run keeps what it measured
                Path(args.json).write_text(json.dumps({"provenance": prov, "args": asdict(args), "rows": rows}, indent=1))
            progress.advance(task)
        sweeps = []
        for batch in map(int, args.batches.split(",")):  # the K ratios, interleaved in one process
            progress.update(task, description=f"engine K sweep, batch={batch}")
            sweeps.append(measure(args, "sweep", 0, batch))
            if args.json:
                Path(args.json).write_text(json.dumps({"provenance": prov, "args": asdict(args), "rows": rows,
                                                       "k_sweeps": sweeps}, indent=1))
    console.print(table(args, rows, machine))
    for sw in sweeps:
        if "error" in sw:
            print(f"engine K sweep batch={sw['batch']} failed: {sw['error']}")
            continue
        print(f"engine, K interleaved in one process, batch {sw['batch']} (median of {sw['rounds']} rounds): " + ", ".join(
            f"K={K} {t:.1f} tok/s ({sw['vs_k1'][K]:.2f}x K=1)" for K, t in sw["tokens_per_s"].items()))
    print(f"plain fp32 torch.mm {MM_SHAPE[0]}x{MM_SHAPE[1]} @ {MM_SHAPE[1]}x{MM_SHAPE[2]}: {mm:.1f} GFLOP/s at "
          f"{args.threads} threads. Model FLOPs = 2 x parameters touched per token (decoder linears + one "
          "adapter's LoRA for every forwarded token, prefill included; lm_head for drawn tokens only).")
    print("peak RSS: ru_maxrss of a fresh process per row. KV peak: most bytes in use, recorded step by step "
          "in an untimed replay of the same rows; pool: the KV budget each engine maps up front (resident only "
          "where written; copies: sums over copies). mem ratio: (peak RSS - RSS before the model) / (weights + "
          "adapters + KV peak), the target <= 1.10; RSS before the model: after the runtime ran once on the tiny "
          "random model (imports, code, first-call caches); (cold): from the RSS after imports only.")
    for r in rows:
        if "error" in r:
            print(f"{r['method']} K={r['K']} batch={r['batch']} failed: {r['error']}")


if __name__ == "__main__":
    main()
