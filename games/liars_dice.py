"""Liar's dice for 2 to 6 seats: hidden dice, rising bids, one challenge ends the hand.

| Creation     | `games.make("liars_dice_v0", num_players=3)` or `liars_dice.env()`         |
|--------------|------------------------------------------------------------------------------|
| API          | PettingZoo AEC, turn-based, not parallelizable                               |
| Agents       | `["player_0", ..., "player_{n-1}"]`, n = `num_players` (2..6, default 3)     |
| Observation  | `Dict({"text": Text(2048, charset=string.printable)})`                       |
| Action       | `Text(2048, charset=string.printable)`: the seat's free-text reply           |
| Rewards      | at the end: the loser -1, every other seat +1/(n-1); zero-sum                |

**Game.** One hand of liar's dice (the single-hand variant, as in OpenSpiel's `liars_dice`).
Each seat rolls `dice_per_player` six-sided dice (default 3) and sees only its own. Seats bid
in turn, player_0 first, then player_1, ... and round again: a bid "Q Fs" claims that at least
Q of all the dice on the table show face F (no wild faces). Each bid must be higher than the
last: more dice, or as many dice of a higher face (3 fives < 3 sixes < 4 ones). Instead of
bidding, a seat may call "liar" on the last bid: all dice are shown; if fewer than Q show F the
bidder loses, otherwise the challenger loses. After `max_bids` bids (default 20) the next seat
must call liar, so a hand has at most `max_bids` + 1 decisions.

**Arguments.** `num_players` 2..6, `dice_per_player` 1..5, `max_bids` 1..60; anything else is
a ValueError naming the argument. The dice are drawn from the env's seeded `np_random` at each
reset; `reset(options={"dice": [[2, 5, 5], [1, 3, 5], [4, 4, 6]]})` fixes them for one hand.

**What each seat sees.** One message per decision that carries the whole public state, so
every message stands alone: the table ("Liar's dice, 3 players, 3 dice each (9 in all).
You are player_1; your dice: 2 5 5."), the bids so far ("Bids so far: player_0 2 fives."),
and for the seat to act the instruction ('Reply with a higher bid (more dice, or as many of a
higher face), such as "bid 2 sixes", or with "liar" to challenge player_0's bid of 2 fives.');
a seat not to act reads "Waiting for player_2." At the end every seat sees all the dice, the
count, who lost and its own result ("You win 1/2 point." / "You lose 1 point.").

**Legal replies.** Case-insensitive, within the first 2048 characters. A bid is a quantity
(digits, or a word one..twelve) then a face: "bid 3 fives", "three 5s", "3 dice showing 5s",
"2 sixes", or "3x5" / "3 x 5". A challenge is the whole word "liar" or "challenge". The reply
is a move when it names exactly one distinct move (a bid repeated, "3x5, three fives", is one
move), and that move is legal: a bid higher than the last with Q at most the number of dice
on the table while fewer than `max_bids` bids were made; "liar" once a bid exists.

**Invalid reply.** Nothing recognised (empty, garbage, unicode, a non-string), two moves
("liar, or 3 fives": echoing the instruction is no decision), a bid that does not raise, a bid
of more dice than the table holds, a bid after `max_bids`, or "liar" before any bid: the
replying seat forfeits and loses the hand (-1 to it, +1/(n-1) to each other seat). Counted in
`infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`.

**Infos.** Always `invalid`, `infostate` ("own dice sorted|dice on the table|bids", e.g.
"255|9|2x5,3x2") and `legal_moves` (example legal replies of the seat to act: "liar" once a
bid exists, then for each face the lowest bid of that face that raises, e.g. "bid 3 fives";
only "liar" after `max_bids` bids; empty when not to act); at the end also `loser`, `reason`
("challenge" or "forfeit") and `last_action` (the seat's last parsed move as "3x5" or "liar",
"invalid", or None if it never acted).

**End.** After a challenge or a forfeit; all agents terminate together.

**Probability.** `bid_probability(bid, own_dice, total_dice)` is the exact probability
(a Fraction) that a bid holds given one's own dice, the other dice being uniform:
P(Binomial(total - own, 1/6) >= Q - own count of F). `liars_dice_cautious` plays from it.

**Version history.** v0: initial release.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from fractions import Fraction
from typing import Any, ClassVar

import gymnasium
import numpy as np
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.text_env import TextAECEnv
from games.evaluation import GameEval

MAX_TEXT = 2048
FACES = 6
LIAR = "liar"
Bid = tuple[int, int]
"""(quantity Q, face F): at least Q of all the dice show F. Bids compare as tuples."""
Move = Bid | str
"""A bid, or `LIAR`."""

_FACE_NAMES = ("one", "two", "three", "four", "five", "six")
_PLURALS = ("ones", "twos", "threes", "fours", "fives", "sixes")
_NUMBER_WORDS = (*_FACE_NAMES, "seven", "eight", "nine", "ten", "eleven", "twelve")
_QTY = r"(\d{1,3}|" + "|".join(_NUMBER_WORDS) + r")"
_FACE = r"(ones?|twos?|threes?|fours?|fives?|six(?:es)?|[1-6]'?s)"
_BID_WORDS = re.compile(
    rf"(?<!\w){_QTY}\s+(?:dice\s+(?:showing\s+|of\s+)?)?{_FACE}(?!\w)", re.IGNORECASE
)
_BID_X = re.compile(r"(?<!\w)(\d{1,3})\s*[x×*]\s*([1-6])(?!\w)", re.IGNORECASE)
_LIAR = re.compile(r"\b(liar|challenge)\b(?!['\u2019]s\b)", re.IGNORECASE)
"""A call of liar; the possessive ("Liar's dice", the game's name, which an untrained policy echoes
from its prompt) is no call."""


def bid_text(bid: Bid) -> str:
    """ "1 five", "3 fives", "2 sixes": how the game writes a bid."""
    quantity, face = bid
    return f"{quantity} {_FACE_NAMES[face - 1] if quantity == 1 else _PLURALS[face - 1]}"


def _quantity(word: str) -> int:
    return int(word) if word.isdigit() else _NUMBER_WORDS.index(word.lower()) + 1


def _face(word: str) -> int:
    word = word.lower().rstrip("s").rstrip("'")
    if word.isdigit():
        return int(word)
    return _FACE_NAMES.index("six" if word == "sixe" else word) + 1


def parse_reply(reply: object) -> Move | None:
    """The one move named in `reply`: a bid (Q, F) or `LIAR`; None when the reply names no move
    or more than one distinct move, or is not a string. Only the first `MAX_TEXT` characters
    are read; legality (does it raise?) is not checked here."""
    if not isinstance(reply, str):
        return None
    text = reply[:MAX_TEXT]
    moves: set[Move] = {(_quantity(m[1]), _face(m[2])) for m in _BID_WORDS.finditer(text)}
    moves |= {(int(m[1]), int(m[2])) for m in _BID_X.finditer(text)}
    if _LIAR.search(text):
        moves.add(LIAR)
    return moves.pop() if len(moves) == 1 else None


def lowest_raises(last: Bid | None, total_dice: int) -> list[Bid]:
    """For each face 1..6, the lowest bid of that face above `last` (any bid when None) with a
    quantity of at most `total_dice`; faces with none are left out."""
    out = []
    for face in range(1, FACES + 1):
        quantity = 1 if last is None else last[0] + (face <= last[1])
        if quantity <= total_dice:
            out.append((quantity, face))
    return out


def bid_probability(bid: Bid, own_dice: Sequence[int], total_dice: int) -> Fraction:
    """Exact P(at least Q of all `total_dice` dice show F | one's own dice `own_dice`).

    The other `total_dice - len(own_dice)` dice are independent and uniform on 1..6, so with
    k own dice showing F: P(Binomial(m, 1/6) >= Q - k), summed term by term in fractions.
    """
    quantity, face = bid
    if not 1 <= face <= FACES:
        raise ValueError(f"face must be in 1..6, got {face!r}")
    if not 0 <= len(own_dice) <= total_dice:
        raise ValueError(f"{len(own_dice)} own dice cannot lie among {total_dice} dice")
    need = quantity - sum(1 for d in own_dice if d == face)
    unseen = total_dice - len(own_dice)
    if need <= 0:
        return Fraction(1)
    p = Fraction(1, FACES)
    return sum(
        (math.comb(unseen, j) * p**j * (1 - p) ** (unseen - j) for j in range(need, unseen + 1)),
        Fraction(0),
    )


def parse_infostate(infostate: str) -> tuple[list[int], int, list[Bid]]:
    """(own dice, dice on the table, bids so far) from an `infostate` such as "255|9|2x5,3x2"."""
    own, total, bids = infostate.split("|")
    history = [(int(q), int(f)) for q, f in (b.split("x") for b in bids.split(",") if b)]
    return [int(d) for d in own], int(total), history


def _check_int(name: str, value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int | np.integer) or not low <= value <= high:
        raise ValueError(f"{name} must be an integer in {low}..{high}, got {value!r}")
    return int(value)


class raw_env(TextAECEnv):
    """Liar's dice AEC env; see the module docstring for the full card."""

    metadata: ClassVar[dict[str, Any]] = {"name": "liars_dice_v0", "is_parallelizable": False, "render_modes": ["ansi"]}

    def __init__(
        self,
        num_players: int = 3,
        dice_per_player: int = 3,
        max_bids: int = 20,
        render_mode: str | None = None,
    ) -> None:
        self.num_players = _check_int("num_players", num_players, 2, 6)
        self.dice_per_player = _check_int("dice_per_player", dice_per_player, 1, 5)
        self.max_bids = _check_int("max_bids", max_bids, 1, 60)
        super().__init__([f"player_{i}" for i in range(self.num_players)], MAX_TEXT, render_mode)
        self.total_dice = self.num_players * self.dice_per_player
        self._dice: list[list[int]] = [[1] * self.dice_per_player] * self.num_players
        self._bids: list[tuple[str, Bid]] = []
        """(bidder, bid) in order."""
        self._challenger: str | None = None

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self._reset_bookkeeping(seed)
        dice = (options or {}).get("dice")
        if dice is None:
            shape = (self.num_players, self.dice_per_player)
            dice = self.np_random.integers(1, FACES + 1, size=shape).tolist()
        self._dice = self._checked_dice(dice)
        self._bids = []
        self._challenger = None
        self._update_infos()

    def _checked_dice(self, dice: object) -> list[list[int]]:
        shape = (self.num_players, self.dice_per_player)
        try:
            array = np.asarray(dice)
        except ValueError as e:
            raise ValueError(f"options['dice'] must be {shape[0]} lists of {shape[1]} faces") from e
        if array.shape != shape or not np.issubdtype(array.dtype, np.integer):
            raise ValueError(f"options['dice'] must be {shape[0]} lists of {shape[1]} faces, got {dice!r}")
        if array.min() < 1 or array.max() > FACES:
            raise ValueError(f"options['dice'] faces must lie in 1..6, got {dice!r}")
        return array.tolist()

    # --- rules ---------------------------------------------------------------------------

    def _last_bid(self) -> Bid | None:
        return self._bids[-1][1] if self._bids else None

    def _legal(self, move: Move) -> bool:
        if move == LIAR:
            return bool(self._bids)
        assert isinstance(move, tuple)
        last = self._last_bid()
        quantity, _ = move
        return (
            len(self._bids) < self.max_bids
            and 1 <= quantity <= self.total_dice
            and (last is None or move > last)
        )

    def _play(self, agent: str, action: object) -> bool:
        move = parse_reply(action)
        if move is None or not self._legal(move):
            return False
        if move == LIAR:
            self._challenger = agent
            self._last_action[agent] = LIAR
        else:
            assert isinstance(move, tuple)
            self._bids.append((agent, move))
            self._last_action[agent] = f"{move[0]}x{move[1]}"
        return True

    def _done(self) -> bool:
        return self._forfeiter is not None or self._challenger is not None

    def count(self, face: int) -> int:
        """How many dice on the table show `face`."""
        return sum(row.count(face) for row in self._dice)

    def _bid_holds(self) -> bool:
        quantity, face = self._bids[-1][1]
        return self.count(face) >= quantity

    def _loser(self) -> str:
        if self._forfeiter is not None:
            return self._forfeiter
        assert self._challenger is not None
        return self._challenger if self._bid_holds() else self._bids[-1][0]

    def _final_rewards(self) -> dict[str, float]:
        loser = self._loser()
        share = 1.0 / (self.num_players - 1)
        return {a: -1.0 if a == loser else share for a in self.possible_agents}

    def _next_agent(self, agent: str) -> str:
        return self.possible_agents[(self.possible_agents.index(agent) + 1) % self.num_players]

    def legal_moves(self) -> list[str]:
        """Example legal replies of the seat to act: "liar" once a bid exists, then the lowest
        raise of each face ("bid 3 fives"), none once `max_bids` bids were made."""
        moves = [LIAR] if self._bids else []
        if len(self._bids) < self.max_bids:
            raises = lowest_raises(self._last_bid(), self.total_dice)
            moves += [f"bid {bid_text(b)}" for b in raises]
        return moves

    def _update_infos(self) -> None:
        done = self._done()
        bids = ",".join(f"{q}x{f}" for _, (q, f) in self._bids)
        legal = [] if done else self.legal_moves()
        for i, agent in enumerate(self.agents):
            own = "".join(str(d) for d in sorted(self._dice[i]))
            info: dict[str, Any] = {
                "invalid": self.invalid_counts[agent],
                "infostate": f"{own}|{self.total_dice}|{bids}",
                "legal_moves": list(legal) if agent == self.agent_selection else [],
            }
            if done:
                info["loser"] = self._loser()
                info["reason"] = "forfeit" if self._forfeiter is not None else "challenge"
                info["last_action"] = self._last_action[agent]
            self.infos[agent] = info

    # --- text ----------------------------------------------------------------------------

    def _dice_text(self, seat: int) -> str:
        return " ".join(str(d) for d in sorted(self._dice[seat]))

    def _text(self, agent: str) -> str:
        seat = self.possible_agents.index(agent)
        n, d = self.num_players, self.dice_per_player
        intro = (
            f"Liar's dice, {n} players, {d} dice each ({self.total_dice} in all). "
            f"You are {agent}; your dice: {self._dice_text(seat)}."
        )
        history = "; ".join(f"{who} {bid_text(bid)}" for who, bid in self._bids)
        bids = f"Bids so far: {history}." if self._bids else "No bids yet."
        if self._done():
            return f"{intro}\n{bids}\n{self._result_text(agent)}"
        if agent != self.agent_selection:
            return f"{intro}\n{bids}\nWaiting for {self.agent_selection}."
        return f"{intro}\n{bids}\n{self._instruction()}"

    def _instruction(self) -> str:
        example = self.legal_moves()[-1]
        if not self._bids:
            quantity, face = lowest_raises(None, self.total_dice)[-1]
            return (
                f'Open with a bid such as "{example}": at least {quantity} of all '
                f"{self.total_dice} dice show a {_FACE_NAMES[face - 1]}."
            )
        bidder, last = self._bids[-1]
        challenge = f"\"liar\" to challenge {bidder}'s bid of {bid_text(last)}"
        if len(self._bids) >= self.max_bids:
            return f"No more bids are allowed: reply {challenge}."
        if self.legal_moves() == [LIAR]:  # the top bid (every die, the highest face) stands
            return f"No higher bid is possible: reply {challenge}."
        return (
            "Reply with a higher bid (more dice, or as many of a higher face), such as "
            f'"{example}", or with {challenge}.'
        )

    def _result_text(self, agent: str) -> str:
        loser = self._loser()
        share = Fraction(1, self.num_players - 1)
        mine = "You lose 1 point." if agent == loser else f"You win {share} point."
        table = "Dice: " + ", ".join(
            f"{a} {self._dice_text(i)}" for i, a in enumerate(self.possible_agents)
        )
        if self._forfeiter is not None:
            who = "Your" if self._forfeiter == agent else f"{self._forfeiter}'s"
            return f"{who} reply was invalid, a forfeit: {loser} loses.\n{table}.\n{mine}"
        bidder, (quantity, face) = self._bids[-1]
        counted = self.count(face)
        verdict = "the bid holds" if counted >= quantity else "the bid was false"
        return (
            f"{self._challenger} called liar on {bidder}'s bid of {bid_text((quantity, face))}.\n"
            f"{table}.\n{counted} of the dice show a {_FACE_NAMES[face - 1]}: {verdict}, "
            f"{loser} loses. {mine}"
        )

    def render(self) -> str | None:
        if self.render_mode is None:
            gymnasium.logger.warn("render() called without a render_mode; use render_mode='ansi'.")
            return None
        dice = " / ".join(self._dice_text(i) for i in range(self.num_players))
        bids = ", ".join(f"{who}:{q}x{f}" for who, (q, f) in self._bids) or "-"
        end = ""
        if self._done():
            end = f" loser={self._loser()}"
        return f"liars_dice_v0 dice={dice} bids={bids}{end}"


def env(**kwargs: Any) -> AECEnv[str, dict[str, str], str]:
    """Make the order-enforced liar's dice env (`raw_env(**kwargs)`); Text spaces rule out the
    AssertOutOfBounds wrapper."""
    return wrappers.OrderEnforcingWrapper(raw_env(**kwargs))


# --- Scripted policy ----------------------------------------------------------------------


class CautiousPolicy:
    """A probabilistic bidder and challenger that reads only its own dice and the bids
    (`info["infostate"]`) and picks among `info["legal_moves"]`.

    It challenges when the last bid is more likely false than its best raise is true
    (P(last false) > max P(raise true), by `bid_probability`), else makes the raise most likely
    to hold, the lowest such bid on a tie. Deterministic: `rng` is not used.
    """

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Return "liar" or one of the legal bids, as text."""
        legal = list(info["legal_moves"])
        if not legal:
            raise ValueError("CautiousPolicy.act called with no legal moves (not this seat's turn)")
        own, total, bids = parse_infostate(info["infostate"])
        ranked = []
        for reply in legal:
            move = parse_reply(reply)
            if move == LIAR:
                ranked.append((1 - bid_probability(bids[-1], own, total), (0, 0, 0), reply))
            elif isinstance(move, tuple):
                # On a tie a raise beats the challenge, and a lower bid a higher one.
                ranked.append((bid_probability(move, own, total), (1, -move[0], -move[1]), reply))
            else:
                raise ValueError(f"not a liar's dice move: {reply!r}")
        return max(ranked)[2]


SCRIPTED_POLICIES: dict[str, type] = {"liars_dice_cautious": CautiousPolicy}
"""Scripted policies of this game by name, for `games.scripted.SCRIPTED`."""

EVALUATION = GameEval(unit="points", per="game", scripted=tuple(SCRIPTED_POLICIES),
                      system_prompt="You are playing liar's dice. Reply with a bid such as \"3 5s\", or with \"liar\".")
"""The evaluation hook: points per game (zero-sum; the loser -1)."""
