"""Prioritized fictitious self-play (PFSP): which league snapshot a learner plays next.

AlphaStar (Vinyals et al. 2019, "Grandmaster level in StarCraft II using multi-agent
reinforcement learning", Methods, "Prioritized fictitious self-play") draws an opponent ``B``
from the pool ``C`` with probability ``f(P[A beats B]) / sum_{C in C} f(P[A beats C])``, with

* ``hard``:     ``f(x) = (1 - x)^p`` (p = 2): the opponents the learner still loses to;
* ``variance``: ``f(x) = x (1 - x)``: the opponents of about its own strength;
* ``uniform``:  ``f(x) = 1``: plain fictitious self-play (what ``train_episodes`` does today).

``P[A beats B]`` is estimated by :class:`WinRates` from the games played: a Beta(1, 1) prior
(an unseen opponent is at 0.5) updated with exponentially decayed counts, so the estimate
tracks a learner that keeps changing. Where AlphaStar keeps running win rates over all games,
here every update first multiplies the pair's past counts by ``decay``.

Everything is a pure function of its inputs and the ``numpy`` generator passed in: a run that
saves :meth:`WinRates.state` and its generator's state draws the same opponents on resume.
"""

from __future__ import annotations

import math
from enum import StrEnum
from typing import Any

import numpy as np


class Weighting(StrEnum):
    """The PFSP weighting functions ``f`` (AlphaStar, Methods)."""

    HARD = "hard"
    VARIANCE = "variance"
    UNIFORM = "uniform"


class WinRates:
    """Estimates of ``P[learner policy beats opponent]``, one per (policy, opponent) pair.

    Each pair keeps decayed counts: ``score`` (wins + draws / 2) and ``games`` (wins + draws +
    losses). An update with ``w`` wins, ``d`` draws and ``l`` losses sets ``score <- decay *
    score + w + d / 2`` and ``games <- decay * games + w + d + l``; the estimate is the mean of
    the Beta(``prior_wins`` + score, ``prior_losses`` + games - score) posterior. With the
    default Beta(1, 1) prior an unseen pair is at 0.5; a game played ``k`` updates ago weighs
    ``decay^k`` as much as one of the latest update (a memory of about ``1 / (1 - decay)``
    updates; ``decay = 1``: plain counts, nothing forgotten)."""

    def __init__(self, decay: float = 0.9, prior_wins: float = 1.0, prior_losses: float = 1.0) -> None:
        if not 0.0 < decay <= 1.0:
            raise ValueError(f"decay: must be in (0, 1], got {decay}")
        if not (prior_wins > 0 and prior_losses > 0 and math.isfinite(prior_wins + prior_losses)):
            raise ValueError(f"prior: both pseudo-counts must be positive and finite, got {prior_wins}, {prior_losses}")
        self.decay = float(decay)
        self.prior_wins = float(prior_wins)
        self.prior_losses = float(prior_losses)
        self._counts: dict[str, dict[str, list[float]]] = {}
        """policy -> opponent -> [score, games] (decayed)."""

    def update(self, policy: str, opponent: str, wins: int, draws: int, losses: int) -> None:
        """Record a batch of games of ``policy`` against ``opponent`` (outcomes for the learner;
        a draw counts half a win). One call is one decay step for this pair."""
        if min(wins, draws, losses) < 0:
            raise ValueError(f"update: negative game counts ({wins}, {draws}, {losses})")
        score, games = self._counts.setdefault(policy, {}).get(opponent, (0.0, 0.0))
        self._counts[policy][opponent] = [self.decay * score + wins + 0.5 * draws,
                                          self.decay * games + wins + draws + losses]

    def p_win(self, policy: str, opponent: str) -> float:
        """The posterior mean of ``P[policy beats opponent]`` (in (0, 1); the prior's mean,
        0.5 by default, for a pair never updated)."""
        score, games = self._counts.get(policy, {}).get(opponent, (0.0, 0.0))
        return (self.prior_wins + score) / (self.prior_wins + self.prior_losses + games)

    def forget(self, opponent: str) -> None:
        """Drop every estimate against ``opponent`` (a snapshot that left the league; a new
        snapshot of the same name starts again from the prior)."""
        for by_opp in self._counts.values():
            by_opp.pop(opponent, None)

    def state(self) -> dict[str, Any]:
        """A JSON-serialisable copy (floats round-trip exactly through ``json``)."""
        return {"decay": self.decay, "prior_wins": self.prior_wins, "prior_losses": self.prior_losses,
                "counts": {p: {o: list(c) for o, c in by_opp.items()} for p, by_opp in self._counts.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> WinRates:
        """The inverse of :meth:`state`: the same estimates and the same later updates."""
        out = cls(state["decay"], state["prior_wins"], state["prior_losses"])
        for policy, by_opp in state["counts"].items():
            for opponent, (score, games) in by_opp.items():
                score, games = float(score), float(games)
                if not (math.isfinite(games) and 0.0 <= score <= games):
                    raise ValueError(f"counts[{policy}][{opponent}]: need 0 <= score <= games, got {score}, {games}")
                out._counts.setdefault(policy, {})[opponent] = [score, games]
        return out


def pfsp_weights(p_wins: np.ndarray, weighting: str, p: float = 2.0) -> np.ndarray:
    """PFSP's opponent probabilities ``f(x_i) / sum_j f(x_j)`` for win probabilities
    ``p_wins`` of shape (n,) in [0, 1]; ``p`` is ``hard``'s exponent. Returns shape (n,),
    summing to 1: uniform where every ``f`` is 0 (e.g. ``hard`` when the learner beats every
    opponent for certain). ``ValueError`` for an unknown weighting or an empty pool."""
    try:
        kind = Weighting(weighting)
    except ValueError:
        raise ValueError(f"weighting: unknown {weighting!r}, expected one of "
                         f"{', '.join(w.value for w in Weighting)}") from None
    x_n = np.asarray(p_wins, dtype=np.float64)
    if x_n.ndim != 1 or x_n.size == 0:
        raise ValueError(f"p_wins: need a non-empty 1-d array, got shape {x_n.shape}")
    if not np.all((x_n >= 0.0) & (x_n <= 1.0)):  # also rejects NaN
        raise ValueError(f"p_wins: must lie in [0, 1], got {x_n}")
    if kind is Weighting.HARD:
        if not (p >= 0.0 and math.isfinite(p)):
            raise ValueError(f"p: hard's exponent must be finite and >= 0, got {p}")
        f_n = (1.0 - x_n) ** p
    elif kind is Weighting.VARIANCE:
        f_n = x_n * (1.0 - x_n)
    else:
        f_n = np.ones_like(x_n)
    total = f_n.sum()
    if not total > 0.0:
        return np.full_like(x_n, 1.0 / x_n.size)
    return f_n / total


def draw_opponent(rng: np.random.Generator, pool: list[str], win_rates: WinRates, policy: str, weighting: str,
                  *, p: float = 2.0) -> str:
    """One opponent of ``policy`` from ``pool``, drawn with :func:`pfsp_weights` of its
    estimated win rates; the same generator state gives the same draw. ``uniform`` draws
    ``pool[rng.integers(len(pool))]``, exactly today's draw in ``train_episodes``, so a job
    that switches to PFSP with ``uniform`` keeps its episodes bit for bit."""
    if not pool:
        raise ValueError("pool: empty (no league snapshot to draw from)")
    if weighting == Weighting.UNIFORM:
        return pool[int(rng.integers(len(pool)))]
    w_n = pfsp_weights(np.array([win_rates.p_win(policy, o) for o in pool]), weighting, p)
    return pool[int(rng.choice(len(pool), p=w_n))]
