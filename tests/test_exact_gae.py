"""``train.advantage = "exact_gae"``: GAE with the game's exact state values as the critic. A
job asks for it only where the game values its states against every opponent of the policy;
a real tic-tac-toe job trains with it (tiny model), each turn judged by its own move."""

from __future__ import annotations

import msgspec
import pytest

from opentinker.config import ConfigError, JobConfig
from opentinker.control.config_checks import check_config
from opentinker.run import run_job


def _job(tmp_path, **over) -> JobConfig:
    raw = {"name": "exact", "out_dir": str(tmp_path), "game": "tictactoe_v0",
           "model": {"base": "tiny-random", "threads": 1, "device": "cpu"},
           "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 120},
           "train": {"steps": 2, "checkpoint_every": 0, "groups_per_step": 2, "group_size": 2, "lr": 1e-2,
                     "advantage": "exact_gae", "lam": 0.0},
           "sampling": {"max_tokens": 2, "explore": 0.5},
           "eval": {"every": 0, "hands_per_stratum": 1, "head_to_head_per_stratum": 0, "cross_play_per_stratum": 0},
           "policies": [{"name": "main", "opponents": {"random": 3, "tictactoe_minimax": 1}}]}
    raw.update(over)
    return msgspec.convert(raw, JobConfig)


def test_exact_gae_needs_a_game_that_values_every_opponent(tmp_path):
    with pytest.raises(ConfigError, match="train.advantage: exact_gae: kuhn_poker_v0's evaluation hook gives no "
                                          "exact state values"):
        check_config(_job(tmp_path, game="kuhn_poker_v0"))
    with pytest.raises(ConfigError, match="exact_gae: tictactoe_v0 values states against random, tictactoe_minimax "
                                          "only, and the policy also plays 'self'"):
        check_config(_job(tmp_path, policies=[{"name": "main", "opponents": {"random": 1, "self": 1}}]))
    two = [{"name": "main", "opponents": {"random": 1}}, {"name": "other", "opponents": {"main": 1},
                                                         "train": {"advantage": "dr_grpo"}}]
    with pytest.raises(ConfigError, match="exact_gae: policy 'other' plays 'main', whose states tictactoe_v0 does "
                                          "not value against another policy"):
        check_config(_job(tmp_path, policies=two))
    league = [{"name": "main", "opponents": {"random": 1}}, {"name": "other", "opponents": {"past": 1},
                                                            "train": {"advantage": "dr_grpo"}}]
    with pytest.raises(ConfigError, match="policy 'other' plays 'main'"):
        check_config(_job(tmp_path, policies=league, league={"pool": "all", "snapshot_every": 1}))
    check_config(_job(tmp_path, policies=league, league={"snapshot_every": 1}))  # its own past selves: never main
    with pytest.raises(ConfigError, match="exact_gae: the game's values are undiscounted; train.gamma must be 1, "
                                          "not 0.9"):
        check_config(_job(tmp_path, train={"steps": 2, "groups_per_step": 2, "group_size": 2, "advantage": "exact_gae",
                                           "gamma": 0.9}))
    check_config(_job(tmp_path))


@pytest.mark.slow
def test_a_tictactoe_job_trains_on_the_games_values(tmp_path, tiny_path):
    """Two steps of a real job: every turn is valued (the estimator refuses a batch with an
    unvalued turn), and turns get non-zero advantages."""
    result = run_job(_job(tmp_path))
    trains = [r for r in result.rows if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [1, 2]
    for r in trains:
        assert r["train/main/n_datums"] >= 4 and r["train/main/adv_abs_mean"] > 0
