"""Every learner selectable by name in a job, run for real on the local backend with
tiny-random: one job trains eight policies side by side (one per advantage estimator, GAE with
a learned critic among them, each policy loss, a KL and an entropy term, PPO's epochs and
minibatches), sharing one
scheduler and base model; the learner's estimator state is reported, checkpointed and
restored; a bad name is refused before start."""

from __future__ import annotations

import json

import msgspec
import pytest
from conftest import DEVICE

from opentinker.config import JobConfig
from opentinker.training.learner import check_job
from opentinker.control.runtime import Job

GAME = "kuhn_poker_v0"
POLICIES = {
    # name: (opponents, overrides of [train])
    "p_grpo": ({"random": 1}, {"advantage": "grpo", "loss": "ppo", "dual_clip": 3.0}),
    "p_drgrpo": ({"random": 1}, {"advantage": "dr_grpo", "loss": "importance_sampling"}),
    "p_rloo": ({"random": 1}, {"advantage": "rloo", "loss": "cispo"}),
    "p_ema": ({"random": 1}, {"advantage": "reinforce_ema", "kl_coef": 0.1, "kl_estimator": "k3"}),
    "p_role": ({"self": 1}, {"advantage": "role_ema", "entropy_coef": 0.01, "ema_decay": 0.5}),
    "p_turn": ({"random": 1}, {"advantage": "turn_returns", "gamma": 0.9, "kl_coef": 0.05,
                               "kl_estimator": "k1", "loss": "cispo"}),
    "p_gae": ({"random": 1}, {"advantage": "gae", "gamma": 0.9, "lam": 0.8, "value_coef": 0.5}),
    "p_epochs": ({"random": 1}, {"advantage": "gae", "loss": "ppo", "epochs": 2, "minibatches": 2}),
}
ONE_UPDATE = [n for n, (_, t) in POLICIES.items() if t.get("epochs", 1) * t.get("minibatches", 1) == 1]


def _cfg(**over) -> JobConfig:
    raw = {
        "game": GAME,
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE},
        "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 120},
        "train": {"groups_per_step": 2, "group_size": 2, "lr": 1e-2},
        "sampling": {"max_tokens": 3},
        "eval": {"hands_per_stratum": 1, "head_to_head_per_stratum": 0, "cross_play_per_stratum": 0,
                 "exact": False},
        "policies": [{"name": n, "opponents": o, "train": t} for n, (o, t) in POLICIES.items()],
    }
    raw.update(over)
    return msgspec.convert(raw, JobConfig)


@pytest.fixture(scope="module")
def job(tiny_path):
    j = Job(_cfg(), tiny_path)
    yield j
    j.shutdown()


POLICY_DIAGNOSTICS = ("clip_frac", "approx_kl", "entropy", "entropy_proxy", "logp_diff_mean",
                      "logp_diff_p95", "logp_diff_max", "ratio_mean")


def test_every_learner_trains_in_one_job_with_its_diagnostics(job) -> None:
    first = job.coordinator("train_step", 1)
    m = job.coordinator("train_step", 2)
    for name in POLICIES:
        key = f"train/{name}/"
        updates = 1 if name in ONE_UPDATE else 4
        assert first[key + "version"] == updates and m[key + "version"] == 2 * updates, name
        assert m[key + "updates"] == updates, name
        assert m[key + "n_datums"] > 0 and m[key + "loss/n_tokens"] == m[key + "n_loss_tokens"]
        for diag in POLICY_DIAGNOSTICS:
            assert diag in {k.removeprefix(key + "loss/") for k in m}, (name, diag)
        assert 0.0 <= m[key + "loss/clip_frac"] <= 1.0 and m[key + "loss/approx_kl"] >= 0.0
        assert m[key + "loss/logp_diff_p95"] <= m[key + "loss/logp_diff_max"] + 1e-9
        assert 0.0 <= m[key + "frac_zero_adv_groups"] <= 1.0
    # The sampler and the trainer agree on step 1 (on-policy, same weights): the log-prob
    # mismatch is numerical noise and no token is clipped.
    for name in ONE_UPDATE:
        assert first[f"train/{name}/loss/logp_diff_max"] < 1e-3, name
        assert first[f"train/{name}/loss/clip_frac"] == 0.0, name
    # Two passes in two minibatches: four updates a step; all but the first minibatch of the
    # first pass score the datums with weights the step already moved.
    assert first["train/p_epochs/loss/logp_diff_max"] > 1e-3 and first["train/p_gae/loss/logp_diff_max"] < 1e-3
    assert first["train/p_epochs/loss/clip_frac"] > 0.0 and first["train/p_epochs/loss/approx_kl"] > 0.0
    # ... and the value term is clipped against the values read before the first update.
    assert first["train/p_epochs/loss/value/value_clip_frac"] > 0.0 == first["train/p_gae/loss/value/value_clip_frac"]
    assert first["train/p_epochs/loss/value/n_tokens"] == first["train/p_epochs/n_value_positions"]
    # Penalty terms report under their own names, and only where configured.
    assert m["train/p_ema/loss/kl_k3/kl_mean"] >= 0.0 and "train/p_ema/loss/term/kl_k3" in m
    assert "train/p_turn/loss/kl_k1/kl_mean" in m
    assert first["train/p_ema/loss/kl_k3/kl_mean"] == pytest.approx(0.0, abs=1e-9)  # adapter == base
    assert m["train/p_role/loss/entropy/entropy_mean"] > 0.0
    assert not [k for k in m if "/kl_k" in k and not k.startswith(("train/p_ema", "train/p_turn"))]
    assert "train/p_grpo/loss/dual_clip_frac" in m
    # Stateful estimators report their baselines, per role for role_ema: one per seat that
    # acted (in self-play both seats are the policy; tiny-random's first reply is usually
    # invalid and forfeits, so player_1 rarely acts).
    roles = {k for k in m if k.startswith("train/p_role/baseline/")}
    assert roles and roles <= {f"train/p_role/baseline/{GAME}/player_{i}" for i in (0, 1)}
    assert "train/p_ema/baseline/all" in m
    assert not [k for k in m if "/baseline/" in k and not k.startswith(("train/p_role", "train/p_ema"))]
    # PPO with a critic: the value loss at one position per turn, beside the policy loss. The
    # fresh value head is zero at step 1 and has learned something by step 2.
    for step in (first, m):
        assert step["train/p_gae/loss/value/n_tokens"] == step["train/p_gae/n_value_positions"] == step["train/p_gae/turns"]
        assert step["train/p_gae/loss/term/value"] > 0.0 and "train/p_gae/loss/value/explained_variance" in step
    assert first["train/p_gae/loss/value/value_mean"] == 0.0 and m["train/p_gae/loss/value/value_mean"] != 0.0
    assert not [k for k in m if "/loss/value/" in k and not k.startswith(("train/p_gae", "train/p_epochs"))]


def test_learner_state_round_trips_and_is_restored(job) -> None:
    states = job.learner_states()
    assert json.loads(json.dumps(states)) == states  # JSON-able
    for name in ("p_ema", "p_role"):
        assert states[name]["advantage"] == POLICIES[name][1]["advantage"]
        assert max(states[name]["advantage_state"]["updates"].values()) == 2
    assert states["p_grpo"]["advantage_state"] is None and states["p_grpo"]["steps_trained"] == 2
    m = job.coordinator("train_step", 3)
    after = job.learner_states()["p_role"]["advantage_state"]
    assert max(after["updates"].values()) == 3
    assert {f"train/p_role/baseline/{k}": v for k, v in after["baselines"].items()} == {
        k: v for k, v in m.items() if k.startswith("train/p_role/baseline/")}
    # Restoring puts the learner back exactly; a state of another estimator is refused.
    job.load_learner_states({"p_role": states["p_role"], "p_ema": states["p_ema"]})
    again = job.learner_states()
    assert again["p_role"] == states["p_role"] and again["p_ema"] == states["p_ema"]
    with pytest.raises(ValueError, match="written by advantage 'role_ema'"):
        job.load_learner_states({"p_ema": states["p_role"]})


def test_bad_names_are_refused_before_start_with_the_known_ones(tiny_path) -> None:
    def cfg(train: dict, policy_train: dict | None = None) -> JobConfig:
        return msgspec.convert({"train": train, "policies": [
            {"name": "main", "train": policy_train or {}}]}, JobConfig)

    with pytest.raises(ValueError, match=r"train.advantage 'ppo' is not an advantage estimator; "
                                         r"known: \['dr_grpo', 'exact_gae', 'gae', 'grpo', 'reinforce_ema', "
                                         r"'rloo', 'role_ema', 'turn_returns'\]"):
        check_job(cfg({"advantage": "ppo"}))
    check_job(cfg({"advantage": "gae"}))  # PPO with a learned critic
    with pytest.raises(ValueError, match=r"train.loss 'dpo' is not a policy loss \(dpo is a "
                                         r"preference loss\); known: \['cispo', "
                                         r"'importance_sampling', 'ppo'\]"):
        check_job(cfg({"loss": "dpo"}))
    with pytest.raises(ValueError, match=r"policies\[main\].train.loss 'kl_k3' is not a policy"):
        check_job(cfg({}, {"loss": "kl_k3"}))
    with pytest.raises(ValueError, match=r"train.loss 'nope'"):
        Job(cfg({"loss": "nope"}), tiny_path)  # refused before any component starts
    with pytest.raises(ValueError, match="kl_estimator"):
        cfg({"kl_estimator": "k4"})
    with pytest.raises(ValueError, match="dual_clip"):
        cfg({"dual_clip": 0.5})
