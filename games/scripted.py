"""Scripted seats: policies that read a game's observation and info and reply with text.

They sit in the league and the evaluation ladder like any LLM policy. Each reads only
`info["legal_moves"]` (and, for exact solvers, `info["infostate"]`; for dialogue games the
game's own infos, such as a negotiator's values), so a scripted seat never makes an invalid
reply; the text it returns goes through the game's ordinary parser. A game module may define
its policies beside its rules and list them in `SCRIPTED_POLICIES`; `GAME_POLICIES` collects
them here.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import numpy as np

from games import calculator, leduc_poker, liars_dice, negotiation, prisoners_dilemma, referential, twenty_questions
from games.kuhn_poker import equilibrium_policy
from games.tictactoe import minimax_moves, to_move


@runtime_checkable
class ScriptedPolicy(Protocol):
    """A seat that replies to one decision; all randomness comes from `rng`."""

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Return the reply text for the decision described by `observation` and `info`."""
        ...


class RandomPolicy:
    """Uniform over `info["legal_moves"]`."""

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Return one legal move drawn uniformly."""
        moves = list(info["legal_moves"])
        if not moves:
            raise ValueError("RandomPolicy.act called with no legal moves (not this seat's turn)")
        return str(moves[int(rng.integers(len(moves)))])


class KuhnEquilibriumPolicy:
    """Kuhn poker Nash equilibrium `equilibrium_policy(alpha)`, played from `info["infostate"]`."""

    def __init__(self, alpha: float = 0.0) -> None:
        self.alpha = alpha
        self.policy = equilibrium_policy(alpha)

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Bet/call with the equilibrium probability at this info state, else check/fold."""
        moves = set(info["legal_moves"])
        aggressive, passive = ("bet", "check") if "bet" in moves else ("call", "fold")
        if {aggressive, passive} != moves:
            raise ValueError(f"not a Kuhn poker decision: legal moves {sorted(moves)}")
        return aggressive if rng.random() < self.policy[info["infostate"]] else passive


class MinimaxPolicy:
    """Exact tic-tac-toe play from `info["infostate"]` (the board): never loses.

    `randomize=True` draws uniformly among the optimal cells (`minimax_moves`), so a league
    meets more than one line of perfect play; False always plays the lowest optimal cell.
    """

    def __init__(self, randomize: bool = True) -> None:
        self.randomize = randomize

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Return an optimal empty cell number for the mark to move, as text."""
        if not info["legal_moves"]:
            raise ValueError("MinimaxPolicy.act called with no legal moves (not this seat's turn)")
        board = info["infostate"]
        best = minimax_moves(board, to_move(board))
        pick = best[int(rng.integers(len(best)))] if self.randomize else best[0]
        return str(pick)


class TablePolicy:
    """Plays `table[info["infostate"]]` (the move a best response computed for that state);
    the scripted seat ``table`` that the runtime builds for the opponent ``best_response``."""

    def __init__(self, table: dict[str, str]) -> None:
        self.table = dict(table)

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """The table's move at this information state (ValueError when it has none or it is
        not legal)."""
        state = info.get("infostate")
        move = self.table.get(state) if isinstance(state, str) else None
        if move is None or move not in info["legal_moves"]:
            raise ValueError(f"table policy: no legal move for info state {state!r} (table gives {move!r}, "
                             f"legal: {list(info['legal_moves'])})")
        return move


TABLE = "table"
"""The name of :class:`TablePolicy` for `make_scripted` (not a config opponent: it needs its
table, which the runtime computes)."""

GAME_POLICIES = (calculator, leduc_poker, liars_dice, negotiation, prisoners_dilemma, referential, twenty_questions)
"""Game modules whose `SCRIPTED_POLICIES` join `SCRIPTED`."""


def _collect() -> dict[str, type]:
    policies: dict[str, type] = {
        "random": RandomPolicy,
        "kuhn_equilibrium": KuhnEquilibriumPolicy,
        "tictactoe_minimax": MinimaxPolicy,
    }
    for module in GAME_POLICIES:
        for name, policy in module.SCRIPTED_POLICIES.items():
            if name in policies:
                raise ValueError(
                    f"scripted policy {name!r} of {module.__name__} is already defined"
                )
            policies[name] = policy
    return policies


SCRIPTED: dict[str, type] = _collect()
"""Scripted policies by name: `random` (any game), `kuhn_equilibrium`, `leduc_equilibrium`,
`tictactoe_minimax`,
`negotiation_fair`, `negotiation_greedy`, `referential_heuristic` (either seat),
`twenty_questions_heuristic` (either seat)."""


def make_scripted(name: str, **kwargs: Any) -> ScriptedPolicy:
    """Construct the scripted policy registered as `name` with `kwargs` (or the `TABLE` policy)."""
    if name == TABLE:
        return TablePolicy(**kwargs)
    if name not in SCRIPTED:
        raise ValueError(f"unknown scripted policy {name!r}; known: {sorted(SCRIPTED)}")
    policy: ScriptedPolicy = SCRIPTED[name](**kwargs)
    return policy
