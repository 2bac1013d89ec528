"""Self-play data for offline learning: a run records its training trajectories, pure
functions turn them into SFT sequences and DPO pairs, and offline jobs train an adapter on
them through the scheduler (local backend, tiny-random)."""

from __future__ import annotations

import io
import json

import msgspec
import numpy as np
import pytest
from conftest import DEVICE
from rich.console import Console

from learners import pair_datums, preference_pairs, sft_datums
from opentinker.config import JobConfig
from opentinker.run import read_learner_states, run_job
from opentinker.training import trajectory_log
from protocols.messages import (
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    StopReason,
    Trajectory,
    Turn,
)

REF = PolicyRef(kind=PolicyKind.ADAPTER, name="main", version=2)


def _traj(eid: int, group: int, reward: float, sampled: list[int], seat: str = "player_0",
          seed: int = 5) -> Trajectory:
    turn = Turn(obs_tokens=np.array([1, 2], np.int32), sampled_tokens=np.array(sampled, np.int32),
                sampler_logprobs=np.array([-0.5] * len(sampled), np.float32), policy=REF,
                stop_reason=StopReason.STOP, parse=ParseOutcome.OK, reward=reward)
    return Trajectory(episode_id=eid, group_id=group, seat=seat, seed=seed, policy="main",
                      turns=[turn], total_reward=reward, step=3)


def test_sft_datums_keep_winners_with_their_sampled_tokens() -> None:
    trajs = [_traj(2, 0, 1.0, [7, 8]), _traj(1, 0, -1.0, [9]), _traj(3, 1, 0.5, [6])]
    datums = sft_datums(trajs, 0.0)
    assert [d.tokens.tolist() for d in datums] == [[1, 2, 7, 8], [1, 2, 6]]
    assert [d.loss_inputs["mask"].tolist() for d in datums] == [[0, 0, 1, 1], [0, 0, 1]]
    assert set(datums[0].loss_inputs) == {"mask"}
    assert len(sft_datums(trajs, -2.0)) == 3 and sft_datums(trajs, 1.0) == []


def test_preference_pairs_come_from_one_start_with_different_outcomes() -> None:
    trajs = [
        _traj(0, 0, -1.0, [10]), _traj(1, 0, 1.0, [11]), _traj(2, 0, 0.0, [12]),
        _traj(3, 0, 1.0, [11]),  # same tokens as episode 1 and the same reward: no pair
        _traj(4, 0, -1.0, [13], seat="player_1"),  # another seat: another start
        _traj(5, 1, 2.0, [14]), _traj(6, 1, 2.0, [15]),  # equal rewards: no pair
        _traj(7, 2, 1.0, [16], seed=6), _traj(8, 2, 0.0, [16], seed=6),  # same tokens: no pair
    ]
    pairs = preference_pairs(list(reversed(trajs)))
    got = [(c.episode_id, r.episode_id) for c, r in pairs]
    assert got == [(1, 0), (2, 0), (3, 0), (1, 2), (3, 2)]
    datums = pair_datums(pairs[:2], first_id=10)
    assert [d.tokens.tolist() for d in datums] == [[1, 2, 11], [1, 2, 10], [1, 2, 12], [1, 2, 10]]
    assert [d.loss_inputs["pair_sign"].tolist() for d in datums] == [[0, 0, 1], [0, 0, -1]] * 2
    assert [d.loss_inputs["pair_id"].tolist() for d in datums] == [[0, 0, 10]] * 2 + [[0, 0, 11]] * 2


def test_trajectory_log_round_trips_exactly(tmp_path) -> None:
    rng = np.random.default_rng(0)
    trajs = [_traj(i, 0, float(i), rng.integers(0, 49152, 3).tolist()) for i in range(3)]
    trajs[1] = msgspec.structs.replace(trajs[1], turns=[msgspec.structs.replace(
        trajs[1].turns[0], sampler_logprobs=rng.normal(size=3).astype(np.float32), game_value=0.9947916666666667)])
    path = tmp_path / "t" / "main.jsonl"
    trajectory_log.append(path, trajs[:2], "kuhn_poker_v0")
    trajectory_log.append(path, trajs[2:], "kuhn_poker_v0")
    records = trajectory_log.read(path)
    assert [r.game for r in records] == ["kuhn_poker_v0"] * 3 and records[0].step == 3
    for got, want in zip((trajectory_log.from_record(r) for r in records), trajs, strict=True):
        assert got.turns[0].sampled_tokens.dtype == np.int32
        assert got.turns[0].sampler_logprobs.dtype == np.float32
        np.testing.assert_array_equal(got.turns[0].sampler_logprobs, want.turns[0].sampler_logprobs)
        assert msgspec.json.encode(got.turns[0].sampled_tokens.tolist()) == msgspec.json.encode(
            want.turns[0].sampled_tokens.tolist())
        assert (got.episode_id, got.group_id, got.seed, got.seat, got.total_reward, got.turns[0].policy,
                got.turns[0].game_value) == (want.episode_id, want.group_id, want.seed, want.seat, want.total_reward,
                                             want.turns[0].policy, want.turns[0].game_value)
    assert [r.turns[0].game_value for r in records] == [None, 0.9947916666666667, None]
    assert path.read_text().count("game_value") == 1  # written only where there is one
    path.write_text(path.read_text() + '{"game": 3}\n')
    with pytest.raises(ValueError, match=r"main.jsonl:4: not a trajectory record"):
        trajectory_log.read(path)
    with pytest.raises(FileNotFoundError):
        trajectory_log.read(tmp_path / "none.jsonl")


def _job(tmp_path, **over) -> JobConfig:
    raw = {
        "name": "rec", "game": "referential_v0", "out_dir": str(tmp_path), "seed": 0,
        "system_prompt": "You play a word game.",
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE},
        "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 120},
        "train": {"steps": 1, "groups_per_step": 4, "group_size": 4, "lr": 1e-2,
                  "advantage": "role_ema", "entropy_coef": 0.01},
        "sampling": {"max_tokens": 4},
        "eval": {"hands_per_stratum": 1, "head_to_head_per_stratum": 0, "exact": False},
        "policies": [{"name": "main", "opponents": {"random": 1}}],
    }
    raw.update(over)
    return msgspec.convert(raw, JobConfig)


def test_a_run_records_then_offline_sft_and_dpo_learn_from_it(tmp_path, monkeypatch) -> None:
    from opentinker import run_folder
    from opentinker.machine import git_commit

    quiet = Console(file=io.StringIO())
    result = run_job(_job(tmp_path), console=quiet)
    run = result.run_dir
    # metrics.jsonl carries the diagnostics and the baselines of every training step.
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in rows if r["kind"] == "train"]
    for key in ("clip_frac", "approx_kl", "entropy", "logp_diff_mean", "logp_diff_p95", "entropy/entropy_mean"):
        assert f"train/main/loss/{key}" in train, key
    assert [k for k in train if k.startswith("train/main/baseline/referential_v0/")]
    # The learner's state sits beside the adapter, as the run ended.
    states = read_learner_states(run / "adapters", ["main"])
    assert states["main"]["advantage"] == "role_ema" and states["main"]["steps_trained"] == 1
    assert (run / "adapters" / "main" / "optimizer.safetensors").is_file()
    # Every training trajectory is on file, token-in/token-out.
    records = trajectory_log.read(run / "trajectories" / "main.jsonl")
    assert len(records) == train["train/main/n_datums"] and {r.step for r in records} == {1}
    rewards = sorted({r.total_reward for r in records})
    assert len(rewards) > 1, rewards  # outcomes differ: there is something to prefer

    data = str(run / "trajectories")
    saved = {}
    # The checkout as the offline job opened it, as a run's summary records it.
    monkeypatch.setattr(run_folder, "git_commit", lambda: ("0" * 40, True))
    for kind, extra in (("sft", {"min_reward": -0.5}), ("dpo", {"beta": 0.5})):
        off = _job(tmp_path, name=f"off_{kind}", offline={"kind": kind, "data": data, "steps": 6,
                                                         "batch_size": 64, **extra})
        res = run_job(off, console=quiet)
        key = f"eval/main/{kind}/loss"
        before, after = res.first_eval[key], res.last_eval[key]
        assert after < before, (kind, before, after)
        if kind == "dpo":
            assert before == pytest.approx(np.log(2.0), abs=1e-4)  # adapter == base: margin 0
        summary = json.loads((res.run_dir / "summary.json").read_text())
        assert summary["kind"] == kind and summary["units"] > 0
        assert (summary["commit"], summary["dirty"], summary["commit_at_end"]) == ("0" * 40, True, git_commit()[0])
        assert summary["machine"]["device"] == "cpu" and summary["machine"]["cores"] >= 1
        trains = [r for r in res.rows if r["kind"] == "train"]
        assert [r["train/main/version"] for r in trains] == list(range(1, 7))
        assert (res.run_dir / "adapters" / "main" / "adapter_model.safetensors").is_file()
        saved[kind] = res.run_dir / "adapters" / "main"

    # Warm start: RL from the SFT adapter starts from its weights, with a fresh optimizer.
    from safetensors.numpy import load_file

    init = str(saved["sft"])
    rl = run_job(_job(tmp_path, name="warm", policies=[{"name": "main", "opponents": {"random": 1}, "init": init}],
                      train={"steps": 1, "groups_per_step": 4, "group_size": 4, "lr": 1e-2}), console=quiet)
    sft_w = load_file(f"{init}/adapter_model.safetensors")
    ckpt = rl.run_dir / "checkpoints" / "step_1" / "adapters" / "main"
    assert [r["train/main/version"] for r in rl.rows if r["kind"] == "train"] == [1]  # version 0 + 1 step
    rl_w = load_file(f"{ckpt}/adapter_model.safetensors")
    moved = [k for k in sft_w if not np.array_equal(sft_w[k], rl_w[k])]
    near = all(np.abs(sft_w[k] - rl_w[k]).max() < 0.05 for k in sft_w)  # one step of lr 1e-2 from it
    assert moved and near, (moved[:3], near)
    assert rl.first_eval != {} and "eval/main/vs_random/hands" in rl.first_eval
    # Off a terminal (this console writes to a string) the run prints a plain line per step
    # and per evaluation, where a terminal gets the progress bar.
    log = quiet.file.getvalue()
    assert "step 0/1 eval: eval vs random" in log and "step 1/1 train: reward" in log and "step 1/1 eval:" in log
    zero = _job(tmp_path, name="cold", train={"steps": 1, "groups_per_step": 4, "group_size": 4, "lr": 1e-2})
    cold = load_file(f"{run_job(zero, console=quiet).run_dir}/adapters/main/adapter_model.safetensors")
    assert any(np.abs(cold[k] - sft_w[k]).max() > 0.05 for k in sft_w)  # a cold start is elsewhere
    from opentinker.config import ConfigError
    from opentinker.control.config_checks import check_config

    with pytest.raises(ConfigError, match=r"policies\[main\].init: the saved adapter has rank 8 \(this job: 4\)"):
        check_config(_job(tmp_path, policies=[{"name": "main", "init": init, "lora_rank": 4}]))
    with pytest.raises(ConfigError, match=r"policies\[main\].init: .* is not a saved adapter"):
        check_config(_job(tmp_path, policies=[{"name": "main", "init": str(tmp_path)}]))
    with pytest.raises(ValueError, match="no two trajectories of one start"):
        run_job(_job(tmp_path, name="off_none", offline={"kind": "dpo", "data": _empty_pairs(tmp_path)}),
                console=quiet)


def _empty_pairs(tmp_path) -> str:
    path = tmp_path / "same.jsonl"
    trajectory_log.append(path, [_traj(0, 0, 1.0, [5]), _traj(1, 0, 1.0, [6])], "kuhn_poker_v0")
    return str(path)


def test_a_pair_drawn_twice_in_one_batch_counts_as_two_pairs() -> None:
    """A batch can hold a pair twice (batches run across epochs); renumbered, its DPO loss is
    twice the pair's, where one shared pair_id would have merged them into a pair with twice
    the margin."""
    import torch

    from learners import LOSSES
    from opentinker.training.offline import renumber_pairs

    pair = pair_datums(preference_pairs([_traj(1, 0, 1.0, [11]), _traj(0, 0, -1.0, [10])]), first_id=4)
    one, twice = pair, renumber_pairs([*pair, *pair])
    assert [d.loss_inputs["pair_id"].tolist() for d in twice] == [[0, 0, 0]] * 2 + [[0, 0, 1]] * 2

    def loss(datums):
        inputs = {k: torch.as_tensor(np.concatenate([d.loss_inputs[k] for d in datums]))
                  for k in datums[0].loss_inputs}
        inputs["ref_logprobs"] = torch.zeros_like(inputs["mask"])
        keep = inputs["mask"] > 0
        logp = torch.where(inputs["pair_sign"] > 0, -1.0, -3.0)  # margin h = 2
        return LOSSES["dpo"].fn(logp[keep], {k: v[keep] for k, v in inputs.items()}, {"beta": 0.1}).loss_sum

    single = float(loss(one))
    assert single == pytest.approx(-np.log(1 / (1 + np.exp(-0.2))), rel=1e-6)
    assert float(loss(twice)) == pytest.approx(2 * single, rel=1e-6)


def test_a_frozen_policy_plays_and_records_but_never_trains(tmp_path) -> None:
    """``policies[].frozen``: data collection at an episode budget (compare_learners' ``dpo``).
    Beside a policy that trains, the frozen one records every trajectory, reports its steps
    (``learn_s`` included) at version 0, and its saved adapter is the initial one."""
    from safetensors.numpy import load_file

    pols = [{"name": "main", "opponents": {"random": 1}}, {"name": "data", "opponents": {"random": 1}, "frozen": True}]
    res = run_job(_job(tmp_path, name="frozen", policies=pols, train={"steps": 2, "groups_per_step": 4, "group_size": 4,
                                                                        "lr": 1e-2}), console=Console(file=io.StringIO()))
    trains = [r for r in res.rows if r["kind"] == "train"]
    assert [r["train/data/version"] for r in trains] == [0, 0]
    assert [r["train/main/version"] for r in trains] == [1, 2]
    assert all(r["train/data/learn_s"] >= 0 and "train/data/grad_norm" not in r for r in trains)
    assert all("train/main/grad_norm" in r for r in trains)
    records = trajectory_log.read(res.run_dir / "trajectories" / "data.jsonl")
    assert len(records) == sum(r["train/data/n_datums"] for r in trains) and {r.step for r in records} == {1, 2}
    data = load_file(f"{res.run_dir}/adapters/data/adapter_model.safetensors")
    main = load_file(f"{res.run_dir}/adapters/main/adapter_model.safetensors")
    b = [k for k in data if "lora_B" in k]
    assert b and all(not data[k].any() for k in b)  # LoRA's B starts at zero and stayed there
    assert any(main[k].any() for k in b)
