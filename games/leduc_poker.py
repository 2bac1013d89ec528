"""Leduc hold'em as a two-seat dialogue game, with its exact game theory.

| Creation           | `games.make("leduc_poker_v0", deal=None, card0=None)` or `leduc_poker.env()` |
|--------------------|-----------------------------------------------------------------|
| API                | PettingZoo AEC, turn-based, not parallelizable                  |
| Agents             | `["player_0", "player_1"]`; player_0 acts first in each round   |
| Observation        | `Dict({"text": Text(512, charset=string.printable)})`           |
| Action             | `Text(512, charset=string.printable)`: the seat's free-text reply |
| Rewards            | net chips at the end, -13..+13, zero-sum                        |

**Game** (OpenSpiel's `leduc_poker`, two players). A deck of six cards, J, Q and K in two
suits; each player is dealt one and antes 1 chip. Two betting rounds; in each, player_0 acts
first, a bet or raise is 2 chips in round 1 and 4 in round 2, and at most 2 of them are made
per round. Not facing a bet a player checks or bets; facing one it folds (losing what it put
in), calls, or raises (while fewer than 2 raises were made this round). A round ends when both
checked or a bet was called; then one public board card is turned, and after round 2 the
showdown: a card pairing the board wins, else the higher card, and equal ranks split the pot.
Suits never matter.

**Arguments.** `deal`: None draws the deal from the env's seeded `np_random` at each reset;
0..119 fixes it as an index into `DEALS`, the ordered (player_0's card, player_1's card, board
card) triples of distinct cards 0..5 (card c has rank `CARDS[c // 2]`). `card0` (0..5) fixes
only player_0's card (the evaluation's strata). `reset(options={"deal": k})` overrides both
for one hand. `forfeit_penalty` (0..10, default 0): chips an invalid reply costs beyond a fold.

**What each seat sees.** One short user message per decision; its first gives the rules and
the seat's card, later ones (follow-ups in the same conversation) only what happened since
its last reply (the opponent's moves, the board card), then the allowed words:
* "Leduc poker: cards J<Q<K, two of each, ante 1; bets 2 chips, 4 after the board card; a pair
  with the board wins, else the higher card. You have a K. Reply with one word: check or bet."
* e.g. "Opponent called. Board card: Q. Opponent bet. Reply with one word: fold, call or raise."
* a seat not to act: the first message's rules and card, then "Waiting for the opponent."
* at the end, the result, e.g. "Showdown: you had K, opponent had Q, board J. You win 3 chips."

**Legal replies.** Case-insensitive; a reply is a move when exactly one of the legal words
("check"/"bet", or "fold"/"call"/"raise" when facing a bet, "fold"/"call" after 2 raises)
occurs in it as a whole word, within the first 512 characters.

**Invalid reply.** A reply with no legal word, with two or more (echoing the instruction), or
not a string is a fold (it loses what the seat put in), plus `forfeit_penalty` chips; the hand
ends. Counted in `infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`.

**Infos.** Always `invalid`, `infostate` (own card, then the moves in letters 'c' for check or
call and 'r' for bet or raise, with "/" and the board card between the rounds, e.g. "Krc/Qcr":
OpenSpiel's information state without suits, which never matter) and `legal_moves` (empty when
not to act); at the end also `winner` (None for a split pot), `reason` ("showdown", "fold" or
"forfeit") and `last_action`.

**End.** After a fold, a forfeit or the showdown; all agents terminate together.

**Game theory.** `GAME` (`games.tabular`: 120 deals, 85 public histories, the 288
`INFO_STATES`) gives `expected_value`, `best_response` and `exploitability` (OpenSpiel's:
NashConv / 2; 2.3736 for uniform play) exactly, by backward induction over every deal;
`openspiel_game()` is the same game over OpenSpiel's 936 information states (cards with
suits), for tabular policies that tell suits apart. `equilibrium_policy()` is CFR+'s average
policy (exploitability under 0.01); `decision_dialogues()` gives, per information state, the
seat's conversation leading to it.

**Version history.** v0: initial release.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import gymnasium
import numpy as np
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.evaluation import Decision, Distribution, record_decision
from games.tabular import TabularGame, poker_evaluation
from games.text_env import TextAECEnv, parse_one_word

CARDS = "JQK"
"""Ranks, low to high; card c (0..5) has rank ``CARDS[c // 2]`` and suit ``c % 2``."""
DEALS: tuple[tuple[int, int, int], ...] = tuple(itertools.permutations(range(6), 3))
"""The 120 ordered deals (player_0's card, player_1's card, board card)."""
AGENTS = ("player_0", "player_1")
MAX_TEXT = 512
BETS = (2, 4)
"""The size of a bet or raise in round 1 and round 2."""
MAX_RAISES = 2
HEADER = ("Leduc poker: cards J<Q<K, two of each, ante 1; bets 2 chips, 4 after the board card; "
          "a pair with the board wins, else the higher card.")
_LETTER = {"check": "c", "call": "c", "bet": "r", "raise": "r", "fold": "f"}
_PAST = {"check": "checked", "call": "called", "bet": "bet", "raise": "raised", "fold": "folded"}


# --- Rules on public histories ("rc/cr": letters, "/" closing a round) --------------------


def _round(history: str) -> str:
    return history.rsplit("/", 1)[-1]


def legal_moves(history: str) -> tuple[str, ...]:
    """The legal words at public `history`, passive first; () at a terminal history."""
    if history.endswith("f") or history.count("/") == 2:
        return ()
    moves = _round(history)
    if not moves.endswith("r"):
        return ("check", "bet")
    return ("fold", "call", "raise") if moves.count("r") < MAX_RAISES else ("fold", "call")


def next_history(history: str, move: str) -> str:
    """The public history after `move`: a check after a check, or a call, closes the round."""
    closes = _LETTER[move] == "c" and _round(history) != ""
    return history + _LETTER[move] + "/" * closes


def to_act(history: str) -> int:
    """The seat (0 or 1) to move at non-terminal `history`."""
    return len(_round(history)) % 2


def stakes(history: str) -> tuple[int, int]:
    """The chips each seat has put in the pot, antes included."""
    put = [1, 1]
    for size, moves in zip(BETS, history.split("/")):
        for j, letter in enumerate(moves):
            seat = j % 2
            if letter == "c":
                put[seat] = put[1 - seat]
            elif letter == "r":
                put[seat] = put[1 - seat] + size
    return put[0], put[1]


def _strength(card: int, board: int) -> int:
    return card // 2 + (10 if card // 2 == board // 2 else 0)


def payoff0(deal: tuple[int, int, int], history: str) -> int:
    """player_0's net chips at terminal `history` for `deal`."""
    put = stakes(history)
    if history.endswith("f"):
        folder = (len(_round(history)) - 1) % 2
        return -put[0] if folder == 0 else put[1]
    s0, s1 = _strength(deal[0], deal[2]), _strength(deal[1], deal[2])
    return put[0] if s0 > s1 else -put[0] if s0 < s1 else 0


def infostate(deal: tuple[int, int, int], history: str, suits: bool = False) -> str:
    """The deciding seat's information state at `history` ("Krc/Qcr"; with `suits` each card
    letter is followed by its suit digit, "K1rc/Q0cr", as OpenSpiel's states tell suits apart)."""
    def name(card: int) -> str:
        return CARDS[card // 2] + (str(card % 2) if suits else "")

    return _state(name(deal[to_act(history)]), name(deal[2]), history)


def _state(card: str, board: str, history: str) -> str:
    return card + history.replace("/", "/" + board, 1)


GAME = TabularGame(DEALS, legal_moves, next_history, infostate, payoff0, to_act)
"""Leduc hold'em's tree over rank-level information states (what a seat of the env sees)."""
INFO_STATES: tuple[str, ...] = tuple(GAME.states)
"""The 288 decision information states, in tree order."""


@functools.cache
def openspiel_game() -> TabularGame:
    """The same tree over OpenSpiel's 936 information states (cards with suits)."""
    return TabularGame(DEALS, legal_moves, next_history, functools.partial(infostate, suits=True), payoff0, to_act)


def expected_value(policy0: Distribution, policy1: Distribution) -> float:
    """player_0's expected chips, player_0 playing `policy0` and player_1 `policy1`
    (`{infostate: {move: probability}}`, each read at its own seat's states); exact."""
    return GAME.expected_value(policy0, policy1)


def best_response(policy: Distribution, seat: int) -> tuple[float, dict[str, str]]:
    """`(value, {infostate: move})`: a pure best response of `seat` to the other seat's part
    of `policy` and its expected chips (`TabularGame.best_response`)."""
    return GAME.best_response(policy, seat)


def exploitability(policy: Distribution) -> float:
    """OpenSpiel's exploitability of `policy` (both seats' parts): NashConv / 2, in chips."""
    return GAME.exploitability(policy)


@functools.cache
def _equilibrium() -> dict[str, dict[str, float]]:
    return GAME.cfr(1000)


def equilibrium_policy() -> dict[str, dict[str, float]]:
    """An approximate Nash equilibrium: the average policy of 1000 CFR+ iterations (about a
    second, once per process; exploitability about 0.007, player_0's value about -0.085)."""
    return {s: dict(p) for s, p in _equilibrium().items()}


class LeducEquilibriumPolicy:
    """Scripted seat `leduc_equilibrium`: plays `equilibrium_policy()` at `info["infostate"]`."""

    def __init__(self) -> None:
        self.policy = _equilibrium()

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """A move drawn from the equilibrium's probabilities at this information state."""
        probs = self.policy.get(info.get("infostate"))
        if probs is None or set(probs) != set(info["legal_moves"]):
            raise ValueError(f"not a Leduc poker decision: {info.get('infostate')!r}, {info.get('legal_moves')}")
        moves = list(probs)
        return moves[int(rng.choice(len(moves), p=np.asarray([probs[m] for m in moves]) / sum(probs.values())))]


SCRIPTED_POLICIES = {"leduc_equilibrium": LeducEquilibriumPolicy}


# --- The env ------------------------------------------------------------------------------


def _check_index(name: str, value: object, n: int) -> None:
    if value is not None and (isinstance(value, bool) or value not in range(n)):
        raise ValueError(f"{name} must be None or in 0..{n - 1}, got {value!r}")


class raw_env(TextAECEnv):
    """Leduc hold'em AEC env; see the module docstring for the full card."""

    metadata = {"name": "leduc_poker_v0", "is_parallelizable": False, "render_modes": ["ansi"]}

    def __init__(self, deal: int | None = None, card0: int | None = None, render_mode: str | None = None,
                 forfeit_penalty: int = 0) -> None:
        super().__init__(AGENTS, MAX_TEXT, render_mode)
        _check_index("deal", deal, len(DEALS))
        _check_index("card0", card0, 6)
        if isinstance(forfeit_penalty, bool) or not isinstance(forfeit_penalty, int) or not 0 <= forfeit_penalty <= 10:
            raise ValueError(f"forfeit_penalty must be an integer in [0, 10], got {forfeit_penalty!r}")
        self.deal, self.card0, self.forfeit_penalty = deal, card0, forfeit_penalty
        self._cards: tuple[int, int, int] = DEALS[0]
        self._history = ""

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self._reset_bookkeeping(seed)
        deal = (options or {}).get("deal", self.deal)
        _check_index("deal", deal, len(DEALS))
        if deal is None:
            pool = [i for i, d in enumerate(DEALS) if self.card0 in (None, d[0])]
            deal = pool[int(self.np_random.integers(len(pool)))]
        self._cards = DEALS[deal]
        self._history = ""
        self._update_infos()

    def _play(self, agent: str, action: object) -> bool:
        move = parse_one_word(action, legal_moves(self._history), MAX_TEXT)
        if move is None:
            return False
        self._last_action[agent] = move
        self._history = next_history(self._history, move)
        return True

    def _done(self) -> bool:
        return self._forfeiter is not None or not legal_moves(self._history)

    def _result0(self) -> int:
        """player_0's net chips for the finished hand."""
        if self._forfeiter is not None:
            seat = AGENTS.index(self._forfeiter)
            lost = stakes(self._history)[seat] + self.forfeit_penalty
            return -lost if seat == 0 else lost
        return payoff0(self._cards, self._history)

    def _final_rewards(self) -> dict[str, float]:
        r0 = self._result0()
        return {AGENTS[0]: r0, AGENTS[1]: -r0}

    def _next_agent(self, agent: str) -> str:
        return AGENTS[to_act(self._history)]

    def _reason(self) -> str:
        if self._forfeiter is not None:
            return "forfeit"
        return "fold" if self._history.endswith("f") else "showdown"

    def _update_infos(self) -> None:
        done = self._done()
        for seat, agent in enumerate(AGENTS):
            to_move = not done and agent == self.agent_selection
            info: dict[str, Any] = {
                "invalid": self.invalid_counts[agent],
                "infostate": self._seen(seat),
                "legal_moves": list(legal_moves(self._history)) if to_move else [],
            }
            if done:
                r0 = self._result0()
                info["winner"] = None if r0 == 0 else AGENTS[0] if r0 > 0 else AGENTS[1]
                info["reason"] = self._reason()
                info["last_action"] = self._last_action[agent]
            self.infos[agent] = info

    def _seen(self, seat: int) -> str:
        """`seat`'s information state at the public history (its card, the board once turned)."""
        return _state(CARDS[self._cards[seat] // 2], CARDS[self._cards[2] // 2], self._history)

    def _events(self, seat: int) -> list[str]:
        """What `seat` has not yet been told: the moves and board card since its last reply."""
        out: list[str] = []
        for i, letter in enumerate(self._history):
            before = self._history[:i]
            if letter == "/":
                if before.count("/") == 0:
                    out.append(f"Board card: {CARDS[self._cards[2] // 2]}.")
            elif to_act(before) == seat:
                out = []
            else:
                move = next(m for m in legal_moves(before) if _LETTER[m] == letter)
                out.append(f"Opponent {_PAST[move]}.")
        return out

    def _text(self, agent: str) -> str:
        seat = AGENTS.index(agent)
        mine = CARDS[self._cards[seat] // 2]
        intro = f"{HEADER} You have a {mine}."
        if self._done():
            return self._outcome(seat)
        if agent != self.agent_selection:
            return f"{intro} Waiting for the opponent."
        moves = legal_moves(self._history)
        ask = "Reply with one word: " + (", ".join(moves[:-1]) + " or " + moves[-1]) + "."
        has_replied = self._last_action[agent] is not None
        return " ".join([*([] if has_replied else [intro]), *self._events(seat), ask])

    def _outcome(self, seat: int) -> str:
        won = self._result0() * (1 if seat == 0 else -1)
        chips = f"{abs(won)} chip{'s' * (abs(won) != 1)}"
        outcome = f"You win {chips}." if won > 0 else f"You lose {chips}." if won < 0 else "Split pot."
        reason = self._reason()
        if reason == "forfeit":
            who = "Your" if self._forfeiter == AGENTS[seat] else "Opponent's"
            return f"{who} reply was invalid, a forfeit. {outcome}"
        if reason == "fold":
            folder = (len(_round(self._history)) - 1) % 2
            return f"{'You' if folder == seat else 'Opponent'} folded. {outcome}"
        mine, theirs, board = (CARDS[c // 2] for c in (self._cards[seat], self._cards[1 - seat], self._cards[2]))
        return f"Showdown: you had {mine}, opponent had {theirs}, board {board}. {outcome}"

    def render(self) -> str | None:
        if self.render_mode is None:
            gymnasium.logger.warn("render() called without a render_mode; use render_mode='ansi'.")
            return None
        cards = "/".join(CARDS[c // 2] + str(c % 2) for c in self._cards)
        end = f" forfeit by {self._forfeiter}" if self._forfeiter else ""
        return f"leduc_poker_v0 cards={cards} history={self._history or '-'}{end}"


def env(**kwargs: Any) -> AECEnv[str, dict[str, str], str]:
    """Make the order-enforced Leduc hold'em env (`raw_env(**kwargs)`)."""
    return wrappers.OrderEnforcingWrapper(raw_env(**kwargs))


# --- The evaluation hook ------------------------------------------------------------------


def _public(state: str) -> tuple[str, str | None]:
    """`(public history, board rank letter or None)` of an information state."""
    rest = state[1:]
    if "/" not in rest:
        return rest, None
    first, second = rest.split("/")
    return first + "/" + second[1:], second[0]


def decision_dialogues() -> list[Decision]:
    """For each of `INFO_STATES` in order, drive the env with canonical one-word replies to the
    decision and record the deciding seat's conversation, for teacher-forced scoring."""
    out: list[Decision] = []
    for state in INFO_STATES:
        history, board = _public(state)
        seat = to_act(history)
        deal = next(i for i, d in enumerate(DEALS)
                    if CARDS[d[seat] // 2] == state[0] and board in (None, CARDS[d[2] // 2]))
        replies, h = [], ""
        for letter in history:
            if letter != "/":
                move = next(m for m in legal_moves(h) if _LETTER[m] == letter)
                replies.append(move)
                h = next_history(h, move)
        game = env(deal=deal)
        game.reset()
        out.append(record_decision(game, state, AGENTS[seat], deal, replies, legal_moves(history)))
    return out


EVALUATION = poker_evaluation(GAME, decision_dialogues, tuple({"card0": c} for c in range(6)), ("leduc_equilibrium",))
"""The evaluation hook: chips per hand, stratified by player_0's card, exact exploitability."""
