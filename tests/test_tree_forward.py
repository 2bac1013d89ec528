"""The trainer's prefix-tree forward: every distinct prefix token once, with the same log-probs,
values, losses and gradients as running each sequence alone."""

import numpy as np
import pytest
import torch

from conftest import DEVICE
from opentinker.engine.model.tree_attention import TreeAttention
from opentinker.engine.shared_forward import token_tree
from protocols.messages import Datum, LoraSpec


def _episodes(rng: np.random.Generator) -> list[np.ndarray]:
    """Multi-turn sequences that share prefixes at several depths, as a step's episodes do: one
    system prompt, two groups with their own first observation, episodes within a group that
    repeat the same first turn (then differ), one that stops where another goes on, and a
    duplicate."""
    system = rng.integers(10, 500, 7)
    seqs = []
    for _ in range(2):
        first = np.concatenate([system, rng.integers(10, 500, 5)])
        turn = rng.integers(10, 500, 4)
        for e in range(4):
            s = np.concatenate([first, turn if e < 3 else rng.integers(10, 500, 4)])
            if e < 2:  # the same second turn too
                s = np.concatenate([s, np.array([11, 12, 13])])
            seqs.append(np.concatenate([s, rng.integers(10, 500, 2 + e)]))
    seqs.append(seqs[0][:15])  # a sequence that another goes on from
    seqs.append(seqs[3].copy())  # a duplicate
    return [s.astype(np.int32) for s in seqs]


def test_the_tree_has_each_distinct_prefix_once_and_rebuilds_every_sequence():
    rng = np.random.default_rng(0)
    seqs = _episodes(rng)
    t = token_tree(seqs)
    prefixes = {s[: k + 1].tobytes() for s in seqs for k in range(len(s))}
    assert len(t.ids_N) == len(prefixes) < sum(map(len, seqs)) // 2
    for s, path in zip(seqs, t.paths):
        np.testing.assert_array_equal(t.ids_N[path], s)
        np.testing.assert_array_equal(t.pos_N[path], np.arange(len(s)))
    queries = np.concatenate([q for q, _ in t.blocks])
    np.testing.assert_array_equal(np.sort(queries), np.arange(len(t.ids_N)))
    for q, k in t.blocks:  # a block's queries end its path
        np.testing.assert_array_equal(k[len(k) - len(q):], q)


def test_tree_attention_refuses_blocks_that_do_not_cover_the_tokens():
    with pytest.raises(ValueError, match="cover each of the 3 tokens once"):
        TreeAttention([(np.array([0, 1]), np.array([0, 1]))], 3, torch.device("cpu"))
    with pytest.raises(ValueError, match="last entries of its path"):
        TreeAttention([(np.array([0, 1]), np.array([1, 0]))], 2, torch.device("cpu"))


def _datums(seqs: list[np.ndarray], rng: np.random.Generator) -> list[Datum]:
    """Loss tokens on every turn after the first observation (inside shared turns as well)."""
    out = []
    for s in seqs:
        mask = np.zeros(len(s), np.float32)
        mask[12:] = 1
        mask[16:18] = 0  # an observation between replies
        vmask = (np.arange(len(s)) % 3 == 0).astype(np.float32)
        out.append(Datum(tokens=s, loss_inputs={
            "mask": mask, "advantages": mask * float(rng.normal()), "sampler_logprobs": mask * -9.0,
            "value_mask": vmask, "value_targets": vmask * float(rng.normal()), "old_values": vmask * 0.1}))
    return out


@pytest.mark.parametrize("checkpointed", [False, True])
def test_the_tree_forward_equals_every_sequence_alone(tiny_path, checkpointed):
    from opentinker.engine.host import ModelHost

    host = ModelHost(tiny_path, threads=1, device=DEVICE)
    assert host.inference.tree is not None  # the engine's own decoder
    host.create_adapter("treed", LoraSpec(rank=4, seed=3, value_head=True))
    rng = np.random.default_rng(1)
    seqs = _episodes(rng)
    datums = _datums(seqs, rng)
    if checkpointed:  # every part over the budget: each layer recomputed in the backward
        host.trainer.part_tokens = 8
    tree = host.inference.tree
    results = {}
    for name, share, with_tree in (("alone", False, None), ("levels", True, None), ("tree", True, tree)):
        host.inference.share_prefix, host.inference.tree = share, with_tree
        lp = host.logprobs("treed", seqs)
        tail = host.logprobs("treed", seqs, tail=3)
        values = host.values("treed", seqs)
        loss, _ = host.forward_backward("treed", datums, "ppo", {"value": 0.5}, normalizer=20.0)
        grad = torch.cat([p.grad.flatten() for p in host.adapters["treed"].params if p.grad is not None]).cpu().clone()
        host.discard_gradients("treed")
        results[name] = (lp, tail, values, loss, grad)
    ref = results["alone"]
    assert ref[4].abs().sum() > 0
    for name in ("levels", "tree"):
        lp, tail, values, loss, grad = results[name]
        for a, b in zip(lp + tail + values, ref[0] + ref[1] + ref[2]):
            np.testing.assert_allclose(a, b, atol=2e-5)
        assert loss == pytest.approx(ref[3], abs=1e-5)
        torch.testing.assert_close(grad, ref[4], atol=1e-5, rtol=1e-4)


def test_parts_are_cut_from_datums_in_datum_order():
    """In token order each datum computes only what its tree adds: the whole batch as one part
    counts exactly the tree's distinct prefixes, whatever order the datums came in; preference
    pairs keep theirs."""
    from opentinker.engine.train_batches import computed_tokens
    from protocols.messages import datum_order

    rng = np.random.default_rng(2)
    seqs = _episodes(rng)
    datums = _datums([seqs[i] for i in rng.permutation(len(seqs))], rng)
    nodes = len(token_tree(seqs).ids_N)
    assert computed_tokens(datums) > nodes  # arrival order misses prefixes shared further apart
    assert computed_tokens(datum_order(datums)) == nodes
    pairs = [Datum(tokens=d.tokens, loss_inputs={**d.loss_inputs, "pair_id": d.loss_inputs["mask"] * (i // 2)})
             for i, d in enumerate(datums)]
    assert [d.tokens.tobytes() for d in datum_order(pairs)] == [d.tokens.tobytes() for d in pairs]
