"""Exact game theory of a small two-player zero-sum game with hidden deals, as a tabular tree.

A game here is a uniform chance draw of a *deal* (the private cards, and any public card drawn
later: its draw is part of the deal but the seats see it only when their information state
shows it), then alternating public moves. Every deal shares the same tree of public
histories (the moves legal at a history never depend on the cards), so the tree is walked once
per history with NumPy vectors over all deals: exact, and fast enough to evaluate a policy's
payoff thousands of times per training step (Leduc hold'em: 120 deals x 85 histories).

A policy is a :data:`Distribution` ``{infostate: {move: probability}}`` (each seat reads only
its own information states). :meth:`TabularGame.expected_value` is player_0's expected
reward; :meth:`TabularGame.best_response` a pure best response of one seat and its value,
computed by backward induction over that seat's information states (perfect recall: an
information state's histories all lie at one public history, so its counterfactual values
are sums over deals); :meth:`TabularGame.exploitability` is OpenSpiel's NashConv / 2.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from games.evaluation import Decision, ExactMeasure, GameEval

Distribution = Mapping[str, Mapping[str, float]]
"""``{infostate: {move: probability}}``, each inner mapping summing to 1 over the legal moves."""

TIE = 1e-12
"""Moves whose counterfactual values lie within this of the best tie; the first in order wins."""


@dataclass(frozen=True)
class _Node:
    history: str
    player: int
    """The seat to move, or -1 at a terminal history."""
    moves: tuple[str, ...]
    children: tuple[int, ...]
    """Indices of the child histories, one per move."""


class TabularGame:
    """The tree of a two-seat zero-sum game with a uniform chance deal; see the module docstring.

    Args:
        deals: the equally likely deals.
        moves: the legal moves (words) at a public history; empty at a terminal one.
        step: the public history after a move.
        infostate: the deciding seat's information state at ``(deal, history)``.
        payoff0: player_0's reward at a terminal ``(deal, history)``.
        player: the seat to move at a non-terminal history (default: alternate, player_0 first).
    """

    def __init__(
        self,
        deals: Sequence[Hashable],
        moves: Callable[[str], tuple[str, ...]],
        step: Callable[[str, str], str],
        infostate: Callable[[Hashable, str], str],
        payoff0: Callable[[Hashable, str], float],
        player: Callable[[str], int] = lambda h: len(h) % 2,
    ) -> None:
        self.deals = tuple(deals)
        nodes: list[_Node] = []

        def visit(history: str) -> int:
            i = len(nodes)
            nodes.append(_Node(history, -1, (), ()))
            legal = tuple(moves(history))
            if legal:
                children = tuple(visit(step(history, m)) for m in legal)
                nodes[i] = _Node(history, player(history), legal, children)
            return i

        visit("")
        self.nodes = tuple(nodes)
        """Public histories, parents before children (index 0: the root)."""
        self.states: dict[str, tuple[int, tuple[str, ...]]] = {}
        """Every information state -> (its seat, its legal moves), in tree order."""
        self._index: dict[int, np.ndarray] = {}
        """Decision node -> ``int[deals]``: the row of each deal's information state in
        ``self.states``' order."""
        self._payoff: dict[int, np.ndarray] = {}
        """Terminal node -> ``float[deals]``: player_0's reward."""
        rows: dict[str, int] = {}
        for i, node in enumerate(self.nodes):
            if node.player < 0:
                self._payoff[i] = np.array([payoff0(d, node.history) for d in self.deals], np.float64)
                continue
            idx = []
            for d in self.deals:
                s = infostate(d, node.history)
                if s not in rows:
                    rows[s] = len(rows)
                    self.states[s] = (node.player, node.moves)
                elif self.states[s] != (node.player, node.moves):
                    raise ValueError(f"info state {s!r} met with different seats or moves")
                idx.append(rows[s])
            self._index[i] = np.array(idx, np.int64)
        self._rows = rows

    def seat_states(self, seat: int) -> tuple[str, ...]:
        """The information states where ``seat`` (0 or 1) decides, in tree order."""
        return tuple(s for s, (p, _) in self.states.items() if p == seat)

    def _table(self, policy: Distribution, seats: tuple[int, ...]) -> np.ndarray:
        """``float[states, max moves]``: the probabilities of ``policy`` at the states of
        ``seats`` (zero elsewhere); ValueError naming a missing state or a bad probability."""
        width = max(len(m) for _, m in self.states.values())
        out = np.zeros((len(self.states), width))
        missing = []
        for s, (p, moves) in self.states.items():
            if p not in seats:
                continue
            probs = policy.get(s)
            if probs is None:
                missing.append(s)
                continue
            row = [float(probs.get(m, 0.0)) for m in moves]
            if any(not 0.0 <= x <= 1.0 for x in row) or abs(sum(row) - 1.0) > 1e-6:
                raise ValueError(f"policy at {s!r}: probabilities {dict(probs)} are not a distribution over {moves}")
            out[self._rows[s], : len(row)] = row
        if missing:
            raise ValueError(f"policy lacks info states {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        return out

    def _values(self, table: np.ndarray,
                visit: Callable[[int, _Node, np.ndarray, np.ndarray], None] | None = None) -> np.ndarray:
        """player_0's value per deal at the root when every seat plays ``table`` (probabilities
        per state row); ``visit(i, node, child, value)`` sees each decision node's ``float[deals,
        moves]`` child values and ``float[deals]`` value on the way up."""
        values: dict[int, np.ndarray] = {}
        for i in range(len(self.nodes) - 1, -1, -1):
            node = self.nodes[i]
            if node.player < 0:
                values[i] = self._payoff[i]
                continue
            child = np.stack([values.pop(c) for c in node.children]).T
            values[i] = (table[self._index[i], : child.shape[1]] * child).sum(axis=1)
            if visit is not None:
                visit(i, node, child, values[i])
        return values[0]

    def expected_value(self, policy0: Distribution, policy1: Distribution) -> float:
        """player_0's expected reward when player_0 plays ``policy0`` and player_1 ``policy1``
        (each read only at its own information states); exact."""
        return float(self._values(self._table(policy0, (0,)) + self._table(policy1, (1,))).mean())

    def payoff(self, first: Distribution, second: Distribution) -> float:
        """The expected reward of ``first`` against ``second``, each seat played half the games."""
        return (self.expected_value(first, second) - self.expected_value(second, first)) / 2.0

    def best_response(self, policy: Distribution, seat: int) -> tuple[float, dict[str, str]]:
        """``(value, {infostate: move})``: a pure best response of ``seat`` (0 or 1) to the
        other seat's part of ``policy``, and its expected reward. At each of its information
        states it plays the move of largest counterfactual value (ties within :data:`TIE` to the
        first legal move), so it is a best response also where its own earlier moves do not
        lead (a state the other seat never reaches gets its first move)."""
        if seat not in (0, 1):
            raise ValueError(f"seat must be 0 or 1, got {seat!r}")
        table = self._table(policy, (1 - seat,))
        sign = 1.0 if seat == 0 else -1.0
        n = len(self.deals)
        reach = {0: np.full(n, 1.0 / n)}  # chance x the other seat, per deal and node
        for i, node in enumerate(self.nodes):
            if node.player >= 0:
                probs = table[self._index[i]]
                for k, c in enumerate(node.children):
                    reach[c] = reach[i] if node.player == seat else reach[i] * probs[:, k]
        values: dict[int, np.ndarray] = {}
        choice: dict[str, str] = {}
        names = list(self._rows)
        for i in range(len(self.nodes) - 1, -1, -1):
            node = self.nodes[i]
            if node.player < 0:
                values[i] = sign * self._payoff[i]
                continue
            child = np.stack([values.pop(c) for c in node.children])  # [moves, deals]
            idx = self._index[i]
            if node.player != seat:
                values[i] = (table[idx, : len(node.children)].T * child).sum(axis=0)
                continue
            rows, inverse = np.unique(idx, return_inverse=True)
            cf = np.zeros((len(rows), len(node.children)))
            np.add.at(cf, inverse, (child * reach[i]).T)
            best = np.array([int(np.flatnonzero(v >= v.max() - TIE)[0]) for v in cf])
            for row, k in zip(rows, best):
                choice[names[row]] = node.moves[k]
            values[i] = child[best[inverse], np.arange(n)]
        return float(values[0].mean()), choice

    def best_responses(self, policy: Distribution) -> dict[str, str]:
        """``{infostate: move}``: a pure best response to ``policy`` in either seat (at each
        seat's states, against the other seat's part)."""
        return {**self.best_response(policy, 0)[1], **self.best_response(policy, 1)[1]}

    def nash_conv(self, policy: Distribution) -> float:
        """OpenSpiel's NashConv of ``policy`` (both seats' parts): the sum of both seats' best
        response values (the game is zero-sum, so the policy's own values cancel)."""
        return self.best_response(policy, 0)[0] + self.best_response(policy, 1)[0]

    def exploitability(self, policy: Distribution) -> float:
        """OpenSpiel's exploitability of ``policy``: NashConv / 2; 0 exactly at an equilibrium."""
        return self.nash_conv(policy) / 2.0

    def uniform(self) -> dict[str, dict[str, float]]:
        """Uniform random play: each legal move equally likely at every information state."""
        return {s: {m: 1.0 / len(moves) for m in moves} for s, (_, moves) in self.states.items()}


    def cfr(self, iterations: int) -> dict[str, dict[str, float]]:
        """The average policy of ``iterations`` of CFR+ (Tammelin 2014: regret matching with
        regrets floored at 0, both seats updated together, later iterations weighted
        linearly), whose exploitability falls towards 0; exact traversals, no sampling."""
        width = max(len(m) for _, m in self.states.values())
        legal = np.zeros((len(self.states), width), bool)
        for s, (_, moves) in self.states.items():
            legal[self._rows[s], : len(moves)] = True
        regret = np.zeros_like(legal, dtype=np.float64)  # stays 0 at padding columns
        average = np.zeros_like(regret)
        n = len(self.deals)
        for t in range(1, iterations + 1):
            positive = np.where(legal, np.maximum(regret, 0.0), 0.0)
            total = positive.sum(axis=1, keepdims=True)
            sigma = np.where(total > 0, positive / np.where(total > 0, total, 1.0), legal / legal.sum(axis=1, keepdims=True))
            reach = {0: (np.ones(n), np.ones(n))}  # (player_0's, player_1's) own reach per deal
            for i, node in enumerate(self.nodes):
                if node.player < 0:
                    continue
                own = reach[i]
                idx = self._index[i]
                np.add.at(average, idx, t * own[node.player][:, None] * sigma[idx])
                for k, c in enumerate(node.children):
                    step = sigma[idx, k]
                    reach[c] = (own[0] * step, own[1]) if node.player == 0 else (own[0], own[1] * step)

            def update(i: int, node: _Node, child: np.ndarray, v: np.ndarray,
                       reach: dict[int, tuple[np.ndarray, np.ndarray]] = reach) -> None:
                sign = 1.0 if node.player == 0 else -1.0
                other = reach[i][1 - node.player] / n
                np.add.at(regret[:, : child.shape[1]], self._index[i], sign * other[:, None] * (child - v[:, None]))

            self._values(sigma, update)
            np.maximum(regret, 0.0, out=regret)  # in place: `update` holds this array
        return {s: dict(zip(moves, (average[self._rows[s], : len(moves)] / average[self._rows[s]].sum()).tolist()))
                for s, (_, moves) in self.states.items()}


def poker_evaluation(game: TabularGame, decisions: Callable[[], list[Decision]], starts: tuple[dict[str, Any], ...],
                     scripted: tuple[str, ...]) -> GameEval:
    """The evaluation hook of a poker game on ``game``: chips per hand over ``starts``; at
    ``decisions()`` the exact exploitability (NashConv / 2), with the payoff and the best
    response the all-actions updates and the ``best_response`` opponent use, and the exact
    chips per hand against the random opponent (uniform over the legal moves, each seat
    equally often) of the policy's legal moves, renormalised: the number a sampled
    evaluation against random estimates, without its noise, for a policy that replies
    validly."""
    uniform_play = game.uniform()
    uniform = game.exploitability(uniform_play)
    br = game.best_responses(uniform_play)  # once: every process that imports the games builds this hook
    best_vs_random = game.payoff({s: {m: float(m == br[s]) for m in moves} for s, moves in uniform_play.items()},
                                 uniform_play)
    return GameEval(
        unit="chips",
        per="hand",
        starts=starts,
        scripted=scripted,
        system_prompt="You are a poker player.",
        references={"best response to random": round(uniform, 3)},
        exact=(
            ExactMeasure(
                name="exploitability",
                decisions=decisions,
                value=game.exploitability,
                better="lower",
                references={"uniform play": uniform, "equilibrium": 0.0},
                description="exploitability (NashConv/2)",
                payoff=game.payoff,
                best_response=game.best_responses,
            ),
            ExactMeasure(
                name="value_vs_random",
                decisions=decisions,
                value=lambda dist: game.payoff(dist, uniform_play),
                better="higher",
                references={"best response to random": best_vs_random, "uniform play": 0.0},
                description="chips/hand vs random, exact",
            ),
        ),
    )
