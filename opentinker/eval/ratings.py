"""League ratings from pairwise game outcomes: a running openskill table and a
Bradley-Terry fit with bootstrap intervals.

Every evaluated pairing of the league (an LLM policy, its snapshots ``main__s10``, scripted
seats such as ``random``, the base model ``base``) gives an :class:`Outcome`:
wins, draws and losses of ``a`` against ``b`` over many games.

* :class:`RunningRatings`: Weng & Lin's Plackett-Luce model (JMLR 2011, Algorithm 4, via
  ``openskill``), updated game by game in the order the outcomes arrive. It is online, so it
  depends on that order and tracks a moving league; its state round-trips through JSON.
* :func:`bradley_terry`: the order-free answer for one set of outcomes. Ratings are natural
  log-strengths (logits): ``P(a beats b) = 1 / (1 + exp(r_b - r_a))`` (:func:`win_probability`);
  multiply by :data:`ELO_PER_LOGIT` for Elo points. A draw counts as half a win each way
  (Hunter 2004, MM algorithms for generalized Bradley-Terry models, with ties split), and a
  Gaussian prior ``l2 / 2 * sum r^2`` keeps a player that won every game finite.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from openskill.models import PlackettLuce

ELO_PER_LOGIT = 400.0 / math.log(10.0)
"""Elo points per unit of Bradley-Terry rating (about 173.7)."""


@dataclass(frozen=True)
class Outcome:
    """Counts over the games of one pairing, from ``a``'s point of view."""

    a: str
    b: str
    wins: int
    draws: int
    losses: int

    def __post_init__(self) -> None:
        if self.a == self.b:
            raise ValueError(f"a player cannot play itself: {self.a!r}")
        if min(self.wins, self.draws, self.losses) < 0:
            raise ValueError(f"negative count in {self}")


def _game_order(o: Outcome) -> list[int]:
    """The games of ``o`` as ranks of ``a`` (0 win, 1 draw, 2 loss), interleaved evenly (game
    ``i`` of a result that occurred ``c`` times sits at ``(i + 0.5) / c``) so that an online
    rating does not see all the wins before all the losses."""
    keyed = [((i + 0.5) / c, r) for r, c in enumerate((o.wins, o.draws, o.losses)) for i in range(c)]
    return [r for _, r in sorted(keyed)]


_RANKS = ([0, 1], [0, 0], [1, 0])
"""openskill ranks (lower is better) of ``[a, b]`` after a win, draw and loss of ``a``."""


class RunningRatings:
    """An openskill Plackett-Luce table, one ``(mu, sigma)`` per player (prior ``(25, 25/3)``).

    Each game is one two-player ``rate`` call (a draw is a tie, ranks ``[0, 0]``), so the table
    depends only on the sequence of updates: the same sequence gives the same floats. ``tau``
    adds uncertainty before every game, so ``sigma`` stays above a floor and old results fade.

    Args:
        anchor: a player (e.g. ``"random"``) whose ``mu`` is subtracted from every ``mu``,
            ``ordinal`` and interval in :meth:`table` once it has a rating (a shift only: the
            sigmas, the order and the stored state are unchanged).
        mu, sigma, beta, tau: the openskill model's parameters (its defaults).
    """

    def __init__(self, anchor: str | None = None, mu: float = 25.0, sigma: float = 25.0 / 3.0,
                 beta: float = 25.0 / 6.0, tau: float = 25.0 / 300.0) -> None:
        self.anchor = anchor
        self.params = {"mu": float(mu), "sigma": float(sigma), "beta": float(beta), "tau": float(tau)}
        self._model = PlackettLuce(**self.params)
        self.ratings: dict[str, tuple[float, float]] = {}
        """name -> (mu, sigma)."""
        self.n_games = 0

    def update(self, outcomes: list[Outcome]) -> None:
        """Rate every game of ``outcomes``, pairing by pairing, in :func:`_game_order`."""
        m = self._model
        for o in outcomes:
            for name in (o.a, o.b):
                self.ratings.setdefault(name, (self.params["mu"], self.params["sigma"]))
            a, b = m.rating(*self.ratings[o.a]), m.rating(*self.ratings[o.b])
            for rank_a in _game_order(o):
                (a,), (b,) = m.rate([[a], [b]], ranks=_RANKS[rank_a])
                self.n_games += 1
            self.ratings[o.a], self.ratings[o.b] = (a.mu, a.sigma), (b.mu, b.sigma)

    def table(self) -> list[dict[str, Any]]:
        """Rows ``{name, mu, sigma, ordinal, lo, hi, relative_to}``, best first by ``ordinal =
        mu - 3 sigma`` (a conservative skill: the true one is above it with ~99.9% belief);
        ``[lo, hi] = mu -+ 1.96 sigma`` is the 95% posterior interval of the player's skill,
        shifted by the anchor's ``mu`` when ``relative_to`` is set (the anchor's own
        uncertainty is not added)."""
        ref = self.anchor if self.anchor in self.ratings else None
        shift = self.ratings[ref][0] if ref is not None else 0.0
        rows = [{"name": n, "mu": mu - shift, "sigma": s, "ordinal": mu - 3.0 * s - shift,
                 "lo": mu - 1.96 * s - shift, "hi": mu + 1.96 * s - shift, "relative_to": ref}
                for n, (mu, s) in self.ratings.items()]
        return sorted(rows, key=lambda r: (-r["ordinal"], r["name"]))

    def state(self) -> dict[str, Any]:
        """A JSON-serialisable snapshot; Python floats survive ``json`` exactly, so
        :meth:`from_state` continues bit for bit."""
        return {"params": dict(self.params), "anchor": self.anchor, "n_games": self.n_games,
                "ratings": {n: [mu, s] for n, (mu, s) in self.ratings.items()}}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> RunningRatings:
        """The table that :meth:`state` saved."""
        r = cls(anchor=state["anchor"], **state["params"])
        r.ratings = {n: (float(mu), float(s)) for n, (mu, s) in state["ratings"].items()}
        r.n_games = int(state["n_games"])
        return r


def outcomes_of(ev: Mapping[str, float]) -> list[Outcome]:
    """Every pairing of an evaluation's metrics (``eval/<a>/vs_<b>/wins``, ``draws``,
    ``losses``) as an :class:`Outcome`, in the order of the sorted keys."""
    out = []
    for key in sorted(ev):
        parts = key.split("/")
        if len(parts) == 4 and parts[0] == "eval" and parts[3] == "wins" and parts[2].startswith("vs_"):
            prefix = key[: -len("wins")]
            out.append(Outcome(parts[1], parts[2][3:], int(ev[prefix + "wins"]), int(ev[prefix + "draws"]),
                               int(ev[prefix + "losses"])))
    return out


def rating_metrics(ev: Mapping[str, float], table: RunningRatings, *, anchor: str, n_boot: int,
                   seed: int) -> dict[str, float]:
    """The ratings of every player of an evaluation's pairings (``ev``'s ``eval/<a>/vs_<b>/wins``
    ...): ``table`` updated with them, then ``ratings/bt/<name>`` (the Bradley-Terry fit of
    these games, logits relative to ``anchor``, with ``/lo`` and ``/hi`` from ``n_boot``
    bootstrap fits) and ``ratings/openskill/<name>`` (mu, ``/sigma``) of the running table."""
    outcomes = outcomes_of(ev)
    if not outcomes:
        return {}
    table.update(outcomes)
    out: dict[str, float] = {}
    for name, (r, lo, hi) in bradley_terry(outcomes, anchor=anchor, n_boot=n_boot, seed=seed).items():
        out.update({f"ratings/bt/{name}": r, f"ratings/bt/{name}/lo": lo, f"ratings/bt/{name}/hi": hi})
    for row in table.table():
        out[f"ratings/openskill/{row['name']}"] = row["mu"]
        out[f"ratings/openskill/{row['name']}/sigma"] = row["sigma"]
    return out


def win_probability(r_a: float, r_b: float) -> float:
    """P(a beats b) under Bradley-Terry with ratings in logits (a draw counted as half)."""
    d = r_a - r_b
    return 1.0 / (1.0 + math.exp(-d)) if d >= 0 else math.exp(d) / (1.0 + math.exp(d))


def _log_posterior(theta_BP: np.ndarray, s_BK: np.ndarray, n_K: np.ndarray, E_KP: np.ndarray,
                   l2: float) -> np.ndarray:
    d_BK = theta_BP @ E_KP.T
    ll = -(s_BK * np.logaddexp(0.0, -d_BK) + (n_K - s_BK) * np.logaddexp(0.0, d_BK)).sum(1)
    return ll - 0.5 * l2 * (theta_BP**2).sum(1)


def _fit_bt(s_BK: np.ndarray, n_K: np.ndarray, E_KP: np.ndarray, l2: float, tol: float = 1e-9,
            max_iter: int = 100) -> np.ndarray:
    """MAP log-strengths ``theta_BP`` of ``B`` independent Bradley-Terry problems at once.

    ``s_BK``: points (wins + draws / 2) of pairing ``k``'s first player; ``n_K``: its games;
    ``E_KP``: +1 at the first player, -1 at the second. Damped Newton on the concave log
    posterior (backtracking until the Armijo condition holds), stopped per problem when the
    largest step is below ``tol``."""
    B, P = s_BK.shape[0], E_KP.shape[1]
    theta = np.zeros((B, P))
    f = _log_posterior(theta, s_BK, n_K, E_KP, l2)
    todo = np.ones(B, dtype=bool)
    for _ in range(max_iter):
        p_BK = 1.0 / (1.0 + np.exp(-(theta @ E_KP.T)))
        g_BP = (s_BK - n_K * p_BK) @ E_KP - l2 * theta
        w_BK = n_K * p_BK * (1.0 - p_BK)
        H_BPP = (E_KP.T[None] * w_BK[:, None, :]) @ E_KP + l2 * np.eye(P)  # minus the Hessian
        step = np.linalg.solve(H_BPP, g_BP[..., None])[..., 0]
        todo &= np.abs(step).max(1) > tol
        if not todo.any():
            break
        gain = (g_BP * step).sum(1)  # Newton decrement squared, >= 0
        t = np.where(todo, 1.0, 0.0)
        for _ in range(40):
            f_new = _log_posterior(theta + t[:, None] * step, s_BK, n_K, E_KP, l2)
            # the slack absorbs rounding in f, which is a sum of up to ~1e6 game terms
            bad = todo & (f_new < f + 1e-4 * t * gain - 1e-12 * (1.0 + np.abs(f)))
            if not bad.any():
                break
            t[bad] *= 0.5
        else:  # no ascent found: rounding level, stop those problems where they are
            t[bad] = 0.0
            f_new = _log_posterior(theta + t[:, None] * step, s_BK, n_K, E_KP, l2)
            todo &= ~bad
        theta = theta + t[:, None] * step
        f = f_new
    return theta


def bradley_terry(outcomes: list[Outcome], anchor: str | None = None, n_boot: int = 200,
                  seed: int = 0, l2: float = 1e-3) -> dict[str, tuple[float, float, float]]:
    """Bradley-Terry ratings with 95% bootstrap intervals: ``{name: (rating, lo, hi)}``.

    ``rating`` is the maximum a posteriori log-strength (logits; :func:`win_probability`;
    ``* ELO_PER_LOGIT`` for Elo) with a ``N(0, 1/l2)`` prior on every log-strength, shifted so
    that ``anchor`` is 0 (default: ``"random"`` when present, else the first name
    alphabetically). Outcomes of the same two players are pooled; a draw is half a win each way.

    ``[lo, hi]`` is the 2.5-97.5 percentile interval of the rating relative to the anchor over
    ``n_boot`` refits, each resampling the games of every pairing with replacement (a
    multinomial draw of its wins, draws and losses), so it includes the anchor's own
    uncertainty and the anchor's interval is ``(0, 0)``. NaN when ``n_boot`` is 0. A perfect
    record resamples to itself: its rating (finite only through the prior) and its narrow
    interval then say "far above", not how far.

    A player that no chain of played games links to the anchor (it played no games, or only in
    a separate group) has no rating relative to it: its triple is NaN, with a warning.
    Empty input gives ``{}``.
    """
    names = sorted({n for o in outcomes for n in (o.a, o.b)})
    if not names:
        return {}
    anchor = anchor if anchor is not None else ("random" if "random" in names else names[0])
    if anchor not in names:
        raise ValueError(f"anchor {anchor!r} is not among the players {names}")
    pooled: dict[tuple[str, str], np.ndarray] = {}
    for o in outcomes:  # key by (first, second) alphabetically; counts as [w, d, l] of first
        key, wdl = ((o.a, o.b), [o.wins, o.draws, o.losses]) if o.a < o.b else \
                   ((o.b, o.a), [o.losses, o.draws, o.wins])
        pooled[key] = pooled.get(key, np.zeros(3, dtype=np.int64)) + wdl
    pooled = {k: v for k, v in pooled.items() if v.sum() > 0}
    linked, frontier = {anchor}, [anchor]
    while frontier:
        x = frontier.pop()
        for a, b in pooled:
            for u, v in ((a, b), (b, a)):
                if u == x and v not in linked:
                    linked.add(v)
                    frontier.append(v)
    out = {n: (math.nan, math.nan, math.nan) for n in names}
    if len(linked) < len(names):
        warnings.warn(f"bradley_terry: {sorted(set(names) - linked)} share no games with the "
                      f"anchor {anchor!r}'s group; their ratings are NaN", stacklevel=2)
    if len(linked) == 1:
        out[anchor] = (0.0, 0.0, 0.0) if n_boot else (0.0, math.nan, math.nan)
        return out
    players = sorted(linked)
    index = {n: i for i, n in enumerate(players)}
    pairs = [k for k in pooled if k[0] in linked]
    wdl_K3 = np.stack([pooled[k] for k in pairs]).astype(np.float64)
    n_K = wdl_K3.sum(1)
    E_KP = np.zeros((len(pairs), len(players)))
    for k, (a, b) in enumerate(pairs):
        E_KP[k, index[a]], E_KP[k, index[b]] = 1.0, -1.0
    points = np.array([1.0, 0.5, 0.0])
    theta_P = _fit_bt((wdl_K3 @ points)[None], n_K, E_KP, l2)[0]
    rating_P = theta_P - theta_P[index[anchor]]
    lo_P = hi_P = np.full(len(players), math.nan)
    if n_boot > 0:
        rng = np.random.default_rng(seed)
        counts_BK3 = rng.multinomial(n_K.astype(np.int64), wdl_K3 / n_K[:, None], size=(n_boot, len(pairs)))
        boot_BP = _fit_bt(counts_BK3 @ points, n_K, E_KP, l2)
        boot_BP = boot_BP - boot_BP[:, index[anchor], None]
        lo_P, hi_P = np.percentile(boot_BP, [2.5, 97.5], axis=0)
    for n, i in index.items():
        out[n] = (float(rating_P[i]), float(lo_P[i]), float(hi_P[i]))
    return out


def plot_ratings(history: list[dict[str, Any]], path: str | Path,
                 ylabel: str = "Bradley-Terry rating (logits vs anchor)") -> None:
    """One line per player over ``step`` with its ``[lo, hi]`` band shaded (an error bar where
    the player has a single point), from rows ``{"step": int, "ratings": {name: (rating, lo,
    hi)}}``; players may appear mid-run, NaN ratings are skipped. Writes a PNG to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    names = list(dict.fromkeys(n for row in history for n in row["ratings"]))
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, name in enumerate(names):
        pts = sorted((row["step"], *row["ratings"][name]) for row in history if name in row["ratings"])
        x, y, lo, hi = (np.array(c, dtype=np.float64) for c in zip(*pts))
        keep = np.isfinite(y)
        if not keep.any():
            continue
        x, y, lo, hi = x[keep], y[keep], lo[keep], hi[keep]
        color = f"C{i % 10}"
        ax.plot(x, y, "o-", ms=3, lw=1.2, color=color, label=name)
        if len(x) == 1 and np.isfinite(lo[0]) and np.isfinite(hi[0]):
            ax.errorbar(x, y, yerr=[y - lo, hi - y], color=color, capsize=3)
        else:
            ax.fill_between(x, lo, hi, color=color, alpha=0.15, lw=0)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set(xlabel="training step", ylabel=ylabel, title="League ratings (95% intervals)")
    if names:
        ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
