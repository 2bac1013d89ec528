"""ModelHost called directly (no bus): the adapter lifecycle (drop, snapshot, save, load), the
KL penalty to the reference and the entropy bonus against direct computations, and the
diagnostics of forward_backward."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import DEVICE

from protocols.messages import AdamParams, Datum, LoraSpec, SamplingParams

SPEC = LoraSpec(rank=4, seed=3)
ADAM = AdamParams(lr=0.05)


@pytest.fixture(scope="module")
def host(tiny_path):
    from opentinker.engine.host import ModelHost

    return ModelHost(tiny_path, threads=2, device=DEVICE, engine="peft")  # checks PEFT internals; tests/test_engine_host.py holds the engine to it


def _datums(seed: int = 0, n: int = 5) -> list[Datum]:
    """``n`` datums sharing a 6-token prompt, with 1-3 sampled tokens after a second
    observation, advantages of alternating sign, and sampler log-probs near the tiny random
    model's (~ -log 49152), so that ratios are near 1 and few tokens are clipped."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(10, 2000, 6)
    out = []
    for i in range(n):
        obs2 = rng.integers(10, 2000, 2)
        sampled = rng.integers(10, 2000, 1 + i % 3)
        tokens = np.concatenate([prompt, rng.integers(10, 2000, 2), obs2, sampled]).astype(np.int32)
        mask = np.zeros(len(tokens), np.float32)
        mask[6:8] = 1.0  # first reply
        mask[10:] = 1.0  # second reply
        out.append(Datum(tokens=tokens, loss_inputs={
            "mask": mask,
            "advantages": (mask * (-1) ** i * rng.uniform(0.5, 1.5)).astype(np.float32),
            "sampler_logprobs": (mask * -rng.uniform(10.5, 11.0, len(tokens))).astype(np.float32),
        }))
    return out


def _grads(host, name: str) -> torch.Tensor:
    return torch.cat([p.grad.flatten() if p.grad is not None else torch.zeros(p.numel())
                      for p in host.adapters[name].params]).cpu().clone()


def _close(got: torch.Tensor, want: torch.Tensor, rel: float = 1e-3) -> None:
    """Float32 gradients through different summation orders (chunks, prefix sharing, a
    difference of two gradients) agree to ``rel`` of the gradient's scale."""
    scale = want.abs().max().item()
    assert scale > 0
    err = (got - want).abs().max().item()
    assert err <= rel * scale, f"max error {err:.3g} > {rel} x scale {scale:.3g}"


def _zero(host, name: str) -> None:
    for p in host.adapters[name].params:
        p.grad = None


def _trained(host, name: str, steps: int = 1) -> None:
    """A fresh adapter (B = 0) equals the base: move it so that KL and snapshots mean something."""
    host.create_adapter(name, SPEC)
    for _ in range(steps):
        host.forward_backward(name, _datums(1), "ppo", {}, 10.0)
        host.optim_step(name, ADAM)


def _weights(host, name: str) -> dict[str, torch.Tensor]:
    return {k: p.detach().cpu().clone() for k, p in host.adapters[name].named.items()}


# ---------------------------------------------------------------------------------------------
# Lifecycle


def test_drop_adapter_frees_weights_and_optimizer(host) -> None:
    _trained(host, "dropme")
    assert any(".dropme." in n for n, _ in host.model.named_parameters())
    host.drop_adapter("dropme")
    assert "dropme" not in host.adapters and "dropme" not in host.model.peft_config
    assert not any(".dropme." in n for n, _ in host.model.named_parameters())
    from opentinker.engine.host import UnknownAdapterError

    with pytest.raises(UnknownAdapterError, match="unknown adapter 'dropme'"):
        host.drop_adapter("dropme")
    assert issubclass(UnknownAdapterError, ValueError)
    with pytest.raises(ValueError, match="unknown adapter 'dropme'"):
        host.logprobs("dropme", [_datums()[0].tokens])
    # The name is free again, for a fresh adapter at version 0 that equals the base.
    assert host.create_adapter("dropme", SPEC) == 0
    seq = [_datums()[0].tokens]
    np.testing.assert_array_equal(host.logprobs("dropme", seq)[0], host.logprobs(None, seq)[0])
    host.drop_adapter("dropme")


def test_snapshot_is_frozen_at_the_source_version(host) -> None:
    _trained(host, "src")
    seqs = [d.tokens for d in _datums(2)]
    params = SamplingParams(max_tokens=4, seed=11)
    before_lp = host.logprobs("src", seqs)
    before_sample = host.sample(["src"], [seqs[0][:6]], [params], [11])[0]
    assert host.snapshot("src", "src_at1") == host.version("src") == 1
    assert host.version("src_at1") == 1
    for a, b in zip(host.logprobs("src_at1", seqs), before_lp, strict=True):
        np.testing.assert_array_equal(a, b)
    _trained_more = host.forward_backward("src", _datums(1), "ppo", {}, 10.0)
    assert _trained_more[0] != 0.0
    host.optim_step("src", ADAM)
    assert host.version("src") == 2 and host.version("src_at1") == 1
    after = host.logprobs("src", seqs)
    assert max(np.abs(a - b).max() for a, b in zip(after, before_lp)) > 1e-4
    for a, b in zip(host.logprobs("src_at1", seqs), before_lp, strict=True):
        np.testing.assert_array_equal(a, b)
    again = host.sample(["src_at1"], [seqs[0][:6]], [params], [11])[0]
    assert again.tokens.tolist() == before_sample.tokens.tolist()
    np.testing.assert_array_equal(again.logprobs, before_sample.logprobs)
    with pytest.raises(ValueError, match="'src_at1' is frozen"):
        host.forward_backward("src_at1", _datums(1), "ppo", {}, 10.0)
    with pytest.raises(ValueError, match="'src_at1' is frozen"):
        host.optim_step("src_at1", ADAM)
    with pytest.raises(ValueError, match="already exists"):
        host.snapshot("src", "src_at1")
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        host.snapshot("nope", "x_snap")
    for name in ("src", "src_at1"):
        host.drop_adapter(name)


def test_save_then_load_restores_weights_optimizer_and_version(host, tmp_path) -> None:
    _trained(host, "orig", steps=2)
    path = tmp_path / "ckpt"
    assert host.save("orig", str(path)) == 2
    names = {p.name for p in path.iterdir()}
    assert names == {"adapter_config.json", "adapter_model.safetensors", "optimizer.safetensors",
                     "opentinker.json"}
    assert not [p for p in tmp_path.iterdir() if p.name != "ckpt"]  # no temporary left behind
    meta = json.loads((path / "opentinker.json").read_text())
    assert meta["version"] == 2 and meta["base_fingerprint"] == host.base_fingerprint
    assert host.load(str(path), "copy") == 2 and host.version("copy") == 2
    seqs = [d.tokens for d in _datums(4)]
    for a, b in zip(host.logprobs("copy", seqs), host.logprobs("orig", seqs), strict=True):
        np.testing.assert_array_equal(a, b)
    # One identical step on both: equal weights only if the AdamW moments came back too.
    for name in ("orig", "copy"):
        host.forward_backward(name, _datums(5), "ppo", {}, 10.0)
        host.optim_step(name, ADAM)
    w_orig, w_copy = _weights(host, "orig"), _weights(host, "copy")
    for key in w_orig:
        torch.testing.assert_close(w_copy[key], w_orig[key], rtol=0, atol=0)
    # A fresh adapter given the same weights but no moments would step elsewhere.
    host.load(str(path), "no_moments")
    host.adapters["no_moments"].optimizer.state.clear()
    host.forward_backward("no_moments", _datums(5), "ppo", {}, 10.0)
    host.optim_step("no_moments", ADAM)
    w_fresh = _weights(host, "no_moments")
    assert max((w_fresh[k] - w_orig[k]).abs().max().item() for k in w_orig) > 1e-6
    # Saving again over the folder replaces it whole.
    assert host.save("orig", str(path)) == 3
    assert json.loads((path / "opentinker.json").read_text())["version"] == 3
    frozen = host.load(str(path), "frozen_copy", trainable=False)
    assert frozen == 3 and not host.adapters["frozen_copy"].trainable
    for name in ("orig", "copy", "no_moments", "frozen_copy"):
        host.drop_adapter(name)


def test_load_errors_name_the_path_and_leave_the_host_serving(host, tmp_path) -> None:
    _trained(host, "good")
    path = tmp_path / "good"
    host.save("good", str(path))
    known = set(host.adapters)

    def broken(name: str, edit) -> str:  # type: ignore[no-untyped-def]
        import shutil

        dst = tmp_path / name
        shutil.copytree(path, dst)
        edit(dst)
        return str(dst)

    meta = json.loads((path / "opentinker.json").read_text())
    cases = [
        (str(tmp_path / "absent"), "no such adapter folder"),
        (broken("no_meta", lambda d: (d / "opentinker.json").unlink()), "missing opentinker.json"),
        (broken("no_weights", lambda d: (d / "adapter_model.safetensors").unlink()),
         "missing adapter_model.safetensors"),
        (broken("bad_weights", lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00" * 20)),
         "adapter_model.safetensors is corrupt"),
        (broken("bad_opt", lambda d: (d / "optimizer.safetensors").write_bytes(b"junk")),
         "optimizer.safetensors is corrupt"),
        (broken("bad_meta", lambda d: (d / "opentinker.json").write_text("{not json")),
         "opentinker.json is corrupt"),
        (broken("other_base", lambda d: (d / "opentinker.json").write_text(
            json.dumps({**meta, "base_model": "other", "base_fingerprint": "0" * 16}))),
         "saved on base model 'other'"),
        (broken("other_rank", lambda d: (d / "opentinker.json").write_text(
            json.dumps({**meta, "spec": {**meta["spec"], "rank": 2}}))),
         "needs"),
    ]
    seq = [_datums()[0].tokens]
    before = host.logprobs("good", seq)[0]
    for where, message in cases:
        with pytest.raises(ValueError, match=message) as e:
            host.load(where, "loaded")
        assert where in str(e.value)
        assert set(host.adapters) == known and "loaded" not in host.model.peft_config
    np.testing.assert_array_equal(host.logprobs("good", seq)[0], before)
    assert host.load(str(path), "loaded") == 1  # the name was never taken
    for name in ("good", "loaded"):
        host.drop_adapter(name)


# ---------------------------------------------------------------------------------------------
# KL to the reference and entropy, against direct computations


def _direct_grad(host, name: str, datums: list[Datum], term) -> tuple[torch.Tensor, torch.Tensor]:  # type: ignore[no-untyped-def]
    """The gradient of ``term(logp_N, entropy_N)`` (and its value) from one plain forward of the
    PEFT model per datum (no prefix sharing, no position selection): ``logp_N`` and the
    full-vocabulary ``entropy_N`` at the loss positions, differentiated by autograd."""
    host.model.set_adapter(name)
    params = host.adapters[name].params
    for p in params:
        p.requires_grad_(True)
    try:
        logps, entropies = [], []
        for d in datums:
            ids = torch.as_tensor(d.tokens[None].astype(np.int64), device=host.device)
            logp_T_V = torch.log_softmax(host.model(input_ids=ids).logits[0, :-1].float(), -1)
            pos = torch.as_tensor(np.nonzero(d.loss_inputs["mask"][1:])[0], device=host.device)
            logps.append(logp_T_V[pos].gather(-1, ids[0, 1:][pos][:, None])[:, 0])
            entropies.append(-(logp_T_V[pos].exp() * logp_T_V[pos]).sum(-1))
        value = term(torch.cat(logps), torch.cat(entropies))
        value.backward()
    finally:
        for p in params:
            p.requires_grad_(False)
    grads = _grads(host, name)
    _zero(host, name)
    return grads, value.detach()


def _fb(host, name: str, datums: list[Datum], config: dict, normalizer: float):  # type: ignore[no-untyped-def]
    """``forward_backward`` from zero gradients: ``(loss, metrics, gradient)``."""
    loss, metrics = host.forward_backward(name, datums, "ppo", config, normalizer)
    grads = _grads(host, name)
    _zero(host, name)
    return loss, metrics, grads


def _at_mask(d: Datum, row: np.ndarray) -> np.ndarray:
    return row[np.asarray(d.loss_inputs["mask"]) != 0]


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
def test_kl_penalty_adds_exactly_its_gradient(host, estimator: str) -> None:
    name = f"kl_{estimator}_pol"
    _trained(host, name)
    datums, normalizer, coef = _datums(7), 9.0, 0.3
    loss_plain, m_plain, g_plain = _fb(host, name, datums, {}, normalizer)
    loss_kl, m_kl, g_kl = _fb(host, name, datums, {f"kl_{estimator}": coef}, normalizer)
    assert "ref_logprobs" not in m_plain and f"kl_{estimator}/kl_mean" not in m_plain

    # Reference log-probs are the base model's (adapter off): ModelHost.logprobs(None, ...).
    ref_N = torch.cat([torch.as_tensor(_at_mask(d, r)) for d, r in
                       zip(datums, host.logprobs(None, [d.tokens for d in datums]), strict=True)])

    def kl(logp_N: torch.Tensor, entropy_N: torch.Tensor) -> torch.Tensor:
        x = logp_N - ref_N.to(logp_N.device)
        return {"k1": x, "k2": 0.5 * x**2, "k3": torch.exp(-x) + x - 1}[estimator]

    g_direct, _ = _direct_grad(host, name, datums, lambda lp, h: coef * kl(lp, h).sum() / normalizer)
    k = kl(torch.cat([torch.as_tensor(_at_mask(d, r)) for d, r in
                      zip(datums, host.logprobs(name, [d.tokens for d in datums]))]), ref_N)
    _close(g_kl - g_plain, g_direct)
    assert m_kl[f"kl_{estimator}/kl_mean"] == pytest.approx(k.mean().item(), rel=1e-4)
    assert m_kl[f"term/kl_{estimator}"] == pytest.approx(coef * k.sum().item() / normalizer, rel=1e-4)
    assert loss_kl == pytest.approx(loss_plain + coef * k.sum().item() / normalizer, rel=1e-4, abs=1e-7)

    # Given explicitly as a loss input, the same reference gives the same gradient.
    explicit = [Datum(tokens=d.tokens, loss_inputs={**d.loss_inputs, "ref_logprobs": r}) for d, r in
                zip(datums, host.logprobs(None, [d.tokens for d in datums]), strict=True)]
    host.forward_backward(name, explicit, "ppo", {f"kl_{estimator}": coef}, normalizer)
    _close(_grads(host, name), g_kl, 1e-4)
    _zero(host, name)
    host.drop_adapter(name)


def test_entropy_bonus_and_diagnostic_match_a_direct_computation(host) -> None:
    name = "ent_pol"
    _trained(host, name)
    datums, normalizer, coef = _datums(8), 11.0, 20.0  # large: near-uniform, H has a small gradient
    _, m_plain, g_plain = _fb(host, name, datums, {}, normalizer)
    _, m_ent, g_ent = _fb(host, name, datums, {"entropy": coef}, normalizer)
    g_direct, h_sum = _direct_grad(host, name, datums, lambda lp, h: -coef * h.sum() / normalizer)
    h_mean = -h_sum.item() * normalizer / coef / m_plain["n_tokens"]
    _close(g_ent - g_plain, g_direct)
    # The diagnostic is the same entropy, with or without the bonus.
    assert m_plain["entropy"] == pytest.approx(h_mean, rel=1e-5)
    assert m_ent["entropy/entropy_mean"] == pytest.approx(h_mean, rel=1e-5)
    host.drop_adapter(name)


def test_forward_backward_diagnostics_are_exact_over_chunks(host) -> None:
    name = "diag_pol"
    _trained(host, name)
    datums = _datums(9, n=7)
    _, whole = host.forward_backward(name, datums, "importance_sampling", {}, 20.0, chunk=64)
    g_whole = _grads(host, name)
    _zero(host, name)
    _, split = host.forward_backward(name, datums, "importance_sampling", {}, 20.0, chunk=2)
    _close(_grads(host, name), g_whole, 1e-4)
    _zero(host, name)
    trainer = np.concatenate([_at_mask(d, r) for d, r in
                              zip(datums, host.logprobs(name, [d.tokens for d in datums]))])
    sampler = np.concatenate([_at_mask(d, d.loss_inputs["sampler_logprobs"]) for d in datums])
    diff = np.abs(trainer - sampler)
    for m in (whole, split):
        assert m["n_tokens"] == len(diff)
        assert m["logp_diff_mean"] == pytest.approx(diff.mean(), rel=1e-5)
        assert m["logp_diff_p95"] == pytest.approx(np.percentile(diff, 95), rel=1e-5)
        assert m["logp_diff_max"] == pytest.approx(diff.max(), rel=1e-5)
        assert m["entropy_proxy"] == pytest.approx(-trainer.mean(), rel=1e-5)
        assert {"clip_frac", "approx_kl", "entropy", "ratio_mean"} <= set(m)
    with pytest.raises(ValueError, match="'value'.*value head"):
        host.forward_backward(name, datums, "value", {}, 1.0)
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        host.forward_backward(name, datums, "nope", {}, 1.0)
    host.drop_adapter(name)


def test_dpo_pairs_stay_whole_across_chunks_and_use_the_base_as_reference(host) -> None:
    name = "dpo_pol"
    _trained(host, name)
    datums = []
    for i, d in enumerate(_datums(10, n=6)):  # pairs (0, 1), (2, 3), (4, 5)
        mask = d.loss_inputs["mask"]
        sign = 1.0 if i % 2 == 0 else -1.0
        datums.append(Datum(tokens=d.tokens, loss_inputs={
            "mask": mask, "pair_sign": mask * sign, "pair_id": mask * (i // 2)}))
    loss_a, m_a = host.forward_backward(name, datums, "dpo", {"beta": 0.5}, 3.0, chunk=64)
    g_a = _grads(host, name)
    _zero(host, name)
    loss_b, m_b = host.forward_backward(name, datums, "dpo", {"beta": 0.5}, 3.0, chunk=1)
    _close(_grads(host, name), g_a, 1e-4)
    _zero(host, name)
    assert loss_b == pytest.approx(loss_a, rel=1e-5) and m_a["n_pairs"] == m_b["n_pairs"] == 3
    # Direct: margins from ModelHost.logprobs with and without the adapter.
    pol = host.logprobs(name, [d.tokens for d in datums])
    ref = host.logprobs(None, [d.tokens for d in datums])
    sums = [(_at_mask(d, p).sum() - _at_mask(d, r).sum()) for d, p, r in zip(datums, pol, ref)]
    margins = np.array([sums[0] - sums[1], sums[2] - sums[3], sums[4] - sums[5]])
    expected = np.sum(np.log1p(np.exp(-0.5 * margins))) / 3.0
    assert loss_a == pytest.approx(expected, rel=1e-4)
    assert m_a["reward_accuracy"] == pytest.approx(np.mean(margins > 0))
    host.drop_adapter(name)


def test_vocabulary_projection_in_row_blocks_is_exact(host, monkeypatch) -> None:
    """The head runs HEAD_ROWS rows at a time (checkpointed): same loss, gradient, entropy."""
    from opentinker.engine import shared_forward

    name = "blocks_pol"
    _trained(host, name)
    datums, config = _datums(12, n=6), {"kl_k2": 0.2, "entropy": 0.5}
    loss_a, m_a, g_a = _fb(host, name, datums, config, 13.0)
    lp_a = host.logprobs(name, [d.tokens for d in datums])
    monkeypatch.setattr(shared_forward, "HEAD_ROWS", 3)
    loss_b, m_b, g_b = _fb(host, name, datums, config, 13.0)
    lp_b = host.logprobs(name, [d.tokens for d in datums])
    assert loss_b == pytest.approx(loss_a, rel=1e-6)
    _close(g_b, g_a, 1e-5)
    for key in ("entropy", "kl_k2/kl_mean", "entropy/entropy_mean", "logp_diff_p95"):
        assert m_b[key] == pytest.approx(m_a[key], rel=1e-6), key
    for a, b in zip(lp_a, lp_b, strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    host.drop_adapter(name)


def test_training_parts_count_a_shared_prefix_once_and_keep_pairs_whole() -> None:
    """``chunks`` with a token bound: a group's datums that share a prompt cost the prompt once,
    a datum longer than the bound is a part of its own, and a preference pair is never cut."""
    from opentinker.engine.train_batches import chunks

    def datum(tokens, pair=None):
        t = np.asarray(tokens, dtype=np.int32)
        inputs = {"mask": np.ones(len(t), np.float32)}
        if pair is not None:
            inputs["pair_id"] = np.full(len(t), pair, np.float32)
        return Datum(tokens=t, loss_inputs=inputs)

    prompt = list(range(100, 160))  # 60 tokens
    group = [datum(prompt + [k, k + 1, k + 2, k + 3]) for k in range(4)]  # 60 + 4 x 4 = 76 new tokens
    other = [datum(list(range(300, 364)) + [k]) for k in range(2)]  # 65 + 1
    sizes = [len(p) for p in chunks(group + other, 64, max_tokens=80)]
    assert sizes == [4, 2]  # the group fits in 80 only because its prompt counts once
    assert [len(p) for p in chunks(group + other, 64, max_tokens=70)] == [2, 2, 2]  # a new part computes the prompt again
    assert [len(p) for p in chunks([datum(range(200))] * 2, 64, max_tokens=50)] == [1, 1]
    assert [len(p) for p in chunks(group, 64, max_tokens=0)] == [4]
    pairs = [datum(range(40), pair=1), datum(range(50, 90), pair=1), datum(range(40), pair=2)]
    assert [len(p) for p in chunks(pairs, 64, max_tokens=50)] == [2, 1]
