"""Bridge: any PettingZoo AEC env with discrete actions and action masks, as a text game.

| Creation     | `games.from_pettingzoo(env_fn_or_env, name="nim_text_v0", ...)`              |
|--------------|------------------------------------------------------------------------------|
| API          | PettingZoo AEC (order-enforced), the wrapped env's agents and turn order     |
| Observation  | `Dict({"text": Text(max_length, charset=string.printable)})`                 |
| Action       | `Text(max_length, charset=string.printable)`: the seat's free-text reply      |
| Rewards      | the wrapped env's, step by step; -1 to a seat whose reply is invalid          |

**Requirements on the wrapped env.** Every agent's action space is `Discrete(n, start)`
(TypeError otherwise, at construction). Legal moves come from an `action_mask` entry of a dict
observation (n entries, 1 = legal), as in `pettingzoo.classic`; an env without one (e.g.
`rps_v2`) has every action legal at every turn. The bridge steps the wrapped env with integer action ids and copies its
agents, turn, rewards, accumulated rewards, terminations and truncations after every step, so a
game played with valid replies is exactly the wrapped game.

**What each seat sees.** `render_observation(agent, observation)` (default: the
`observation` entry as nested lists, e.g. "Observation: [[0, 1], [1, 0]]"), escaped to
printable characters, then for the seat to act:

    <rendered observation>
    Legal moves: 0) rock, 2) scissors.
    Reply with the number of one legal move.

where the labels come from `render_moves(agent, action_id)`; without `render_moves` the list
is the bare ids, "Legal moves: 0, 2.". A seat not to act sees "Waiting for your turn." in place
of the two lines, a finished seat "The game is over." (or, after a forfeit, "Your reply was
invalid, a forfeit." / "A reply was invalid, a forfeit."). The observation part is cut first
(ending in "...") so that the moves and the instruction survive `max_length`.

**Legal replies.** `parse_reply(reply, legal)` with `legal` = {action id: label or None}
returns an action id or None. The default reads the first `max_length` characters: every
legal label occurring as a whole word (any case) names its move and is blanked out, then every
remaining integer names that id, legal or not; the reply is a move when exactly one distinct
id is named and it is legal. "2", "2) scissors", "Scissors!" are move 2; "0 or 2", "7" (not
legal), "" and non-strings are invalid. A custom parser's result is checked against `legal`.

**Invalid reply.** The wrapped env is not stepped (its own illegal-move handling differs from
game to game, so it is not relied on). The replying seat gets -1, every other seat 0 (the game
was abandoned, not decided), all agents terminate, and the bridge ends the episode with its own
dead steps. Counted in `infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`.

**Infos.** The wrapped env's infos (minus any `action_mask`, which would make
`pettingzoo.test.api_test` sample Text actions with a mask) plus `invalid`, `infostate` (the
rendered observation text) and `legal_moves` (the legal ids as strings, ascending; empty when
not to act); after a forfeit also `reason` = "forfeit".
"""

from __future__ import annotations

import re
import string
from collections.abc import Callable, Mapping
from typing import Any

import gymnasium
import numpy as np
from gymnasium import spaces
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

RenderObservation = Callable[[str, Any], str]
"""(agent, the wrapped env's observation) -> text."""
RenderMove = Callable[[str, int], str]
"""(agent, action id) -> the move's label."""
ParseReply = Callable[[object, Mapping[int, str | None]], int | None]
"""(reply, {legal action id: label or None}) -> action id, or None for an invalid reply."""

INSTRUCTION = "Reply with the number of one legal move."
_PRINTABLE = frozenset(string.printable)
_INTEGER = re.compile(r"(?<![0-9])[0-9]+(?![0-9])")


def printable(text: str, max_length: int) -> str:
    """`text` with every character outside `string.printable` escaped (`\\xe9`, `\\u2660`), cut
    to `max_length` characters."""
    out = "".join(c if c in _PRINTABLE else c.encode("unicode_escape").decode() for c in text)
    return out[:max_length]


def default_render_observation(agent: str, observation: Any) -> str:
    """ "Observation: <nested lists>" for the `observation` entry of a dict observation (the
    other entries but `action_mask` as "key: value" when there is none), else the whole."""
    if isinstance(observation, Mapping):
        if "observation" in observation:
            return f"Observation: {_plain(observation['observation'])}"
        parts = [f"{k}: {_plain(v)}" for k, v in observation.items() if k != "action_mask"]
        return "Observation: " + "; ".join(parts)
    return f"Observation: {_plain(observation)}"


def _plain(value: Any) -> Any:
    return np.asarray(value).tolist() if isinstance(value, np.ndarray | np.generic) else value


def default_parse_reply(
    reply: object, legal: Mapping[int, str | None], max_length: int = 1024
) -> int | None:
    """The one legal action id named in `reply`, else None; see the module docstring."""
    if not isinstance(reply, str):
        return None
    text = reply[:max_length]
    named: set[int] = set()
    # Longest labels first, so "take 10" is blanked before "take 1" could match inside it.
    for action, label in sorted(legal.items(), key=lambda kv: -len(kv[1] or "")):
        if not label:
            continue
        pattern = re.compile(r"(?<!\w)" + re.escape(label) + r"(?!\w)", re.IGNORECASE)
        text, hits = pattern.subn(" ", text)
        if hits:
            named.add(action)
    named.update(int(m.group()) for m in _INTEGER.finditer(text))
    if len(named) != 1:
        return None
    action = named.pop()
    return action if action in legal else None


class TextBridge(AECEnv[str, dict[str, str], str]):
    """The text game over a wrapped discrete, action-masked AEC env; see the module docstring."""

    def __init__(
        self,
        env_fn_or_env: AECEnv | Callable[[], AECEnv],
        *,
        name: str,
        render_observation: RenderObservation | None = None,
        render_moves: RenderMove | None = None,
        parse_reply: ParseReply | None = None,
        max_length: int = 1024,
        render_mode: str | None = None,
    ) -> None:
        super().__init__()
        inner = env_fn_or_env if isinstance(env_fn_or_env, AECEnv) else env_fn_or_env()
        if not isinstance(inner, AECEnv):
            raise TypeError(f"expected a PettingZoo AECEnv or a factory of one, got {inner!r}")
        if max_length < 64:
            raise ValueError(f"max_length must be at least 64, got {max_length}")
        self.env = inner
        self.metadata = {"name": name, "is_parallelizable": False, "render_modes": ["ansi"]}
        self.render_mode = render_mode
        self.max_length = max_length
        self._render_observation = render_observation or default_render_observation
        self._render_moves = render_moves
        self._parse_reply = parse_reply
        self.possible_agents = list(inner.possible_agents)
        for agent in self.possible_agents:
            act = inner.action_space(agent)
            if not isinstance(act, spaces.Discrete):
                raise TypeError(f"{name}: agent {agent!r} has action space {act}, not Discrete")
        self.observation_spaces = {
            a: spaces.Dict({"text": spaces.Text(max_length, charset=string.printable)})
            for a in self.possible_agents
        }
        self.action_spaces = {
            a: spaces.Text(max_length, charset=string.printable) for a in self.possible_agents
        }
        self.invalid_counts: dict[str, int] = {a: 0 for a in self.possible_agents}
        self._forfeiter: str | None = None

    def observation_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.action_spaces[agent]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self.env.reset(seed=seed, options=options)
        self.invalid_counts = {a: 0 for a in self.possible_agents}
        self._forfeiter = None
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
            move = default_parse_reply(action, legal, self.max_length)
        else:
            move = self._parse_reply(action, legal)
        if move is not None and move in legal:
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
        """{legal action id: label or None} from the wrapped env's action mask (every action
        when it has none)."""
        obs = self.env.observe(agent)
        space = self.env.action_space(agent)
        has_mask = isinstance(obs, Mapping) and "action_mask" in obs
        mask = np.asarray(obs["action_mask"]) if has_mask else np.ones(int(space.n), dtype=np.int8)
        start = int(space.start)
        ids = [start + int(i) for i in np.flatnonzero(mask)]
        return {a: self._render_moves(agent, a) if self._render_moves else None for a in ids}

    def _body(self, agent: str) -> str:
        return printable(self._render_observation(agent, self.env.observe(agent)), self.max_length)

    def _text(self, agent: str) -> str:
        if self._to_act(agent):
            legal = self._legal(agent)
            if self._render_moves is None:
                listed = ", ".join(str(a) for a in legal)
            else:
                listed = ", ".join(f"{a}) {label}" for a, label in legal.items())
            tail = printable(f"Legal moves: {listed}.\n{INSTRUCTION}", self.max_length)
        elif self._forfeiter is not None:
            who = "Your reply" if agent == self._forfeiter else "A reply"
            tail = f"{who} was invalid, a forfeit."
        elif self.terminations.get(agent) or self.truncations.get(agent):
            tail = "The game is over."
        else:
            tail = "Waiting for your turn."
        body = self._body(agent)
        room = self.max_length - len(tail) - 1
        if len(body) > room:
            body = body[: max(0, room - 3)] + "..."
        return f"{body}\n{tail}"[: self.max_length]


def from_pettingzoo(
    env_fn_or_env: AECEnv | Callable[[], AECEnv],
    *,
    name: str,
    render_observation: RenderObservation | None = None,
    render_moves: RenderMove | None = None,
    parse_reply: ParseReply | None = None,
    max_length: int = 1024,
    render_mode: str | None = None,
) -> AECEnv[str, dict[str, str], str]:
    """Turn a discrete, action-masked PettingZoo AEC env into an order-enforced text game.

    `env_fn_or_env` is the env or a zero-argument factory of it (a factory gives each bridge its
    own copy, as `pettingzoo.test.seed_test` needs); `name` the versioned name for
    `metadata["name"]`. The three keyword functions override rendering and parsing (see the
    module docstring); observations and replies are at most `max_length` characters.
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
        )
    )
