"""The coordinator's part of the exact all-actions gradient (``train.all_actions``): score each
policy's canonical replies, build its opponents' action probabilities, and turn the weights of
:func:`learners.all_actions.all_actions_weights` into datums the policy's learner trains on.

The opponents are the policy's own mix (``[[policies]].opponents``), each by what is known of
its play: ``best_response`` a pure best response to the policy as it is now (the game's exact
exploiter), ``random`` uniform over the legal moves, ``self`` the policy itself, another policy
its scored replies, and ``past`` the league's snapshots weighted by the job's matchmaking
(``league.matchmaking`` on the coordinator's win-rate estimates; the policy itself before the
first snapshot).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

import numpy as np

from games.evaluation import DecisionPoint, Distribution, ExactMeasure
from opentinker.config import JobConfig, opponent_pool
from opentinker.rollout.matchmaking import WinRates, pfsp_weights
from protocols.messages import Datum


@dataclass(frozen=True)
class Scored:
    """One policy's teacher-forced scoring of every legal move's canonical reply."""

    decisions: Sequence[DecisionPoint]
    sequences: Sequence[np.ndarray]
    """``int32[T]`` per (decision, legal move) in order."""
    n_reply: Sequence[int]
    logprobs: Sequence[np.ndarray]
    """``float32[>= n_reply]`` per sequence: the reply's tokens last."""
    dist: Distribution
    mass: float
    """The model's mean probability of the canonical replies."""


Score = Callable[[str], Awaitable[Scored]]
"""Scores a policy (an adapter name) at the measure's decisions."""


def uniform(decisions: Sequence[DecisionPoint]) -> dict[str, dict[str, float]]:
    """Random play: uniform over each decision's legal moves."""
    return {d.infostate: {m: 1.0 / len(d.legal_moves) for m in d.legal_moves} for d in decisions}


def pure(table: dict[str, str], decisions: Sequence[DecisionPoint]) -> dict[str, dict[str, float]]:
    """A pure strategy ``{decision: move}`` as a distribution."""
    return {d.infostate: {m: float(m == table[d.infostate]) for m in d.legal_moves} for d in decisions}


def trained_rows(decisions: Sequence[DecisionPoint], k: int, seed: tuple[int, int]) -> list[int]:
    """The indices (into the scored sequences, one per decision and legal move, in order) of
    the replies a step trains on: those of ``k`` decisions drawn without replacement by a
    generator seeded with ``seed`` (the job's seed and the step, so a resumed run draws the
    same), in their original order; every row when ``k`` is 0 or at least the decisions."""
    starts = np.cumsum([0] + [len(d.legal_moves) for d in decisions])
    if k == 0 or k >= len(decisions):
        return list(range(int(starts[-1])))
    chosen = np.sort(np.random.default_rng(list(seed)).choice(len(decisions), size=k, replace=False))
    return [i for j in chosen for i in range(int(starts[j]), int(starts[j + 1]))]


async def opponents_of(cfg: JobConfig, policy: str, step: int, m: ExactMeasure, me: Scored, score: Score,
                       win_rates: WinRates) -> list[tuple[float, Distribution]]:
    """``[(weight, distribution)]`` of ``policy``'s opponent mix at ``step``."""
    (p,) = [q for q in cfg.policies if q.name == policy]
    out: list[tuple[float, Distribution]] = []
    for name, w in sorted(p.opponents.items()):
        if w <= 0:
            continue
        if name == "best_response":
            assert m.best_response is not None, "the config check requires an exact exploiter"
            out.append((w, pure(dict(m.best_response(me.dist)), me.decisions)))
        elif name == "random":
            out.append((w, uniform(me.decisions)))
        elif name in ("self", policy):
            out.append((w, me.dist))
        elif name == "past":
            pool = opponent_pool(cfg, policy, step)
            if not pool:
                out.append((w, me.dist))
                continue
            p_wins = np.array([win_rates.p_win(policy, o) for o in pool])
            for o, share in zip(pool, pfsp_weights(p_wins, cfg.league.matchmaking, cfg.league.pfsp_power)):
                if share > 0:
                    out.append((w * float(share), (await score(o)).dist))
        else:  # another policy of the job
            out.append((w, (await score(name)).dist))
    return out


async def all_actions_terms(cfg: JobConfig, step: int, m: ExactMeasure, score: Score, win_rates: WinRates,
                            ) -> tuple[dict[str, list[Datum]], dict[str, float]]:
    """For every policy with ``train.all_actions`` > 0: its datums (one per decision and legal
    move; only those of ``train.all_actions_decisions`` drawn decisions when that is set) and
    metrics ``train/<policy>/all_actions/payoff`` (the payoff against its mix),
    ``/canonical_mass`` and ``/decisions`` (how many decisions it trains on)."""
    from learners.all_actions import all_actions_datums, all_actions_weights  # (the learners package imports torch)

    assert m.payoff is not None, "the config check requires an exact payoff"
    datums: dict[str, list[Datum]] = {}
    metrics: dict[str, float] = {}
    for p in cfg.policies:
        tc = cfg.train_for(p.name)
        if not tc.all_actions > 0 or p.frozen:
            continue
        me = await score(p.name)
        opps = await opponents_of(cfg, p.name, step, m, me, score, win_rates)
        rows = trained_rows(me.decisions, tc.all_actions_decisions, (cfg.seed, step))
        flat = [(d.infostate, move) for d in me.decisions for move in d.legal_moves]
        at = {flat[i][0] for i in rows}
        # Only the drawn decisions are weighed (a payoff per legal move each); all are scored.
        weights, value = all_actions_weights(m.payoff, me.dist, opps, tc.canonical_coef, tc.all_actions_rule, at=at)
        datums[p.name] = all_actions_datums([me.sequences[i] for i in rows], [me.n_reply[i] for i in rows],
                                            [me.logprobs[i] for i in rows],
                                            [tc.all_actions * weights[flat[i][0]][flat[i][1]] for i in rows])
        metrics[f"train/{p.name}/all_actions/decisions"] = float(len(at))
        metrics[f"train/{p.name}/all_actions/payoff"] = value
        metrics[f"train/{p.name}/all_actions/canonical_mass"] = me.mass
    return datums, metrics
