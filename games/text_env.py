"""The part every turn-based text game shares: Text observation and action spaces, seeding,
and PettingZoo's per-hand bookkeeping (agents, turn, rewards, terminations, infos, invalid
reply counts). A game subclasses :class:`TextAECEnv`, sets ``possible_agents`` and
``metadata``, and writes its own rules, observations and parsing."""

from __future__ import annotations

import string
from typing import Any, Sequence

import gymnasium
from gymnasium import spaces
from gymnasium.utils import seeding
from pettingzoo import AECEnv


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
