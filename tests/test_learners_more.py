"""Tests of the added estimators, losses, preference losses and aggregators (DESIGN §5):
hand-computed values, gradients against the analytic derivative, and invariances."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from learners import (
    ADVANTAGES,
    LOSSES,
    EmaState,
    EpisodeBatch,
    LossKind,
    chunked_token_logprobs,
    compute_loss,
    discounted_returns,
    dpo,
    explained_variance,
    gae_1d,
    ipo,
    losses_of_kind,
    sequence_mean,
    split_terms,
    token_sum,
)
from learners.losses import register_loss

# ---------------------------------------------------------------------------------------------
# Group and sequence advantages


def _adv(name: str, rewards, state=None, config=None, group_ids=None, roles=None):  # type: ignore[no-untyped-def]
    out = ADVANTAGES[name](EpisodeBatch.outcomes(rewards, group_ids, roles), state, config or {})
    return np.concatenate(out.per_turn), out.state


def test_rloo_hand_computed_and_permutation() -> None:
    rewards = np.array([1.0, -1.0, 2.0, 0.0])
    # A_0 = 1 - (-1 + 2 + 0) / 3 = 2/3; A_1 = -1 - 1 = -2; A_2 = 2 - 0 = 2; A_3 = 0 - 2/3.
    adv, state = _adv("rloo", rewards)
    assert adv.dtype == np.float32 and state is None
    np.testing.assert_allclose(adv, [2 / 3, -2.0, 2.0, -2 / 3], rtol=1e-6)
    perm = np.array([2, 0, 3, 1])
    np.testing.assert_allclose(_adv("rloo", rewards[perm])[0], adv[perm], rtol=1e-6)
    np.testing.assert_array_equal(_adv("rloo", [5.0])[0], [0.0])
    adv_g, _ = _adv("rloo", [1.0, 10.0, 3.0, 20.0], group_ids=[0, 1, 0, 1])
    np.testing.assert_allclose(adv_g, [-2.0, -10.0, 2.0, 10.0])


def test_reinforce_ema_uses_pre_update_baseline_and_round_trips() -> None:
    adv, state = _adv("reinforce_ema", [1.0, 3.0], None, {"decay": 0.5})
    np.testing.assert_array_equal(adv, [1.0, 3.0])  # fresh baseline is 0
    assert state == EmaState({"all": 1.0}, {"all": 1})  # 0.5 * 0 + 0.5 * 2
    adv, state2 = _adv("reinforce_ema", [0.0, 4.0], state, {"decay": 0.5})
    np.testing.assert_array_equal(adv, [-1.0, 3.0])  # scored against 1.0, not the new 1.5
    assert state2 == EmaState({"all": 1.5}, {"all": 2})
    # Round trip through JSON (what a checkpoint holds) gives the same continuation.
    rebuilt = EmaState.from_json(json.loads(json.dumps(state2.to_json())))
    assert rebuilt == state2
    a1, s1 = _adv("reinforce_ema", [2.0], state2, {"decay": 0.5})
    a2, s2 = _adv("reinforce_ema", [2.0], rebuilt, {"decay": 0.5})
    np.testing.assert_array_equal(a1, a2)
    assert s1 == s2
    # Groups do not matter to a batch-wide baseline.
    np.testing.assert_array_equal(_adv("reinforce_ema", [1.0, 3.0], None, {}, [0, 1])[0], [1, 3])
    with pytest.raises(ValueError, match="decay"):
        _adv("reinforce_ema", [1.0], None, {"decay": 1.0})


def test_ema_state_json_errors() -> None:
    with pytest.raises(ValueError, match="baselines"):
        EmaState.from_json({"baselines": {"a": "x"}, "updates": {}})
    with pytest.raises(ValueError, match="updates"):
        EmaState.from_json({"baselines": {}, "updates": {"a": -1}})
    with pytest.raises(ValueError, match="needs keys"):
        EmaState.from_json([1, 2])


def test_role_ema_per_key_baselines_and_round_trip() -> None:
    rewards = np.array([1.0, -1.0, 3.0, 0.5])
    roles = ["g/p0", "g/p1", "g/p0", "h/p0"]
    state_in = EmaState({"g/p1": 2.0, "other": 7.0}, {"g/p1": 4, "other": 1})
    adv, state = _adv("role_ema", rewards, state_in, {"decay": 0.5}, roles=roles)
    np.testing.assert_array_equal(adv, [1.0, -3.0, 3.0, 0.5])
    assert state.baselines == {"g/p0": 1.0, "g/p1": 0.5, "h/p0": 0.25, "other": 7.0}
    assert state.updates == {"g/p0": 1, "g/p1": 5, "h/p0": 1, "other": 1}
    assert state_in.baselines == {"g/p1": 2.0, "other": 7.0}  # not mutated
    # Permuting the batch permutes the advantages and leaves the state unchanged.
    perm = [3, 1, 0, 2]
    adv_p, state_p = _adv("role_ema", rewards[perm], state_in, {"decay": 0.5},
                          roles=[roles[i] for i in perm])
    np.testing.assert_array_equal(adv_p, adv[perm])
    assert state_p == state
    a1, s1 = _adv("role_ema", [2.0], EmaState.from_json(state.to_json()), {"decay": 0.5},
                  roles=["g/p0"])
    np.testing.assert_array_equal(a1, [1.0])
    assert s1.baselines["g/p0"] == 1.5


def test_discounted_returns_hand_computed() -> None:
    np.testing.assert_allclose(discounted_returns(np.array([1.0, 0.0, 2.0]), 0.5),
                               [1.0 + 0.25 * 2.0, 1.0, 2.0])
    np.testing.assert_allclose(discounted_returns(np.array([1.0, 1.0]), 1.0), [2.0, 1.0])


def test_gae_hand_computed() -> None:
    rewards, values = np.array([1.0, 2.0]), np.array([0.5, 1.0, 0.0])
    adv, ret = gae_1d(rewards, values, 0.9, 0.5)
    d1 = 2.0 + 0.9 * 0.0 - 1.0
    d0 = 1.0 + 0.9 * 1.0 - 0.5
    np.testing.assert_allclose(adv, [d0 + 0.45 * d1, d1], rtol=1e-6)
    np.testing.assert_allclose(ret, adv + values[:-1], rtol=1e-6)
    with pytest.raises(ValueError, match="K\\+1"):
        gae_1d(rewards, values[:2], 1.0, 1.0)
    # Through the registry: per trajectory, value targets beside the advantages.
    batch = EpisodeBatch(group_ids_D=np.array([0, 0]), turn_rewards=(rewards, np.array([3.0])),
                         roles_D=("p", "p"), values=(values, np.array([1.0, 0.0])))
    out = ADVANTAGES["gae"](batch, None, {"gamma": 0.9, "lam": 0.5})
    np.testing.assert_allclose(out.per_turn[0], adv, rtol=1e-6)
    np.testing.assert_allclose(out.per_turn[1], [2.0])
    assert out.value_targets is not None
    np.testing.assert_allclose(out.value_targets[1], [3.0])
    with pytest.raises(ValueError, match="K\\+1"):
        EpisodeBatch(group_ids_D=np.array([0]), turn_rewards=(rewards,), roles_D=("p",),
                     values=(values[:2],))


def test_gae_lam1_is_returns_minus_values_and_lam0_is_td() -> None:
    rng = np.random.default_rng(0)
    rewards, values = rng.normal(size=6), np.append(rng.normal(size=6), 0.0)
    adv, ret = gae_1d(rewards, values, 0.8, 1.0)
    disc = discounted_returns(rewards, 0.8)
    np.testing.assert_allclose(adv, disc - values[:-1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(ret, disc, rtol=1e-5, atol=1e-6)
    adv0, _ = gae_1d(rewards, values, 0.8, 0.0)
    np.testing.assert_allclose(adv0, rewards + 0.8 * values[1:] - values[:-1], rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# PPO dual clip and CISPO


def test_ppo_dual_clip_changes_only_negative_advantages_with_large_ratio() -> None:
    ratios = [1.1, 5.0, 0.5, 5.0, 2.0]
    adv = [1.0, 1.0, -1.0, -1.0, -1.0]
    inputs = {"advantages": torch.tensor(adv), "sampler_logprobs": torch.zeros(5)}

    def per_token(config: dict[str, float]) -> tuple[np.ndarray, np.ndarray, dict[str, float]]:
        losses, grads = [], []
        for i in range(5):
            logp = torch.tensor([math.log(ratios[i])], requires_grad=True)
            one = {k: v[i : i + 1] for k, v in inputs.items()}
            out = compute_loss("ppo", logp, one, config)
            out.loss_sum.backward()
            assert logp.grad is not None
            losses.append(out.loss_sum.item())
            grads.append(logp.grad.item())
        logp_N = torch.tensor(np.log(ratios), dtype=torch.float32)
        return np.array(losses), np.array(grads), compute_loss("ppo", logp_N, inputs, config).metrics

    plain_l, plain_g, plain_m = per_token({})
    dual_l, dual_g, dual_m = per_token({"dual_clip": 3.0})
    # Only token 3 (A < 0, ratio 5 > c = 3) changes: loss -r A = 5 -> -c A = 3, gradient -> 0.
    np.testing.assert_allclose(dual_l, [*plain_l[:3], 3.0, plain_l[4]], rtol=1e-6)
    np.testing.assert_allclose(plain_l[3], 5.0, rtol=1e-6)
    np.testing.assert_allclose(dual_g, [*plain_g[:3], 0.0, plain_g[4]], atol=1e-6)
    assert plain_g[3] == pytest.approx(5.0, rel=1e-6)
    assert dual_m["dual_clip_frac"] == pytest.approx(1 / 5)
    assert dual_m["clip_frac"] == pytest.approx(plain_m["clip_frac"] + 1 / 5)
    assert "dual_clip_frac" not in plain_m
    # 0 disables, exactly.
    zero_l, zero_g, _ = per_token({"dual_clip": 0.0})
    np.testing.assert_array_equal(zero_l, plain_l)
    np.testing.assert_array_equal(zero_g, plain_g)
    with pytest.raises(ValueError, match="dual_clip"):
        compute_loss("ppo", torch.zeros(1), {k: v[:1] for k, v in inputs.items()},
                     {"dual_clip": 0.5})


def test_cispo_hand_computed_gradient_and_diagnostics() -> None:
    # ratios 2 (clipped to 1.2), 0.5 (kept: no lower bound by default), 1.1.
    ratios, adv = [2.0, 0.5, 1.1], [1.0, -2.0, 0.5]
    logp_N = torch.tensor(np.log(ratios), dtype=torch.float32, requires_grad=True)
    inputs = {"advantages": torch.tensor(adv), "sampler_logprobs": torch.zeros(3)}
    out = compute_loss("cispo", logp_N, inputs, {"eps_high": 0.2})
    weights = np.array([1.2, 0.5, 1.1])
    expected = -np.sum(weights * np.array(adv) * np.log(ratios))
    assert out.loss_sum.item() == pytest.approx(expected, rel=1e-5)
    out.loss_sum.backward()
    assert logp_N.grad is not None
    np.testing.assert_allclose(logp_N.grad.numpy(), -weights * np.array(adv), rtol=1e-6)
    assert out.metrics["clip_frac"] == pytest.approx(1 / 3)
    for key in ("approx_kl", "logp_diff_mean", "logp_diff_p95", "n_tokens"):
        assert key in out.metrics
    low = compute_loss("cispo", logp_N, inputs, {"eps_low": 0.2, "eps_high": 0.2})
    assert low.metrics["clip_frac"] == pytest.approx(2 / 3)


# ---------------------------------------------------------------------------------------------
# Objectives


def test_one_registry_and_penalty_terms_by_name() -> None:
    assert losses_of_kind(LossKind.POLICY) == ["cispo", "importance_sampling", "ppo"]
    assert LOSSES["kl_k3"].needs == {"ref_logprobs"} and LOSSES["entropy"].needs == {"entropy"}
    assert LOSSES["dpo"].kind is LossKind.PREFERENCE and LOSSES["sft"].kind is LossKind.SUPERVISED
    with pytest.raises(ValueError, match="already registered"):
        register_loss("value")(LOSSES["value"].fn)
    with pytest.raises(ValueError, match=r"'nope'.*kl_k1.*ppo.*value"):
        compute_loss("nope", torch.zeros(1), {}, {})
    with pytest.raises(ValueError, match=r"'value'.*'old_values'"):
        compute_loss("value", torch.zeros(1), {"value_targets": torch.zeros(1)}, {})
    config, terms = split_terms({"clip_low": 0.2, "kl_k3": 0.05, "entropy": 0.0, "kl_k1": 1})
    assert config == {"clip_low": 0.2} and terms == {"kl_k3": 0.05, "kl_k1": 1.0}
    # The critic's loss rides the same way; its clip range stays in the shared config.
    config, terms = split_terms({"clip_low": 0.2, "value": 0.5, "value_clip": 0.1})
    assert config == {"clip_low": 0.2, "value_clip": 0.1} and terms == {"value": 0.5}


def test_value_loss_hand_computed_and_gradient() -> None:
    # eps 0.5. Token 0: v 2, R 0, old 1 -> clip(2) = 1.5: max(4, 2.25) = 4, grad v - R = 2.
    # Token 1: v 2, R 3, old 1 -> clip(2) = 1.5: max(1, 2.25) = 2.25, grad 0 (clipped).
    # Token 2: v 1, R 1, old 1 -> 0, grad 0.
    values_N = torch.tensor([2.0, 2.0, 1.0], requires_grad=True)
    inputs = {"value_targets": torch.tensor([0.0, 3.0, 1.0]), "old_values": torch.ones(3)}
    out = compute_loss("value", values_N, inputs, {"value_clip": 0.5})
    assert out.loss_sum.item() == pytest.approx(0.5 * (4.0 + 2.25 + 0.0))
    out.loss_sum.backward()
    assert values_N.grad is not None
    np.testing.assert_allclose(values_N.grad.numpy(), [2.0, 0.0, 0.0])
    assert out.metrics["value_clip_frac"] == pytest.approx(1 / 3)
    assert out.metrics["value_mse"] == pytest.approx(5 / 3)
    assert out.metrics["n_tokens"] == 3.0
    assert out.metrics["value_mean"] == pytest.approx(5 / 3) and out.metrics["target_mean"] == pytest.approx(4 / 3)
    unclipped = compute_loss("value", values_N, inputs, {"value_clip": 0.0})
    assert unclipped.loss_sum.item() == pytest.approx(0.5 * (4.0 + 1.0))
    scaled = compute_loss("value", values_N, inputs, {"value_clip": 0.5, "coef": 0.25})
    assert scaled.loss_sum.item() == pytest.approx(0.25 * out.loss_sum.item())


def test_explained_variance_hand_computed() -> None:
    targets = torch.tensor([1.0, 2.0, 3.0, 4.0])  # Var = 1.25
    values = torch.tensor([1.0, 2.0, 2.0, 5.0])  # R - V = [0, 0, 1, -1]: Var = 0.5
    assert explained_variance(values, targets) == pytest.approx(1 - 0.5 / 1.25)
    assert explained_variance(targets, targets) == 1.0
    assert explained_variance(torch.full((4,), 2.5), targets) == pytest.approx(0.0)  # a constant
    assert explained_variance(targets.flip(0), targets) < 0  # worse than a constant
    assert explained_variance(values, torch.ones(4)) == 0.0  # nothing to explain
    assert explained_variance(values[:1], targets[:1]) == 0.0


def test_entropy_loss_hand_computed_and_gradient() -> None:
    logits = torch.tensor([[0.0, 1.0, 2.0], [1.0, 1.0, 1.0]], requires_grad=True)
    logp_all = torch.log_softmax(logits, -1)
    entropy_N = -(logp_all.exp() * logp_all).sum(-1)
    logp_N = logp_all[:, 0].detach()
    out = compute_loss("entropy", logp_N, {"entropy": entropy_N}, {"coef": 0.1})
    assert out.metrics["entropy_mean"] == pytest.approx(entropy_N.mean().item())
    assert out.metrics["n_tokens"] == 2.0
    assert out.loss_sum.item() == pytest.approx(-0.1 * entropy_N.sum().item())
    out.loss_sum.backward()
    # dH/dz_v = -p_v (log p_v + H); the uniform row is at the maximum: gradient 0.
    p = logp_all.detach().exp()
    analytic = -0.1 * -(p * (logp_all.detach() + entropy_N.detach()[:, None]))
    assert logits.grad is not None
    torch.testing.assert_close(logits.grad, analytic)
    assert entropy_N[1].item() == pytest.approx(math.log(3))


@pytest.mark.parametrize(
    ("name", "value", "grad"),
    [
        ("kl_k1", lambda x: x, lambda x: np.ones_like(x)),
        ("kl_k2", lambda x: 0.5 * x**2, lambda x: x),
        ("kl_k3", lambda x: np.exp(-x) + x - 1, lambda x: 1 - np.exp(-x)),
    ],
)
def test_kl_losses_hand_computed_and_gradient(name: str, value, grad) -> None:  # type: ignore[no-untyped-def]
    logp, ref = np.array([-1.0, -0.5, -2.0]), np.array([-1.5, -0.5, -1.0])
    x = logp - ref
    logp_N = torch.tensor(logp, dtype=torch.float32, requires_grad=True)
    out = compute_loss(name, logp_N, {"ref_logprobs": torch.tensor(ref)}, {"coef": 0.5})
    assert out.loss_sum.item() == pytest.approx(0.5 * value(x).sum(), rel=1e-5)
    assert out.metrics["kl_mean"] == pytest.approx(value(x).mean(), rel=1e-5)
    assert out.metrics["n_tokens"] == 3.0
    out.loss_sum.backward()
    assert logp_N.grad is not None
    np.testing.assert_allclose(logp_N.grad.numpy(), 0.5 * grad(x), rtol=1e-5, atol=1e-7)


def test_kl_k3_matches_its_written_form() -> None:
    logp, ref = torch.tensor([-1.0, -3.0]), torch.tensor([-2.0, -1.0])
    out = compute_loss("kl_k3", logp, {"ref_logprobs": ref}, {})
    expected = (torch.exp(ref - logp) - (ref - logp) - 1).sum()
    assert out.loss_sum.item() == pytest.approx(expected.item(), rel=1e-6)
    assert out.loss_sum.item() >= 0


def test_sft_hand_computed_and_gradient() -> None:
    logp_N = torch.tensor([-0.5, -2.0], requires_grad=True)
    out = compute_loss("sft", logp_N, {}, {})
    assert out.loss_sum.item() == pytest.approx(2.5)
    assert out.metrics == {"n_tokens": 2.0, "nll_mean": 1.25}
    weighted = compute_loss("sft", logp_N, {"weights": torch.tensor([2.0, 0.0])}, {})
    assert weighted.loss_sum.item() == pytest.approx(1.0)
    weighted.loss_sum.backward()
    assert logp_N.grad is not None
    np.testing.assert_allclose(logp_N.grad.numpy(), [-2.0, 0.0])


@pytest.mark.parametrize("name", ["value", "entropy", "kl_k1", "kl_k2", "kl_k3", "sft"])
def test_objectives_empty_and_split_invariance(name: str) -> None:
    gen = torch.Generator().manual_seed(1)
    n = 11
    first = torch.randn(n, generator=gen)
    inputs = {
        "value_targets": torch.randn(n, generator=gen),
        "old_values": torch.randn(n, generator=gen),
        "entropy": torch.rand(n, generator=gen),
        "ref_logprobs": -torch.rand(n, generator=gen),
    }
    whole_N = first.clone().requires_grad_(True)
    whole = compute_loss(name, whole_N, inputs, {})
    if name != "entropy":  # entropy's gradient flows to inputs["entropy"], not logp_N
        (whole.loss_sum / n).backward()
    split_N = first.clone().requires_grad_(True)
    total = 0.0
    for part in (slice(0, 4), slice(4, n)):
        out = compute_loss(name, split_N[part], {k: v[part] for k, v in inputs.items()}, {})
        if name != "entropy":
            (out.loss_sum / n).backward()
        total += out.loss_sum.item() / n
    assert total == pytest.approx(whole.loss_sum.item() / n, abs=1e-6)
    torch.testing.assert_close(split_N.grad, whole_N.grad)
    empty = compute_loss(name, torch.zeros(0), {k: v[:0] for k, v in inputs.items()}, {})
    assert empty.loss_sum.item() == 0.0 and empty.metrics["n_tokens"] == 0.0


# ---------------------------------------------------------------------------------------------
# Preferences


def _pairs() -> tuple[torch.Tensor, ...]:
    pc = torch.tensor([-3.0, -5.0], requires_grad=True)
    pr = torch.tensor([-4.0, -4.0], requires_grad=True)
    rc, rr = torch.tensor([-3.5, -5.0]), torch.tensor([-3.5, -4.5])
    return pc, pr, rc, rr


def test_dpo_hand_computed_and_gradient() -> None:
    pc, pr, rc, rr = _pairs()
    h = np.array([(-3.0 + 3.5) - (-4.0 + 3.5), (-5.0 + 5.0) - (-4.0 + 4.5)])  # [1, -0.5]
    out = dpo(pc, pr, rc, rr, beta=0.5)
    sig = lambda z: 1 / (1 + np.exp(-z))
    assert out.loss_sum.item() == pytest.approx(-np.log(sig(0.5 * h)).sum(), rel=1e-6)
    assert out.metrics["reward_accuracy"] == 0.5
    assert out.metrics["reward_margin"] == pytest.approx(0.5 * h.mean())
    out.loss_sum.backward()
    dh = -0.5 * sig(-0.5 * h)
    np.testing.assert_allclose(pc.grad.numpy(), dh, rtol=1e-6)  # type: ignore[union-attr]
    np.testing.assert_allclose(pr.grad.numpy(), -dh, rtol=1e-6)  # type: ignore[union-attr]


def test_ipo_hand_computed_and_gradient() -> None:
    pc, pr, rc, rr = _pairs()
    h = np.array([1.0, -0.5])
    out = ipo(pc, pr, rc, rr, tau=0.25)  # target 1 / (2 tau) = 2
    assert out.loss_sum.item() == pytest.approx(((h - 2.0) ** 2).sum())
    out.loss_sum.backward()
    np.testing.assert_allclose(pc.grad.numpy(), 2 * (h - 2.0), rtol=1e-6)  # type: ignore[union-attr]
    np.testing.assert_allclose(pr.grad.numpy(), -2 * (h - 2.0), rtol=1e-6)  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="tau"):
        ipo(pc, pr, rc, rr, tau=0.0)


def _token_pairs() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    # Pair 7: chosen tokens 0, 3; rejected 1. Pair 2: chosen 4; rejected 2, 5 (interleaved).
    logp = torch.tensor([-1.0, -2.0, -0.5, -2.0, -5.0, -3.5])
    inputs = {
        "pair_sign": torch.tensor([1.0, -1.0, -1.0, 1.0, 1.0, -1.0]),
        "pair_id": torch.tensor([7.0, 7.0, 2.0, 7.0, 2.0, 2.0]),
        "ref_logprobs": torch.tensor([-1.5, -1.5, -1.0, -2.0, -5.0, -3.5]),
    }
    return logp, inputs


@pytest.mark.parametrize(("name", "fn", "config"),
                         [("dpo", dpo, {"beta": 0.5}), ("ipo", ipo, {"tau": 0.25})])
def test_token_adapter_sums_by_pair(name: str, fn, config: dict[str, float]) -> None:  # type: ignore[no-untyped-def]
    logp, inputs = _token_pairs()
    logp_N = logp.clone().requires_grad_(True)
    out = compute_loss(name, logp_N, inputs, config)
    # Sorted pair ids: pair 2 is b = 0, pair 7 is b = 1.
    pc = torch.tensor([-5.0, -3.0], requires_grad=True)
    pr = torch.tensor([-4.0, -2.0], requires_grad=True)
    ref = fn(pc, pr, torch.tensor([-5.0, -3.5]), torch.tensor([-4.5, -1.5]),
             *config.values())
    assert out.loss_sum.item() == pytest.approx(ref.loss_sum.item(), rel=1e-6)
    assert out.metrics["n_tokens"] == 6.0 and out.metrics["n_pairs"] == 2.0
    out.loss_sum.backward()
    ref.loss_sum.backward()
    g_c, g_r = pc.grad.numpy(), pr.grad.numpy()  # type: ignore[union-attr]
    expected = [g_c[1], g_r[1], g_r[0], g_c[1], g_c[0], g_r[0]]
    np.testing.assert_allclose(logp_N.grad.numpy(), expected, rtol=1e-6)  # type: ignore[union-attr]
    # Split into micro-batches that keep pairs whole: same total and gradient.
    split_N = logp.clone().requires_grad_(True)
    total = 0.0
    for idx in ([0, 1, 3], [2, 4, 5]):
        part = torch.tensor(idx)
        o = compute_loss(name, split_N[part], {k: v[part] for k, v in inputs.items()}, config)
        o.loss_sum.backward()
        total += o.loss_sum.item()
    assert total == pytest.approx(out.loss_sum.item(), rel=1e-6)
    torch.testing.assert_close(split_N.grad, logp_N.grad)
    with pytest.raises(ValueError, match="chosen and rejected"):
        compute_loss(name, logp[:1], {k: v[:1] for k, v in inputs.items()}, config)


def test_chunked_token_logprobs_matches_direct() -> None:
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=gen, dtype=torch.float64)
    weight = torch.randn(11, 5, generator=gen, dtype=torch.float64)
    targets = torch.randint(0, 11, (7,), generator=gen)
    h1, w1 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    direct = torch.log_softmax((h1 @ w1.T).float(), -1).gather(1, targets[:, None]).squeeze(1)
    h2, w2 = hidden.clone().requires_grad_(True), weight.clone().requires_grad_(True)
    chunked = chunked_token_logprobs(h2, w2, targets, chunk=3)
    torch.testing.assert_close(chunked, direct)
    coef = torch.arange(7, dtype=torch.float32)
    (direct * coef).sum().backward()
    (chunked * coef).sum().backward()
    # float32 logits; log_softmax and logsumexp round differently in the backward.
    torch.testing.assert_close(h2.grad, h1.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(w2.grad, w1.grad, rtol=1e-5, atol=1e-5)
    # Analytic: d logp_t / d h_t = W[y_t] - sum_v p_v W[v].
    p = torch.softmax(hidden @ weight.T, -1)
    analytic = (weight[targets] - p @ weight) * coef[:, None].double()
    torch.testing.assert_close(h2.grad, analytic, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(chunked_token_logprobs(hidden, weight, targets, 100), direct)
    assert chunked_token_logprobs(hidden[:0], weight, targets[:0], 2).shape == (0,)


# ---------------------------------------------------------------------------------------------
# Aggregation


def test_token_sum_and_sequence_mean_hand_computed() -> None:
    loss_N = torch.tensor([1.0, 3.0, 2.0, 6.0, 4.0])
    seq_N = torch.tensor([5, 5, 9, 9, 9])
    assert token_sum(loss_N, 10.0).item() == pytest.approx(1.6)
    # Sequence 5: mean 2; sequence 9: mean 4; over n_sequences 4 (two elsewhere in the step).
    assert sequence_mean(loss_N, seq_N, 4).item() == pytest.approx(1.5)
    with pytest.raises(ValueError, match="normalizer"):
        token_sum(loss_N, 0.0)
    assert sequence_mean(loss_N[:0], seq_N[:0], 3).item() == 0.0


@pytest.mark.parametrize("how", ["token_sum", "sequence_mean"])
def test_aggregation_micro_batch_split_invariance(how: str) -> None:
    gen = torch.Generator().manual_seed(3)
    base = torch.randn(12, generator=gen)
    seq_N = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 4, 4])
    weights = torch.randn(12, generator=gen)

    def aggregate(x_N: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        loss_N = (x_N * weights[idx]) ** 2
        if how == "token_sum":
            return token_sum(loss_N, 12.0)
        return sequence_mean(loss_N, seq_N[idx], 5)

    whole = base.clone().requires_grad_(True)
    total_whole = aggregate(whole, torch.arange(12))
    total_whole.backward()
    split = base.clone().requires_grad_(True)
    total_split = torch.zeros(())
    for idx in (torch.arange(0, 5), torch.arange(5, 12)):  # sequences kept whole
        part = aggregate(split[idx], idx)
        part.backward()
        total_split = total_split + part.detach()
    assert total_split.item() == pytest.approx(total_whole.item(), rel=1e-6)
    torch.testing.assert_close(split.grad, whole.grad)
    # Gradient against the analytic derivative: d/dx of w^2 x^2 is 2 w^2 x, over the weight.
    if how == "token_sum":
        torch.testing.assert_close(whole.grad, 2 * weights**2 * base / 12.0)


def test_kl_k3_stays_finite_far_off_the_reference():
    """logp - ref = -94 would overflow exp; the clamp keeps the penalty large and finite and
    leaves ordinary tokens exact."""
    import torch

    from learners import LOSSES
    from learners.losses import K3_CLAMP

    logp = torch.tensor([-95.0, -1.2], requires_grad=True)
    out = LOSSES["kl_k3"].fn(logp, {"ref_logprobs": torch.tensor([-1.0, -1.0])}, {"coef": 1.0})
    assert torch.isfinite(out.loss_sum)
    near = torch.tensor(0.2)
    exact = (torch.exp(near) - near - 1.0) + (torch.exp(torch.tensor(K3_CLAMP)) - 94.0 - 1.0)
    assert float(out.loss_sum) == pytest.approx(float(exact), rel=1e-5)
    out.loss_sum.backward()
    assert torch.isfinite(logp.grad).all()
