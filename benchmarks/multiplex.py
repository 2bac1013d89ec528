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

Phases (``--phases``; each row's ``phase``):

* ``decode``: the rows above. With ``--profile_steps`` > 0 an engine row also profiles the
  steady decode steps of its batch (every row decoding): ``decode_step_ms``,
  ``decode_tokens_per_s`` (batch / step time: the rate the targets speak of), ``ops`` and, on
  CUDA, ``kernels`` and ``device_ms`` per step (``benchmarks/_device_rows.decode_profile``);
* ``floor``: per batch, the step's matmuls alone (every projection and the vocabulary
  projection on ``[batch, in]`` inputs, in one CUDA graph on CUDA): the rate no decode step can
  beat; engine rows get ``vs_floor``;
* ``train``: ``forward_backward`` + ``optim_step`` of ``--train_seqs`` sequences of
  ``--train_len`` tokens, as a LoRA adapter (``train_lora``) and as a full-parameter copy
  (``train_full``): tokens/s and peak memory.

``--peft_row K,BATCH,NEW_TOKENS`` measures PEFT's mixed batch only there (``peft_mixed`` left
out of the grid); ``--target_tps 8x64:30000,...`` states decode targets (K x batch: tokens/s)
that the run reports as met or not.

On CUDA (``--device cuda``) the flags not given take :data:`CUDA`'s values: the
Qwen2.5-0.5B-shaped issue grid (K 1, 8, 16 at batch 64 and 256, 128-token prompts, 128 new
tokens, LoRA r16 on all seven projections, bf16, the engine only, PEFT's mixed batch at 8
adapters, batch 64, 16 new tokens, floor and training rows), and the KV budget is sized to
the rows (peak device memory then compares with weights + adapters + KV in use). Memory on
CUDA is ``torch.cuda.max_memory_allocated``: ``mem_ratio_device`` = device peak / (weights +
adapters + KV peak).

    python benchmarks/multiplex.py --json multiplex.json     # ~20 minutes on 2 cores
    python benchmarks/multiplex.py --quick                   # tiny-random, < 1 minute
    python benchmarks/multiplex.py --device cuda --model /tmp/qwen05b --json multiplex_cuda.json
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
from _device_rows import ALL_PROJECTIONS, decode_profile, linears_floor, train_row
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
    dtype: str = "float32"
    """The engine's base weights and activations (``model.dtype``)."""
    targets: str = "q_proj,k_proj,v_proj,o_proj"
    """The adapters' LoRA projections (``all``: every one of a layer)."""
    methods: str = ",".join(METHODS)
    phases: str = "decode"
    """Comma-separated: ``decode``, ``floor``, ``train``."""
    peft_row: str = ""
    """``K,BATCH,NEW_TOKENS``: PEFT's mixed batch only there, not over the grid (``none``: no
    PEFT row at all, e.g. on CUDA, where the preset sets one)."""
    profile_steps: int = 0
    """Steady decode steps profiled per engine row (0: none)."""
    kv_budget_mb: int = 0
    """The engine's KV budget; 0: the host's default on CPU, sized to the rows on CUDA."""
    train_methods: str = "train_lora,train_full"
    train_seqs: int = 32
    train_len: int = 256
    sweep_rounds: int = 5
    """Rounds of the interleaved K sweep of the engine (0: no sweep)."""
    target_tps: str = ""
    """Decode targets, ``KxBATCH:tokens_per_s`` comma-separated (e.g. ``8x64:30000``)."""
    quick: bool = False
    json: str = ""


CUDA = {"ks": "1,8,16", "batches": "64,256", "prompt_len": 128, "new_tokens": 128, "rank": 16, "targets": "all",
        "dtype": "bfloat16", "methods": "engine", "phases": "decode,floor,train", "peft_row": "8,64,16",
        "profile_steps": 8, "mm_reps": 50, "target_tps": "8x64:30000,16x256:80000", "repeats": 1, "sweep_rounds": 0}
"""What ``--device cuda`` changes (flags given on the command line win): the issue's H200 grid."""

QUICK = {"model": "tiny-random", "ks": "1,4", "batches": "8", "prompt_len": 16, "new_tokens": 4, "mm_reps": 3,
         "repeats": 1}
"""What ``--quick`` changes (flags given explicitly win)."""


def parse() -> tuple[Args, list[str] | None]:
    from dataclasses import replace

    args, extra = parse_args(Args, __doc__, QUICK, {"one": {"nargs": 3, "metavar": ("METHOD", "K", "BATCH")}})
    if args.device.startswith("cuda"):  # the preset, for every field not given on the command line
        given = {a.split("=")[0].removeprefix("--") for a in sys.argv[1:] if a.startswith("--")}
        args = replace(args, **{k: v for k, v in CUDA.items() if k not in given})
    return args, extra["one"]


def target_modules(args: Args) -> tuple[str, ...]:
    return ALL_PROJECTIONS if args.targets == "all" else tuple(args.targets.split(","))


def lora_spec(args: Args, seed: int) -> LoraSpec:
    return LoraSpec(rank=args.rank, alpha=2.0 * args.rank, target_modules=target_modules(args), seed=seed)


def kv_budget_bytes(args: Args, cfg: dict, batch: int) -> int:
    """``--kv_budget_mb``, or on CUDA the KV blocks the rows need (prompt + the most tokens a
    row draws, in 8-token blocks, one more block each, two rows' worth more): the pool is
    allocated up front there, so its size is what the rows use. 0 (the host's default) on CPU."""
    if args.kv_budget_mb:
        return args.kv_budget_mb << 20
    if not args.device.startswith("cuda"):
        return 0
    heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
    per_token = 2 * cfg["num_hidden_layers"] * cfg.get("num_key_value_heads", heads) * head_dim * (
        2 if args.dtype == "bfloat16" else 4)
    tokens = args.prompt_len + max(args.new_tokens, args.profile_steps + 8)
    blocks = -(-tokens // 8) + 1
    return (batch + 2) * blocks * 8 * per_token


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


def make_host(path: str, args: Args, engine: str, adapters: list[int], marks: dict | None = None,
              kv_bytes: int = 0) -> ModelHost:
    """A host with adapters ``a{j}``; adapter j has the same weights on every host and engine
    (A from PEFT's seeded init, B from a generator seeded by j, in sorted-name order).
    ``marks["load_peak_bytes"]``, if not set yet: ``ru_maxrss`` once the base is loaded,
    before any adapter."""
    options = {"dtype": args.dtype, **({"kv_budget_bytes": kv_bytes} if kv_bytes else {})} if engine == "own" else {}
    host = ModelHost(path, threads=args.threads, device=args.device, engine=engine, engine_options=options)
    if marks is not None:
        marks.setdefault("load_peak_bytes", maxrss_bytes())
    for j in adapters:
        host.create_adapter(f"a{j}", lora_spec(args, j))
        g = torch.Generator().manual_seed(1000 + j)
        named = host.adapters[f"a{j}"].named
        with torch.no_grad():
            for name in sorted(named):
                if "lora_B" in name:
                    named[name].copy_(torch.randn(named[name].shape, generator=g).to(named[name]) * 0.01)
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
        tiny.create_adapter(f"a{j}", lora_spec(args, j))
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
    kv_bytes = kv_budget_bytes(args, cfg, batch)
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if method == "copies":
        hosts = [make_host(path, args, "own", [j], marks, kv_budget_bytes(args, cfg, len(groups[j]))) for j in range(K)]
        calls = [(hosts[j], groups[j]) for j in range(K)]
    else:
        host = make_host(path, args, "own" if method == "engine" else "peft", list(range(K)), marks, kv_bytes)
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
        "phase": "decode", "method": method, "K": K, "batch": batch, "new_tokens": args.new_tokens,
        "tokens_per_s": generated / wall, "wall_s": wall,
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
    if args.profile_steps and method == "engine":  # the steady decode step of this batch
        prof = SamplingParams(max_tokens=args.profile_steps + 8)
        seqs = [host.engine.add(f"a{i % K}", prompts[i], prof, seeds[i]) for i in range(batch)]
        got = decode_profile(host, seqs, args.profile_steps)
        row.update({"decode_step_ms": got.pop("step_ms"), **got})
    if args.device.startswith("cuda"):
        row["device_peak_bytes"] = torch.cuda.max_memory_allocated()
        if "kv_peak_bytes" in row:
            row["mem_ratio_device"] = row["device_peak_bytes"] / (row["weights_bytes"] + row["adapter_bytes"]
                                                                  + row["kv_peak_bytes"])
    return row


def run_floor(args: Args, batch: int) -> dict:
    """The ``floor`` row of ``batch`` (:func:`linears_floor` on the model's weights)."""
    host = make_host(resolve_model(args.model), args, "own", [])
    return {**linears_floor(host, batch, args.mm_reps), "dtype": args.dtype}


def run_train(args: Args, method: str) -> dict:
    """A ``train`` row: ``method`` (``train_lora`` / ``train_full``) on a fresh host."""
    host = make_host(resolve_model(args.model), args, "own", [])
    if args.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    row = train_row(host, method, lora_spec(args, 0), args.train_seqs, args.train_len, args.repeats, args.seed)
    row.update(weights_bytes=weight_bytes(host), dtype=args.dtype)
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
    """:func:`machine` with the matmul rate; on CUDA also ``device_name`` and the CUDA version."""
    out = {**machine(args.threads, args.device), "mm_shape": list(MM_SHAPE), "mm_gflops_per_s": mm}
    if args.device.startswith("cuda"):
        out.update(device_name=torch.cuda.get_device_name(), cuda=torch.version.cuda)
    return out


def k_sweep(args: Args, batch: int) -> dict:
    """The engine's tokens/s at each K of ``--ks`` measured interleaved in one process (one
    host with max(K) adapters; round after round, one call per K, the prefix cache emptied
    before each): the ratios to K=1 do not drift with the machine's speed as rows measured
    minutes apart in separate processes do. Medians over ``--sweep_rounds``."""
    ks = [int(k) for k in args.ks.split(",")]
    path = resolve_model(args.model)
    cfg = model_config(path)
    host = make_host(path, args, "own", list(range(max(ks))))
    prompts = make_prompts(cfg["vocab_size"], batch, args.prompt_len, args.seed)
    params = [SamplingParams(max_tokens=args.new_tokens)] * batch
    seeds = [args.seed + i for i in range(batch)]
    host.sample(["a0"], [prompts[0][:4]], [SamplingParams(max_tokens=2)], [0])  # warm-up
    walls: dict[int, list[float]] = {K: [] for K in ks}
    rounds = args.sweep_rounds
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
    decode = [r for r in rows if r.get("phase") == "decode" and "error" not in r]
    ok = {(r["method"], r["K"], r["batch"], r["new_tokens"]): r for r in decode}
    floors = {r["batch"]: r for r in rows if r.get("phase") == "floor" and "error" not in r}
    for (method, K, batch, new), r in ok.items():
        r["mm_share"] = r["gflops_per_s"] / mm
        base = ok.get(("peft_mixed", K, batch, new))
        r["vs_peft_mixed"] = r["tokens_per_s"] / base["tokens_per_s"] if base else None
        if method == "engine":
            one = ok.get(("engine", 1, batch, new))
            r["vs_engine_k1"] = r["tokens_per_s"] / one["tokens_per_s"] if one else None
            if "decode_tokens_per_s" in r:
                r["decode_vs_engine_k1"] = (r["decode_tokens_per_s"] / one["decode_tokens_per_s"]
                                            if one and "decode_tokens_per_s" in one else None)
                if batch in floors:
                    r["vs_floor"] = r["decode_tokens_per_s"] / floors[batch]["decode_tokens_per_s"]


def check_targets(args: Args, rows: list[dict]) -> list[dict]:
    """``--target_tps`` against the engine rows' steady decode rate, and on CUDA the memory
    target (device peak <= 1.1 x (weights + adapters + KV in use)) at the largest K."""
    engine = {(r["K"], r["batch"]): r for r in rows
              if r.get("phase") == "decode" and r.get("method") == "engine" and "error" not in r
              and r.get("new_tokens") == args.new_tokens}
    out = []
    for item in filter(None, args.target_tps.split(",")):
        shape, want = item.split(":")
        K, batch = map(int, shape.split("x"))
        r = engine.get((K, batch))
        got = r.get("decode_tokens_per_s") if r else None
        out.append({"what": f"decode tokens/s, {K} adapters at batch {batch}", "target": float(want), "got": got,
                    "met": got is not None and got >= float(want)})
        if r and K > 1 and r.get("decode_vs_engine_k1") is not None:
            out.append({"what": f"{K} adapters / 1 adapter at batch {batch}", "target": 0.9,
                        "got": r["decode_vs_engine_k1"], "met": r["decode_vs_engine_k1"] >= 0.9})
    if engine and args.device.startswith("cuda"):
        k = max(K for K, _ in engine)
        for (K, batch), r in sorted(engine.items()):
            if K == k and "mem_ratio_device" in r:
                out.append({"what": f"device peak / (weights + {K} adapters + KV in use), batch {batch}",
                            "target": 1.1, "got": r["mem_ratio_device"], "met": r["mem_ratio_device"] <= 1.1,
                            "lower_is_better": True})
    return out


def table(args: Args, rows: list[dict], machine: dict) -> Table:
    t = Table(title=f"{args.model}: K LoRA adapters, {args.prompt_len}-token prompts, {args.new_tokens} new tokens, "
                    f"{args.threads} threads ({machine['cpu']}, {machine['cpu_capability']})")
    for col in ("K", "batch", "method", "tokens/s", "vs peft_mixed", "engine vs K=1", "GFLOP/s", "% of mm",
                "peak RSS MiB", "weights+adapters MiB", "KV peak/pool MiB", "mem ratio (cold)"):
        t.add_column(col, justify="left" if col == "method" else "right")
    mib = 1 << 20
    for r in rows:
        if r.get("phase", "decode") != "decode":
            continue
        if "error" in r:
            t.add_row(str(r["K"]), str(r["batch"]), r["method"], "failed", *[""] * 8)
            continue
        ratio = lambda x: f"{x:.2f}x" if x else ""  # noqa: E731
        mem = f"{r['weights_bytes'] / mib:.0f}+{r['adapter_bytes'] / mib:.2f}"
        kv = f"{r['kv_peak_bytes'] / mib:.1f}/{r['kv_pool_bytes'] / mib:.0f}" if "kv_peak_bytes" in r else ""
        t.add_row(str(r["K"]), str(r["batch"]), r["method"] + (f" ({r['new_tokens']} new)" if r["new_tokens"] != args.new_tokens else ""), f"{r['tokens_per_s']:.1f}", ratio(r["vs_peft_mixed"]),
                  ratio(r.get("vs_engine_k1")), f"{r['gflops_per_s']:.2f}", f"{100 * r['mm_share']:.1f}%",
                  f"{r['peak_bytes'] / mib:.0f}", mem, kv,
                  f"{r['mem_ratio']:.2f} ({r['mem_ratio_cold']:.2f})" if "mem_ratio" in r else "")
    return t


def device_table(args: Args, rows: list[dict]) -> Table:
    """The steady decode step of the engine rows, the floor and the training rows."""
    t = Table(title=f"{args.model} on {args.device} ({args.dtype}): decode steps, the matmul floor, training")
    for col in ("phase", "method", "K", "batch", "tokens/s", "step ms", "kernels", "device ms", "ops", "vs floor",
                "vs K=1", "peak MiB"):
        t.add_column(col, justify="left" if col in ("phase", "method") else "right")
    mib, f = 1 << 20, (lambda x, spec: format(x, spec) if isinstance(x, (int, float)) else "")  # noqa: E731
    for r in rows:
        if "error" in r:
            t.add_row(r.get("phase", ""), r["method"], str(r.get("K", "")), str(r.get("batch", "")), "failed",
                      *[""] * 7)
        elif r["phase"] == "decode" and "decode_tokens_per_s" in r:
            peak = r.get("device_peak_bytes", r["peak_bytes"])
            t.add_row("decode", r["method"], str(r["K"]), str(r["batch"]), f(r["decode_tokens_per_s"], ",.0f"),
                      f(r["decode_step_ms"], ".2f"), f(r.get("kernels"), "d"), f(r.get("device_ms"), ".2f"),
                      f(r["ops"], "d"), f(r.get("vs_floor"), ".3f"), f(r.get("decode_vs_engine_k1"), ".2f"),
                      f(peak / mib, ",.0f"))
        elif r["phase"] == "floor":
            t.add_row("floor", r["method"], "", str(r["batch"]), f(r["decode_tokens_per_s"], ",.0f"),
                      f(r["step_ms"], ".3f"), f(r["matmuls"], "d"), "", "", "", "", "")
        elif r["phase"] == "train":
            t.add_row("train", r["method"], "", f"{r['seqs']}x{r['seq_len']}", f(r["tokens_per_s"], ",.0f"),
                      f(1000 * r["step_s"], ".1f"), "", "", "", "", "", f(r["peak_bytes"] / mib, ",.0f"))
    return t


def plan(args: Args) -> list[tuple[Args, str, int, int]]:
    """The rows to measure, in order: ``(args, method, K, batch)`` (``args`` with the row's own
    new-token count for the PEFT row), the decode grid first."""
    from dataclasses import replace

    phases = set(args.phases.split(","))
    if not phases <= {"decode", "floor", "train"}:
        raise SystemExit(f"--phases {args.phases}: decode, floor and/or train")
    ks, batches = [int(k) for k in args.ks.split(",")], [int(b) for b in args.batches.split(",")]
    peft_row = "" if args.peft_row == "none" else args.peft_row
    methods = [m for m in args.methods.split(",") if not ((peft_row or args.peft_row == "none") and m == "peft_mixed")]
    out = []
    if "decode" in phases:
        out += [(args, m, K, b) for K in ks for b in batches for m in methods]
        if peft_row:  # PEFT's mixed batch at one point, and the engine on the same rows
            K, b, new = map(int, peft_row.split(","))
            at = replace(args, new_tokens=new)
            out += [(at, "peft_mixed", K, b)] + ([(at, "engine", K, b)] if new != args.new_tokens or
                                                  K not in ks or b not in batches else [])
    if "floor" in phases:
        out += [(args, "floor", 0, b) for b in batches]
    if "train" in phases:
        out += [(args, m, 0, 0) for m in args.train_methods.split(",")]
    return out


def child(args: Args, one: list[str]) -> dict:
    """The row ``--one METHOD K BATCH`` asks for, measured in this (fresh) process."""
    method, K, batch = one[0], int(one[1]), int(one[2])
    if method == "sweep":
        return k_sweep(args, batch)
    if method == "floor":
        return run_floor(args, batch)
    if method.startswith("train_"):
        return run_train(args, method)
    return run_one(args, method, K, batch)


def main() -> None:
    args, one = parse()
    if one:
        print("RESULT " + json.dumps(child(args, one)), flush=True)
        return
    resolve_model(args.model)  # build the cached folder once, before the children race for it
    mm = mm_gflops(args)
    machine = machine_info(args, mm)
    extra = {"device_name": torch.cuda.get_device_name(), "cuda": torch.version.cuda} if args.device.startswith(
        "cuda") else {}
    prov = script_provenance(args, args.threads, args.device, mm_shape=list(MM_SHAPE), mm_gflops_per_s=mm, **extra)
    grid = plan(args)
    rows: list[dict] = []
    sweeps: list[dict] = []
    targets: list[dict] = []

    def save() -> None:  # after every row: a killed run keeps what it measured
        if args.json:
            Path(args.json).write_text(json.dumps({"provenance": prov, "machine": machine, "args": asdict(args),
                                                   "rows": rows, "k_sweeps": sweeps, "targets": targets}, indent=1))

    console = Console()
    if not console.is_terminal:
        console.width = max(console.width, 160)
    sweep = ("decode" in args.phases and "engine" in args.methods and len(args.ks.split(",")) > 1
             and args.sweep_rounds > 0)
    with Progress(console=console, transient=True) as progress:
        task = progress.add_task("measuring", total=len(grid))
        for at, method, K, batch in grid:
            progress.update(task, description=f"K={K} batch={batch} {method}")
            row = measure(at, method, K, batch)
            row.setdefault("phase", "train" if method.startswith("train_") else "floor" if method == "floor"
                           else "decode")
            rows.append(row)
            add_ratios(rows, mm)
            targets[:] = check_targets(args, rows)
            save()
            progress.advance(task)
        for batch in map(int, args.batches.split(",")) if sweep else []:  # K ratios, interleaved in one process
            progress.update(task, description=f"engine K sweep, batch={batch}")
            sweeps.append(measure(args, "sweep", 0, batch))
            save()
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
    if any(r["phase"] != "decode" or "decode_tokens_per_s" in r for r in rows):
        console.print(device_table(args, rows))
    for t in targets:
        print(f"target: {t['what']} {'<=' if t.get('lower_is_better') else '>='} {t['target']:g}: "
              f"{'met' if t['met'] else 'NOT met'} ({t['got'] if t['got'] is None else format(t['got'], ',.3g')})")
    for r in rows:
        if "error" in r:
            print(f"{r['phase']} {r['method']} K={r.get('K')} batch={r.get('batch')} failed: {r['error']}")
    if args.json:
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
