"""Negotiation: two players split a pool of items they value privately (competitive).

| Creation     | `games.make("negotiation_v0", max_rounds=3)` or `negotiation.env()`          |
|--------------|-----------------------------------------------------------------------------|
| API          | PettingZoo AEC on `games.dialogue.DialogueEnv`, not parallelizable           |
| Agents       | `["player_0", "player_1"]`; they take turns, player_0 first                 |
| Observation  | `Dict({"text": Text(2048, charset=string.printable)})`                      |
| Action       | `Text(2048, charset=string.printable)`: the seat's free-text reply           |
| Rewards      | at the end: each seat's value of its share if they agree, 0 for both if not |

**Game** (Deal or No Deal, Lewis et al. 2017, "Deal or No Deal? End-to-End Learning for
Negotiation Dialogues", §2). A pool of books, hats and balls (1-4 of each, 5-7 in all) and, for
each seat, a private value per item (whole points) such that the whole pool is worth 10 to
each; every item is worth something to someone and some item to both. Seats talk in turns for
up to `max_rounds` rounds (default 3). On its turn a seat may instead make the final proposal,
"propose: books=1 hats=2 balls=0": the items it takes, the other seat getting the rest. The
other seat must then reply accept (a deal) or reject (no deal). Deviation from the paper:
one structured proposal ends the talk, where the paper has both seats write their selection.

**What each seat sees** (`view="new"`, see `games.dialogue`). The rules, "Moderator (only to
you): Your values: book 4, hat 0, ball 2 (the whole pool is worth 10 points to you).", the
other seat's messages as "player_1: ...", the moderator's account of a proposal ("player_1
proposes to take books=1 hats=0 balls=1, leaving player_0 books=0 hats=2 balls=2."), then the
prompt: "Round 2 of 3: write a message to player_1, or a final proposal ..."; for the last
talk turn "Last turn: propose now ..., or there is no deal."; facing a proposal "You would get
books=0 hats=2 balls=2, worth 4 points to you. Reply accept or reject.".

**Legal replies.** Talk: any non-empty text (cut to 300 characters). A reply containing
"propose:" (any case) is a proposal: the `item=count` pairs after it are read (item singular
or plural, count a whole number; text without "=" is ignored, so "propose: books=1 balls=2.
Deal?" is fine); an item not named is 0. Facing a proposal: exactly one of "accept" /
"reject" as a whole word (any case, "accepted" too).

**Malformed proposal and other invalid replies.** A proposal with no pair, an unknown item, an
item named twice, a count that is not a whole number, or more of an item than the pool holds;
a reply to a proposal with neither or both of accept/reject; an empty or non-text reply. The
hand ends with no deal: -1 to the seat that replied, 0 to the other (`games.dialogue`).
Counted in `infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`. Text that tries to
instruct the game ("ignore the rules, I win") is a message like any other while talking, and
invalid when a reply to a proposal is due.

**End.** After accept ("deal"), reject ("rejected"), or when `max_rounds` rounds pass without
a proposal ("no_deal"); a proposal made on the last turn still gets its answer.

**Infos.** Those of `games.dialogue` plus `pool` and `values` (the seat's own; dicts by item),
`proposal` (None, or {"by": seat, "shares": {seat: {item: count}}}), `last_turn` (True when
this is the last turn to propose) and at the end `deal` (the shares, or None).

**Tools.** With `value_tool=True`, player_0's brief does not give its values: it has a tool
`value_of(item)` (item "book", "hat" or "ball", or the plural) that returns its value of one
item, called as `games.tool_use` describes (3 calls per turn, 12 per game).

**Arguments.** `max_rounds`; `view`; `value_tool`. `reset(options={"pool": {...}, "values": {"player_0":
{...}, "player_1": {...}}})` fixes the hand (checked against the rules above).

**Version history.** v0: initial release.
"""

from __future__ import annotations

import functools
import itertools
import re
from typing import Any, ClassVar

import numpy as np
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.dialogue import DialogueEnv, View, check_decision
from games.evaluation import GameEval
from games.tool_use import ToolUse
from games.tools import Tool

AGENTS = ("player_0", "player_1")
TOOL_SEAT = "player_0"
"""The seat that has the `value_of` tool when the game is made with `value_tool=True`."""
ITEMS = ("book", "hat", "ball")
TOTAL_VALUE = 10
"""What the whole pool is worth to each seat."""
Bundle = dict[str, int]
"""Items by name -> count."""

_PROPOSE = re.compile(r"\bpropose\s*:", re.IGNORECASE)
_PAIR = re.compile(r"([a-z]+)\s*=\s*(\S*)", re.IGNORECASE)
_ANSWER = re.compile(r"\b(accept|reject)(?:s|ed)?\b", re.IGNORECASE)


@functools.cache
def _pools() -> tuple[tuple[int, ...], ...]:
    """Every pool of Lewis et al.: 1-4 of each item, 5-7 items in all."""
    return tuple(c for c in itertools.product(range(1, 5), repeat=len(ITEMS)) if 5 <= sum(c) <= 7)


@functools.cache
def _value_pairs(pool: tuple[int, ...]) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Every (values_0, values_1) for `pool`: each worth `TOTAL_VALUE` in all, every item worth
    something to someone, some item worth something to both."""
    vectors = [
        v
        for v in itertools.product(range(TOTAL_VALUE + 1), repeat=len(ITEMS))
        if sum(c * x for c, x in zip(pool, v, strict=True)) == TOTAL_VALUE
    ]
    return tuple(
        (a, b)
        for a in vectors
        for b in vectors
        if all(x or y for x, y in zip(a, b, strict=True))
        and any(x and y for x, y in zip(a, b, strict=True))
    )


def worth(bundle: Bundle, values: Bundle) -> int:
    """Points of `bundle` to a seat with `values`."""
    return sum(bundle[i] * values[i] for i in ITEMS)


def fmt(bundle: Bundle) -> str:
    """ "books=1 hats=0 balls=2": the proposal syntax."""
    return " ".join(f"{i}s={bundle[i]}" for i in ITEMS)


def in_words(bundle: Bundle) -> str:
    """ "1 book and 2 balls" (items with a count only), "nothing" for none."""
    parts = [f"{bundle[i]} {i}{'s' * (bundle[i] > 1)}" for i in ITEMS if bundle[i]]
    return (
        " and ".join([", ".join(parts[:-1]), parts[-1]] if len(parts) > 1 else parts) or "nothing"
    )


def parse_proposal(text: str, pool: Bundle) -> Bundle | str:
    """The bundle a reply's "propose:" takes (see the card), or why it is malformed."""
    m = _PROPOSE.search(text)
    assert m is not None, "parse_proposal needs a reply with 'propose:'"
    take = dict.fromkeys(ITEMS, 0)
    named: set[str] = set()
    for name, count in _PAIR.findall(text[m.end() :]):
        item = name.lower().removesuffix("s") if name.lower() not in ITEMS else name.lower()
        count = count.rstrip(".,;:!?)")
        if item not in ITEMS:
            return f"unknown item {name!r} in the proposal"
        if item in named:
            return f"{item}s named twice in the proposal"
        if not count.isdigit():
            return f"{item}s={count!r} is not a whole number"
        if int(count) > pool[item]:
            return f"{item}s={count} but the pool holds {pool[item]}"
        named.add(item)
        take[item] = int(count)
    return take if named else "a proposal with no item=count pair"


def ask_for(values: Bundle, pool: Bundle, fraction: float) -> Bundle:
    """What a seat takes to get at least `fraction` of its total: whole items, most valuable
    first (ties in `ITEMS` order), never an item worth nothing to it."""
    take = dict.fromkeys(ITEMS, 0)
    for item in sorted(ITEMS, key=lambda i: -values[i]):
        while (
            take[item] < pool[item]
            and values[item] > 0
            and worth(take, values) < fraction * TOTAL_VALUE
        ):
            take[item] += 1
    return take


class raw_env(DialogueEnv):
    """Negotiation AEC env; see the module docstring for the card."""

    metadata: ClassVar[dict[str, Any]] = {
        "name": "negotiation_v0",
        "is_parallelizable": False,
        "render_modes": ["ansi"],
    }

    def __init__(
        self, max_rounds: int = 3, view: View = "new", render_mode: str | None = None,
        value_tool: bool = False,
    ) -> None:
        super().__init__(AGENTS, max_rounds=max_rounds, view=view, render_mode=render_mode)
        self.value_tool = value_tool
        self.pool: Bundle = dict.fromkeys(ITEMS, 1)
        self.values: dict[str, Bundle] = {a: dict.fromkeys(ITEMS, 0) for a in AGENTS}
        self.proposal: tuple[str, Bundle] | None = None
        """(proposer, what it takes) while an answer is due."""
        self.shares: dict[str, Bundle] | None = None

    def _deal(self, options: dict[str, Any]) -> None:
        pools = _pools()
        pool = (
            tuple(options["pool"][i] for i in ITEMS)
            if "pool" in options
            else pools[self.np_random.integers(len(pools))]
        )
        if pool not in pools:
            raise ValueError(f"pool {options.get('pool')!r} breaks the rules: 1 to 4 of each item, 5 to 7 in all")
        pairs = _value_pairs(pool)
        if "values" in options:
            pair = tuple(tuple(options["values"][a][i] for i in ITEMS) for a in AGENTS)
            if pair not in pairs:
                raise ValueError(f"values {options['values']!r} break the rules for pool {pool!r}")
        else:
            pair = pairs[self.np_random.integers(len(pairs))]
        self.pool = dict(zip(ITEMS, map(int, pool), strict=True))
        self.values = {
            a: dict(zip(ITEMS, map(int, v), strict=True)) for a, v in zip(AGENTS, pair, strict=True)
        }
        self.proposal, self.shares = None, None
        self.announce(
            f"Negotiation. You and the other player split {in_words(self.pool)}. Talk for up to "
            f"{self.max_rounds} rounds; on your turn you may instead make the final proposal, e.g. "
            f'"{self._example()}" (the items you take; '
            "the other player gets the rest), which the other player accepts or rejects. A deal "
            "scores each player its own value of its items; no deal scores 0 for both."
        )
        for a in AGENTS:
            vals = ", ".join(f"{i} {self.values[a][i]}" for i in ITEMS)
            if a == TOOL_SEAT and self.value_tool:
                vals = "ask the value_of tool"
            self.announce(
                f"Your values: {vals} (the whole pool is worth {TOTAL_VALUE} points to you).", to=a
            )

    def value_of(self, item: str) -> int:
        """The `value_of` tool of `TOOL_SEAT`: its value of one `item` (singular or plural)."""
        return self.values[TOOL_SEAT][item.removesuffix("s")]

    def _example(self) -> str:
        """A proposal to show the syntax: half of each item, rounded down (it reveals no values)."""
        return f"propose: {fmt({i: self.pool[i] // 2 for i in ITEMS})}"

    def _other(self, agent: str) -> str:
        return AGENTS[1 - AGENTS.index(agent)]

    def _split(self, proposer: str, take: Bundle) -> dict[str, Bundle]:
        return {proposer: take, self._other(proposer): {i: self.pool[i] - take[i] for i in ITEMS}}

    def _turn(self, agent: str, text: str) -> str | None:
        if self.proposal is not None:
            answers = {m.group(1).lower() for m in _ANSWER.finditer(text)}
            if len(answers) != 1:
                return "not exactly one of accept or reject"
            self.say(agent, text)
            if answers == {"accept"}:
                self.shares = self._split(*self.proposal)
                self.announce(
                    "Deal: " + "; ".join(f"{a} gets {fmt(s)}" for a, s in self.shares.items()) + "."
                )
                self.end("deal")
            else:
                self.announce("No deal: the proposal was rejected.")
                self.end("rejected")
            return None
        if _PROPOSE.search(text):
            take = parse_proposal(text, self.pool)
            if isinstance(take, str):
                return take
            self.say(agent, text)
            self.proposal = (agent, take)
            other = self._other(agent)
            rest = self._split(agent, take)[other]
            self.announce(f"{agent} proposes to take {fmt(take)}, leaving {other} {fmt(rest)}.")
            return None
        self.say(agent, text)
        return None

    def _on_round_limit(self) -> None:
        if self.proposal is None:  # a proposal on the last turn still gets its answer
            self.announce("The talk is over without a proposal: no deal.")
            self.end("no_deal")

    def _last_turn(self) -> bool:
        return self.proposal is None and self.turns == self.max_rounds * len(AGENTS) - 1

    def _prompt(self, agent: str) -> str:
        if self.proposal is not None:
            mine = self._split(*self.proposal)[agent]
            points = worth(mine, self.values[agent])
            return (
                f"You would get {fmt(mine)}, worth {points} points to you. Reply accept or reject."
            )
        example = f'"{self._example()}"'
        if self._last_turn():
            return f"Last turn: write your proposal now, e.g. {example}, or there is no deal."
        return (
            f"Round {self.round} of {self.max_rounds}: write a message to {self._other(agent)}, "
            f"or a final proposal such as {example}."
        )

    def _legal_moves(self, agent: str) -> list[str]:
        if self.proposal is not None:
            return ["accept", "reject"]
        splits = itertools.product(*(range(self.pool[i] + 1) for i in ITEMS))
        talk = [f"I would like the {i}s." for i in ITEMS]
        return talk + [f"propose: {fmt(dict(zip(ITEMS, s, strict=True)))}" for s in splits]

    def _rewards(self) -> dict[str, float]:
        if self.shares is None:
            return dict.fromkeys(AGENTS, 0.0)
        return {a: float(worth(self.shares[a], self.values[a])) for a in AGENTS}

    def _seat_info(self, agent: str) -> dict[str, Any]:
        proposal = (
            None
            if self.proposal is None
            else {"by": self.proposal[0], "shares": self._split(*self.proposal)}
        )
        info: dict[str, Any] = {
            "pool": dict(self.pool),
            "values": dict(self.values[agent]),
            "proposal": proposal,
            "last_turn": self._last_turn(),
        }
        if self._done():
            info["deal"] = self.shares
        return info


def env(**kwargs: Any) -> AECEnv[str, dict[str, str], str]:
    """Make the order-enforced negotiation game (`raw_env(**kwargs)`); with `value_tool=True`,
    `TOOL_SEAT` learns its values only from its `value_of` tool (`games.tool_use`)."""
    raw = raw_env(**kwargs)
    if not raw.value_tool:
        return wrappers.OrderEnforcingWrapper(raw)
    tool = Tool(name="value_of", description="Your value, in points, of one item of the pool.",
                parameters={"type": "object", "properties": {"item": {"enum": [*ITEMS, *(f"{i}s" for i in ITEMS)]}},
                            "required": ["item"], "additionalProperties": False},
                fn=raw.value_of)
    return wrappers.OrderEnforcingWrapper(ToolUse(raw, {TOOL_SEAT: [tool]}))


# --- Scripted policies --------------------------------------------------------------------


class Negotiator:
    """Asks for `take` of its total (`ask_for`), accepts an offer worth at least `accept` of it
    (and more than nothing). With `talk`, its first turn is a message saying what it wants
    ("I would like 1 book and 2 balls."), unless that turn is the last one to propose.
    Reads `info` only; deterministic."""

    take = 0.5
    accept = 0.4

    def __init__(
        self, take: float | None = None, accept: float | None = None, talk: bool = True
    ) -> None:
        self.take = self.take if take is None else take
        self.accept = self.accept if accept is None else accept
        self.talk = talk

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Return "accept"/"reject" facing a proposal, else a message or a proposal."""
        check_decision(info, ("values", "pool", "proposal", "last_turn", "round"), "negotiation_v0")
        values = info["values"]
        if info["proposal"] is not None:
            got = worth(info["proposal"]["shares"][info["seat"]], values)
            return "accept" if got > 0 and got >= self.accept * TOTAL_VALUE else "reject"
        want = ask_for(values, info["pool"], self.take)
        if self.talk and info["round"] == 1 and not info["last_turn"]:
            return f"I would like {in_words(want)}."
        return f"propose: {fmt(want)}"


class FairNegotiator(Negotiator):
    """Asks for half of its total; accepts 40% or more."""

    take, accept = 0.5, 0.4


class GreedyNegotiator(Negotiator):
    """Asks for every item worth anything to it; accepts any offer worth more than nothing."""

    take, accept = 1.0, 0.0


SCRIPTED_POLICIES: dict[str, type] = {
    "negotiation_fair": FairNegotiator,
    "negotiation_greedy": GreedyNegotiator,
}
"""Scripted policies of this game by name, for `games.scripted.SCRIPTED`."""

EVALUATION = GameEval(
    unit="points", per="game", scripted=tuple(SCRIPTED_POLICIES),
    system_prompt=("You negotiate with another player over how to split some items. Keep messages short. To make "
                   "your final offer, write: propose: books=N hats=N balls=N (the items you take). When you get an "
                   "offer, reply accept or reject."),
)
"""The evaluation hook: points per game; the seat with more points wins a pairing's game."""
