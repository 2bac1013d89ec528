"""Performance metrics of a training step from the scheduler's counters (``SchedulerStats``),
taken before and after its rollout: what ``perf/engine/*`` in ``metrics.jsonl`` and
TensorBoard mean."""

from __future__ import annotations


def engine_metrics(before: dict[str, int], after: dict[str, int]) -> dict[str, float]:
    """``perf/engine/*`` of one rollout from the scheduler's counters before and after it:
    rows per step, prefill and decode tokens per second of forward time, the prefix-cache hit
    rate, and the gauges at its end (adapters resident and spilled, KV bytes in use). Empty
    when the scheduler runs the PEFT path."""
    if "engine/steps" not in after:
        return {}
    d = {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("engine/")}
    fwd_s = d["engine/forward_ms"] / 1000
    out = {
        "perf/engine/steps": float(d["engine/steps"]),
        "perf/engine/rows_per_step": d["engine/rows"] / d["engine/steps"] if d["engine/steps"] else 0.0,
        "perf/engine/prefill_tokens": float(d["engine/prefill_tokens"]),
        "perf/engine/decode_tokens": float(d["engine/decode_tokens"]),
        "perf/engine/prefill_tokens_per_s": d["engine/prefill_tokens"] / fwd_s if fwd_s else 0.0,
        "perf/engine/decode_tokens_per_s": d["engine/decode_tokens"] / fwd_s if fwd_s else 0.0,
        "perf/engine/prefix_hit_rate": (d["engine/cached_prompt_tokens"] / d["engine/prompt_tokens"]
                                        if d["engine/prompt_tokens"] else 0.0),
    }
    for key in ("adapters_resident", "adapters_spilled", "kv_bytes_in_use", "adapter_bytes_resident"):
        out[f"perf/engine/{key}"] = float(after.get(f"engine/{key}", 0))
    return out
