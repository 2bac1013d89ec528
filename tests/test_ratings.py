"""League ratings: Bradley-Terry recovery, anchoring and intervals; the openskill table's order
and its bit-for-bit state round trip; the ratings plot."""

from __future__ import annotations

import itertools
import json
import math
import warnings

import numpy as np
import pytest

from opentinker.eval.ratings import (
    ELO_PER_LOGIT,
    Outcome,
    RunningRatings,
    bradley_terry,
    plot_ratings,
    win_probability,
)

TRUTH = {"random": 0.0, "main": 1.0, "main__s10": 0.4, "base": -0.6}


def sampled_outcomes(n_games: int, seed: int, truth: dict[str, float] = TRUTH) -> list[Outcome]:
    """Every pairing of ``truth`` played ``n_games`` times under Bradley-Terry (no draws)."""
    rng = np.random.default_rng(seed)
    out = []
    for a, b in itertools.combinations(truth, 2):
        w = int(rng.binomial(n_games, win_probability(truth[a], truth[b])))
        out.append(Outcome(a, b, w, 0, n_games - w))
    return out


def expected_outcomes(n_games: int) -> list[Outcome]:
    """Every pairing of ``TRUTH`` with its expected counts (a draw for the odd half game)."""
    out = []
    for a, b in itertools.combinations(TRUTH, 2):
        w2 = round(2 * n_games * win_probability(TRUTH[a], TRUTH[b]))
        out.append(Outcome(a, b, w2 // 2, w2 % 2, n_games - w2 // 2 - w2 % 2))
    return out


def test_bt_recovers_known_strengths():
    r = bradley_terry(sampled_outcomes(2000, seed=0), n_boot=200, seed=0)
    assert set(r) == set(TRUTH)
    covered = 0
    for name, true in TRUTH.items():
        est, lo, hi = r[name]
        assert abs(est - true) < 0.15, (name, est, true)
        assert lo <= est <= hi
        covered += lo <= true <= hi
    assert covered >= 3  # the anchor always; most of the other three


def test_bt_anchor_is_zero_and_defaults():
    out = sampled_outcomes(200, seed=1)
    r = bradley_terry(out, n_boot=20)
    assert r["random"] == (0.0, 0.0, 0.0)  # "random" is the default anchor when present
    r2 = bradley_terry(out, anchor="main", n_boot=20)
    assert r2["main"] == (0.0, 0.0, 0.0)
    # re-anchoring shifts every point estimate by the same amount
    for n in TRUTH:
        assert r2[n][0] == pytest.approx(r[n][0] - r["main"][0], abs=1e-6)
    no_random = [o for o in out if "random" not in (o.a, o.b)]
    assert bradley_terry(no_random, n_boot=0)["base"][0] == 0.0  # first alphabetically
    with pytest.raises(ValueError):
        bradley_terry(out, anchor="nobody")


def test_bt_draw_is_half_a_win_and_matches_win_probability():
    even = bradley_terry([Outcome("a", "b", 0, 100, 0)], n_boot=0)
    split = bradley_terry([Outcome("a", "b", 50, 0, 50)], n_boot=0)
    assert even["b"][0] == pytest.approx(0.0, abs=1e-9) and split["b"][0] == pytest.approx(0.0, abs=1e-9)
    assert math.isnan(even["b"][1])  # no bootstrap, no interval
    # one pairing: a scored 300 of 400 points; the fitted gap reproduces 3:1 (up to the prior)
    r = bradley_terry([Outcome("a", "b", 250, 100, 50)], n_boot=50)
    assert r["a"] == (0.0, 0.0, 0.0)
    assert win_probability(r["a"][0], r["b"][0]) == pytest.approx(0.75, abs=1e-3)
    assert r["b"][1] < r["b"][0] < r["b"][2] < 0.0


def test_win_probability():
    assert win_probability(0.0, 0.0) == 0.5
    assert win_probability(1.0, 0.0) == pytest.approx(1 / (1 + math.exp(-1)))
    assert win_probability(0.3, -0.2) + win_probability(-0.2, 0.3) == pytest.approx(1.0)
    assert win_probability(800.0, 0.0) == 1.0 and win_probability(0.0, 800.0) == 0.0  # no overflow
    assert win_probability(400 / ELO_PER_LOGIT, 0.0) == pytest.approx(10 / 11)  # Elo: 400 points = 10:1


def test_bt_dominating_player_is_finite_and_first():
    out = [Outcome("champ", x, 50, 0, 0) for x in ("random", "base", "main")]
    out += [Outcome("main", "base", 30, 5, 15), Outcome("base", "random", 28, 0, 22),
            Outcome("random", "main", 10, 0, 40)]
    r = bradley_terry(out, n_boot=100)
    assert all(math.isfinite(v) for v in r["champ"])
    assert max(r, key=lambda n: r[n][0]) == "champ"
    assert r["champ"][1] > max(r[n][2] for n in r if n != "champ")


def test_bt_point_estimate_solves_the_score_equations():
    """At the MAP each player's points equal its expected points plus the prior's pull,
    ``s_i - sum_j n_ij p_ij = l2 * (r_i - mean r)`` (the prior centres the free log-strengths)."""
    out = [Outcome("champ", x, 50, 0, 0) for x in ("random", "base", "main")]
    out += [Outcome("main", "base", 30, 5, 15), Outcome("base", "random", 28, 0, 22)]
    r = {n: v[0] for n, v in bradley_terry(out, n_boot=0, l2=1e-3).items()}
    mean = np.mean(list(r.values()))
    resid = {n: 0.0 for n in r}
    for o in out:
        n, p = o.wins + o.draws + o.losses, win_probability(r[o.a], r[o.b])
        resid[o.a] += o.wins + o.draws / 2 - n * p
        resid[o.b] += o.losses + o.draws / 2 - n * (1 - p)
    for name, rating in r.items():
        assert resid[name] == pytest.approx(1e-3 * (rating - mean), abs=1e-7), name


def test_bt_intervals_shrink_with_more_games():
    small = bradley_terry(expected_outcomes(100), n_boot=200, seed=0)
    large = bradley_terry(expected_outcomes(2000), n_boot=200, seed=0)
    for n in TRUTH:
        if n == "random":
            continue
        w_small, w_large = small[n][2] - small[n][1], large[n][2] - large[n][1]
        assert 0 < w_large < 0.5 * w_small, (n, w_small, w_large)


def test_bt_bootstrap_is_seeded():
    out = sampled_outcomes(100, seed=2)
    assert bradley_terry(out, seed=3) == bradley_terry(out, seed=3)
    assert bradley_terry(out, seed=3) != bradley_terry(out, seed=4)


def test_bt_edge_cases():
    assert bradley_terry([]) == {}
    with pytest.warns(UserWarning, match="share no games"):
        r = bradley_terry([Outcome("a", "b", 10, 0, 5), Outcome("c", "d", 3, 0, 3),
                           Outcome("a", "e", 0, 0, 0)], n_boot=20)
    assert r["a"] == (0.0, 0.0, 0.0) and math.isfinite(r["b"][0])
    assert all(math.isnan(v) for n in "cde" for v in r[n])
    # outcomes of one pairing are pooled whichever way round they are reported
    one = bradley_terry([Outcome("a", "b", 30, 2, 8)], n_boot=0)
    two = bradley_terry([Outcome("a", "b", 20, 1, 3), Outcome("b", "a", 5, 1, 10)], n_boot=0)
    assert one["b"][0] == pytest.approx(two["b"][0], abs=1e-9)
    with pytest.raises(ValueError):
        Outcome("a", "a", 1, 0, 0)
    with pytest.raises(ValueError):
        Outcome("a", "b", -1, 0, 0)


def test_openskill_orders_winner_above_loser():
    rr = RunningRatings()
    rr.update([Outcome("strong", "weak", 10, 0, 0), Outcome("mid", "strong", 0, 0, 10),
               Outcome("mid", "weak", 10, 0, 0)])
    rows = rr.table()
    assert [r["name"] for r in rows] == ["strong", "mid", "weak"]
    for r in rows:
        assert r["ordinal"] == pytest.approx(r["mu"] - 3 * r["sigma"])
        assert (r["lo"], r["hi"]) == pytest.approx((r["mu"] - 1.96 * r["sigma"], r["mu"] + 1.96 * r["sigma"]))
    assert rr.n_games == 30
    # games are interleaved, not replayed as all wins then all losses (which would leave the
    # last results dominating: a 50-50 record rated as a rout)
    even = RunningRatings()
    even.update([Outcome("a", "b", 50, 0, 50)])
    assert abs(even.ratings["a"][0] - even.ratings["b"][0]) < 1.0
    # draws are ties: an all-draw pairing of equals leaves their means equal
    tie = RunningRatings()
    tie.update([Outcome("x", "y", 0, 7, 0)])
    assert tie.ratings["x"] == tie.ratings["y"] and tie.ratings["x"][0] == 25.0


def test_openskill_anchor_shifts_table():
    rr = RunningRatings(anchor="random")
    rr.update([Outcome("main", "random", 8, 1, 1)])
    rows = {r["name"]: r for r in rr.table()}
    assert rows["random"]["mu"] == 0.0 and rows["random"]["relative_to"] == "random"
    assert rows["main"]["mu"] == pytest.approx(rr.ratings["main"][0] - rr.ratings["random"][0])


def test_openskill_state_round_trips_bit_for_bit():
    first = sampled_outcomes(30, seed=5) + [Outcome("main", "base", 3, 4, 2)]
    second = sampled_outcomes(30, seed=6) + [Outcome("newcomer", "main", 1, 2, 3)]
    straight = RunningRatings(anchor="random")
    straight.update(first)
    saved = json.dumps(straight.state())
    straight.update(second)
    restored = RunningRatings.from_state(json.loads(saved))
    assert restored.state() == json.loads(saved)
    restored.update(second)
    assert restored.state() == straight.state()  # exact float equality
    assert restored.table() == straight.table()
    again = RunningRatings(anchor="random")
    again.update(first + second)
    assert again.state() == straight.state()  # deterministic for the same sequence


def test_plot_ratings_writes_png(tmp_path):
    one = tmp_path / "one.png"
    plot_ratings([{"step": 0, "ratings": {"random": (0.0, 0.0, 0.0), "main": (0.3, 0.1, 0.5)}}], str(one))
    history = [{"step": s, "ratings": bradley_terry(sampled_outcomes(50 + 20 * s, seed=s), n_boot=20)}
               for s in range(3)]
    history[2]["ratings"]["main__s20"] = (0.7, 0.4, 1.0)  # appears mid-run
    history[1]["ratings"]["base"] = (math.nan, math.nan, math.nan)
    many = tmp_path / "ratings.png"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plot_ratings(history, many)
    for p in (one, many):
        data = p.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 1000
