"""Tool use in a game's turns: a PettingZoo AEC wrapper that lets seats call tools.

``ToolUse(env, {"solver": [calc]})`` wraps any text AEC env (observations ``{"text": str}``,
text actions; the games of this package and bridged ones). A seat with tools may answer a
decision with tool calls instead of a move (the format is :mod:`games.tools`):

1. The seat replies with one or more calls. The wrapper runs them in order
   (:func:`games.tools.run_call`: schema-checked arguments, a time and an output-size limit,
   no I/O unless the tool allows it). The game does not see the reply: no move is made, every
   seat's step reward is 0, and the same seat is to act again.
2. The seat's next observation is the result: the one call's content, or ``name: content``
   lines for several, and ``infos[seat]["tool_result"]`` holds the same text (None when the
   observation is the game's). The runtime renders such an observation as a ``tool`` message
   of the chat template, and it is observation tokens (mask 0) in the trajectory, like any.
3. The seat replies again: more calls, or its move, which goes to the game as usual.

**Invalid calls.** A malformed call, an unknown tool, arguments that break the schema, a tool
that raises or runs past its time: the result is an ``Error: ...`` line saying so, returned as
in 2, and the call is counted in ``invalid_tool_calls`` (by seat, and by :class:`Outcome` in
``outcomes``). The seat may try again; nothing else happens to it.

**Limits.** At most ``max_calls_per_turn`` calls per decision and ``max_calls`` per episode
and seat. A reply whose calls would pass either limit is not run: it goes to the game as the
seat's move, where the game's own rule for an unreadable move applies (a forfeit in the
dialogue games). So an episode stays bounded whatever a seat writes.

**Infos** of a seat with tools, every step: ``tools`` (its tools' names), ``tool_calls``,
``invalid_tool_calls`` (this episode), ``tool_result``. After a result, ``legal_moves`` is
the game's ``legal_moves_after_tool(seat, results)`` when its raw env defines it (example
replies that use the results, for scripted seats and exploration), else the game's own.

A game declares its tools in its ``env()`` factory: ``OrderEnforcingWrapper(ToolUse(raw_env(),
tools))``; :func:`find_tool_use` finds the wrapper in a wrapped env (the runtime's way to its
declarations, :meth:`ToolUse.schemas`, and its counters).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from pettingzoo import AECEnv
from pettingzoo.utils.wrappers import BaseWrapper

from games.tools import Outcome, Result, Tool, parse_calls, run_call


class ToolUse(BaseWrapper):
    """Seats call tools between moves; see the module docstring."""

    def __init__(self, env: AECEnv, tools: Mapping[str, Sequence[Tool]], *, max_calls_per_turn: int = 3,
                 max_calls: int = 12) -> None:
        super().__init__(env)
        unknown = sorted(set(tools) - set(env.possible_agents))
        if unknown:
            raise ValueError(f"tools for seats {unknown}, which the game does not have (seats: {env.possible_agents})")
        self.tools: dict[str, dict[str, Tool]] = {}
        for seat, seat_tools in tools.items():
            names = [t.name for t in seat_tools]
            if len(set(names)) != len(names):
                raise ValueError(f"seat {seat!r}: tool names must be unique, got {names}")
            self.tools[seat] = {t.name: t for t in seat_tools}
        if not 1 <= max_calls_per_turn <= max_calls <= 1000:
            raise ValueError(f"need 1 <= max_calls_per_turn <= max_calls <= 1000, got {max_calls_per_turn} and "
                             f"{max_calls}")
        self.max_calls_per_turn, self.max_calls = max_calls_per_turn, max_calls
        self._reset_counts()

    def _reset_counts(self) -> None:
        seats = self.env.possible_agents
        self.tool_calls: dict[str, int] = dict.fromkeys(seats, 0)
        """Calls per seat this episode (invalid ones included)."""
        self.invalid_tool_calls: dict[str, int] = dict.fromkeys(seats, 0)
        self.outcomes: Counter[Outcome] = Counter()
        """Calls by outcome this episode, all seats."""
        self.over_limit: dict[str, int] = dict.fromkeys(seats, 0)
        """Replies with calls past a limit, handed to the game as moves."""
        self.log: list[tuple[str, Result]] = []
        """``(seat, result)`` of every call this episode, in order."""
        self._turn_results: dict[str, list[Result]] = {s: [] for s in seats}
        self._pending: dict[str, str | None] = dict.fromkeys(seats)

    def schemas(self, seat: str) -> list[dict[str, Any]]:
        """The OpenAI-shaped declarations of ``seat``'s tools (``tools=`` of a chat template)."""
        return [t.schema() for t in self.tools.get(seat, {}).values()]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self.env.reset(seed=seed, options=options)
        self._reset_counts()
        self._decorate()

    def observe(self, agent: str) -> Any:
        pending = self._pending.get(agent)
        if pending is None:
            return self.env.observe(agent)
        space = self.observation_space(agent)
        limit = getattr(space["text"], "max_length", None) if hasattr(space, "spaces") else None
        return {"text": pending[:limit] if limit else pending}

    def step(self, action: Any) -> None:
        agent = self.agent_selection
        live = not (self.terminations.get(agent) or self.truncations.get(agent))
        calls = parse_calls(action) if live and agent in self.tools and isinstance(action, str) else None
        if calls is None:
            self._move(action)
            return
        room = min(self.max_calls_per_turn - len(self._turn_results[agent]),
                   self.max_calls - self.tool_calls[agent])
        if len(calls) > room:
            self.over_limit[agent] += 1
            self._move(action)
            return
        results = [run_call(self.tools[agent], c) for c in calls]
        for r in results:
            self.tool_calls[agent] += 1
            self.invalid_tool_calls[agent] += not r.ok
            self.outcomes[r.outcome] += 1
            self.log.append((agent, r))
        self._turn_results[agent].extend(results)
        self._pending[agent] = (results[0].content if len(results) == 1
                                else "\n".join(f"{r.name}: {r.content}" for r in results))
        # No move was made: nobody is rewarded for this step, and the seat acts again.
        for a in self.rewards:
            self.rewards[a] = 0
        self._cumulative_rewards[agent] = 0
        self._decorate()

    def _move(self, action: Any) -> None:
        agent = self.agent_selection
        self._pending[agent] = None
        self._turn_results[agent] = []
        self.env.step(action)
        self._decorate()

    def _decorate(self) -> None:
        """Add the tool entries to the infos of the seats with tools (the inner game rewrites its
        infos every step)."""
        raw = self.env.unwrapped
        after = getattr(raw, "legal_moves_after_tool", None)
        for seat in self.tools:
            info = self.infos.get(seat)
            if info is None:  # the seat has left the episode
                continue
            info.update(tools=sorted(self.tools[seat]), tool_calls=self.tool_calls[seat],
                        invalid_tool_calls=self.invalid_tool_calls[seat], tool_result=self._pending[seat])
            if self._pending[seat] is not None and after is not None:
                moves = after(seat, list(self._turn_results[seat]))
                if moves:
                    info["legal_moves"] = list(moves)

    def __str__(self) -> str:
        return f"ToolUse<{self.env!s}>"


def find_tool_use(env: Any) -> ToolUse | None:
    """The :class:`ToolUse` layer of a wrapped env, or None when the game has no tools."""
    for _ in range(16):  # wrappers nest a few deep
        if isinstance(env, ToolUse):
            return env
        if not isinstance(env, BaseWrapper):
            return None
        env = env.env
    return None
