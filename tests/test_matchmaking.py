"""PFSP matchmaking: the weightings match AlphaStar's formulas, the win-rate estimates start at
the prior and follow recent games, a saved and restored state draws exactly the same opponents,
and draws follow the weights."""

from __future__ import annotations

import json

import numpy as np
import pytest

from opentinker.rollout.matchmaking import WinRates, draw_opponent, pfsp_weights

POOL = ["main__s10", "main__s20", "main__s30", "main__s40"]


def test_weights_match_the_formulas() -> None:
    x = np.array([0.1, 0.5, 0.8, 0.95])
    hard = (1 - x) ** 2
    var = x * (1 - x)
    np.testing.assert_allclose(pfsp_weights(x, "hard"), hard / hard.sum(), rtol=1e-15)
    np.testing.assert_allclose(pfsp_weights(x, "hard", p=1.0), (1 - x) / (1 - x).sum(), rtol=1e-15)
    np.testing.assert_allclose(pfsp_weights(x, "variance"), var / var.sum(), rtol=1e-15)
    assert pfsp_weights(x, "uniform").tolist() == [0.25] * 4
    # Literal values: f = 0.81, 0.25, 0.04, 0.0025 for hard, sum 1.1025.
    np.testing.assert_allclose(pfsp_weights(x, "hard"), [0.81 / 1.1025, 0.25 / 1.1025, 0.04 / 1.1025, 0.0025 / 1.1025])
    for w in ("hard", "variance", "uniform"):
        out = pfsp_weights(x, w)
        assert out.shape == (4,) and abs(out.sum() - 1.0) < 1e-12


def test_hard_favours_the_opponent_it_loses_to_and_variance_peaks_at_half() -> None:
    x = np.array([0.7, 0.2, 0.5, 0.9])
    hard = pfsp_weights(x, "hard")
    assert int(np.argmax(hard)) == 1 and hard[1] > 0.5
    assert np.all(np.diff(hard[np.argsort(x)]) < 0)  # strictly decreasing in p_win
    var = pfsp_weights(x, "variance")
    assert int(np.argmax(var)) == 2
    grid = np.linspace(0.0, 1.0, 11)
    assert grid[int(np.argmax(pfsp_weights(grid, "variance")))] == 0.5


def test_all_zero_falls_back_to_uniform_and_bad_inputs_are_named() -> None:
    assert pfsp_weights(np.ones(3), "hard").tolist() == [1 / 3] * 3
    assert pfsp_weights(np.array([0.0, 1.0]), "variance").tolist() == [0.5, 0.5]
    with pytest.raises(ValueError, match="'hardest'"):
        pfsp_weights(np.array([0.5]), "hardest")
    with pytest.raises(ValueError, match="p_wins"):
        pfsp_weights(np.array([]), "hard")
    with pytest.raises(ValueError, match="p_wins"):
        pfsp_weights(np.array([0.5, np.nan]), "hard")
    with pytest.raises(ValueError, match="'bogus'"):
        draw_opponent(np.random.default_rng(0), POOL, WinRates(), "main", "bogus")
    with pytest.raises(ValueError, match="pool"):
        draw_opponent(np.random.default_rng(0), [], WinRates(), "main", "hard")


def test_uniform_is_todays_draw() -> None:
    # train_episodes today: pool[int(rng.integers(len(pool)))]; win rates make no difference.
    wr = WinRates()
    wr.update("main", POOL[0], wins=0, draws=0, losses=50)
    a, b = np.random.default_rng(123), np.random.default_rng(123)
    ours = [draw_opponent(a, POOL, wr, "main", "uniform") for _ in range(200)]
    today = [POOL[int(b.integers(len(POOL)))] for _ in range(200)]
    assert ours == today


def test_unseen_opponent_is_at_the_prior() -> None:
    wr = WinRates()
    assert wr.p_win("main", "main__s10") == 0.5
    wr.update("main", "main__s10", wins=3, draws=0, losses=0)
    assert wr.p_win("other", "main__s10") == 0.5 and wr.p_win("main", "main__s20") == 0.5
    assert wr.p_win("main", "main__s10") == (1 + 3) / (2 + 3)
    assert WinRates(prior_wins=3.0, prior_losses=1.0).p_win("main", "x") == 0.75


def test_estimates_follow_recent_results_and_forget_old_ones() -> None:
    wr = WinRates(decay=0.5)
    wr.update("main", "s", wins=1, draws=2, losses=1)  # score 2 of 4: still 0.5
    assert wr.p_win("main", "s") == 0.5
    wr.update("main", "s", wins=4, draws=0, losses=0)  # score 0.5 * 2 + 4 = 5, games 0.5 * 4 + 4 = 6
    assert wr.p_win("main", "s") == (1 + 5) / (2 + 6)
    for _ in range(10):  # won 10 updates in a row: moves toward 1, monotonically
        before = wr.p_win("main", "s")
        wr.update("main", "s", wins=4, draws=0, losses=0)
        assert wr.p_win("main", "s") > before
    assert wr.p_win("main", "s") > 0.8
    for _ in range(30):  # the learner now loses: the old wins fade out
        wr.update("main", "s", wins=0, draws=0, losses=4)
    # Limit: score -> 0, games -> 4 / (1 - 0.5) = 8, so p_win -> 1 / 10.
    assert abs(wr.p_win("main", "s") - 0.1) < 1e-6
    # Without decay the same history would still remember the wins.
    flat = WinRates(decay=1.0)
    for _ in range(11):
        flat.update("main", "s", wins=4, draws=0, losses=0)
    for _ in range(30):
        flat.update("main", "s", wins=0, draws=0, losses=4)
    assert flat.p_win("main", "s") > 0.25


def test_forget_resets_a_dropped_snapshot() -> None:
    wr = WinRates()
    wr.update("main", "main__s10", wins=0, draws=0, losses=9)
    wr.update("rival", "main__s10", wins=9, draws=0, losses=0)
    wr.update("main", "main__s20", wins=0, draws=0, losses=9)
    wr.forget("main__s10")
    assert wr.p_win("main", "main__s10") == 0.5 and wr.p_win("rival", "main__s10") == 0.5
    assert wr.p_win("main", "main__s20") == 1 / 11
    wr.forget("never_seen")  # no-op


def _play(rng: np.random.Generator, wr: WinRates, n: int) -> list[tuple[str, float]]:
    """n rounds: draw a hard opponent, then record a made-up outcome from the same rng."""
    out = []
    for _ in range(n):
        opp = draw_opponent(rng, POOL, wr, "main", "hard")
        w, d, l = (int(v) for v in rng.integers(0, 5, size=3))
        wr.update("main", opp, wins=w, draws=d, losses=l)
        out.append((opp, wr.p_win("main", opp)))
    return out


def test_state_round_trips_bit_for_bit() -> None:
    rng = np.random.default_rng(7)
    wr = WinRates(decay=0.83)
    _play(rng, wr, 40)
    wr.update("rival", POOL[1], wins=1, draws=1, losses=0)
    saved = json.loads(json.dumps(wr.state()))
    rng_saved = json.loads(json.dumps(rng.bit_generator.state))
    restored = WinRates.from_state(saved)
    assert restored.state() == wr.state()
    for o in POOL:
        assert restored.p_win("main", o) == wr.p_win("main", o)
        assert restored.p_win("rival", o) == wr.p_win("rival", o)
    rng2 = np.random.default_rng()
    rng2.bit_generator.state = rng_saved
    assert _play(rng2, restored, 200) == _play(rng, wr, 200)  # exact float equality
    assert restored.state() == wr.state()


def test_from_state_rejects_bad_counts() -> None:
    state = WinRates().state()
    state["counts"] = {"main": {"s": [3.0, 2.0]}}
    with pytest.raises(ValueError, match=r"counts\[main\]\[s\]"):
        WinRates.from_state(state)
    with pytest.raises(ValueError, match="decay"):
        WinRates(decay=0.0)


def test_hard_draw_frequencies_match_the_weights() -> None:
    wr = WinRates(decay=1.0, prior_wins=1e-9, prior_losses=1e-9)  # a negligible prior: p_win = score / games
    for opp, wins in zip(POOL, [10, 50, 80, 95]):
        wr.update("main", opp, wins=wins, draws=0, losses=100 - wins)
    w = pfsp_weights(np.array([wr.p_win("main", o) for o in POOL]), "hard")
    np.testing.assert_allclose(w, pfsp_weights(np.array([0.1, 0.5, 0.8, 0.95]), "hard"), rtol=1e-6)
    rng = np.random.default_rng(2024)
    n = 5000
    draws = [draw_opponent(rng, POOL, wr, "main", "hard") for _ in range(n)]
    counts = np.array([draws.count(o) for o in POOL])
    se = np.sqrt(n * w * (1 - w))
    assert np.all(np.abs(counts - n * w) <= 4 * se + 1), (counts, n * w)
