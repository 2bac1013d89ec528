"""Tests of :mod:`learners`: hand-computed values, gradients and invariances (DESIGN §5)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learners import (
    ADVANTAGES,
    LOSSES,
    EpisodeBatch,
    LossKind,
    LossOutput,
    assemble,
    compute_loss,
    estimate,
    loss_token_count,
    losses_of_kind,
    trajectory_to_datum,
    turn_rewards,
)
from learners.advantages import register_advantage
from learners.losses import register_loss
from protocols import codec
from protocols.messages import (
    ForwardBackward,
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    StopReason,
    Trajectory,
    Turn,
)

# ---------------------------------------------------------------------------------------------
# Advantages


GROUP_ESTIMATORS = ["dr_grpo", "grpo", "rloo"]
OUTCOME_ESTIMATORS = sorted(n for n, e in ADVANTAGES.items() if not e.needs_values and not e.needs_game_values)


def adv(name: str, rewards, group_ids=None, config=None, roles=None) -> np.ndarray:  # type: ignore[no-untyped-def]
    """One-turn episodes through the registry; the advantage of each, in input order."""
    batch = EpisodeBatch.outcomes(rewards, group_ids, roles)
    per_turn = ADVANTAGES[name](batch, None, config or {}).per_turn
    assert all(a.dtype == np.float32 and a.shape == (1,) for a in per_turn)
    return np.concatenate(per_turn) if per_turn else np.zeros(0, np.float32)


def test_registry_names_and_descriptors() -> None:
    assert set(ADVANTAGES) == {"grpo", "dr_grpo", "rloo", "reinforce_ema", "role_ema",
                               "turn_returns", "gae", "exact_gae"}
    assert {n for n, e in ADVANTAGES.items() if e.stateful} == {"reinforce_ema", "role_ema"}
    assert {n for n, e in ADVANTAGES.items() if e.needs_values} == {"gae"}
    assert {n for n, e in ADVANTAGES.items() if e.needs_game_values} == {"exact_gae"}
    assert set(LOSSES) == {"ppo", "importance_sampling", "cispo", "value", "entropy", "kl_k1",
                           "kl_k2", "kl_k3", "move_values", "dpo", "ipo", "sft"}
    assert losses_of_kind(LossKind.POLICY) == ["cispo", "importance_sampling", "ppo"]
    assert losses_of_kind(LossKind.PENALTY) == ["entropy", "kl_k1", "kl_k2", "kl_k3", "move_values"]


@pytest.mark.parametrize("name", sorted(ADVANTAGES) + sorted(LOSSES))
def test_every_registered_function_cites_a_paper_and_an_equation(name: str) -> None:
    import re

    doc = (ADVANTAGES[name].fn if name in ADVANTAGES else LOSSES[name].fn).__doc__ or ""
    assert re.search(r"(19|20)\d\d", doc), f"{name}: no year of a paper in {doc[:80]!r}"
    assert re.search(r"eq\.|§|Algorithm|=", doc), f"{name}: no equation in {doc[:80]!r}"


def test_dr_grpo_hand_computed() -> None:
    np.testing.assert_array_equal(adv("dr_grpo", [1.0, -1.0, 2.0, 0.0]), [0.5, -1.5, 1.5, -0.5])


def test_grpo_hand_computed() -> None:
    got = adv("grpo", [1.0, -1.0, 2.0, 0.0], config={"eps": 0.0})
    std = math.sqrt(1.25)  # population std: ((.25 + 2.25 + 2.25 + .25) / 4) ** .5
    np.testing.assert_allclose(got, np.array([0.5, -1.5, 1.5, -0.5]) / std, rtol=1e-6)
    got_eps = adv("grpo", [1.0, -1.0, 2.0, 0.0])
    np.testing.assert_allclose(got_eps, np.array([0.5, -1.5, 1.5, -0.5]) / (std + 1e-6), rtol=1e-6)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS + ["turn_returns"])
def test_degenerate_groups_give_exact_zeros(name: str) -> None:
    np.testing.assert_array_equal(adv(name, [3.0]), [0.0])
    # 0.1 * 3 / 3 != 0.1 in floating point: a plain r - mean would leave residues.
    np.testing.assert_array_equal(adv(name, [0.1, 0.1, 0.1]), [0, 0, 0])


@pytest.mark.parametrize("name", OUTCOME_ESTIMATORS)
def test_permutation_within_group_permutes_advantages(name: str) -> None:
    rewards = np.array([0.3, -1.0, 2.5, 0.0, 1.0])
    roles = np.array(["a", "b", "a", "b", "a"])
    perm = np.array([3, 0, 4, 1, 2])
    got = adv(name, rewards, roles=roles)
    np.testing.assert_allclose(adv(name, rewards[perm], roles=roles[perm]), got[perm], rtol=1e-6)


@pytest.mark.parametrize("name", GROUP_ESTIMATORS + ["turn_returns"])
def test_group_split_invariance(name: str) -> None:
    """Each group's advantages depend only on that group, wherever its members sit."""
    rewards = [1.0, 5.0, -1.0, 7.0, 2.0, 0.0, 6.0]
    group_ids = [0, 1, 0, 1, 0, 0, 2]
    got = adv(name, rewards, group_ids)
    for g in set(group_ids):
        idx = [i for i, gid in enumerate(group_ids) if gid == g]
        np.testing.assert_array_equal(got[idx], adv(name, [rewards[i] for i in idx]))
    assert got[6] == 0.0  # a group of one


def test_group_estimators_work_per_group_in_input_order() -> None:
    got = adv("dr_grpo", [1.0, 10.0, -1.0, 20.0], [7, 3, 7, 3])
    np.testing.assert_array_equal(got, np.array([1.0, -5.0, -1.0, 5.0], np.float32))


def test_estimate_and_batch_errors() -> None:
    with pytest.raises(ValueError, match=r"'nope'.*dr_grpo.*grpo"):
        estimate("nope", EpisodeBatch.outcomes([1.0]), None, {})
    with pytest.raises(ValueError, match="group_ids_D"):
        EpisodeBatch.outcomes([1.0, 2.0], [0])
    with pytest.raises(ValueError, match="finite"):
        EpisodeBatch.outcomes([1.0, float("nan")])
    with pytest.raises(ValueError, match="'gae' needs critic values"):
        estimate("gae", EpisodeBatch.outcomes([1.0]), None, {})


def test_duplicate_advantage_registration_raises() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_advantage("dr_grpo")(ADVANTAGES["dr_grpo"].fn)
    try:
        register_advantage("_test_tmp")(ADVANTAGES["dr_grpo"].fn)
        with pytest.raises(ValueError, match="already registered"):
            register_advantage("_test_tmp")(ADVANTAGES["dr_grpo"].fn)
    finally:
        ADVANTAGES.pop("_test_tmp", None)


# ---------------------------------------------------------------------------------------------
# Losses

# Sampler log-probs 0, so ratio = exp(logp). clip 0.2 / 0.2 -> range [0.8, 1.2].
#   r=1.1 A=+1: unclipped,  l = -1.1
#   r=1.5 A=+1: clipped,    l = -1.2
#   r=0.5 A=-1: clipped,    l = +0.8
#   r=0.9 A=-1: unclipped,  l = +0.9
#   r=0.5 A=+1: outside the range but min picks r*A (pessimistic): unclipped, l = -0.5
PPO_RATIOS = [1.1, 1.5, 0.5, 0.9, 0.5]
PPO_ADV = [1.0, 1.0, -1.0, -1.0, 1.0]


def _ppo_case() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    logp_N = torch.tensor(np.log(PPO_RATIOS), dtype=torch.float32, requires_grad=True)
    inputs = {"advantages": torch.tensor(PPO_ADV), "sampler_logprobs": torch.zeros(5)}
    return logp_N, inputs


def test_ppo_hand_computed_loss_and_clip_frac() -> None:
    logp_N, inputs = _ppo_case()
    out = compute_loss("ppo", logp_N, inputs, {})
    assert isinstance(out, LossOutput)
    assert out.loss_sum.shape == ()
    assert out.loss_sum.item() == pytest.approx(-1.1 - 1.2 + 0.8 + 0.9 - 0.5, abs=1e-6)
    assert out.metrics["clip_frac"] == pytest.approx(2 / 5)
    assert out.metrics["n_tokens"] == 5.0
    assert out.metrics["ratio_mean"] == pytest.approx(np.mean(PPO_RATIOS), rel=1e-6)
    assert all(isinstance(v, float) for v in out.metrics.values())


def test_ppo_clip_higher_is_asymmetric() -> None:
    logp_N, inputs = _ppo_case()
    out = compute_loss("ppo", logp_N, inputs, {"clip_low": 0.2, "clip_high": 0.28})
    assert out.loss_sum.item() == pytest.approx(-1.1 - 1.28 + 0.8 + 0.9 - 0.5, abs=1e-6)


def test_ppo_gradient_is_minus_adv_times_ratio_where_unclipped_else_zero() -> None:
    logp_N, inputs = _ppo_case()
    compute_loss("ppo", logp_N, inputs, {}).loss_sum.backward()
    ratio = np.array(PPO_RATIOS)
    clipped = np.array([False, True, True, False, False])
    expected = np.where(clipped, 0.0, -np.array(PPO_ADV) * ratio)
    assert logp_N.grad is not None
    np.testing.assert_allclose(logp_N.grad.numpy(), expected, atol=1e-6)


def test_importance_sampling_hand_computed_and_gradient() -> None:
    # ratios 3 (truncated to 2) and 0.5; A = 1, -2.
    logp_N = torch.tensor([math.log(3.0), math.log(0.5)], requires_grad=True)
    inputs = {"advantages": torch.tensor([1.0, -2.0]), "sampler_logprobs": torch.zeros(2)}
    out = compute_loss("importance_sampling", logp_N, inputs, {"is_truncation": 2.0})
    expected = -(2.0 * math.log(3.0) * 1.0) - (0.5 * math.log(0.5) * -2.0)
    assert out.loss_sum.item() == pytest.approx(expected, abs=1e-6)
    assert out.metrics["clip_frac"] == pytest.approx(0.5)
    out.loss_sum.backward()
    assert logp_N.grad is not None
    np.testing.assert_allclose(logp_N.grad.numpy(), [-2.0, 1.0], atol=1e-6)


def test_diagnostics_hand_computed() -> None:
    trainer = np.array([-0.5, -1.0, -2.0, -0.1])
    sampler = np.array([-0.6, -1.0, -1.5, -0.4])
    entropy = np.array([1.0, 2.0, 0.5, 0.25])
    logp_N = torch.tensor(trainer, dtype=torch.float32)
    inputs = {"advantages": torch.ones(4), "sampler_logprobs": torch.tensor(sampler)}
    for name in losses_of_kind(LossKind.POLICY):
        m = compute_loss(name, logp_N, inputs, {}).metrics
        log_r = trainer - sampler
        assert m["approx_kl"] == pytest.approx(np.mean(np.exp(log_r) - 1 - log_r), rel=1e-5)
        assert m["logp_diff_mean"] == pytest.approx(np.mean(np.abs(log_r)), rel=1e-5)
        assert m["logp_diff_p95"] == pytest.approx(np.percentile(np.abs(log_r), 95), rel=1e-5)
        assert m["logp_diff_max"] == pytest.approx(0.5, rel=1e-5)
        assert m["entropy_proxy"] == pytest.approx(np.mean(-trainer), rel=1e-6)
        assert m["approx_kl"] >= 0.0
        assert "entropy" not in m  # only when the runtime passes full-vocabulary entropies
        with_h = compute_loss(name, logp_N, {**inputs, "entropy": torch.tensor(entropy)}, {})
        assert with_h.metrics["entropy"] == pytest.approx(entropy.mean())


POLICY_LOSSES = losses_of_kind(LossKind.POLICY)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_on_policy_matches_reinforce(name: str) -> None:
    """At ratio 1 both losses have the REINFORCE gradient -A."""
    logp_N = torch.tensor([-0.3, -1.2, -2.0], requires_grad=True)
    inputs = {"advantages": torch.tensor([1.0, -0.5, 2.0]), "sampler_logprobs": logp_N.detach()}
    out = compute_loss(name, logp_N, inputs, {})
    out.loss_sum.backward()
    assert logp_N.grad is not None
    np.testing.assert_allclose(logp_N.grad.numpy(), [-1.0, 0.5, -2.0], atol=1e-6)
    assert out.metrics["clip_frac"] == 0.0
    assert out.metrics["approx_kl"] == pytest.approx(0.0, abs=1e-7)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_micro_batch_split_invariance(name: str) -> None:
    gen = torch.Generator().manual_seed(0)
    n = 37
    logp = -torch.rand(n, generator=gen) * 3
    sampler = logp + 0.3 * torch.randn(n, generator=gen)
    adv = torch.randn(n, generator=gen)
    normalizer = float(n)

    whole_N = logp.clone().requires_grad_(True)
    whole = compute_loss(name, whole_N, {"advantages": adv, "sampler_logprobs": sampler}, {})
    (whole.loss_sum / normalizer).backward()

    split_N = logp.clone().requires_grad_(True)
    total = torch.zeros(())
    for part in (slice(0, 15), slice(15, n)):
        inputs = {"advantages": adv[part], "sampler_logprobs": sampler[part]}
        out = compute_loss(name, split_N[part], inputs, {})
        (out.loss_sum / normalizer).backward()
        total = total + out.loss_sum.detach() / normalizer
    assert total.item() == pytest.approx((whole.loss_sum / normalizer).item(), abs=1e-6)
    assert whole_N.grad is not None and split_N.grad is not None
    torch.testing.assert_close(split_N.grad, whole_N.grad)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_empty_micro_batch(name: str) -> None:
    logp_N = torch.zeros(0, requires_grad=True)
    inputs = {"advantages": torch.zeros(0), "sampler_logprobs": torch.zeros(0)}
    out = compute_loss(name, logp_N, inputs, {})
    assert out.loss_sum.item() == 0.0 and out.metrics["n_tokens"] == 0.0
    out.loss_sum.backward()


def test_compute_loss_errors() -> None:
    logp_N = torch.zeros(2)
    with pytest.raises(ValueError, match=r"'nope'.*importance_sampling.*ppo"):
        compute_loss("nope", logp_N, {}, {})
    with pytest.raises(ValueError, match=r"'ppo'.*'sampler_logprobs'"):
        compute_loss("ppo", logp_N, {"advantages": torch.zeros(2)}, {})
    with pytest.raises(ValueError, match=r"'importance_sampling'.*'advantages'"):
        compute_loss("importance_sampling", logp_N, {"sampler_logprobs": torch.zeros(2)}, {})
    with pytest.raises(ValueError, match="shape"):
        inputs = {"advantages": torch.zeros(3), "sampler_logprobs": torch.zeros(2)}
        compute_loss("ppo", logp_N, inputs, {})


def test_duplicate_loss_registration_raises() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_loss("ppo")(LOSSES["ppo"])


# ---------------------------------------------------------------------------------------------
# Assembly

POLICY = PolicyRef(kind=PolicyKind.ADAPTER, name="main", version=0)


def _turn(obs: list[int], sampled: list[int], logp: list[float], reward: float = 0.0) -> Turn:
    return Turn(
        obs_tokens=np.array(obs, np.int32),
        sampled_tokens=np.array(sampled, np.int32),
        sampler_logprobs=np.array(logp, np.float32),
        policy=POLICY,
        stop_reason=StopReason.STOP,
        parse=ParseOutcome.OK,
        reward=reward,
    )


def _traj(episode_id: int, group_id: int, reward: float, seat: str = "player_0") -> Trajectory:
    turns = [_turn([1, 2, 3], [4, 5], [-0.1, -0.2]), _turn([6, 7], [8], [-0.3])]
    return Trajectory(
        episode_id=episode_id, group_id=group_id, seat=seat, seed=0, policy="main",
        turns=turns, total_reward=reward,
    )


def test_trajectory_to_datum_literal_tokens_and_mask() -> None:
    datum = trajectory_to_datum(_traj(0, 0, 1.0), 0.75)
    assert datum.tokens.dtype == np.int32
    assert datum.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    li = datum.loss_inputs
    assert li["mask"].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    np.testing.assert_array_equal(
        li["sampler_logprobs"], np.array([0, 0, 0, -0.1, -0.2, 0, 0, -0.3], np.float32)
    )
    assert li["advantages"].tolist() == [0, 0, 0, 0.75, 0.75, 0, 0, 0.75]
    assert all(a.dtype == np.float32 and a.shape == (8,) for a in li.values())


def test_trajectory_to_datum_survives_the_wire() -> None:
    datum = trajectory_to_datum(_traj(0, 0, 1.0), 0.75)
    msg = ForwardBackward(adapter="main", datums=[datum], loss="ppo", normalizer=3.0)
    _, back = codec.decode(codec.encode(msg))
    assert back.datums[0].tokens.tolist() == datum.tokens.tolist()
    for key, value in datum.loss_inputs.items():
        np.testing.assert_array_equal(back.datums[0].loss_inputs[key], value)


def test_trajectory_to_datum_errors() -> None:
    bad = Trajectory(
        episode_id=42, group_id=0, seat="player_1", seed=0, policy="main", total_reward=0.0,
        turns=[_turn([1], [2], [-0.1]), _turn([3], [4, 5], [-0.1])],
    )
    with pytest.raises(ValueError, match=r"episode 42.*turn 1"):
        trajectory_to_datum(bad, 1.0)
    no_obs = Trajectory(
        episode_id=7, group_id=0, seat="p", seed=0, policy="main", total_reward=0.0,
        turns=[_turn([], [2], [-0.1])],
    )
    with pytest.raises(ValueError, match=r"episode 7.*no observation tokens"):
        trajectory_to_datum(no_obs, 1.0)
    with pytest.raises(ValueError, match="no turns"):
        trajectory_to_datum(
            Trajectory(episode_id=1, group_id=0, seat="p", seed=0, policy="main", turns=[],
                       total_reward=0.0),
            1.0,
        )


def test_assemble_values_and_metrics() -> None:
    trajs = [_traj(0, 0, 1.0), _traj(1, 0, -1.0), _traj(2, 1, 3.0), _traj(3, 1, 3.0)]
    datums, metrics, state = assemble(trajs, "dr_grpo", {})
    assert [d.loss_inputs["advantages"][3] for d in datums] == [1.0, -1.0, 0.0, 0.0]
    assert state is None
    assert metrics == {
        "reward_mean": 1.5,
        "adv_mean": 0.0,
        "adv_abs_mean": 0.5,
        "frac_zero_adv_groups": 0.5,
        "n_datums": 4.0,
        "n_loss_tokens": 12.0,
    }
    assert loss_token_count(datums) == 12


def test_assemble_is_independent_of_arrival_order() -> None:
    trajs = [
        _traj(3, 1, 0.0, "b"), _traj(0, 0, 1.0, "a"), _traj(0, 0, 2.0, "b"),
        _traj(1, 0, -4.0, "a"), _traj(3, 1, 5.0, "a"),
    ]
    ref_datums, ref_metrics, _ = assemble(trajs, "grpo", {})
    for seed in range(5):
        order = np.random.default_rng(seed).permutation(len(trajs))
        datums, metrics, _ = assemble([trajs[i] for i in order], "grpo", {})
        assert metrics == ref_metrics
        for d, r in zip(datums, ref_datums, strict=True):
            assert d.tokens.tolist() == r.tokens.tolist()
            for key in r.loss_inputs:
                np.testing.assert_array_equal(d.loss_inputs[key], r.loss_inputs[key])


def test_assemble_rejects_duplicates_and_handles_empty() -> None:
    with pytest.raises(ValueError, match=r"duplicate.*episode 0"):
        assemble([_traj(0, 0, 1.0), _traj(0, 0, 2.0)], "dr_grpo", {})
    datums, metrics, state = assemble([], "dr_grpo", {})
    assert datums == [] and metrics["n_datums"] == 0.0 and state is None


def test_assembled_datums_feed_the_loss() -> None:
    """End to end: flatten at mask == 1, as the runtime does, and take the loss."""
    datums, _, _ = assemble([_traj(0, 0, 1.0), _traj(1, 0, -1.0)], "dr_grpo", {})
    picks = [d.loss_inputs["mask"] == 1 for d in datums]
    inputs = {
        key: torch.from_numpy(
            np.concatenate([d.loss_inputs[key][m] for d, m in zip(datums, picks)])
        )
        for key in ("advantages", "sampler_logprobs")
    }
    logp_N = inputs["sampler_logprobs"].clone().requires_grad_(True)  # on-policy
    out = compute_loss("ppo", logp_N, inputs, {})
    normalizer = loss_token_count(datums)
    assert logp_N.numel() == normalizer == 6
    (out.loss_sum / normalizer).backward()
    assert logp_N.grad is not None
    np.testing.assert_allclose(logp_N.grad.numpy(), [-1 / 6] * 3 + [1 / 6] * 3, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# Turn-level credit


def _two_turn_group() -> list[Trajectory]:
    # Episode 0: reward 0.5 after turn 0 and 1.0 after turn 1.
    # Episode 1: no reward at its turns; its total (-1) arrived after the opponent's move,
    # so it is credited to its last turn.
    a = Trajectory(episode_id=0, group_id=5, seat="player_0", seed=0, policy="main",
                   total_reward=1.5, turns=[_turn([1, 2, 3], [4, 5], [-0.1, -0.2], 0.5),
                                            _turn([6, 7], [8], [-0.3], 1.0)])
    b = Trajectory(episode_id=1, group_id=5, seat="player_0", seed=0, policy="main",
                   total_reward=-1.0, turns=[_turn([1, 2, 3], [9], [-0.4]),
                                             _turn([6], [10, 11], [-0.5, -0.6])])
    return [b, a]


def test_turn_returns_literal_datums_for_a_two_turn_group() -> None:
    # gamma 0.5: returns-to-go A: [0.5 + 0.5 * 1, 1] = [1, 1]; B: [0.5 * -1, -1] = [-0.5, -1].
    # Turn 0 group mean (1 - 0.5) / 2 = 0.25 -> 0.75, -0.75; turn 1 mean 0 -> 1, -1.
    (da, db), metrics, state = assemble(_two_turn_group(), "turn_returns", {"gamma": 0.5})
    assert state is None
    assert da.tokens.tolist() == [1, 2, 3, 4, 5, 6, 7, 8]
    assert da.loss_inputs["mask"].tolist() == [0, 0, 0, 1, 1, 0, 0, 1]
    assert da.loss_inputs["advantages"].tolist() == [0, 0, 0, 0.75, 0.75, 0, 0, 1.0]
    np.testing.assert_array_equal(da.loss_inputs["sampler_logprobs"],
                                  np.array([0, 0, 0, -0.1, -0.2, 0, 0, -0.3], np.float32))
    assert db.tokens.tolist() == [1, 2, 3, 9, 6, 10, 11]
    assert db.loss_inputs["mask"].tolist() == [0, 0, 0, 1, 0, 1, 1]
    assert db.loss_inputs["advantages"].tolist() == [0, 0, 0, -0.75, 0, -1.0, -1.0]
    np.testing.assert_array_equal(db.loss_inputs["sampler_logprobs"],
                                  np.array([0, 0, 0, -0.4, 0, -0.5, -0.6], np.float32))
    assert all(v.dtype == np.float32 for d in (da, db) for v in d.loss_inputs.values())
    assert metrics["adv_abs_mean"] == pytest.approx((0.75 + 1 + 0.75 + 1) / 4)
    # The outcome estimator puts one advantage (total - group mean = +-1.25) on both turns.
    (oa, ob), _, _ = assemble(_two_turn_group(), "dr_grpo", {})
    assert oa.loss_inputs["advantages"].tolist() == [0, 0, 0, 1.25, 1.25, 0, 0, 1.25]
    assert ob.loss_inputs["advantages"].tolist() == [0, 0, 0, -1.25, 0, -1.25, -1.25]


def test_turn_rewards_credit_the_residue_to_the_last_turn() -> None:
    a, b = sorted(_two_turn_group(), key=lambda t: t.episode_id)
    np.testing.assert_array_equal(turn_rewards(a), [0.5, 1.0])
    np.testing.assert_array_equal(turn_rewards(b), [0.0, -1.0])


def test_turn_returns_hand_computed_with_a_turn_reached_once() -> None:
    batch = EpisodeBatch(group_ids_D=np.array([0, 0, 0, 1]),
                         turn_rewards=(np.array([0.0, 2.0, 1.0]), np.array([1.0]),
                                       np.array([0.0, 0.0]), np.array([3.0, 4.0])),
                         roles_D=("p",) * 4)
    per_turn = ADVANTAGES["turn_returns"](batch, None, {}).per_turn
    # gamma 1: returns [3, 3, 1], [1], [0, 0]; turn 0 mean 4/3; turn 1 mean 1.5;
    # turn 2 reached by one episode only: 0. Group 1 has one episode: all 0.
    np.testing.assert_allclose(per_turn[0], [3 - 4 / 3, 1.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(per_turn[1], [1 - 4 / 3], rtol=1e-6)
    np.testing.assert_allclose(per_turn[2], [-4 / 3, -1.5], rtol=1e-6)
    np.testing.assert_array_equal(per_turn[3], [0.0, 0.0])
    # With one turn per episode it is Dr. GRPO.
    one = EpisodeBatch.outcomes([1.0, 4.0, -2.0], [3, 3, 3])
    np.testing.assert_array_equal(
        np.concatenate(ADVANTAGES["turn_returns"](one, None, {"gamma": 0.3}).per_turn),
        np.concatenate(ADVANTAGES["dr_grpo"](one, None, {}).per_turn))


@pytest.mark.parametrize("name", OUTCOME_ESTIMATORS)
def test_permuting_multi_turn_episodes_permutes_per_turn_advantages(name: str) -> None:
    rng = np.random.default_rng(4)
    turns = [rng.normal(size=k) for k in (1, 3, 2, 3, 1, 2)]
    batch = EpisodeBatch(group_ids_D=np.array([0, 0, 0, 1, 1, 1]), turn_rewards=tuple(turns),
                         roles_D=("a", "b", "a", "b", "a", "b"))
    perm = [4, 2, 0, 5, 1, 3]
    permuted = EpisodeBatch(group_ids_D=batch.group_ids_D[perm],
                            turn_rewards=tuple(turns[i] for i in perm),
                            roles_D=tuple(batch.roles_D[i] for i in perm))
    want = ADVANTAGES[name](batch, None, {"gamma": 0.7})
    got = ADVANTAGES[name](permuted, None, {"gamma": 0.7})
    for g, i in zip(got.per_turn, perm, strict=True):
        np.testing.assert_allclose(g, want.per_turn[i], rtol=1e-6)
    assert got.state == want.state


def test_stateful_estimator_state_flows_through_assemble() -> None:
    trajs = [_traj(0, 0, 1.0, "a"), _traj(0, 0, -1.0, "b"), _traj(1, 1, 3.0, "a")]
    datums, _, state = assemble(trajs, "role_ema", {"decay": 0.5}, None, "kuhn")
    assert [d.loss_inputs["advantages"][3] for d in datums] == [1.0, -1.0, 3.0]
    # a: 0.5 * 0 + 0.5 * mean(1, 3) = 1; b: 0.5 * -1.
    assert state is not None and dict(state.baselines) == {"kuhn/a": 1.0, "kuhn/b": -0.5}
    datums, _, state2 = assemble(trajs, "role_ema", {"decay": 0.5}, state, "kuhn")
    assert [d.loss_inputs["advantages"][3] for d in datums] == [0.0, -0.5, 2.0]
    assert state2 is not None and dict(state2.updates) == {"kuhn/a": 2, "kuhn/b": 2}


def test_equal_totals_give_exact_zeros_whatever_their_turn_rewards() -> None:
    def two_turns(eid: int, r0: float, r1: float) -> Trajectory:
        return Trajectory(episode_id=eid, group_id=0, seat="p", seed=0, policy="main",
                          total_reward=0.3, turns=[_turn([1], [2], [-0.1], r0), _turn([3], [4], [-0.1], r1)])

    datums, metrics, _ = assemble([two_turns(0, 0.1, 0.2), two_turns(1, 0.2, 0.1)], "dr_grpo", {})
    assert all(not d.loss_inputs["advantages"].any() for d in datums)
    assert metrics["frac_zero_adv_groups"] == 1.0
