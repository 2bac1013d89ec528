"""benchmarks/collect_runs.py: a run's row, finished or stopped part way (no summary.json)."""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import collect_runs as cr

from opentinker.config import load_config, to_toml


def _run(tmp_path: Path) -> Path:
    folder = tmp_path / "tictactoe_v0__tictactoe__3__20261205-000000"
    folder.mkdir()
    (folder / "config.toml").write_bytes(to_toml(load_config("tictactoe", {"seed": 3, "game_kwargs": {"brief": True}})))
    ev = lambda step, score, draws: {"step": step, "kind": "eval", "timing_s/eval": 5.0,
                                     "eval/main/vs_random/score": score, "eval/main/vs_random/ci95": 0.1,
                                     "eval/main/vs_tictactoe_minimax/draws": draws, "eval/main/canonical_mass": 0.5}
    rows = [ev(0, -0.9, 0.0), {"step": 1, "kind": "train", "timing_s/rollout": 2.0, "timing_s/learn": 3.0},
            {"step": 2, "kind": "train", "timing_s/rollout": 4.0, "timing_s/learn": 5.0}, ev(2, 0.2, 7.0)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_a_stopped_run_is_kept_as_far_as_it_went(tmp_path) -> None:
    row = cr.run_row(_run(tmp_path))
    assert (row["seed"], row["steps"], row["finished"], row["wall_s"]) == (3, 2, False, None)
    assert row["config"]["game_kwargs"] == {"brief": True} and row["config"]["opponent_draws"] == "episode"
    assert row["steps_and_evals_s"] == pytest.approx(2 + 3 + 4 + 5 + 5 + 5)
    assert row["median_s_per_step"] == {"timing_s/rollout": 3.0, "timing_s/learn": 4.0}
    assert row["curve"] == [
        {"step": 0, "eval/main/vs_random/score": -0.9, "eval/main/vs_random/ci95": 0.1,
         "eval/main/vs_tictactoe_minimax/draws": 0.0},
        {"step": 2, "eval/main/vs_random/score": 0.2, "eval/main/vs_random/ci95": 0.1,
         "eval/main/vs_tictactoe_minimax/draws": 7.0}]
    assert row["last_eval"]["eval/main/vs_random/score"] == 0.2


def test_a_finished_run_takes_its_summary(tmp_path) -> None:
    folder = _run(tmp_path)
    (folder / "summary.json").write_text(json.dumps({"first_eval": {"a": 1}, "last_eval": {"b": 2}, "wall_s": 99.0,
                                                     "commit": "abc", "machine": {"cores": 2}}))
    row = cr.run_row(folder)
    assert (row["finished"], row["wall_s"], row["commit"], row["last_eval"]) == (True, 99.0, "abc", {"b": 2})
    assert "commit_at_end" not in row
    # A run during which the checkout moved: where it started, and where the checkout was at its end.
    (folder / "summary.json").write_text(json.dumps({"first_eval": {}, "last_eval": {}, "wall_s": 1.0,
                                                     "commit": "abc", "commit_at_end": "def"}))
    assert (cr.run_row(folder)["commit"], cr.run_row(folder)["commit_at_end"]) == ("abc", "def")


def test_a_league_runs_exact_measures_are_kept_per_step_and_plotted(tmp_path) -> None:
    folder = tmp_path / "kuhn_poker_v0__league__0__20261205-000000"
    folder.mkdir()
    (folder / "config.toml").write_bytes(to_toml(load_config("kuhn_league", {})))
    train = lambda step, x, peak: {"step": step, "kind": "train", "timing_s/rollout": 1.0, "timing_s/learn": 2.0,
                                   "train/main/exploitability": x, "train/main/all_actions/payoff": -x,
                                   "train/main/reward": 0.5, "perf/scheduler_peak_rss_mb": peak}
    rows = [{"step": 0, "kind": "eval", "eval/main/vs_random/chips": 0.0, "eval/main/exploitability": 0.4},
            train(1, 0.33, 900.0), train(2, 0.1, 1200.0), {"step": 3, "kind": "train", "timing_s/rollout": 1.0,
                                                          "timing_s/learn": 2.0}]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    row = cr.run_row(folder)
    assert row["exact_curve"] == [
        {"step": 1, "train/main/exploitability": 0.33, "train/main/all_actions/payoff": -0.33},
        {"step": 2, "train/main/exploitability": 0.1, "train/main/all_actions/payoff": -0.1}]
    assert row["scheduler_peak_rss_mb"] == 1200.0 and row["config"]["all_actions_decisions"] == 0
    png = tmp_path / "exact.png"
    assert cr.plot_exact([row], png) and png.read_bytes()[:4] == b"\x89PNG"
    plain = cr.run_row(_run(tmp_path))  # tic-tac-toe: no exact measure, nothing to plot
    assert plain["exact_curve"] == [] and plain["scheduler_peak_rss_mb"] is None
    assert not cr.plot_exact([plain], tmp_path / "none.png") and not (tmp_path / "none.png").exists()
