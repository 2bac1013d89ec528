"""A base for dialogue games: turn order, public and private channels, a moderator, message
history rendered per seat, and round and reply-length limits, on top of :class:`TextAECEnv`.

A dialogue game is a list of :class:`Message` records. Seats speak in turn; the game (in its
hooks) posts their replies with :meth:`DialogueEnv.say` and its own announcements with
:meth:`DialogueEnv.announce`, either public (``to=None``) or to one seat (``to=agent``: only the
sender and that seat ever see it). What the moderator posts while dealing (in ``_deal``: the
rules, each seat's private information) is the seat's *brief*: it is never dropped when an
observation is cut to length.

**What each seat sees.** ``view="new"`` (default): the messages the seat may see, posted since
the start of its last turn, minus its own (the runtime keeps each seat's conversation, so every
observation is the next user message of it); the first observation therefore holds the brief.
``view="full"``: the whole visible history every time, own messages as "You: ...", for agents
without memory. Then one status line: the game's prompt for the seat to act, "Waiting for
<seat>." otherwise, "Game over. Your reward: R." at the end. Lines read "Moderator: ...",
"Moderator (only to you): ...", "player_1: ...", "player_1 (only to you): ...". When an
observation is longer than the space allows, the oldest messages outside the brief are left
out ("(N earlier messages left out)"); the status line always stays.

**Replies.** A reply is read from its first ``max_reply`` characters (a longer one is cut,
counted in ``infos[agent]["cut"]``, not invalid), escaped to printable characters (``\\u00e9``)
and put on one line (every run of whitespace becomes one space, so no seat can forge a
"Moderator:" line in another's observation). Anything that is not a string, or nothing but
whitespace, is invalid. Otherwise ``_turn`` decides.

**Invalid reply.** The game ends at once: the replying seat gets ``FORFEIT_REWARD`` (-1), every
other seat 0, the moderator announces it, and ``infos[a]["reason"]`` is "forfeit". Counted in
``infos[agent]["invalid"]`` and ``env.unwrapped.invalid_counts`` (by :class:`TextAECEnv`).

**Rounds.** A round is one turn of each seat. After ``max_rounds`` rounds of valid turns the
base calls ``_on_round_limit`` (default: announce it and end with reason "rounds"); a game that
lets the current exchange finish (a pending proposal) must still end within a bounded number
of turns. The default turn order cycles through ``possible_agents``.

**Infos.** Every seat, every step: ``invalid``, ``cut``, ``seat`` (its name), ``round``
(1-based, at most ``max_rounds``), ``legal_moves`` (example legal replies for the seat to act,
never empty; empty for the others), ``infostate`` (the seat's whole visible history, as
``view="full"`` renders it), plus the game's ``_seat_info``; at the end also ``reason`` and
``last_action`` (the seat's last reply as read, "invalid", or None).

**Writing a game.** Subclass, call ``super().__init__(agents, max_rounds=...)`` and implement
``_deal(options)`` (draw a hand from ``self.np_random``, announce the rules and private info),
``_turn(agent, text)`` (apply a reply: post messages, ``self.end(reason)`` when it is over;
return None, or why the reply is invalid), ``_prompt(agent)``, ``_legal_moves(agent)``,
``_rewards()`` (at a natural end), and optionally ``_seat_info``, ``_next_agent`` and
``_on_round_limit``. See ``docs/games.md`` and ``games/referential.py``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import gymnasium

from games.bridge import printable
from games.text_env import TextAECEnv

MODERATOR = "moderator"
"""The sender name of the game's own messages."""
FORFEIT_REWARD = -1.0
"""Reward of the seat whose invalid reply ended the game (every other seat gets 0)."""

View = Literal["new", "full"]


@dataclass(frozen=True)
class Message:
    """One message of the history."""

    sender: str
    """A seat's name or `MODERATOR`."""
    text: str
    """Printable text; a seat's message is one line of at most `max_reply` characters."""
    to: str | None = None
    """None: public; else the one seat that sees it besides the sender."""
    brief: bool = False
    """Posted while dealing (rules, private info): never left out of a cut observation."""

    def visible_to(self, agent: str) -> bool:
        """Whether `agent` may see this message."""
        return self.to is None or agent == self.to or agent == self.sender

    def render(self, agent: str | None) -> str:
        """The message as one seat reads it; `agent=None` gives the omniscient form."""
        if agent is None:
            return f"{self.sender}{'' if self.to is None else ' -> ' + self.to}: {self.text}"
        sender = (
            "You"
            if self.sender == agent
            else "Moderator"
            if self.sender == MODERATOR
            else self.sender
        )
        if self.to is None:
            return f"{sender}: {self.text}"
        to = "you" if self.to == agent else self.to
        return f"{sender} (only to {to}): {self.text}"


def clean_reply(reply: str, max_reply: int) -> tuple[str, bool]:
    """`(text, cut)`: `reply` escaped to printable (never cutting an escape in two) up to
    `max_reply` characters, every run of whitespace made one space, stripped; `cut` tells
    whether anything was dropped."""
    parts: list[str] = []
    size = 0
    for char in reply[:max_reply]:
        escaped = printable(char, 16)
        if size + len(escaped) > max_reply:
            break
        parts.append(escaped)
        size += len(escaped)
    cut = len(parts) < len(reply)
    return " ".join("".join(parts).split()), cut


def check_decision(info: dict[str, Any], keys: tuple[str, ...], game: str) -> None:
    """Raise ValueError unless `info` is a decision of `game` (a scripted policy's guard): the
    seat must have legal moves and every entry of `keys`."""
    missing = [k for k in keys if k not in info]
    if missing or not info.get("legal_moves"):
        why = f"lacks {missing}" if missing else "has no legal moves (not this seat's turn)"
        raise ValueError(f"not a {game} decision: the info {why}")


class DialogueEnv(TextAECEnv):
    """Turn-based dialogue game; see the module docstring for the rules every game shares."""

    def __init__(
        self,
        agents: Sequence[str],
        *,
        max_rounds: int,
        max_reply: int = 300,
        max_text: int = 2048,
        view: View = "new",
        render_mode: str | None = None,
    ) -> None:
        if max_rounds < 1:
            raise ValueError(f"max_rounds must be >= 1, got {max_rounds!r}")
        if not 1 <= max_reply <= max_text:
            raise ValueError(f"max_reply must lie in 1..max_text={max_text}, got {max_reply!r}")
        if view not in ("new", "full"):
            raise ValueError(f"view must be 'new' or 'full', got {view!r}")
        super().__init__(agents, max_text, render_mode)
        self.max_rounds = max_rounds
        self.max_reply = max_reply
        self.max_text = max_text
        self.view: View = view
        self.history: list[Message] = []
        self.turns = 0
        """Valid turns taken this hand."""
        self.reason: str | None = None
        """Why the hand ended naturally (set by `end`), None while it runs or after a forfeit."""
        self.cut_counts: dict[str, int] = {a: 0 for a in agents}
        self._cursor: dict[str, int] = {a: 0 for a in agents}
        self._dealing = False

    # --- what a game calls -------------------------------------------------------------

    def say(self, sender: str, text: str, to: str | None = None) -> None:
        """Post `text` from `sender` (a seat or `MODERATOR`) to everyone, or only to seat `to`."""
        if to is not None and to not in self.possible_agents:
            raise ValueError(f"no seat {to!r} to send to; seats: {self.possible_agents}")
        self.history.append(Message(sender, printable(text, self.max_text), to, self._dealing))

    def announce(self, text: str, to: str | None = None) -> None:
        """Post a moderator message to everyone, or only to seat `to` (its private info)."""
        self.say(MODERATOR, text, to)

    def end(self, reason: str) -> None:
        """End the hand naturally; `_rewards` then gives every seat's reward."""
        self.reason = reason

    @property
    def round(self) -> int:
        """The current round, 1-based; turns after the limit (an exchange finishing) and the end
        count as the last round."""
        return min(self.turns // len(self.possible_agents) + 1, self.max_rounds)

    def split_recipient(self, text: str) -> tuple[str | None, str]:
        """`(to, body)` of a reply that starts "@seat ..." or "to seat: ...", else `(None, text)`,
        for games that let seats whisper (post with `say(agent, body, to)`)."""
        m = re.match(r"\s*(?:@|to\s+)(\w+)\s*:?\s*(.*)", text, re.IGNORECASE | re.DOTALL)
        if m and m.group(1) in self.possible_agents:
            return m.group(1), m.group(2)
        return None, text

    def transcript(self, agent: str | None = None) -> str:
        """Every message `agent` may see, oldest first ("You" for its own); None: all of them."""
        return "\n".join(
            m.render(agent) for m in self.history if agent is None or m.visible_to(agent)
        )

    # --- hooks of a game ---------------------------------------------------------------

    def _deal(self, options: dict[str, Any]) -> None:
        """Start a hand from `self.np_random` (and `options`); announce rules and private info."""
        raise NotImplementedError

    def _turn(self, agent: str, text: str) -> str | None:
        """Apply `agent`'s cleaned, non-empty reply; return None, or why it is invalid (then
        nothing it did counts: the hand ends in a forfeit)."""
        raise NotImplementedError

    def _prompt(self, agent: str) -> str:
        """The last line for the seat to act: what to reply."""
        raise NotImplementedError

    def _legal_moves(self, agent: str) -> list[str]:
        """A few example legal replies for the seat to act (what the `random` policy plays)."""
        raise NotImplementedError

    def _rewards(self) -> dict[str, float]:
        """Every seat's reward at a natural end (`self.reason` is set)."""
        raise NotImplementedError

    def _seat_info(self, agent: str) -> dict[str, Any]:
        """Game-specific infos of `agent` (what scripted policies read)."""
        return {}

    def _on_round_limit(self) -> None:
        """Called once `max_rounds` rounds of valid turns are played and the hand runs on."""
        self.announce(f"The {self.max_rounds}-round limit is reached.")
        self.end("rounds")

    # --- TextAECEnv hooks --------------------------------------------------------------

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self._reset_bookkeeping(seed)
        self.history, self.turns, self.reason = [], 0, None
        self.cut_counts = {a: 0 for a in self.possible_agents}
        self._cursor = {a: 0 for a in self.possible_agents}
        self._dealing = True
        try:
            self._deal(dict(options or {}))
        finally:
            self._dealing = False
        self._update_infos()

    def _play(self, agent: str, action: object) -> bool:
        self._cursor[agent] = len(self.history)
        why = "the reply is not text"
        if isinstance(action, str):
            text, cut = clean_reply(action, self.max_reply)
            self.cut_counts[agent] += cut
            self._last_action[agent] = text
            why = self._turn(agent, text) if text else "the reply is empty"
        if why is not None:
            self.announce(f"{agent}'s reply was invalid ({why}): a forfeit.")
            return False
        self.turns += 1
        if self.reason is None and self.turns >= self.max_rounds * len(self.possible_agents):
            self._on_round_limit()
        return True

    def _done(self) -> bool:
        return self._forfeiter is not None or self.reason is not None

    def _final_rewards(self) -> dict[str, float]:
        if self._forfeiter is not None:
            return {
                a: FORFEIT_REWARD if a == self._forfeiter else 0.0 for a in self.possible_agents
            }
        return self._rewards()

    def _next_agent(self, agent: str) -> str:
        agents = self.possible_agents
        return agents[(agents.index(agent) + 1) % len(agents)]

    def _text(self, agent: str) -> str:
        if self._done():
            status = f"Game over. Your reward: {self._final_rewards()[agent]:g}."
        elif agent == self.agent_selection:
            status = printable(self._prompt(agent), self.max_text)
        else:
            status = f"Waiting for {self.agent_selection}."
        return self._fit(agent, self._shown(agent, full=self.view == "full"), status)

    def _update_infos(self) -> None:
        done = self._done()
        for agent in self.agents:
            to_act = not done and agent == self.agent_selection
            legal = list(self._legal_moves(agent)) if to_act else []
            if to_act and not legal:
                raise RuntimeError(f"{type(self).__name__}: no example legal reply for {agent}")
            info: dict[str, Any] = {
                "invalid": self.invalid_counts[agent],
                "cut": self.cut_counts[agent],
                "seat": agent,
                "round": self.round,
                "legal_moves": legal,
                "infostate": self.transcript(agent),
            }
            info.update(self._seat_info(agent))
            if done:
                info["reason"] = "forfeit" if self._forfeiter is not None else self.reason
                info["last_action"] = self._last_action[agent]
            self.infos[agent] = info

    def render(self) -> str | None:
        if self.render_mode is None:
            gymnasium.logger.warn("render() called without a render_mode; use render_mode='ansi'.")
            return None
        return f"{self.metadata['name']} round {self.round}\n{self.transcript()}"

    # --- rendering ---------------------------------------------------------------------

    def _shown(self, agent: str, full: bool) -> list[Message]:
        """The messages of `agent`'s observation: all it may see, or the new ones (not its own)."""
        if full:
            return [m for m in self.history if m.visible_to(agent)]
        new = self.history[self._cursor[agent] :]
        return [m for m in new if m.visible_to(agent) and m.sender != agent]

    def _fit(self, agent: str, shown: list[Message], status: str) -> str:
        """`shown` as `agent` reads it, then `status`, within `max_text` characters: the oldest
        messages outside the brief are left out first; the status line always stays."""
        lines = [m.render(agent) for m in shown]
        budget = self.max_text - len(status) - 1
        size = sum(len(line) + 1 for line in lines)
        if size > budget:
            budget -= 40  # room for the "left out" line
        dropped: set[int] = set()
        for i, m in enumerate(shown):
            if size <= budget:
                break
            if not m.brief:
                dropped.add(i)
                size -= len(lines[i]) + 1
        kept = [line for i, line in enumerate(lines) if i not in dropped]
        if dropped:  # only brief messages come before the first one left out
            kept.insert(min(dropped), f"({len(dropped)} earlier messages left out)")
        body = "\n".join(kept)
        if len(body) > budget:  # the brief alone is too long: keep its start
            body = body[: max(budget - 3, 0)] + "..."
        return (f"{body}\n{status}" if body else status)[: self.max_text]
