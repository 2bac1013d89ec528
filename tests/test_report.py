"""Run outputs: every metrics row goes to metrics.jsonl and, as scalars, to TensorBoard; a
resumed writer replaces what an earlier process wrote from its first step on."""

from __future__ import annotations

import json
import math

from conftest import read_tensorboard

import games

from opentinker.eval.report import MetricsLog


def test_metrics_go_to_jsonl_and_tensorboard_and_a_resume_purges_the_rest(tmp_path):
    log = MetricsLog(tmp_path / "metrics.jsonl")
    for step in range(4):
        log.write(step, "train", {"train/main/reward": step / 10, "train/main/invalid_rate": 0.5,
                                  "train/main/kl": float("nan"), "train/main/note": "text", "train/main/n": 3})
    log.write(3, "eval", {"eval/main/vs_random/chips": -0.25})
    # No close(): each row is flushed as it is written (a run that dies loses nothing).
    tb = read_tensorboard(tmp_path / "tb")
    assert [s for s, _ in tb["train/main/reward"]] == [0, 1, 2, 3]
    assert all(math.isclose(v, s / 10, rel_tol=1e-6) for s, v in tb["train/main/reward"])
    assert tb["train/main/n"] == [(s, 3.0) for s in range(4)] and tb["eval/main/vs_random/chips"] == [(3, -0.25)]
    assert "train/main/kl" not in tb and "train/main/note" not in tb  # NaN and text stay in the JSONL only
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 5 and rows[0]["train/main/kl"] is None and rows[0]["train/main/note"] == "text"
    log.close()

    resumed = MetricsLog(tmp_path / "metrics.jsonl", purge_step=2)  # resumed from step 1's checkpoint
    for step in (2, 3):
        resumed.write(step, "train", {"train/main/reward": 1.0 + step})
    resumed.close()
    tb = read_tensorboard(tmp_path / "tb")
    got = [(s, round(v, 6)) for s, v in tb["train/main/reward"]]
    assert got == [(0, 0.0), (1, 0.1), (2, 3.0), (3, 4.0)]
    assert "eval/main/vs_random/chips" not in tb  # step 3's eval came after the checkpoint: gone
    assert MetricsLog(tmp_path / "other.jsonl", tensorboard=False)._tb is None


def _eval(values: dict[str, tuple[float, float]]) -> dict[str, float]:
    out = {}
    for key, (mean, ci) in values.items():
        out[f"eval/{key}/chips"], out[f"eval/{key}/ci95"] = mean, ci
    return out


def test_cross_play_matrix_rows_columns_and_values(tmp_path):
    import numpy as np

    from opentinker.eval.report import cross_play_matrix, plot_cross_play, summary_table

    first = _eval({"a/vs_random": (-0.9, 0.1), "a/vs_base": (0.0, 0.2), "b/vs_random": (-0.8, 0.1),
                   "a/vs_b": (0.05, 0.3), "b/vs_a": (-0.05, 0.3)})
    last = _eval({"a/vs_random": (0.4, 0.1), "a/vs_kuhn_equilibrium": (-0.1, 0.1), "a/vs_base": (0.9, 0.1),
                  "b/vs_random": (0.2, 0.1), "a/vs_b": (0.3, 0.2), "b/vs_a": (-0.3, 0.2)})
    kuhn = games.evaluation("kuhn_poker_v0")
    rows, cols, mean, ci = cross_play_matrix([("step 0", first), ("step 9", last)], ["a", "b"], "chips")
    assert rows == ["a (step 0)", "b (step 0)", "a (step 9)", "b (step 9)"]
    assert cols == ["random", "kuhn_equilibrium", "base", "a", "b"]
    want = np.array([[-0.9, np.nan, 0.0, np.nan, 0.05], [-0.8, np.nan, np.nan, -0.05, np.nan],
                     [0.4, -0.1, 0.9, np.nan, 0.3], [0.2, np.nan, np.nan, -0.3, np.nan]])
    assert np.array_equal(mean, want, equal_nan=True) and ci[2, 2] == 0.1 and np.isnan(ci[1, 2])
    plot_cross_play([("step 0", first), ("step 9", last)], ["a", "b"], tmp_path / "x.png", kuhn)
    assert (tmp_path / "x.png").stat().st_size > 10_000
    # The summary table names another policy as one: "vs policy b".
    labels = [c for col in summary_table(first, last, ["a", "b"], 9, kuhn).columns[1:2] for c in col._cells]
    assert "chips/hand vs policy b (95% CI)" in labels and "chips/hand vs kuhn_equilibrium (95% CI)" in labels
    assert labels.index("chips/hand vs base model (95% CI)") < labels.index("chips/hand vs policy b (95% CI)")


def test_a_policy_cannot_take_a_scripted_policys_name():
    import msgspec
    import pytest

    from opentinker.config import JobConfig

    with pytest.raises(ValueError, match="'random': must be an identifier other than self, base, past, best_response, league and the scripted"):
        msgspec.convert({"policies": [{"name": "random"}]}, JobConfig)
    with pytest.raises(ValueError, match="'league': must be an identifier"):  # adapters/league/ is the league's folder
        msgspec.convert({"policies": [{"name": "league"}]}, JobConfig)
