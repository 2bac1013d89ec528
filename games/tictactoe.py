"""Tic-tac-toe as a two-seat dialogue game, with an exact minimax solver.

| Creation           | `games.make("tictactoe_v0")` or `tictactoe.env()`               |
|--------------------|-----------------------------------------------------------------|
| API                | PettingZoo AEC, turn-based, not parallelizable                  |
| Agents             | `["player_x", "player_o"]`; player_x (X) moves first            |
| Observation        | `Dict({"text": Text(512, charset=string.printable)})`           |
| Action             | `Text(512, charset=string.printable)`: the seat's free-text reply |
| Rewards            | at the end: win +1, loss -1, draw 0; zero-sum                   |

**Game.** A 3x3 board with cells numbered 1-9 row by row. The seats alternate placing their
mark (X, then O) in an empty cell; three of one mark in a row, column or diagonal wins, a full
board with no line is a draw. Deterministic: `reset(seed=...)` only reseeds `np_random`.

**What each seat sees.** One short user message per decision that carries the whole board, so
every message stands alone. Empty cells show their number (the number is the move), marks show
`X` or `O`, three cells per line:
* the seat to act, e.g. player_o after X took 5:
  "Tic-tac-toe. You are O. Opponent took cell 5.\\n1 2 3\\n4 X 6\\n7 8 9\\n
  Reply with the number of an empty cell (1-9)." (player_x's first message has no
  "Opponent took" sentence);
* a seat not to act: "Tic-tac-toe. You are O.\\n1 2 3\\n4 5 6\\n7 8 9\\nWaiting for the opponent.";
* at the end, the final board then the result: "You win: three in a row.", "You lose: three
  in a row.", "Draw: the board is full.", "Your reply was invalid, a forfeit. You lose." or
  "Opponent's reply was invalid, a forfeit. You win."

**Brief messages.** `env(brief=True)`: once a seat has moved it has read the header and the
instruction in its conversation, so its later messages carry only the news and the board:
"Opponent took cell 3.\n1 2 X\n4 O 6\n7 8 9" (24 tokens of SmolLM2's instead of 51), the
board and "Waiting for the opponent." when not to act, the board and the result at the end.
A game's conversation is about a third shorter, and so is every step that trains on it.

**Legal replies.** A cell is mentioned by a digit 1-9 standing alone (not part of a longer
number) within the first 512 characters: "5", "Cell 5.", "I take cell 5!" all mean cell 5;
"10" mentions no cell. The reply is a move when exactly one distinct cell is mentioned and
that cell is empty ("5, 5" is cell 5).

**Invalid reply.** No cell mentioned (empty, garbage, "ten", a non-string), two or more
distinct cells ("5 and 7", or an echo of the board: several numbers are no decision), or an
occupied cell: the replying seat forfeits, -1 to it and +1 to the opponent, and the game ends.
Counted in `infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`.

**Infos.** Always `invalid`, `infostate` (the board as 9 characters `X`/`O`/`.` row by row,
e.g. "X...O...." ; the mark to move follows from the counts) and `legal_moves` (the empty cell
numbers as strings, ascending; empty when not to act); at the end also `winner` (an agent, or
None for a draw), `reason` ("line", "draw" or "forfeit") and `last_action` (the seat's last
cell as a string, "invalid", or None if it never moved).

**End.** After a line, a full board or a forfeit; all agents terminate together.

**Exact play.** `minimax_moves(board, player)` gives every optimal cell by full game-tree
search (memoized: 5,478 positions), preferring faster wins and slower losses;
`minimax_move` the lowest of them. Optimal play never loses; both seats optimal is a draw.

**Exact values.** `state_value(board, agent, opponent)`: the expected result (+1 win, 0 draw,
-1 loss) for `agent`, to move on `board`, playing best from there on against `opponent`:
`tictactoe_minimax` (the negamax value's sign) or `random` (expectimax against uniform legal
moves, memoized). `move_values(board, agent, opponent)`: the same for each empty cell taken
(the state's value is their maximum). The critic of the `exact_gae` advantage and the move
values of `train.move_values` (`EVALUATION.state_values`).

**Exact outcomes of a policy.** `exact_outcomes(agent, opponent, policy)`: a seat's exact win,
draw and loss probabilities against random or minimax, read from its move probabilities at
every history it reaches (no sampling noise), and the decisions where it puts probability on
a cell worth less against best play than the best one: a won game given away, or a drawn one
(`benchmarks/tictactoe_exact.py` scores a trained adapter).

**Version history.** v0: initial release; `brief` added (default off: the messages as before).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from typing import Any

import gymnasium
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.text_env import TextAECEnv
from games.evaluation import GameEval, StateValues

AGENTS = ("player_x", "player_o")
MARKS = ("X", "O")
EMPTY = "."
MAX_TEXT = 512
HEADER = "Tic-tac-toe."
INSTRUCTION = "Reply with the number of an empty cell (1-9)."
LINES: tuple[tuple[int, int, int], ...] = (
    (0, 1, 2), (3, 4, 5), (6, 7, 8),
    (0, 3, 6), (1, 4, 7), (2, 5, 8),
    (0, 4, 8), (2, 4, 6),
)  # fmt: skip
"""The 8 winning lines as 0-based board indices (cell number - 1)."""
_CELL = re.compile(r"(?<![0-9])[1-9](?![0-9])")


def parse_reply(reply: object, board: str) -> int | None:
    """Return the cell number (1-9) that `reply` names, or None if the reply is invalid.

    Valid when exactly one distinct cell number (a lone digit 1-9) occurs in the first
    `MAX_TEXT` characters and that cell of `board` (9 characters `X`/`O`/`.`) is empty.
    """
    if not isinstance(reply, str):
        return None
    cells = {int(m.group()) for m in _CELL.finditer(reply[:MAX_TEXT])}
    if len(cells) != 1:
        return None
    cell = cells.pop()
    return cell if board[cell - 1] == EMPTY else None


def empty_cells(board: str) -> list[int]:
    """The empty cells (1-9, ascending) of ``board`` (9 characters ``X``/``O``/``.``)."""
    return [i + 1 for i, c in enumerate(board) if c == EMPTY]


def winner_mark(board: str) -> str | None:
    """The mark ("X" or "O") with three in a row on `board`, else None."""
    for a, b, c in LINES:
        if board[a] != EMPTY and board[a] == board[b] == board[c]:
            return board[a]
    return None


def to_move(board: str) -> str:
    """The mark to move on a consistent `board`: X when the counts are equal, else O."""
    return MARKS[0] if board.count("X") == board.count("O") else MARKS[1]


def _check_board(board: str, player: str) -> None:
    if len(board) != 9 or set(board) - {"X", "O", EMPTY}:
        raise ValueError(f"board must be 9 characters of 'X', 'O', '.', got {board!r}")
    if board.count("X") - board.count("O") not in (0, 1):
        raise ValueError(f"inconsistent mark counts on board {board!r}")
    if player != to_move(board):
        raise ValueError(f"it is {to_move(board)}'s move on {board!r}, not {player!r}'s")
    if winner_mark(board) is not None or EMPTY not in board:
        raise ValueError(f"the game on board {board!r} is over")


@cache
def _value(board: str) -> int:
    """Negamax value for the mark to move: 10 - marks at the end for a win (faster wins score
    higher), minus that for a loss, 0 for a draw."""
    if winner_mark(board) is not None:  # the previous mover made the line
        return -(10 - (9 - board.count(EMPTY)))
    if EMPTY not in board:
        return 0
    player = to_move(board)
    return max(-_value(_place(board, c - 1, player)) for c in empty_cells(board))


def _place(board: str, index: int, mark: str) -> str:
    return board[:index] + mark + board[index + 1 :]


def minimax_moves(board: str, player: str) -> tuple[int, ...]:
    """All optimal cells (1-9, ascending) for `player` ("X" or "O") to move on `board`.

    Exact negamax over the full game tree; among moves with the same game value it keeps the
    fastest wins (or slowest losses). Raises ValueError for a malformed or finished board or
    when it is not `player`'s move.
    """
    _check_board(board, player)
    scores = {c: -_value(_place(board, c - 1, player)) for c in empty_cells(board)}
    best = max(scores.values())
    return tuple(cell for cell, score in scores.items() if score == best)


def minimax_move(board: str, player: str) -> int:
    """The lowest-numbered optimal cell (1-9) for `player` to move on `board`; see
    `minimax_moves`."""
    return minimax_moves(board, player)[0]


@cache
def _vs_random(board: str) -> float:
    """The mover's expected result on a live ``board`` when it plays best and the other seat
    plays a uniformly random empty cell (expectimax)."""
    player = to_move(board)
    return max(_after_vs_random(_place(board, c - 1, player)) for c in empty_cells(board))


def _after_vs_random(after: str) -> float:
    """The expected result for the seat that just moved to ``after`` when the other seat plays
    a uniformly random empty cell and it plays best from there on (+1 for its line)."""
    if winner_mark(after) is not None:
        return 1.0
    if EMPTY not in after:
        return 0.0
    other = to_move(after)
    replies = []
    for c in empty_cells(after):
        last = _place(after, c - 1, other)
        replies.append(-1.0 if winner_mark(last) is not None else 0.0 if EMPTY not in last else _vs_random(last))
    return sum(replies) / len(replies)


def _after_vs_minimax(after: str) -> float:
    """The result for the seat that just moved to ``after`` against optimal play from there on
    (both sides optimal: the negamax value's sign)."""
    if winner_mark(after) is not None:
        return 1.0
    v = -_value(after)
    return float((v > 0) - (v < 0))


VALUED_OPPONENTS = ("random", "tictactoe_minimax")
"""The scripted opponents :func:`state_value` values against."""


def state_value(board: str, agent: str, opponent: str) -> float:
    """The expected result for ``agent`` (``player_x`` or ``player_o``), to move on ``board``
    (its ``infostate``), playing best from there on against ``opponent`` (one of
    :data:`VALUED_OPPONENTS`): +1 a sure win, 0 a draw, -1 a sure loss. ``ValueError`` for a
    malformed or finished board, another seat's move or another opponent."""
    return max(move_values(board, agent, opponent).values())


def move_values(board: str, agent: str, opponent: str) -> dict[str, float]:
    """``{cell: value}`` for every empty cell of ``board`` (as its reply, "1"-"9", ascending:
    the ``legal_moves``): ``agent``'s expected result when it takes that cell, then plays best
    against ``opponent`` (:func:`state_value` is their maximum). ``ValueError`` as
    :func:`state_value`."""
    if agent not in AGENTS:
        raise ValueError(f"agent must be one of {AGENTS}, got {agent!r}")
    mark = MARKS[AGENTS.index(agent)]
    _check_board(board, mark)
    after = {"random": _after_vs_random, "tictactoe_minimax": _after_vs_minimax}.get(opponent)
    if after is None:
        raise ValueError(f"tic-tac-toe values states against {', '.join(VALUED_OPPONENTS)}, not {opponent!r}")
    return {str(c): after(_place(board, c - 1, mark)) for c in empty_cells(board)}


Policy = Callable[[Sequence[tuple[str, ...]]], Sequence[Mapping[str, float]]]
"""A seat's play for :func:`exact_outcomes`: for each history (the cells played so far, as
their replies "1"-"9", X first), ``{cell: probability}`` over the empty cells of its board.
Batched, so a language model scores a whole frontier at once."""


@dataclass(frozen=True)
class ExactOutcomes:
    """What :func:`exact_outcomes` computes for one seat against one opponent."""

    win: float
    draw: float
    loss: float
    unresolved: float
    """Probability of the games left out: histories the policy's own choices reach with
    probability below the threshold."""
    decisions: tuple[tuple[tuple[str, ...], float, float], ...]
    """Each decision the seat reaches: ``(history, reach, blunder)``, ``blunder`` the
    probability it puts on cells worth less against best play than the best one (a cell whose
    :func:`move_values` against minimax is below the best one's: a won game given away to a
    draw or a loss, or a drawn one to a loss)."""

    @property
    def score(self) -> float:
        """Expected result per game: wins minus losses (the unresolved games count 0)."""
        return self.win - self.loss

    def blunders(self, n: int = 10) -> list[tuple[tuple[str, ...], float, float]]:
        """The ``n`` decisions that cost most: by reach times blunder probability."""
        return sorted((d for d in self.decisions if d[2] > 0), key=lambda d: -d[1] * d[2])[:n]


def board_after(history: Sequence[str]) -> str:
    """The board after ``history`` (cells "1"-"9" in the order played, X first); ValueError for
    a cell that is not empty or a move after the game's end."""
    board = EMPTY * 9
    for k, cell in enumerate(history):
        i = int(cell) - 1
        if not 0 <= i < 9 or board[i] != EMPTY or winner_mark(board) is not None:
            raise ValueError(f"history {''.join(history)!r}: cell {cell!r} cannot be played on {board!r}")
        board = _place(board, i, MARKS[k % 2])
    return board


def exact_outcomes(agent: str, opponent: str, policy: Policy, prune: float = 1e-3) -> ExactOutcomes:
    """The exact win / draw / loss probabilities of ``agent`` playing ``policy`` against
    ``opponent`` (``random``: a uniform empty cell; ``tictactoe_minimax``: a uniform optimal
    cell, as the scripted seat plays), from the empty board. Breadth-first over the game tree:
    each depth's decisions of ``agent`` go to ``policy`` in one batch. A history the policy's
    own choices reach with probability below ``prune`` (the product of its move probabilities
    along it, the opponent's left out) is not followed (its probability is ``unresolved``):
    a sharp policy is scored on the few hundred states it plays into, against every reply of
    the opponent's. ValueError for another seat or opponent, or a policy that does not give a
    distribution over the empty cells."""
    if agent not in AGENTS:
        raise ValueError(f"agent must be one of {AGENTS}, got {agent!r}")
    if opponent not in VALUED_OPPONENTS:
        raise ValueError(f"exact_outcomes plays against {', '.join(VALUED_OPPONENTS)}, not {opponent!r}")
    mark = MARKS[AGENTS.index(agent)]
    result = {"win": 0.0, "draw": 0.0, "loss": 0.0, "unresolved": 0.0}
    decisions: list[tuple[tuple[str, ...], float, float]] = []
    # history -> (reach, the policy's own share of it, board)
    frontier: dict[tuple[str, ...], tuple[float, float, str]] = {(): (1.0, 1.0, EMPTY * 9)}
    while frontier:
        nxt: dict[tuple[str, ...], tuple[float, float, str]] = {}
        ours = []
        for history, (reach, own, board) in frontier.items():
            w = winner_mark(board)
            if w is not None or EMPTY not in board:
                result["draw" if w is None else "win" if w == mark else "loss"] += reach
            elif own < prune:
                result["unresolved"] += reach
            elif to_move(board) == mark:
                ours.append((history, reach, own, board))
            else:
                other = to_move(board)
                cells = (minimax_moves(board, other) if opponent == "tictactoe_minimax"
                         else empty_cells(board))
                for c in cells:
                    nxt[(*history, str(c))] = (reach / len(cells), own, _place(board, c - 1, other))
        dists = policy([h for h, _, _, _ in ours]) if ours else []
        if len(dists) != len(ours):
            raise ValueError(f"the policy gave {len(dists)} distributions for {len(ours)} histories")
        for (history, reach, own, board), dist in zip(ours, dists):
            legal = {str(c) for c in empty_cells(board)}
            if set(dist) - legal or abs(sum(dist.values()) - 1) > 1e-6 or min(dist.values(), default=0) < 0:
                raise ValueError(f"the policy's distribution at {board!r} (history {''.join(history)!r}) must sum "
                                 f"to 1 over its empty cells {sorted(legal)}, got {dict(dist)}")
            values = move_values(board, agent, "tictactoe_minimax")
            best = max(values.values())
            decisions.append((history, reach, sum(p for m, p in dist.items() if values[m] < best)))
            for m, p in dist.items():
                if p > 0:
                    nxt[(*history, m)] = (reach * p, own * p, _place(board, int(m) - 1, mark))
        frontier = nxt
    return ExactOutcomes(**result, decisions=tuple(decisions))


def render_board(board: str) -> str:
    """Three lines, marks as X/O and empty cells as their number: "X 2 3\\n4 O 6\\n7 8 9"."""
    cells = [c if c != EMPTY else str(i + 1) for i, c in enumerate(board)]
    return "\n".join(" ".join(cells[r : r + 3]) for r in (0, 3, 6))


class raw_env(TextAECEnv):
    """Tic-tac-toe AEC env; see the module docstring for the full card."""

    metadata = {"name": "tictactoe_v0", "is_parallelizable": False, "render_modes": ["ansi"]}

    def __init__(self, render_mode: str | None = None, brief: bool = False) -> None:
        super().__init__(AGENTS, MAX_TEXT, render_mode)
        if not isinstance(brief, bool):
            raise ValueError(f"brief must be true or false, got {brief!r}")
        self.brief = brief
        self._board = EMPTY * 9
        self._last_cell: int | None = None

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self._reset_bookkeeping(seed)
        self._board = EMPTY * 9
        self._last_cell = None
        self._update_infos()

    def _play(self, agent: str, action: object) -> bool:
        cell = parse_reply(action, self._board)
        if cell is None:
            return False
        self._board = _place(self._board, cell - 1, MARKS[self._seat(agent)])
        self._last_action[agent] = str(cell)
        self._last_cell = cell
        return True

    def _final_rewards(self) -> dict[str, float]:
        winner = self._winner()
        return {a: 0 if winner is None else 1 if a == winner else -1 for a in AGENTS}

    def _next_agent(self, agent: str) -> str:
        return AGENTS[1 - self._seat(agent)]

    def render(self) -> str | None:
        if self.render_mode is None:
            gymnasium.logger.warn("render() called without a render_mode; use render_mode='ansi'.")
            return None
        end = f"\nforfeit by {self._forfeiter}" if self._forfeiter else ""
        return f"tictactoe_v0\n{render_board(self._board)}{end}"

    def _seat(self, agent: str) -> int:
        return AGENTS.index(agent)

    def _done(self) -> bool:
        return (
            self._forfeiter is not None
            or winner_mark(self._board) is not None
            or EMPTY not in self._board
        )

    def _winner(self) -> str | None:
        """The winning agent of a finished game, None for a draw."""
        if self._forfeiter is not None:
            return AGENTS[1 - self._seat(self._forfeiter)]
        mark = winner_mark(self._board)
        return None if mark is None else AGENTS[MARKS.index(mark)]

    def _reason(self) -> str:
        if self._forfeiter is not None:
            return "forfeit"
        return "draw" if winner_mark(self._board) is None else "line"

    def _update_infos(self) -> None:
        done = self._done()
        legal = [str(c) for c in empty_cells(self._board)]
        for agent in self.agents:
            to_act = not done and agent == self.agent_selection
            info: dict[str, Any] = {
                "invalid": self.invalid_counts[agent],
                "infostate": self._board,
                "legal_moves": list(legal) if to_act else [],
            }
            if done:
                info["winner"] = self._winner()
                info["reason"] = self._reason()
                info["last_action"] = self._last_action[agent]
            self.infos[agent] = info

    def _text(self, agent: str) -> str:
        board = render_board(self._board)
        if self.brief and MARKS[self._seat(agent)] in self._board:
            # The seat has moved, so it read the header and the instruction in an earlier
            # message of its conversation: only the news and the board.
            return self._brief_text(agent, board)
        intro = f"{HEADER} You are {MARKS[self._seat(agent)]}."
        if self._done():
            return f"{intro}\n{board}\n{self._result(agent)}"
        if agent != self.agent_selection:
            return f"{intro}\n{board}\nWaiting for the opponent."
        took = f" Opponent took cell {self._last_cell}." if self._last_cell is not None else ""
        return f"{intro}{took}\n{board}\n{INSTRUCTION}"

    def _brief_text(self, agent: str, board: str) -> str:
        """``brief``'s message to a seat that has moved: the opponent's last cell when it is
        the seat's turn, the board, and the result at the end."""
        if self._done():
            return f"{board}\n{self._result(agent)}"
        if agent != self.agent_selection:
            return f"{board}\nWaiting for the opponent."
        return f"Opponent took cell {self._last_cell}.\n{board}"

    def _result(self, agent: str) -> str:
        """The last line of a finished game's message to ``agent``."""
        reason, winner = self._reason(), self._winner()
        if reason == "forfeit":
            if self._forfeiter == agent:
                return "Your reply was invalid, a forfeit. You lose."
            return "Opponent's reply was invalid, a forfeit. You win."
        if reason == "draw":
            return "Draw: the board is full."
        return f"You {'win' if winner == agent else 'lose'}: three in a row."


def env(**kwargs: Any) -> AECEnv[str, dict[str, str], str]:
    """Make the order-enforced tic-tac-toe env (`raw_env(**kwargs)`); Text spaces rule out the
    AssertOutOfBounds wrapper."""
    return wrappers.OrderEnforcingWrapper(raw_env(**kwargs))

EVALUATION = GameEval(unit="score", per="game", scripted=("tictactoe_minimax",),
                      system_prompt="You are playing tic-tac-toe.",
                      state_values=StateValues(VALUED_OPPONENTS, state_value, move_values))
"""The evaluation hook: win +1, draw 0, loss -1 per game; the minimax player as a scripted seat;
exact state values against it and against random."""
