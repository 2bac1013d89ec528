"""Readable text for wrapped PettingZoo envs: the default views of `games.from_pettingzoo`.

A `View` is how the bridge shows one wrapped env to a seat: the state text, the moves' own
names (when the env has a notation), the reply instruction, and the most legal moves a turn can
have (which sizes the observation space). `classic_view(env)` returns the view of a
`pettingzoo.classic` env it knows (chess_v6, go_v5, connect_four_v3, tictactoe_v3, rps_v2 and
the RLCard poker envs), found by the unwrapped env's `metadata["name"]` and module; any other
env gets `grid_text` of its observation. No classic env module is imported here: each view
imports what it needs when it is built, so the bridge costs nothing for envs it does not wrap.

The state is what the env shows people, for the seat: chess is python-chess's own board print
(`str(board)`) with rank and file labels, the FEN and the side to move; go the GTP board
(`X` black, `O` white, `.` empty, columns A-T without I, row 1 at the bottom); connect four and
tic-tac-toe their grids from the seat's own observation planes. The env's `render()` is not used
for envs not listed here: it is one picture for everyone, which in a hidden-information game
(poker) shows every hand.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

INSTRUCTION = "Reply with the number of one legal move."
NAMED_INSTRUCTION = "Reply with one legal move."

# The most legal moves of any reachable chess position: 218 (Petrovic 1964; proved maximal for
# legal positions in 2024). Sizes the observation space; 4,672 action ids would be 21x looser.
MAX_CHESS_MOVES = 218
_GTP_COLUMNS = "ABCDEFGHJKLMNOPQRSTUVWXYZ"  # GTP skips I, as go_v5's coords.py does


@dataclass(frozen=True)
class View:
    """How the bridge shows one wrapped env to a seat (see the module docstring)."""

    render_observation: Callable[[str, Any], str]
    """(agent, the wrapped env's observation) -> the state text."""
    move_name: Callable[[str, int], str] | None = None
    """(agent, legal action id) -> the move's name in the env's notation ("e2e4", "D4"); None:
    the ids are the names (a connect-four column, a tic-tac-toe cell), listed bare."""
    name_syntax: re.Pattern[str] | None = None
    """A word of this shape in a reply names a move even when it is not a legal one ("e2e5"),
    so it is read as an illegal move instead of as the integers inside it."""
    instruction: str = INSTRUCTION
    """The reply instruction under the move list."""
    max_moves: int | None = None
    """The most legal moves a turn can have (None: every action id)."""
    max_name_length: int = 0
    """The longest `move_name`, in characters."""
    compact_moves: Callable[[str, Sequence[int]], str | None] | None = None
    """(agent, legal ids) -> an exact shorter statement of the legal moves, used when the list
    and the state do not fit the length limit together (go: "any empty point except ...")."""
    header_lines: int = 0
    """Leading lines of the state that never change in a game (a board game's title, the seat's
    mark and the rule): a brief bridge leaves them out once the seat has moved."""


def grid_text(array: np.ndarray) -> str:
    """A 2-D array as rows of right-aligned values; an (H, W, C) array of 0/1 planes with C <= 9
    and at most one plane set per cell as one H x W grid whose cells name the plane set (1-C)
    or `.`; any other 3-D array plane by plane. Lower or higher ranks: the nested lists."""
    a = np.asarray(array)
    if a.dtype.kind == "f" and np.all(a == np.round(a)):
        a = a.astype(np.int64)  # 0./1. planes read as 0/1
    if a.ndim == 2:
        return _rows(a)
    if a.ndim != 3:
        return str(a.tolist())
    binary = bool(np.isin(a, (0, 1)).all())
    if binary and a.shape[2] <= 9 and int(a.sum(axis=2).max(initial=0)) <= 1:
        cells = np.where(a.any(axis=2), (a.argmax(axis=2) + 1).astype(str), ".")
        head = f"{a.shape[0]}x{a.shape[1]} grid; a cell shows the plane (1-{a.shape[2]}) set there:"
        return head + "\n" + "\n".join(" ".join(row) for row in cells)
    return "\n".join(f"plane {c + 1}:\n{_rows(a[:, :, c])}" for c in range(a.shape[2]))


def _rows(a: np.ndarray) -> str:
    cells = [[str(v) for v in row] for row in a.tolist()]
    width = max((len(c) for row in cells for c in row), default=1)
    return "\n".join(" ".join(c.rjust(width) for c in row) for row in cells)


def classic_view(env: Any) -> View | None:
    """The view of `env` when its unwrapped env is a `pettingzoo.classic` env listed in the module
    docstring, else None."""
    inner = env.unwrapped
    build = _BUILDERS.get(str(getattr(inner, "metadata", {}).get("name")))
    if build is None or not type(inner).__module__.startswith("pettingzoo.classic."):
        return None
    return build(inner)


def _seat(inner: Any, agent: str) -> int:
    return list(inner.possible_agents).index(agent)


def _chess(inner: Any) -> View:
    import chess
    from pettingzoo.classic.chess import chess_utils

    def render(agent: str, observation: Any) -> str:
        board: chess.Board = inner.board
        me, them = ("white", "black") if _seat(inner, agent) == 0 else ("black", "white")
        case = "uppercase" if me == "white" else "lowercase"
        to_move = "White" if board.turn == chess.WHITE else "Black"
        last = board.peek().uci() if board.move_stack else "none"
        check = " Check." if board.is_check() else ""
        rows = str(board).splitlines()
        grid = [f"{8 - i} {row} {8 - i}" for i, row in enumerate(rows)]
        files = "  a b c d e f g h"
        # What a cut to the length limit loses first comes last: the FEN repeats the board.
        return "\n".join([
            (f"Chess. You play {me} (the {case} pieces), {them} the others. {to_move} to move, "
             f"move {board.fullmove_number}.{check} Last move: {last}."),
            files, *grid, files,
            f"FEN: {board.fen()}",
        ])

    def name(agent: str, action: int) -> str:
        # Black's action ids are of the mirrored board; action_to_move undoes the mirror and
        # restores the queen promotion the ids leave implicit.
        return chess_utils.action_to_move(inner.board, int(action), _seat(inner, agent)).uci()

    return View(
        render_observation=render,
        move_name=name,
        name_syntax=re.compile(r"(?<![A-Za-z0-9])[a-h][1-8][a-h][1-8][nbrq]?(?![A-Za-z0-9])", re.IGNORECASE),
        instruction="Reply with one legal move in UCI notation (from square, to square, "
        "promotion piece if any), e.g. e2e4.",
        max_moves=MAX_CHESS_MOVES,
        max_name_length=5,
    )


def _go(inner: Any) -> View:
    # go_v5 keeps its board size in a module global that the last go env built overwrites, so
    # everything here reads the env's own `_N`; a flat id is N * row + col from the top left.
    size = int(inner._N)
    columns = _GTP_COLUMNS[:size]

    def point(action: int) -> str:
        return "pass" if action == size * size else f"{columns[action % size]}{size - action // size}"

    def render(agent: str, observation: Any) -> str:
        position = inner._go
        board = np.asarray(position.board)
        me, them = ("black (X)", "white (O)") if _seat(inner, agent) == 0 else ("white (O)", "black (X)")
        if position.recent:
            played = position.recent[-1]
            who = "black" if played.color == 1 else "white"
            last = f"{who} passed" if played.move is None else f"{who} {point(size * played.move[0] + played.move[1])}"
        else:
            last = "none"
        head = "   " + " ".join(columns)
        rows = [f"{size - r:2d} " + " ".join(".XO"[int(v)] for v in board[r]) for r in range(size)]
        # What a cut to the length limit loses first comes last.
        return "\n".join([
            f"Go {size}x{size}. You are {me}, the opponent {them}. Last move: {last}.",
            head, *rows,
            f"Komi {inner._komi}. Captured stones: X {position.caps[0]}, O {position.caps[1]}.",
        ])

    def compact(agent: str, legal: Sequence[int]) -> str | None:
        empty = np.flatnonzero(np.asarray(inner._go.board).ravel() == 0)
        points = set(legal) - {size * size}
        if not points <= set(empty.tolist()):
            return None
        barred = [point(int(a)) for a in empty if int(a) not in points]
        text = "any empty point (.)" + (f" except {', '.join(barred)}" if barred else "")
        return text + (", or pass" if size * size in legal else "") if points else None

    return View(
        render_observation=render,
        move_name=lambda agent, action: point(int(action)),
        # Any letter, so that "I5" (GTP has no I) is read as an illegal point, not as id 5.
        name_syntax=re.compile(r"(?<![A-Za-z0-9])(?:[A-Z][0-9]{1,2}|pass)(?![A-Za-z0-9])", re.IGNORECASE),
        instruction="Reply with one legal move: a point such as D4, or pass.",
        max_moves=size * size + 1,
        max_name_length=4,
        compact_moves=compact,
    )


def _board_view(title: str, rule: str, cell: Callable[[np.ndarray, int, int], str],
                shape: tuple[int, int], header: str | None) -> Callable[[Any], View]:
    """A view of a two-seat board game whose observation planes are (the seat's own pieces, the
    opponent's); the first seat plays X."""

    def build(inner: Any) -> View:
        def render(agent: str, observation: Any) -> str:
            planes = np.asarray(observation["observation"])
            mine, theirs = ("X", "O") if _seat(inner, agent) == 0 else ("O", "X")
            marks = np.where(planes[..., 0] == 1, mine, np.where(planes[..., 1] == 1, theirs, ""))
            rows = [cell(marks, r, c) for r in range(shape[0]) for c in range(shape[1])]
            grid = [" ".join(rows[r * shape[1]:(r + 1) * shape[1]]) for r in range(shape[0])]
            return "\n".join([f"{title}. You are {mine}, the opponent {theirs}; {rule}",
                              *([header] if header else []), *grid])

        return View(render_observation=render, header_lines=1)

    return build


def _rlcard(inner: Any) -> View:
    actions = inner.env.actions
    if isinstance(actions, type) and issubclass(actions, enum.Enum):
        names = {int(m.value): m.name.lower() for m in actions}
    else:
        names = {i: str(a) for i, a in enumerate(actions)}
    title = str(inner.metadata["name"]).rsplit("_v", 1)[0].replace("_", " ")

    def word(value: Any) -> str:
        if isinstance(value, enum.Enum):
            return value.name.lower()
        if isinstance(value, np.generic):
            return str(value.item())
        if isinstance(value, list | tuple):
            return "[" + ", ".join(word(v) for v in value) + "]"
        return "none" if value is None else str(value)

    def render(agent: str, observation: Any) -> str:
        # RLCard's state for this seat: its own cards and the public ones, never the others'.
        state = inner.env.get_state(_seat(inner, agent))
        lines = [f"{title.capitalize()}. You are {agent}."]
        lines += [f"{k.replace('_', ' ')}: {word(v)}" for k, v in state["raw_obs"].items()
                  if k not in ("legal_actions", "current_player")]
        record = state.get("action_record") or []
        if record:
            said = [f"{inner.possible_agents[p]} {word(a)}" for p, a in record]
            lines.append("Actions so far: " + ", ".join(said) + ".")
        return "\n".join(lines)

    return View(
        render_observation=render,
        move_name=lambda agent, action: names[int(action)],
        instruction=NAMED_INSTRUCTION,
        max_name_length=max(len(n) for n in names.values()),
    )


def _rps(inner: Any) -> View:
    names = [m.lower() for m in inner._moves]  # the last is "none": no move seen yet

    def render(agent: str, observation: Any) -> str:
        seen = int(np.asarray(observation))
        last = "none yet" if seen >= len(names) - 1 else names[seen]
        rules = ", ".join(names[:-1])
        return (f"Rock-paper-scissors ({rules}), round {min(inner.num_moves + 1, inner.max_cycles)} of "
                f"{inner.max_cycles}. The opponent's last move: {last}.")

    return View(
        render_observation=render,
        move_name=lambda agent, action: names[int(action)],
        instruction=NAMED_INSTRUCTION,
        max_name_length=max(len(n) for n in names[:-1]),
    )


def _tictactoe_cell(marks: np.ndarray, r: int, c: int) -> str:
    # tictactoe_v3 numbers the cells down the columns (0 3 6 / 1 4 7 / 2 5 8) and its planes
    # are indexed [column, row].
    return marks[c, r] or str(3 * c + r)


_BUILDERS: dict[str, Callable[[Any], View]] = {
    "chess_v6": _chess,
    "go_v5": _go,
    "connect_four_v3": _board_view(
        "Connect four", "a move drops a piece into a column (0-6), four in a row wins.",
        lambda marks, r, c: marks[r, c] or ".", (6, 7), "0 1 2 3 4 5 6"),
    "tictactoe_v3": _board_view(
        "Tic-tac-toe", "a free cell shows its move number, three in a row wins.",
        _tictactoe_cell, (3, 3), None),
    "rps_v2": _rps,
    "leduc_holdem_v4": _rlcard,
    "texas_holdem_v4": _rlcard,
    "texas_holdem_no_limit_v6": _rlcard,
}
