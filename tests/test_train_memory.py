"""A learning step's memory is set by the trainer's budget (``model.train_memory_mb``), not by
the number or length of its episodes, and the gradient is the unbounded step's."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from opentinker.engine.host import ModelHost
from opentinker.engine.trainer import activation_bytes_per_token, head_bytes, part_tokens
from protocols.messages import Datum, LoraSpec


def _datums(groups: int, turns: int, seed: int = 0) -> list[Datum]:
    """Dialogue-shaped trajectories: a shared header, a group's first observation, then turns
    of a 3-token reply (the loss tokens) and an 11-token observation."""
    rng = np.random.default_rng(seed)
    header = rng.integers(10, 2000, 9)
    out = []
    for g in range(groups):
        first = rng.integers(10, 2000, 11)
        for e in range(4):
            toks, mask = [header, first], [np.zeros(9), np.zeros(11)]
            for _ in range(turns):
                toks += [rng.integers(10, 2000, 3), rng.integers(10, 2000, 11)]
                mask += [np.ones(3), np.zeros(11)]
            m = np.concatenate(mask).astype(np.float32)
            out.append(Datum(tokens=np.concatenate(toks).astype(np.int32), loss_inputs={
                "mask": m, "advantages": m * np.float32(1 if (g + e) % 2 else -1),
                "sampler_logprobs": m * np.float32(-3.0)}))
    return out


def _step(host: ModelHost, datums: list[Datum], body_only: bool = False) -> tuple[float, torch.Tensor, list[int]]:
    """One forward_backward on a fresh adapter: its loss, its gradient (flat) and, per part,
    the bytes autograd saved for the backward (activations: parameters not counted; with
    ``body_only``, the vocabulary projection's ``[rows, V]`` tensors not counted either)."""
    host.create_adapter("p", LoraSpec(seed=1))
    params = {t.untyped_storage().data_ptr() for t in host.registry.decoder.parameters()}
    vocab = host.registry.vocab_size
    per_part = [0]

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.untyped_storage().data_ptr() not in params and not (body_only and t.shape[-1:] == (vocab,)):
            per_part[-1] += t.numel() * t.element_size()
        return t

    norm = float(sum(d.loss_inputs["mask"].sum() for d in datums))
    parts = host.forward_backward_parts("p", datums, "importance_sampling", {}, norm)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        try:
            while True:
                next(parts)
                per_part.append(0)
        except StopIteration as stop:
            loss = stop.value[0]
    grad = torch.cat([p.grad.flatten() for p in host.adapters["p"].named.values()])
    host.drop_adapter("p")
    return loss, grad, per_part


def test_the_formula_matches_what_autograd_saves_per_token(tiny_path):
    host = ModelHost(tiny_path, threads=1, engine="own")
    s = host.registry.decoder.spec
    one = _datums(1, 6)[:1]
    _, _, (saved,) = _step(host, one)
    loss_tokens = int(one[0].loss_inputs["mask"].sum())
    predicted = (len(one[0].tokens) * activation_bytes_per_token(s.hidden_size, s.intermediate_size, s.num_layers, 4)
                 + head_bytes(s.vocab_size, loss_tokens))
    # Within a factor of 1.5 either way (SmolLM2-135M: 1.67 MB per token measured, 1.68 MB by the formula).
    assert predicted / 1.5 < saved < predicted * 1.5, (saved, predicted)


@pytest.mark.parametrize("groups", [2, 6])
def test_a_step_holds_its_budget_whatever_its_episodes_and_trains_as_unbounded(tiny_path, groups):
    s = ModelHost(tiny_path, threads=1, engine="own").registry.decoder.spec
    per_token = activation_bytes_per_token(s.hidden_size, s.intermediate_size, s.num_layers, 4)
    budget = head_bytes(s.vocab_size) + 120 * per_token  # a few datums a part
    bounded = ModelHost(tiny_path, threads=1, engine="own", engine_options={"train_memory_bytes": budget})
    unbounded = ModelHost(tiny_path, threads=1, engine="own", engine_options={"train_memory_bytes": 1 << 40})
    assert bounded.trainer.part_tokens == part_tokens(bounded.registry, budget) == 120
    datums = _datums(groups, 4)  # 68-token trajectories, groups x 4 of them
    loss_b, grad_b, parts_b = _step(bounded, datums, body_only=True)
    loss_u, grad_u, parts_u = _step(unbounded, datums, body_only=True)
    assert len(parts_u) == 1 and len(parts_b) > 1
    # The same loss and gradient however the step is cut (to float32 rounding: the loss is a sum
    # of terms that nearly cancel, so summed in another order it moved by 1.1e-5 of itself on
    # an Intel Xeon; a wrong cut or normalisation moves it by far more).
    assert loss_b == pytest.approx(loss_u, rel=1e-4)
    torch.testing.assert_close(grad_b, grad_u, rtol=1e-4, atol=1e-7)
    # The body's activations of every part within its share of the budget (with the formula's
    # margin); the unbounded step's grow with its episodes past it. (On tiny-random the
    # vocabulary projection's share, a constant, is most of the budget: it is left out here.)
    body = budget - head_bytes(s.vocab_size)
    assert max(parts_b) <= 1.5 * body, (max(parts_b), body)
    assert parts_u[0] > 2 * body * (groups // 2)


def test_a_bad_budget_is_refused(tiny_path):
    with pytest.raises(ValueError, match="training memory budget"):
        ModelHost(tiny_path, threads=1, engine="own", engine_options={"train_memory_bytes": 0})


def test_the_scheduler_reports_its_peak_memory_and_starts_it_again(scheduler):
    """``SchedulerStats`` carries the process's RSS and peak; ``reset_peak`` starts the peak
    again, so a training step's metrics report that step's own peak."""
    import gc
    import mmap

    from opentinker.bus.sync import SyncClient
    from protocols.messages import SchedulerStats

    with SyncClient(scheduler.endpoint, "test") as client:
        client.request(SchedulerStats(reset_peak=True))
        # 64 MiB of fresh pages, written then unmapped (an anonymous mapping: not heap the
        # process already holds, which a long test session may have to reuse).
        region = mmap.mmap(-1, 64 << 20)
        np.frombuffer(region, np.uint8)[:] = 1
        region.close()
        gc.collect()
        high = client.request(SchedulerStats(reset_peak=True)).counters
        low = client.request(SchedulerStats()).counters
    assert high["mem/peak_rss_bytes"] >= high["mem/rss_bytes"] > 0
    assert high["mem/peak_rss_bytes"] - low["mem/peak_rss_bytes"] > 48 << 20


def test_a_datum_longer_than_the_budget_is_trained_with_checkpointed_layers(tiny_path):
    """A datum is never split: one longer than the budget is a part alone, whose layers keep
    only their input for the backward and are computed again there. The gradient is the same."""
    s = ModelHost(tiny_path, threads=1, engine="own").registry.decoder.spec
    per_token = activation_bytes_per_token(s.hidden_size, s.intermediate_size, s.num_layers, 4)
    long = _datums(1, 30)[:1]  # 440 tokens
    small = ModelHost(tiny_path, threads=1, engine="own",
                      engine_options={"train_memory_bytes": head_bytes(s.vocab_size) + 100 * per_token})
    big = ModelHost(tiny_path, threads=1, engine="own", engine_options={"train_memory_bytes": 1 << 40})
    loss_s, grad_s, (saved_s,) = _step(small, long, body_only=True)
    loss_b, grad_b, (saved_b,) = _step(big, long, body_only=True)
    assert loss_s == pytest.approx(loss_b, rel=1e-5)
    torch.testing.assert_close(grad_s, grad_b, rtol=1e-4, atol=1e-7)
    # What the checkpoints hold besides: each layer's input, a hidden-wide row a token.
    inputs = s.num_layers * 440 * s.hidden_size * 4
    assert saved_b > 0.8 * 440 * per_token and saved_s + inputs < saved_b / 4, (saved_s, inputs, saved_b)
