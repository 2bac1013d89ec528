"""The batched LoRA methods' cost alone, at SmolLM2-135M's shapes (random weights), against
the base model's forward in the same run: the table in ``opentinker/engine/model/lora.py``.

Per K rank-8 adapters on q/k/v/o (rows sorted by adapter), the LoRA terms of one forward
(``LoraBatch`` built, 30 x 4 ``apply`` calls) for ``segments``, ``stacked`` and ``bgmv`` (warm
``LoraStackCache``), and ``stacked`` and ``bgmv`` without a cache (``-uncached``). Single-thread
CPU seconds (min over ``--repeats``; CPU time, not wall time, because the machine is shared),
``rows x length`` tokens, no grad, fp32. ``ratio`` is each case over the base forward.

    python benchmarks/lora_methods.py --json benchmarks/results/lora_methods.json
    python benchmarks/lora_methods.py --quick
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
from _args import parse_args
from _machine import script_provenance
from rich.console import Console
from rich.table import Table

from opentinker.engine.model.attention import DenseAttention
from opentinker.engine.model.config import DecoderSpec, module_dims
from opentinker.engine.model.decoder import Decoder
from opentinker.engine.model.lora import LoraBatch
from opentinker.engine.model.lora_weights import LoraStackCache, LoraWeights
from protocols.messages import LoraSpec


@dataclass
class Args:
    ks: str = "1,4,16"
    """Adapter counts mixed in one batch."""
    rows: int = 32
    length: int = 64
    """Tokens per row: 64 is a prefill, 1 a decode step."""
    repeats: int = 7
    json: str = ""
    quick: bool = False


QUICK = {"ks": "1,4", "rows": 8, "length": 16, "repeats": 2}


def cases(ks: list[int], rows: int, spec: DecoderSpec) -> dict[str, tuple[list[LoraWeights], str, LoraStackCache | None]]:
    """Name -> (each row's adapter, method, stack cache or ``None``) for every K and method."""
    out: dict[str, tuple[list[LoraWeights], str, LoraStackCache | None]] = {}
    for K in ks:
        adapters = []
        for k in range(K):
            named = LoraWeights.new(LoraSpec(rank=8, seed=k), spec)
            for name, t in named.items():
                if ".lora_B." in name:
                    t.data.normal_(0, 0.02)
            adapters.append(LoraWeights.from_named(named, LoraSpec(rank=8), spec))
        per_row = [adapters[b * K // rows] for b in range(rows)]
        out[f"K={K} segments"] = (per_row, "segments", None)
        out[f"K={K} stacked"] = (per_row, "stacked", LoraStackCache())
        out[f"K={K} stacked-uncached"] = (per_row, "stacked", None)
        out[f"K={K} bgmv"] = (per_row, "bgmv", LoraStackCache())
        out[f"K={K} bgmv-uncached"] = (per_row, "bgmv", None)
    return out


def measure(args: Args) -> dict[str, float]:
    """CPU seconds of ``"base forward"`` (the whole 30-layer forward without LoRA) and of each
    case's LoRA terms, min over ``args.repeats`` after a warm-up round."""
    spec = DecoderSpec(family="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
                       num_heads=9, num_kv_heads=3, head_dim=64, tie_word_embeddings=True)
    rows, length = args.rows, args.length
    N = rows * length
    target = ("q_proj", "k_proj", "v_proj", "o_proj")
    x_N_H = torch.randn(N, spec.hidden_size)
    y = {m: torch.zeros(N, module_dims(spec, m)[1]) for m in target}
    table = cases([int(k) for k in args.ks.split(",")], rows, spec)
    times: dict[str, float] = {name: float("inf") for name in table}
    clock = time.thread_time
    with torch.no_grad():
        for rep in range(args.repeats + 1):  # round 0 warms up (and fills the stack caches)
            for name, (per_row, method, cache) in table.items():
                t0 = clock()
                lora = LoraBatch(per_row, [length] * rows, method, cache)
                for layer in range(spec.num_layers):
                    for m in target:
                        lora.apply(layer, m, x_N_H, y[m])
                if rep:
                    times[name] = min(times[name], clock() - t0)
        dec = Decoder(spec).init_random_(0)
        ids_N = torch.randint(0, spec.vocab_size, (N,))
        pos_N = torch.arange(length).repeat(rows)
        base = float("inf")
        for rep in range(max(args.repeats // 2, 1) + 1):
            t0 = clock()
            dec(ids_N, pos_N, DenseAttention(rows, length))
            base = min(base, clock() - t0) if rep else base
    return {"base forward": base, **times}


def main() -> None:
    args, _ = parse_args(Args, __doc__, QUICK)
    torch.manual_seed(0)
    torch.set_num_threads(1)  # one thread's CPU time: what the work costs, whatever the load
    seconds = measure(args)
    base = seconds["base forward"]
    table = Table(title=f"LoRA terms of one forward, {args.rows} rows x {args.length} tokens (CPU ms, 1 thread)")
    for col in ("case", "ms", "ratio to base forward"):
        table.add_column(col, justify="left" if col == "case" else "right")
    for name, s in seconds.items():
        table.add_row(name, f"{s * 1000:.1f}", f"{s / base:.3f}")
    Console().print(table)
    if args.json:
        out = {"provenance": script_provenance(args, threads=1),
               "rows": [{"case": n, "seconds": s, "ratio_to_base": s / base} for n, s in seconds.items()]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
