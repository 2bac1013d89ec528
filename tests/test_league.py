"""The league: past selves as opponents. Snapshots are taken every ``snapshot_every`` steps,
the oldest dropped past ``keep``; ``past`` opponents are drawn from the snapshots of that step
(a pure function of the config); evaluations play each snapshot; a resumed run restores them
and ends bit-identical to an uninterrupted one."""

from __future__ import annotations

import json

import msgspec
import pytest
from conftest import DEVICE
from safetensors.numpy import load_file

from opentinker.cli import main
from opentinker.config import JobConfig, league_pool
from opentinker.eval.ratings import RunningRatings, outcomes_of
from opentinker.rollout.episodes import train_episodes
from opentinker.run import run_job
from protocols.messages import PolicyKind


def _cfg(tmp_path, steps: int, **league) -> JobConfig:
    return msgspec.convert({
        "name": "league", "out_dir": str(tmp_path),
        # Bit-for-bit resume holds on the PEFT path (the engine batches rows by arrival time).
        "model": {"base": "tiny-random", "threads": 1, "device": DEVICE, "engine": "peft"},
        "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 120},
        "train": {"steps": steps, "checkpoint_every": 1, "groups_per_step": 4, "group_size": 2, "lr": 1e-2,
                  "advantage": "gae"},  # a critic: nonzero updates even when every reply forfeits
        "game": "kuhn_poker_v0", "sampling": {"max_tokens": 3},
        "eval": {"every": 0, "hands_per_stratum": 1, "head_to_head_per_stratum": 0, "exact": False},
        "league": {"snapshot_every": 1, "keep": 2, "eval_per_stratum": 1, **league},
        "policies": [{"name": "main", "opponents": {"past": 3, "random": 1}}],
    }, JobConfig)


def test_the_pool_and_past_opponents_follow_from_the_config(tmp_path):
    cfg = _cfg(tmp_path, 5)
    assert [league_pool(cfg, "main", s) for s in (1, 2, 3, 4)] == [
        [], ["main__s1"], ["main__s1", "main__s2"], ["main__s2", "main__s3"]]
    every3 = _cfg(tmp_path, 9, snapshot_every=3, keep=5)
    assert league_pool(every3, "main", 3) == [] and league_pool(every3, "main", 7) == ["main__s3", "main__s6"]
    for step in (1, 4):
        opponents = {spec.seats[a].name for spec in train_episodes(cfg, step) for a in spec.seats
                     if spec.seats[a].kind is PolicyKind.ADAPTER}
        # Step 1: no snapshot yet, "past" is the policy itself; step 4: the two newest.
        assert opponents <= {"main", *league_pool(cfg, "main", step)}, (step, opponents)
    assert {"main__s2", "main__s3"} & {spec.seats[a].name for spec in train_episodes(cfg, 4) for a in spec.seats}
    with pytest.raises(ValueError, match="'past' needs a league"):
        _cfg(tmp_path, 1, snapshot_every=0)
    with pytest.raises(ValueError, match="'randm' is none of self, base, past"):
        msgspec.convert({"policies": [{"name": "main", "opponents": {"randm": 1}}]}, JobConfig)
    with pytest.raises(ValueError, match="not ending in __s<digits>"):
        msgspec.convert({"policies": [{"name": "main__s3"}]}, JobConfig)
    with pytest.raises(ValueError, match="league.eval_per_stratum: evaluates against league snapshots"):
        msgspec.convert({"league": {"eval_per_stratum": 2}}, JobConfig)


def test_snapshots_come_last_in_the_cross_play_columns_in_step_order():
    from opentinker.eval.report import cross_play_matrix

    ev = {f"eval/a/vs_{o}/chips": 0.0 for o in ("a__s10", "base", "a__s2", "random", "b", "kuhn_equilibrium")}
    assert cross_play_matrix([("x", ev)], ["a", "b"], "chips")[1] == [
        "random", "kuhn_equilibrium", "base", "b", "a__s2", "a__s10"]


def _tensors(folder):
    return {f.name: load_file(str(f)) for f in sorted(folder.glob("*.safetensors"))}


@pytest.mark.slow
def test_a_league_run_snapshots_evaluates_and_resumes_bit_for_bit(tmp_path, tiny_path, monkeypatch,
                                                                 one_request_per_batch):
    straight = run_job(_cfg(tmp_path / "a", 3, matchmaking="hard"), run_dir=tmp_path / "a" / "run")
    adapters = straight.run_dir / "adapters"
    assert sorted(p.name for p in (adapters / "league").iterdir()) == ["main__s2", "main__s3"]  # keep = 2: s1 dropped
    rows = [json.loads(line) for line in (straight.run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in rows if r["kind"] == "train"]
    assert [r["league/snapshots"] for r in trains] == [1.0, 2.0, 2.0]
    last = [r for r in rows if r["kind"] == "eval"][-1]
    # The final evaluation plays the league, but not the snapshot of this very step (a copy).
    assert last["eval/main/vs_main__s2/hands"] == 6 * 2 and "eval/main/vs_main__s3/hands" not in last
    # A snapshot is frozen: it holds the policy as it was then. Step 3 changed the policy
    # (grad_norm > 0) only if it had trajectories; compare what each snapshot saved with the
    # policy's checkpoint of the same step.
    for step in (2, 3):
        snap = _tensors(adapters / "league" / f"main__s{step}")
        then = _tensors(straight.run_dir / "checkpoints" / f"step_{step}" / "adapters" / "main")
        for name in ("adapter_model.safetensors", "value_head.safetensors"):
            assert all((snap[name][k] == then[name][k]).all() for k in then[name]), (step, name)
    s2, s3 = _tensors(adapters / "league" / "main__s2"), _tensors(adapters / "league" / "main__s3")
    moved = trains[2]["train/main/grad_norm"] > 0
    assert moved == any((s2["adapter_model.safetensors"][k] != s3["adapter_model.safetensors"][k]).any()
                        for k in s2["adapter_model.safetensors"])

    # PFSP's win rates come from the training games against snapshots; ratings from evaluations.
    assert any(k.startswith("league/main/p_win/main__s") for k in trains[2])
    assert last["ratings/bt/random"] == 0.0 and "ratings/bt/main__s2" in last and "ratings/openskill/main" in last
    assert (straight.run_dir / "ratings.png").stat().st_size > 10_000

    half = run_job(_cfg(tmp_path / "b", 2, matchmaking="hard"), run_dir=tmp_path / "b" / "run")
    monkeypatch.chdir(tmp_path)
    assert main(["run", "--resume", str(half.run_dir), "--set", "train.steps=3"]) == 0
    a, b = _tensors(adapters / "main"), _tensors(half.run_dir / "adapters" / "main")
    assert a.keys() == b.keys()
    for name in a:
        for key in a[name]:
            assert (a[name][key] == b[name][key]).all(), (name, key)
    assert sorted(p.name for p in (half.run_dir / "adapters" / "league").iterdir()) == ["main__s2", "main__s3"]
    # The win rates were restored bit for bit and went on identically; so were the ratings
    # (the half run's own final evaluation at step 2 rated more games than the straight run's).
    state = json.loads((adapters / "league_state.json").read_text())
    resumed = json.loads((half.run_dir / "adapters" / "league_state.json").read_text())
    assert state["win_rates"] == resumed["win_rates"] and state["win_rates"]["counts"]["main"]
    saved = json.loads((half.run_dir / "checkpoints" / "step_2" / "adapters" / "league_state.json").read_text())
    table = RunningRatings.from_state(saved["ratings"])
    evals = [json.loads(line) for line in (half.run_dir / "metrics.jsonl").read_text().splitlines()]
    table.update(outcomes_of([r for r in evals if r["kind"] == "eval"][-1]))
    assert table.state() == resumed["ratings"] and resumed["ratings"]["n_games"] > saved["ratings"]["n_games"]


def test_prioritized_matchmaking_draws_by_the_win_rates(tmp_path):
    from opentinker.rollout.matchmaking import WinRates

    cfg = _cfg(tmp_path, 9, keep=5, matchmaking="hard")
    wr = WinRates()
    wr.update("main", "main__s1", wins=50, draws=0, losses=0)  # beaten: rarely drawn
    wr.update("main", "main__s2", wins=0, draws=0, losses=50)  # the one it loses to: mostly

    def drawn(cfg, win_rates):
        names = [spec.seats[a].name for step in range(4, 9) for spec in train_episodes(cfg, step, win_rates)
                 for a in spec.seats if spec.seats[a].name.startswith("main__s")]
        return {n: names.count(n) / len(names) for n in set(names)}

    hard = drawn(cfg, wr)
    assert hard["main__s2"] > 0.5 > hard.get("main__s1", 0.0)
    uniform = drawn(_cfg(tmp_path, 9, keep=5), wr)  # uniform ignores the estimates: today's draws
    assert uniform == drawn(_cfg(tmp_path, 9, keep=5), None)
    assert uniform["main__s2"] < 0.3 and hard.get("main__s1", 0.0) < uniform["main__s1"] / 2
    everyone = _cfg(tmp_path, 9, keep=5, pool="all")
    assert league_pool(everyone, "main", 4) == ["main__s1", "main__s2", "main__s3"]
