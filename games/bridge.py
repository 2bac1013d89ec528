"""Bridge: any PettingZoo AEC env with discrete actions and action masks, as a text game.

| Creation     | `games.from_pettingzoo(env_fn_or_env, name=None, ...)`                       |
|--------------|------------------------------------------------------------------------------|
| API          | PettingZoo AEC (order-enforced), the wrapped env's agents and turn order     |
| Observation  | `Dict({"text": Text(text_limit, charset=string.printable)})`, see below      |
| Action       | `Text(max_length, charset=string.printable)`: the seat's free-text reply      |
| Rewards      | the wrapped env's, step by step; -1 to a seat whose reply is invalid          |

**Requirements on the wrapped env.** Every agent's action space is `Discrete(n, start)`
(TypeError otherwise, at construction). Legal moves come from an `action_mask` entry of a dict
observation (n entries, 1 = legal), as in `pettingzoo.classic`; an env without one (e.g.
`rps_v2`) has every action legal at every turn. The bridge steps the wrapped env with integer
action ids and copies its agents, turn, rewards, accumulated rewards, terminations and
truncations after every step, so a game played with valid replies is exactly the wrapped game.
`name` defaults to the wrapped env's `metadata["name"]` (ValueError when it has none).

**What each seat sees.** The state, then for the seat to act the legal moves and the
instruction:

    <the state>
    Legal moves: <the legal moves>.
    <the instruction>

A seat not to act sees "Waiting for your turn." in place of the two lines, a finished seat "The
game is over." (or, after a forfeit, "Your reply was invalid, a forfeit." / "A reply was invalid,
a forfeit."). Everything is escaped to printable characters. The state, the move names and the
instruction come from the env's view (`games.bridge_render`), for `pettingzoo.classic` envs:

| env                | the state                                         | moves (example)          |
|--------------------|---------------------------------------------------|--------------------------|
| chess_v6           | python-chess's board print with ranks and files,  | UCI: `e2e4, g1f3`        |
|                    | the seat's colour, side to move, last move, FEN   |                          |
| go_v5              | the GTP board (X black, O white, . empty), komi,  | `D4, ..., pass`          |
|                    | captures, last move                               | (`any empty point (.)    |
|                    |                                                   | except C3, or pass` when |
|                    |                                                   | the list does not fit)   |
| connect_four_v3    | the 6x7 grid under its column numbers, X and O    | column ids: `0, 1, 6`    |
| tictactoe_v3       | the 3x3 grid, a free cell showing its move number | cell ids: `0, 4, 8`      |
| rps_v2             | the round and the opponent's last move            | `rock, paper, scissors`  |
| RLCard poker envs  | the seat's own cards, public cards, chips, the    | `call, raise, fold`      |
|                    | actions so far (never the other hands)            |                          |

A named list ends with the env's instruction ("Reply with one legal move in UCI notation ...");
a list of ids with "Reply with the number of one legal move.". Any other env shows
`render_observation(agent, observation)`, default "Observation:" and the `observation` entry of
a dict observation (the whole observation otherwise) as a grid when it is 2-D or a stack of
planes (`games.bridge_render.grid_text`), as nested lists otherwise; its moves are
`render_moves(agent, action_id)` labels as "0) rock, 2) scissors", or the bare ids "0, 2"
(consecutive ids compacted to ranges, "0-40, 42", when the list does not fit). Passing
`render_observation` or `render_moves` overrides the view's state or moves (a custom
`render_moves` also drops the view's names and instruction).

**Brief messages.** `from_pettingzoo(..., brief=True)` (a job: `game_kwargs.bridge_brief = true`):
once a seat has moved, its conversation holds the header and the instruction, so its later
messages leave them out: the state without the view's header lines (`View.header_lines`: a
board game's title, marks and rule) and the legal moves without the instruction. Connect four's
message to a seat that has moved is then the column numbers, the grid and "Legal moves: 0, 1,
2, 3, 4, 5, 6." (86 tokens of SmolLM2's instead of 128). `infos["infostate"]` is the full state
either way.

**Length.** The legal moves and the instruction are never cut. The state is cut (ending in
"...") to what `max_length` leaves after them, but to no fewer than `max_length // 4`
characters, so that it is still seen: only a move list longer than about three quarters of
`max_length` (about 95 chess moves at 1,024; a go list is written compactly first) makes the
text longer than `max_length`. The observation space's `text_limit` is `max(max_length,
max_length // 4 + 1 + the longest move list and instruction possible)`, computed at
construction from the action count and the longest move name (a view's `max_moves`, e.g. 218
for chess), so every observation lies in its space; `render_moves` is called for every id then,
so its labels must not depend on the game state. Replies are read up to `max_length`
characters.

**Legal replies.** `parse_reply(reply, legal)` with `legal` = {action id: name or None}
returns an action id or None. The default reads the first `max_length` characters: every
legal name occurring as a whole word (any case) names its move and is blanked out; in an env
with a notation (chess, go) any other word in that notation ("e2e5", "Z9") names an illegal
move; then every remaining integer names that id, legal or not; the reply is a move when
exactly one distinct move is named and it is legal. "e2e4", "I play E2E4." are chess's e2e4 at
the first move, "0" its action id 0 if legal; "2", "2) scissors", "Scissors!" are move 2 of a
labelled rps; "0 or 2", "7" (not legal), "e2e5", "" and non-strings are invalid. A custom
parser's result is checked against `legal`.

**Invalid reply.** The wrapped env is not stepped (its own illegal-move handling differs from
game to game, so it is not relied on). The replying seat gets -1, every other seat 0 (the game
was abandoned, not decided), all agents terminate, and the bridge ends the episode with its own
dead steps. Counted in `infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`.

**Infos.** The wrapped env's infos (minus any `action_mask`, which would make
`pettingzoo.test.api_test` sample Text actions with a mask) plus `invalid`, `infostate` (the
state text, cut to `max_length`) and `legal_moves` (the legal ids as strings, ascending; empty
when not to act); after a forfeit also `reason` = "forfeit".
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.bridge_render import INSTRUCTION, View, classic_view, grid_text

__all__ = [
    "INSTRUCTION",
    "TextBridge",
    "default_parse_reply",
    "default_render_observation",
    "from_pettingzoo",
    "printable",
]

RenderObservation = Callable[[str, Any], str]
"""(agent, the wrapped env's observation) -> text."""
RenderMove = Callable[[str, int], str]
"""(agent, action id) -> the move's label."""
ParseReply = Callable[[object, Mapping[int, str | None]], int | None]
"""(reply, {legal action id: label or None}) -> action id, or None for an invalid reply."""

_PRINTABLE = frozenset(string.printable)
_INTEGER = re.compile(r"(?<![0-9])[0-9]+(?![0-9])")
_ILLEGAL = "illegal"  # what a well-formed name of no legal move names, in default_parse_reply


def printable(text: str, max_length: int | None = None) -> str:
    """`text` with every character outside `string.printable` escaped (`\\xe9`, `\\u2660`), cut
    to `max_length` characters (None: not cut)."""
    out = "".join(c if c in _PRINTABLE else c.encode("unicode_escape").decode() for c in text)
    return out if max_length is None else out[:max_length]


def default_render_observation(agent: str, observation: Any) -> str:
    """ "Observation:" and the `observation` entry of a dict observation (the other entries but
    `action_mask` as "key: value" when there is none), else the whole; a 2-D array or a stack of
    planes as a grid (`grid_text`), anything else as nested lists."""
    if isinstance(observation, Mapping):
        if "observation" not in observation:
            parts = [f"{k}: {_plain(v)}" for k, v in observation.items() if k != "action_mask"]
            return "Observation: " + "; ".join(parts)
        observation = observation["observation"]
    if isinstance(observation, np.ndarray) and observation.ndim in (2, 3):
        return f"Observation:\n{grid_text(observation)}"
    return f"Observation: {_plain(observation)}"


def _plain(value: Any) -> Any:
    return np.asarray(value).tolist() if isinstance(value, np.ndarray | np.generic) else value


def default_parse_reply(
    reply: object,
    legal: Mapping[int, str | None],
    max_length: int = 1024,
    name_syntax: re.Pattern[str] | None = None,
) -> int | None:
    """The one legal action id named in `reply`, else None; see the module docstring.
    `name_syntax` is the shape of a move name in the env's notation: a word of that shape that
    is no legal move's name names an illegal move."""
    if not isinstance(reply, str):
        return None
    text = reply[:max_length]
    named: set[int | str] = set()
    # Longest labels first, so "take 10" is blanked before "take 1" could match inside it.
    for action, label in sorted(legal.items(), key=lambda kv: -len(kv[1] or "")):
        if not label:
            continue
        pattern = re.compile(r"(?<!\w)" + re.escape(label) + r"(?!\w)", re.IGNORECASE)
        text, hits = pattern.subn(" ", text)
        if hits:
            named.add(action)
    if name_syntax is not None:
        text, hits = name_syntax.subn(" ", text)
        if hits:
            named.add(_ILLEGAL)
    named.update(int(m.group()) for m in _INTEGER.finditer(text))
    if len(named) != 1:
        return None
    action = named.pop()
    return action if isinstance(action, int) and action in legal else None


def _ranges(ids: Sequence[int]) -> str:
    """Ascending ids with each run of consecutive ids as "first-last": "0-40, 42"."""
    runs: list[list[int]] = []
    for a in ids:
        if runs and a == runs[-1][1] + 1:
            runs[-1][1] = a
        else:
            runs.append([a, a])
    return ", ".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in runs)


class TextBridge(AECEnv[str, dict[str, str], str]):
    """The text game over a wrapped discrete, action-masked AEC env; see the module docstring."""

    def __init__(
        self,
        env_fn_or_env: AECEnv | Callable[[], AECEnv],
        *,
        name: str | None = None,
        render_observation: RenderObservation | None = None,
        render_moves: RenderMove | None = None,
        parse_reply: ParseReply | None = None,
        max_length: int = 1024,
        render_mode: str | None = None,
        brief: bool = False,
    ) -> None:
        super().__init__()
        if not isinstance(brief, bool):  # a game kwarg's bad value: ValueError, as every game's
            raise ValueError(f"brief must be true or false, got {brief!r}")  # noqa: TRY004
        self.brief = brief
        inner = env_fn_or_env if isinstance(env_fn_or_env, AECEnv) else env_fn_or_env()
        if not isinstance(inner, AECEnv):
            raise TypeError(f"expected a PettingZoo AECEnv or a factory of one, got {inner!r}")
        if max_length < 64:
            raise ValueError(f"max_length must be at least 64, got {max_length}")
        name = name or (getattr(inner, "metadata", None) or {}).get("name")
        if not name:
            raise ValueError(
                f"no name for the bridged {type(inner.unwrapped).__name__}: pass name=... "
                "(the wrapped env's metadata has no 'name')"
            )
        self.env = inner
        self.metadata = {"name": name, "is_parallelizable": False, "render_modes": ["ansi"]}
        self.render_mode = render_mode
        self.max_length = max_length
        self.possible_agents = list(inner.possible_agents)
        for agent in self.possible_agents:
            act = inner.action_space(agent)
            if not isinstance(act, spaces.Discrete):
                raise TypeError(f"{name}: agent {agent!r} has action space {act}, not Discrete")
        view = classic_view(inner) or View(render_observation=default_render_observation)
        if render_moves is not None:  # the caller's labels replace the view's notation
            view = View(render_observation=view.render_observation)
        self._view = view
        self._render_observation = render_observation or view.render_observation
        self._render_moves = render_moves
        self._parse_reply = parse_reply
        # The observation space's max_length: see "Length" in the module docstring.
        self.text_limit = max(
            max_length, max_length // 4 + 1 + max(map(self._longest_tail, self.possible_agents))
        )
        self.observation_spaces = {
            a: spaces.Dict({"text": spaces.Text(self.text_limit, charset=string.printable)})
            for a in self.possible_agents
        }
        self.action_spaces = {
            a: spaces.Text(max_length, charset=string.printable) for a in self.possible_agents
        }
        self.invalid_counts: dict[str, int] = {a: 0 for a in self.possible_agents}
        self._forfeiter: str | None = None
        self._moved: set[str] = set()
        """Seats that have made a move this game (a brief bridge shortens their messages)."""

    def observation_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.action_spaces[agent]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self.env.reset(seed=seed, options=options)
        self.invalid_counts = {a: 0 for a in self.possible_agents}
        self._forfeiter = None
        self._moved = set()
        self._mirror()

    def step(self, action: str | None) -> None:
        agent = self.agent_selection
        if self._forfeiter is not None:  # abandoned: the wrapped env is frozen, end it here
            self._was_dead_step(action)
            return
        if self.terminations[agent] or self.truncations[agent]:
            self.env.step(None)  # the wrapped env's own dead step keeps the two in lockstep
            self._mirror()
            return
        legal = self._legal(agent)
        if self._parse_reply is None:
            move = default_parse_reply(action, legal, self.max_length, self._view.name_syntax)
        else:
            move = self._parse_reply(action, legal)
        if move is not None and move in legal:
            self._moved.add(agent)
            self.env.step(int(move))
            self._mirror()
            return
        self._forfeiter = agent
        self.invalid_counts[agent] += 1
        self._cumulative_rewards[agent] = 0
        self.rewards = {a: -1 if a == agent else 0 for a in self.agents}
        self.terminations = {a: True for a in self.agents}
        for a in self.agents:
            self.infos[a] = {
                **self.infos[a],
                "invalid": self.invalid_counts[a],
                "reason": "forfeit",
            }
            self.infos[a]["legal_moves"] = []
        self._accumulate_rewards()

    def observe(self, agent: str) -> dict[str, str]:
        return {"text": self._text(agent)}

    def render(self) -> str | None:
        if self.render_mode is None:
            gymnasium.logger.warn("render() called without a render_mode; use render_mode='ansi'.")
            return None
        return self._text(self.agent_selection) if self.agents else "The game is over."

    def close(self) -> None:
        self.env.close()

    def _mirror(self) -> None:
        """Copy the wrapped env's turn state, then rebuild the infos."""
        inner = self.env
        self.agents = list(inner.agents)
        self.rewards = dict(inner.rewards)
        self._cumulative_rewards = dict(inner._cumulative_rewards)
        self.terminations = dict(inner.terminations)
        self.truncations = dict(inner.truncations)
        self.agent_selection = inner.agent_selection
        self.infos = {}
        for agent in self.agents:
            info = {k: v for k, v in inner.infos.get(agent, {}).items() if k != "action_mask"}
            info["invalid"] = self.invalid_counts[agent]
            info["infostate"] = self._body(agent)
            info["legal_moves"] = (
                [str(a) for a in self._legal(agent)] if self._to_act(agent) else []
            )
            self.infos[agent] = info

    def _to_act(self, agent: str) -> bool:
        return (
            self._forfeiter is None
            and agent == self.agent_selection
            and not self.terminations.get(agent, True)
            and not self.truncations.get(agent, True)
        )

    def _legal(self, agent: str) -> dict[int, str | None]:
        """{legal action id: name or None} from the wrapped env's action mask (every action
        when it has none)."""
        obs = self.env.observe(agent)
        space = self.env.action_space(agent)
        has_mask = isinstance(obs, Mapping) and "action_mask" in obs
        mask = np.asarray(obs["action_mask"]) if has_mask else np.ones(int(space.n), dtype=np.int8)
        start = int(space.start)
        ids = [start + int(i) for i in np.flatnonzero(mask)]
        label = self._render_moves or self._view.move_name
        return {a: label(agent, a) if label else None for a in ids}

    def _listing(self, legal: Mapping[int, str | None]) -> str:
        if self._view.move_name is not None:
            return ", ".join(str(label) for label in legal.values())
        if self._render_moves is not None:
            return ", ".join(f"{a}) {label}" for a, label in legal.items())
        return ", ".join(str(a) for a in legal)

    def _tail(self, agent: str, legal: Mapping[int, str | None], room: int) -> str:
        """The move list and the instruction (the list alone for a brief seat that has moved);
        the compact list when the full one exceeds `room` characters and a shorter exact one
        exists."""
        instruction = self._view.instruction if self._render_moves is None else INSTRUCTION
        if self._is_brief(agent):
            instruction = ""
        tail = printable(f"Legal moves: {self._listing(legal)}.\n{instruction}".rstrip("\n"))
        if len(tail) <= room:
            return tail
        if self._view.compact_moves is not None:
            short = self._view.compact_moves(agent, list(legal))
        elif self._view.move_name is None and self._render_moves is None:
            short = _ranges(list(legal))
        else:
            short = None
        compact = printable(f"Legal moves: {short}.\n{instruction}".rstrip("\n")) if short else tail
        return compact if len(compact) < len(tail) else tail

    def _longest_tail(self, agent: str) -> int:
        """An upper bound on the length of `agent`'s move list and instruction."""
        space = self.env.action_space(agent)
        ids = range(int(space.start), int(space.start) + int(space.n))
        if self._render_moves is not None:
            listed = sum(len(printable(f"{a}) {self._render_moves(agent, a)}")) + 2 for a in ids)
            instruction = INSTRUCTION
        elif self._view.move_name is not None:
            moves = min(self._view.max_moves or len(ids), len(ids))
            listed = moves * (self._view.max_name_length + 2)
            instruction = self._view.instruction
        else:
            listed = sum(len(str(a)) + 2 for a in ids)
            instruction = self._view.instruction
        return len("Legal moves: .\n") + listed + len(instruction)

    def _body(self, agent: str) -> str:
        return printable(self._render_observation(agent, self.env.observe(agent)), self.max_length)

    def _is_brief(self, agent: str) -> bool:
        """Whether ``agent``'s messages are shortened now: a brief bridge, a seat that has moved."""
        return self.brief and agent in self._moved

    def _text(self, agent: str) -> str:
        body = self._body(agent)
        own_view = self._render_observation is self._view.render_observation  # not a caller's renderer
        if self._is_brief(agent) and own_view and self._view.header_lines:
            body = "\n".join(body.split("\n")[self._view.header_lines:])
        room = self.max_length - len(body) - 1
        if self._to_act(agent):
            tail = self._tail(agent, self._legal(agent), room)
            # The moves and the instruction are never cut; the state keeps at least a quarter.
            keep = max(self.max_length - len(tail) - 1, self.max_length // 4)
        else:
            if self._forfeiter is not None:
                who = "Your reply" if agent == self._forfeiter else "A reply"
                tail = f"{who} was invalid, a forfeit."
            elif self.terminations.get(agent) or self.truncations.get(agent):
                tail = "The game is over."
            else:
                tail = "Waiting for your turn."
            keep = self.max_length - len(tail) - 1
        if len(body) > keep:
            body = body[: max(0, keep - 3)] + "..."
        return f"{body}\n{tail}"


def from_pettingzoo(
    env_fn_or_env: AECEnv | Callable[[], AECEnv],
    name: str | None = None,
    *,
    render_observation: RenderObservation | None = None,
    render_moves: RenderMove | None = None,
    parse_reply: ParseReply | None = None,
    max_length: int = 1024,
    render_mode: str | None = None,
    brief: bool = False,
) -> AECEnv[str, dict[str, str], str]:
    """Turn a discrete, action-masked PettingZoo AEC env into an order-enforced text game.

    `env_fn_or_env` is the env or a zero-argument factory of it (a factory gives each bridge its
    own copy, as `pettingzoo.test.seed_test` needs); `name` the versioned name for
    `metadata["name"]`, by default the wrapped env's own (ValueError when it has none). The three
    keyword functions override rendering and parsing (see the module docstring); replies are
    read up to `max_length` characters, and observations are at most `max_length` characters
    unless the legal moves alone take more than about three quarters of that ("Length" in the
    module docstring). `brief`: a seat that has moved is no longer shown the header and the
    instruction ("Brief messages" in the module docstring).
    """
    return wrappers.OrderEnforcingWrapper(
        TextBridge(
            env_fn_or_env,
            name=name,
            render_observation=render_observation,
            render_moves=render_moves,
            parse_reply=parse_reply,
            max_length=max_length,
            render_mode=render_mode,
            brief=brief,
        )
    )
