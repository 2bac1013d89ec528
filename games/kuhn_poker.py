"""Kuhn poker as a two-seat dialogue game, with its exact game theory.

| Creation           | `games.make("kuhn_poker_v0", deal=None)` or `kuhn_poker.env()`  |
|--------------------|-----------------------------------------------------------------|
| API                | PettingZoo AEC, turn-based, not parallelizable                  |
| Agents             | `["player_0", "player_1"]`; player_0 acts first                 |
| Observation        | `Dict({"text": Text(512, charset=string.printable)})`           |
| Action             | `Text(512, charset=string.printable)`: the seat's free-text reply |
| Rewards            | net chips at the end: +1/-1 or +2/-2, zero-sum                  |

**Game.** Cards J<Q<K; each player is dealt one and antes 1 chip. player_0 checks or bets 1;
after a check player_1 checks (showdown for 1) or bets 1; facing a bet a player calls
(showdown for 2) or folds (loses the ante). Showdown: the higher card wins the pot.

**Arguments.** `deal`: None draws the deal from the env's seeded `np_random` at each reset;
0..5 fixes it as an index into `DEALS` = (J,Q) (J,K) (Q,J) (Q,K) (K,J) (K,Q), read as
(player_0's card, player_1's card). `reset(options={"deal": k})` overrides it for one hand.

**What each seat sees.** One short user message per decision, because a small model replies
legally far more often to a short message ending in the allowed words than to a rules preamble:
* player_0 first: "Kuhn poker, cards J<Q<K. You have the K. Reply with one word: check or bet."
* player_1 after a check / a bet: "Kuhn poker, cards J<Q<K. You have the Q. Opponent checked.
  Reply with one word: check or bet." / "... Opponent bet. Reply with one word: call or fold."
* player_0 after check, bet (a follow-up in the same conversation, so no card):
  "Opponent bet. Reply with one word: call or fold."
* a seat not to act: "Kuhn poker, cards J<Q<K. You have the Q. Waiting for the opponent."
* at the end, the result, e.g. "Showdown: you had K, opponent had Q. You win 1 chip."

**Legal replies.** Case-insensitive; a reply is a move when exactly one of the legal words
("check"/"bet", or "call"/"fold" when facing a bet) occurs in it as a whole word, within the
first 512 characters: "I'll BET!" is a bet, "Bet. I bet!" too.

**Invalid reply.** A reply with no legal word (empty, garbage, "call" with no bet pending, a
non-string) or with both ("check or bet": echoing the instruction is no decision) forfeits: the replying seat folds, losing its 1-chip stake (a seat that has bet
never acts again), the opponent gets +1, and the hand ends. Counted in
`infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`. `forfeit_chips` (default 1)
makes a forfeit cost more: with 2 or more an invalid reply is never as good as folding (at 1
it pays what a fold facing a bet pays, so junk and "fold" are the same to a learner).

**Infos.** Always `invalid`, `infostate` (own card + history in OpenSpiel letters, 'p' for
check/fold, 'b' for bet/call, e.g. "Jpb") and `legal_moves` (empty when not to act); at the end
also `winner`, `reason` ("showdown", "fold" or "forfeit") and `last_action` (the seat's last
parsed reply, "invalid", or None if it never acted).

**End.** After a fold, a forfeit or a showdown; all agents terminate together.

**Game theory.** `INFO_STATES`, `expected_value`, `best_response_value`, `exploitability`
(OpenSpiel's: NashConv / 2) and `equilibrium_policy(alpha)` (Kuhn 1950; game value -1/18 for
player_0) are exact, computed by enumeration over the 6 deals. `decision_dialogues()` gives,
per information state, the seat's conversation leading to that decision.

**Version history.** v0: initial release.
"""

from __future__ import annotations

from typing import Any

import gymnasium
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.evaluation import Decision, record_decision
from games.tabular import TabularGame, poker_evaluation
from games.text_env import TextAECEnv, parse_one_word

CARDS = "JQK"
DEALS: tuple[tuple[int, int], ...] = ((0, 1), (0, 2), (1, 0), (1, 2), (2, 0), (2, 1))
"""The 6 ordered deals as (player_0 card, player_1 card) indices into `CARDS`."""
AGENTS = ("player_0", "player_1")
MAX_TEXT = 512
HEADER = "Kuhn poker, cards J<Q<K."

# Decision histories and their legal words as (passive 'p', aggressive 'b').
_MOVES: dict[str, tuple[str, str]] = {
    "": ("check", "bet"),
    "p": ("check", "bet"),
    "b": ("fold", "call"),
    "pb": ("fold", "call"),
}
_TERMINALS = frozenset({"pp", "bp", "bb", "pbp", "pbb"})

INFO_STATES: tuple[str, ...] = (
    "J", "Q", "K",
    "Jp", "Jb", "Qp", "Qb", "Kp", "Kb",
    "Jpb", "Qpb", "Kpb",
)  # fmt: skip
"""The 12 decision information states: own card + public history, player_0's first."""
_P0_STATES = tuple(s for s in INFO_STATES if len(s) % 2 == 1)
_P1_STATES = tuple(s for s in INFO_STATES if len(s) % 2 == 0)

Policy = dict[str, float]
"""Behaviour policy: info state -> probability of the aggressive action (bet or call)."""


def parse_reply(reply: object, legal: tuple[str, ...]) -> str | None:
    """Return the one legal word named in `reply` (whole word, any case), or None if invalid
    (`games.text_env.parse_one_word` over the first `MAX_TEXT` characters)."""
    return parse_one_word(reply, legal, MAX_TEXT)


def payoff0(deal: tuple[int, int], history: str) -> int:
    """Player_0's net chips at terminal `history` (OpenSpiel letters) for `deal`."""
    if history == "bp":
        return 1
    if history == "pbp":
        return -1
    stake = 2 if "b" in history else 1
    return stake if deal[0] > deal[1] else -stake


def _check_deal(deal: object) -> None:
    if deal is not None and deal not in range(len(DEALS)):
        raise ValueError(f"deal must be None or in 0..{len(DEALS) - 1}, got {deal!r}")


class raw_env(TextAECEnv):
    """Kuhn poker AEC env; see the module docstring for the full card."""

    metadata = {"name": "kuhn_poker_v0", "is_parallelizable": False, "render_modes": ["ansi"]}

    def __init__(self, deal: int | None = None, render_mode: str | None = None, forfeit_chips: int = 1) -> None:
        super().__init__(AGENTS, MAX_TEXT, render_mode)
        _check_deal(deal)
        if isinstance(forfeit_chips, bool) or not isinstance(forfeit_chips, int) or not 1 <= forfeit_chips <= 10:
            raise ValueError(f"forfeit_chips must be an integer in [1, 10], got {forfeit_chips!r}")
        self.deal = deal
        self.forfeit_chips = forfeit_chips
        self._cards: tuple[int, int] = DEALS[0]
        self._history = ""

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self._reset_bookkeeping(seed)
        deal = (options or {}).get("deal", self.deal)
        _check_deal(deal)
        if deal is None:
            deal = int(self.np_random.integers(len(DEALS)))
        self._cards = DEALS[deal]
        self._history = ""
        self._update_infos()

    def _play(self, agent: str, action: object) -> bool:
        moves = _MOVES[self._history]
        move = parse_reply(action, moves)
        if move is None:
            return False
        self._last_action[agent] = move
        self._history += "pb"[moves.index(move)]
        return True

    def _final_rewards(self) -> dict[str, float]:
        r0 = self._result0()
        return {AGENTS[0]: r0, AGENTS[1]: -r0}

    def _next_agent(self, agent: str) -> str:
        return AGENTS[len(self._history) % 2]

    def render(self) -> str | None:
        if self.render_mode is None:
            gymnasium.logger.warn("render() called without a render_mode; use render_mode='ansi'.")
            return None
        cards = "/".join(CARDS[c] for c in self._cards)
        end = f" forfeit by {self._forfeiter}" if self._forfeiter else ""
        return f"kuhn_poker_v0 cards={cards} history={self._history or '-'}{end}"

    def _done(self) -> bool:
        return self._forfeiter is not None or self._history in _TERMINALS

    def _result0(self) -> int:
        """Player_0's net chips for the finished hand."""
        if self._forfeiter is not None:
            return -self.forfeit_chips if self._forfeiter == AGENTS[0] else self.forfeit_chips
        return payoff0(self._cards, self._history)

    def _seat(self, agent: str) -> int:
        return AGENTS.index(agent)

    def _update_infos(self) -> None:
        done = self._done()
        for agent in self.agents:
            seat = self._seat(agent)
            to_act = not done and agent == self.agent_selection
            info: dict[str, Any] = {
                "invalid": self.invalid_counts[agent],
                "infostate": CARDS[self._cards[seat]] + self._history,
                "legal_moves": list(_MOVES[self._history]) if to_act else [],
            }
            if to_act and info["legal_moves"][0] == "fold":
                info["legal_moves"].reverse()  # documented order: ["call", "fold"]
            if done:
                info["winner"] = AGENTS[0] if self._result0() > 0 else AGENTS[1]
                info["reason"] = self._reason()
                info["last_action"] = self._last_action[agent]
            self.infos[agent] = info

    def _reason(self) -> str:
        if self._forfeiter is not None:
            return "forfeit"
        return "fold" if self._history.endswith("bp") else "showdown"

    def _text(self, agent: str) -> str:
        seat = self._seat(agent)
        mine, theirs = CARDS[self._cards[seat]], CARDS[self._cards[1 - seat]]
        intro = f"{HEADER} You have the {mine}."
        if self._done():
            won = self._result0() * (1 if seat == 0 else -1)
            outcome = f"You {'win' if won > 0 else 'lose'} {abs(won)} chip{'s' * (abs(won) > 1)}."
            reason = self._reason()
            if reason == "forfeit":
                who = "Your" if self._forfeiter == agent else "Opponent's"
                return f"{who} reply was invalid, a forfeit. {outcome}"
            if reason == "fold":
                folder = AGENTS[(len(self._history) - 1) % 2]  # who replied last
                return f"{'You' if folder == agent else 'Opponent'} folded. {outcome}"
            return f"Showdown: you had {mine}, opponent had {theirs}. {outcome}"
        if agent != self.agent_selection:
            return f"{intro} Waiting for the opponent."
        h = self._history
        if h == "":
            return f"{intro} Reply with one word: check or bet."
        if h == "p":
            return f"{intro} Opponent checked. Reply with one word: check or bet."
        if h == "b":
            return f"{intro} Opponent bet. Reply with one word: call or fold."
        return "Opponent bet. Reply with one word: call or fold."


def env(**kwargs: Any) -> AECEnv[str, dict[str, str], str]:
    """Make the order-enforced Kuhn poker env (`raw_env(**kwargs)`); Text spaces rule out the
    AssertOutOfBounds wrapper."""
    return wrappers.OrderEnforcingWrapper(raw_env(**kwargs))


# --- Exact game theory -------------------------------------------------------------------


def _check(policy: Policy, states: tuple[str, ...]) -> None:
    missing = [s for s in states if s not in policy]
    if missing:
        raise ValueError(f"policy lacks info states {missing}")
    bad = {s: policy[s] for s in states if not 0.0 <= policy[s] <= 1.0}
    if bad:
        raise ValueError(f"policy probabilities outside [0, 1]: {bad}")


def _letters(history: str, move: str) -> str:
    """The history after `move` (a word legal at `history`)."""
    return history + "pb"[_MOVES[history].index(move)]


GAME = TabularGame(DEALS, lambda h: _MOVES.get(h, ()), _letters, lambda d, h: CARDS[d[len(h) % 2]] + h, payoff0)
"""Kuhn poker's tree (`games.tabular`): 6 deals, 9 public histories, the 12 `INFO_STATES`."""


def _moves_of(policy: Policy, states: tuple[str, ...]) -> dict[str, dict[str, float]]:
    """`policy` at `states` as move probabilities (checked: every state, probabilities in [0, 1])."""
    _check(policy, states)
    return {s: dict(zip(_MOVES[s[1:]], (1.0 - policy[s], policy[s]), strict=True)) for s in states}


def expected_value(policy0: Policy, policy1: Policy) -> float:
    """Player_0's expected net chips when player_0 plays `policy0` and player_1 `policy1`.

    Each policy maps an info state to P(bet or call); only the seat's own 6 states are read.
    Exact: sums over the 6 deals with chance probability 1/6.
    """
    return GAME.expected_value(_moves_of(policy0, _P0_STATES), _moves_of(policy1, _P1_STATES))


def _response(policy: Policy, br_player: int) -> tuple[float, Policy]:
    """The value and the P(bet or call) table of `GAME.best_response` for seat `br_player`."""
    if br_player not in (0, 1):
        raise ValueError(f"br_player must be 0 or 1, got {br_player!r}")
    value, table = GAME.best_response(_moves_of(policy, _P1_STATES if br_player == 0 else _P0_STATES), br_player)
    return value, {s: float(move == _MOVES[s[1:]][1]) for s, move in table.items()}


def best_response(policy: Policy, br_player: int) -> Policy:
    """A pure best response of seat `br_player` (0 or 1) to the other seat's part of `policy`:
    P(bet or call) of 0 or 1 at each of its own 6 info states, the move of larger
    counterfactual value (ties to the passive one), also at states its own moves avoid."""
    return _response(policy, br_player)[1]


def best_response_value(policy: Policy, br_player: int) -> float:
    """Expected net chips of seat `br_player` (0 or 1) best-responding to the other seat's part
    of `policy`; exact (backward induction over its info states, `games.tabular`)."""
    return _response(policy, br_player)[0]


def exploitability(policy: Policy) -> float:
    """OpenSpiel's exploitability of `policy` (both seats' parts): NashConv / 2, in chips.

    NashConv = BR value of player_0 + BR value of player_1 (the game is zero-sum, so the policy's
    own values cancel). 11/24 for the uniform policy, 0 exactly at a Nash equilibrium.
    """
    return (best_response_value(policy, 0) + best_response_value(policy, 1)) / 2.0


def equilibrium_policy(alpha: float = 0.0) -> Policy:
    """Kuhn's (1950) equilibrium family, alpha in [0, 1/3]; player_0's value is -1/18 for all.

    player_0 bets J w.p. alpha, never Q, K w.p. 3 alpha; after check-bet calls J never, Q w.p.
    alpha + 1/3, K always. player_1 after a check bets J w.p. 1/3, Q never, K always; facing a
    bet calls J never, Q w.p. 1/3, K always.
    """
    if not 0.0 <= alpha <= 1.0 / 3.0 + 1e-12:
        raise ValueError(f"alpha must lie in [0, 1/3], got {alpha!r}")
    third = 1.0 / 3.0
    return {
        "J": alpha, "Q": 0.0, "K": min(3.0 * alpha, 1.0),
        "Jp": third, "Jb": 0.0, "Qp": 0.0, "Qb": third, "Kp": 1.0, "Kb": 1.0,
        "Jpb": 0.0, "Qpb": min(alpha + third, 1.0), "Kpb": 1.0,
    }  # fmt: skip


def decision_dialogues() -> list[Decision]:
    """For each of `INFO_STATES` in order, drive the env with canonical one-word replies to the
    decision and record the deciding seat's conversation, for teacher-forced scoring."""
    out: list[Decision] = []
    for state in INFO_STATES:
        history = state[1:]
        seat = len(history) % 2
        deal = next(i for i, d in enumerate(DEALS) if CARDS[d[seat]] == state[0])
        game = env(deal=deal)
        game.reset()
        replies = [_MOVES[history[:i]]["pb".index(letter)] for i, letter in enumerate(history)]
        out.append(record_decision(game, state, AGENTS[seat], deal, replies, _MOVES[history]))
    return out


EVALUATION = poker_evaluation(GAME, decision_dialogues, tuple({"deal": d} for d in range(len(DEALS))),
                              ("kuhn_equilibrium",))
"""The evaluation hook: chips per hand, stratified by the 6 deals, exact exploitability."""
