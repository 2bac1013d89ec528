"""The part every turn-based text game shares: Text observation and action spaces, seeding,
PettingZoo's per-hand bookkeeping (agents, turn, rewards, terminations, infos, invalid reply
counts) and the step skeleton (dead steps, forfeit on an invalid reply, end of hand).

A game subclasses :class:`TextAECEnv`, sets ``metadata``, and writes its rules in five hooks:
``_play`` (apply a reply; False when it names no legal move), ``_done``, ``_final_rewards``,
``_next_agent`` and ``_text`` (what a seat reads), plus ``_update_infos``."""

from __future__ import annotations

import functools
import re
import string
from typing import Any, Sequence

import gymnasium
from gymnasium import spaces
from gymnasium.utils import seeding
from pettingzoo import AECEnv


@functools.lru_cache(maxsize=64)
def _words(legal: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(r"\b(" + "|".join(map(re.escape, legal)) + r")\b", re.IGNORECASE)


def parse_one_word(reply: object, legal: Sequence[str], max_text: int) -> str | None:
    """The one legal word named in ``reply`` (whole word, any case), or None if it is invalid.

    A reply that names two or more legal moves ("check or bet") is ambiguous, hence invalid:
    echoing the instruction must not count as a decision. Only the first ``max_text``
    characters are read; anything that is not a string is invalid.
    """
    if not isinstance(reply, str):
        return None
    found = {m.group(1).lower() for m in _words(tuple(legal)).finditer(reply[:max_text])}
    return found.pop() if len(found) == 1 else None


class TextAECEnv(AECEnv[str, dict[str, str], str]):
    """AEC env whose observations are ``{"text": str}`` and whose actions are free text."""

    def __init__(self, agents: Sequence[str], max_text: int, render_mode: str | None = None) -> None:
        super().__init__()
        self.render_mode = render_mode
        self.possible_agents = list(agents)
        self.observation_spaces = {
            a: spaces.Dict({"text": spaces.Text(max_text, charset=string.printable)}) for a in agents
        }
        self.action_spaces = {a: spaces.Text(max_text, charset=string.printable) for a in agents}
        self.np_random, self.np_random_seed = seeding.np_random(None)
        self.invalid_counts: dict[str, int] = {a: 0 for a in agents}
        self._forfeiter: str | None = None
        """The seat whose invalid reply ended the hand, if any."""
        self._last_action: dict[str, str | None] = {a: None for a in agents}
        """Each seat's last parsed move, ``"invalid"``, or None before it acts."""

    def observation_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.action_spaces[agent]

    def _reset_bookkeeping(self, seed: int | None) -> None:
        """Reseed (when ``seed`` is given) and start a new hand with the first agent to act."""
        if seed is not None:
            self.np_random, self.np_random_seed = seeding.np_random(seed)
        agents = self.possible_agents
        self.invalid_counts = {a: 0 for a in agents}
        self.agents = list(agents)
        self.agent_selection = agents[0]
        self.rewards = {a: 0 for a in agents}
        self._cumulative_rewards = {a: 0 for a in agents}
        self.terminations = {a: False for a in agents}
        self.truncations = {a: False for a in agents}
        self.infos = {a: {} for a in agents}
        self._forfeiter = None
        self._last_action = {a: None for a in agents}

    def step(self, action: str | None) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        self._cumulative_rewards[agent] = 0
        self.rewards = {a: 0 for a in self.agents}
        if not self._play(agent, action):
            # The defined outcome of an invalid reply: a forfeit, counted.
            self._forfeiter = agent
            self.invalid_counts[agent] += 1
            self._last_action[agent] = "invalid"
        if self._done():
            self.rewards = self._final_rewards()
            self.terminations = {a: True for a in self.agents}
        else:
            self.agent_selection = self._next_agent(agent)
        self._update_infos()
        self._accumulate_rewards()

    def observe(self, agent: str) -> dict[str, str]:
        return {"text": self._text(agent)}

    def close(self) -> None:
        pass

    # Hooks a game implements.

    def _play(self, agent: str, action: object) -> bool:
        """Apply ``agent``'s reply; return False (changing nothing) when it is invalid."""
        raise NotImplementedError

    def _done(self) -> bool:
        raise NotImplementedError

    def _final_rewards(self) -> dict[str, float]:
        """Every seat's reward at the end of the hand (a forfeit included)."""
        raise NotImplementedError

    def _next_agent(self, agent: str) -> str:
        raise NotImplementedError

    def _text(self, agent: str) -> str:
        raise NotImplementedError

    def _update_infos(self) -> None:
        raise NotImplementedError
