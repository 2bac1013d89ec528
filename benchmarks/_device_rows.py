"""Measurements that ``multiplex.py`` and ``engine_overhead.py`` share, on CPU and CUDA alike:
what one decode step of the engine dispatches and takes (:func:`decode_profile`), the floor
set by a decode step's matmuls alone (:func:`linears_floor`), and training throughput
(:func:`train_row`)."""

from __future__ import annotations

import resource
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from opentinker.engine.host import ModelHost
from protocols.messages import AdamParams, Datum, LoraSpec

ALL_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""LoRA on every projection of a layer."""


class _Count(TorchDispatchMode):
    """Counts the ATen ops dispatched inside it (a fused ``torch.ops.opentinker`` op once)."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += 1
        return func(*args, **(kwargs or {}))


def aten_ops(prof) -> int:
    """ATen ops of a profile that run under no other ATen op (a fused op's composite counts)."""
    n = 0
    for e in prof.events():
        if not e.name.startswith("aten::"):
            continue
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        n += p is None
    return n


def syncer(device: torch.device | str) -> Callable[[], None]:
    """``torch.cuda.synchronize`` on a CUDA device, else nothing."""
    return torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)


def timings(fn: Callable[[], object], reps: int, sync: Callable[[], None]) -> list[float]:
    """Wall seconds of ``reps`` calls of ``fn``, each between two syncs of the device."""
    out = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        out.append(time.perf_counter() - t0)
    return out


def decode_profile(host: ModelHost, seqs: Sequence, steps: int) -> dict:
    """Decode steps of the rows ``seqs`` (just added to ``host.engine``, each with at least
    ``steps + 3`` tokens to draw): prefill them, take one warm-up decode step (which captures
    the batch's CUDA graph), then measure steps in which every row decodes.

    Returns ``ops`` (ATen ops dispatched in one step), ``aten_ops`` (every ATen op run on the
    CPU, the fused ops' composites included), ``step_ms`` (median over ``steps`` steps) and
    ``decode_tokens_per_s`` (rows / step time); on CUDA also ``kernels`` (CUDA kernels of one
    step, profiler), ``device_ms`` (their summed device time) and ``graph_steps``. The rows
    are cancelled at the end."""
    eng = host.engine
    B = len(seqs)
    while any(s.pending > 1 for s in seqs):  # prefill (in chunks if the budget says so)
        eng.step()
    eng.step()
    sync = syncer(eng.device)
    with _Count() as c:
        eng.step()
    from torch.profiler import ProfilerActivity, profile

    cuda = eng.device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])) as prof:
        eng.step()
        sync()
    row = {"ops": c.n, "aten_ops": aten_ops(prof)}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
        row.update(kernels=len(kernels), device_ms=sum(e.device_time for e in kernels) / 1000,
                   graph_steps=eng.metrics()["engine/graph_steps"])
    def step() -> None:
        progressed, _ = eng.step()
        assert len(progressed) == B, (len(progressed), B)

    times = timings(step, steps, sync)
    row["step_ms"] = statistics.median(times) * 1000
    row["decode_tokens_per_s"] = B / statistics.median(times)
    eng.cancel(seqs)
    eng.step()
    return row


def decoder_linears(host: ModelHost) -> list[torch.Tensor]:
    """The weights a decode step multiplies by: every projection of every layer, and the
    vocabulary projection (the tied embedding where there is no ``lm_head``)."""
    named = dict(host.registry.decoder.named_parameters())
    out = [p for n, p in named.items() if p.dim() == 2 and "embed_tokens" not in n and "lm_head" not in n]
    head = next((p for n, p in named.items() if "lm_head" in n), None)
    return [*out, head if head is not None else next(p for n, p in named.items() if "embed_tokens" in n)]


def linears_floor(host: ModelHost, batch: int, reps: int) -> dict:
    """The step time of a decode step's matmuls alone (:func:`decoder_linears`, each on a
    ``[batch, in]`` input in the base weights' dtype; no attention, LoRA, norms or sampling):
    on CUDA replayed from one CUDA graph, on CPU run eagerly. What no engine step of this
    model and batch can beat; ``decode_tokens_per_s`` = batch / that time."""
    weights = decoder_linears(host)
    dev, dtype = weights[0].device, weights[0].dtype
    xs = {w.shape[1]: torch.randn(batch, w.shape[1], device=dev, dtype=dtype) for w in weights}
    cuda = dev.type == "cuda"

    def step() -> list[torch.Tensor]:
        return [torch.nn.functional.linear(xs[w.shape[1]], w) for w in weights]

    with torch.no_grad():
        run = step
        if cuda:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(3):
                    step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            run = graph.replay
        run()
        times = timings(run, reps, syncer(dev))
    step_s = statistics.median(times)
    flops = 2 * batch * sum(w.numel() for w in weights)
    return {"phase": "floor", "method": "linears_graph" if cuda else "linears_eager", "batch": batch,
            "matmuls": len(weights), "step_ms": step_s * 1000, "decode_tokens_per_s": batch / step_s,
            "tflops_per_s": flops / step_s / 1e12}


def train_datums(vocab: int, seqs: int, length: int, seed: int) -> list[Datum]:
    """``seqs`` random sequences of ``length`` tokens; the second half of each is the reply
    (mask 1) with advantages of alternating sign and sampler log-probs of -2."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(seqs):
        mask = np.zeros(length, np.float32)
        mask[length // 2:] = 1.0
        out.append(Datum(tokens=rng.integers(0, vocab, length).astype(np.int32), loss_inputs={
            "mask": mask, "advantages": mask * np.float32((-1) ** i), "sampler_logprobs": mask * np.float32(-2.0)}))
    return out


def peak_bytes(device: torch.device | str) -> int:
    """Peak memory so far: the CUDA caching allocator's on a GPU, the process's RSS on CPU."""
    if torch.device(device).type == "cuda":
        return torch.cuda.max_memory_allocated()
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def train_row(host: ModelHost, method: str, spec: LoraSpec, seqs: int, length: int, repeats: int,
              seed: int = 0) -> dict:
    """Tokens per second of ``forward_backward`` (importance-sampling loss on
    :func:`train_datums`) then ``optim_step`` on one policy of ``host``: ``train_lora`` (an
    adapter, ``spec``) or ``train_full`` (``spec`` with ``full = True``: a private copy of
    every base weight, AdamW on all). One untimed step first (the optimizer's moments
    allocated), then the median of ``repeats`` steps; peak memory over all of them, and
    ``step_peak_bytes`` (CUDA): the most a timed step added above what was resident before it."""
    import msgspec

    if method not in ("train_lora", "train_full"):
        raise ValueError(f"train method {method!r}: train_lora or train_full")
    name = method
    host.create_adapter(name, msgspec.structs.replace(spec, full=method == "train_full"))
    datums = train_datums(host.registry.vocab_size, seqs, length, seed)
    norm = float(sum(d.loss_inputs["mask"].sum() for d in datums))
    hp = AdamParams(lr=1e-5)
    sync = syncer(host.registry.device)
    cuda = torch.device(host.registry.device).type == "cuda"

    def one() -> float:
        loss, _ = host.forward_backward(name, datums, "importance_sampling", {}, norm)
        host.optim_step(name, hp)
        return loss

    loss0 = one()
    sync()
    before = torch.cuda.memory_allocated() if cuda else 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = timings(one, repeats, sync)
    step_s = statistics.median(times)
    row = {"phase": "train", "method": method, "seqs": seqs, "seq_len": length, "tokens": seqs * length,
           "loss_tokens": int(norm), "step_s": step_s, "tokens_per_s": seqs * length / step_s, "walls_s": times,
           "first_loss": float(loss0), "trainable_params": sum(p.numel() for p in host.adapters[name].named.values()),
           "peak_bytes": peak_bytes(host.registry.device)}
    if cuda:
        row["step_peak_bytes"] = torch.cuda.max_memory_allocated() - before
        row["device_peak_bytes"] = row["peak_bytes"]
    host.drop_adapter(name)
    return row
