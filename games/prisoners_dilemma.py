"""Iterated prisoner's dilemma with talk: two seats, simultaneous messages, then simultaneous moves.

| Creation     | `games.make_parallel("prisoners_dilemma_v0", rounds=3)`, `games.make(...)` (AEC) |
|--------------|------------------------------------------------------------------------------|
| API          | PettingZoo Parallel (simultaneous moves); the AEC form via `parallel_to_aec` |
| Agents       | `["player_0", "player_1"]`, symmetric                                         |
| Observation  | `Dict({"text": Text(1024, charset=string.printable)})`                       |
| Action       | `Text(1024, charset=string.printable)`: the seat's free-text reply           |
| Rewards      | every round: both cooperate 3/3, both defect 1/1, defect vs cooperate 5/0    |

**Game.** `rounds` rounds (default 3, 1..50) of the prisoner's dilemma with the standard
payoffs T=5, R=3, P=1, S=0. Each round has two simultaneous steps. *Talk*: both seats write a
short message at once; neither sees the other's before writing. *Move*: each seat reads the
other's message, then both choose cooperate or defect at once; the round's payoffs are the
rewards of that step (the talk step rewards 0). The seats' totals are public. Deterministic:
`reset(seed=...)` only reseeds `np_random`.

**What each seat sees.** One message per step:
* talk, round 1: the rules, then "Round 1 of 3. Write a short message to the other player
  (at most 200 characters)."; later rounds start with the last round's result and the score:
  "Last round you cooperated and they defected: you got 0, they got 5. Score: you 0, they 5.";
* move: 'Round 1 of 3. They said: "<their message>"\\nReply with one word: cooperate or
  defect.' ("They said nothing." for an empty message). The other seat's text is escaped to
  printable characters (`\\u00e9`) and cut to 200 characters, so every observation lies in its
  space;
* at the end: the last round's result and the final score, then "Game over after 3 rounds."

**Legal replies.** Talk: any string of at most 200 characters, delivered escaped to printable
characters and cut to 200 (escaping lengthens non-ASCII text); "" is silence. Move:
case-insensitive, within the first 1024 characters, exactly one of the whole words "cooperate"
or "defect" ("I defect!" defects; "cooperate or defect" is invalid).

**Invalid reply.** Move: no move word (empty, garbage, unicode, text that tries to instruct the
game, a non-string) or both: the seat keeps silent, which the other seat is paid for as
cooperation (3 or 5), and the invalid seat is fined: -1 for the round instead of its payoff,
below S = 0, the worst legal outcome; the game goes on. A seat missing from the Parallel
`actions` replied None. Talk: a non-string (delivered as
silence) or a message of more than 200 characters (delivered cut): no fine. Each is counted in
`infos[agent]["invalid"]` and `env.unwrapped.invalid_counts`; in the AEC form a reply is judged
in the `step` that receives it (not when the last seat has replied), so a runtime that reads
`invalid_counts` around each step attributes it to the right decision.

**Infos.** Always `invalid`, `round` (1-based; `rounds` at the end), `phase` ("talk", "move",
"end"), `infostate` ("phase:" then one pair per finished round, the seat's move then the other's
as C, D or X for invalid, e.g. "move:CD,DD") and `legal_moves` (example legal replies: a few
messages in the talk phase, ["cooperate", "defect"] in the move phase, empty at the end); at
the end also `score`, `opponent_score` and `last_action` ("cooperate", "defect", "invalid").

**End.** After the move step of the last round; both agents terminate together.

**Version history.** v0: initial release.
"""

from __future__ import annotations

import re
import string
from typing import Any, ClassVar

import gymnasium
import numpy as np
from gymnasium import spaces
from gymnasium.utils import seeding
from pettingzoo import AECEnv, ParallelEnv
from pettingzoo.utils import wrappers
from pettingzoo.utils.conversions import parallel_to_aec_wrapper

from games.bridge import printable
from games.evaluation import GameEval

AGENTS = ("player_0", "player_1")
MAX_TEXT = 1024
MAX_MESSAGE = 200
COOPERATE, DEFECT, INVALID = "C", "D", "X"
MOVE_WORDS = {COOPERATE: "cooperate", DEFECT: "defect"}
PAYOFFS: dict[tuple[str, str], int] = {
    (COOPERATE, COOPERATE): 3,  # R, reward
    (COOPERATE, DEFECT): 0,  # S, sucker
    (DEFECT, COOPERATE): 5,  # T, temptation
    (DEFECT, DEFECT): 1,  # P, punishment
}
"""(own move, other's move) -> own points."""
INVALID_REWARD = -1
"""What an invalid move scores for its seat: below S = 0, the worst legal outcome."""
TALK_EXAMPLES = ("Let's both cooperate.", "I will cooperate if you do.", "I will defect.")
_MOVE = re.compile(r"\b(cooperate|defect)\b", re.IGNORECASE)
_PAST = {COOPERATE: "cooperated", DEFECT: "defected", INVALID: "sent an invalid reply"}

RULES = (
    "Iterated prisoner's dilemma, {rounds} rounds, you and one other player. Each round you "
    "both write a short message, then both choose at the same time: cooperate or defect. "
    "Points each round: both cooperate, 3 each; both defect, 1 each; one defects and the "
    "other cooperates, 5 to the defector and 0 to the cooperator."
)


def parse_move(reply: object) -> str | None:
    """`COOPERATE` or `DEFECT` when `reply` names exactly one of the whole words "cooperate" or
    "defect" (any case) in its first `MAX_TEXT` characters; None otherwise (a non-string too)."""
    if not isinstance(reply, str):
        return None
    found = {m.group(1).lower() for m in _MOVE.finditer(reply[:MAX_TEXT])}
    if len(found) != 1:
        return None
    return COOPERATE if found.pop() == "cooperate" else DEFECT


def round_points(move: str, other: str) -> int:
    """One seat's points for a round: `PAYOFFS`, an invalid own move `INVALID_REWARD`, and an
    invalid move of the other seat paid as cooperation."""
    if move == INVALID:
        return INVALID_REWARD
    return PAYOFFS[(move, COOPERATE if other == INVALID else other)]


class PrisonersDilemma(ParallelEnv[str, dict[str, str], str]):
    """Iterated prisoner's dilemma with talk, Parallel form; see the module docstring."""

    metadata: ClassVar[dict[str, Any]] = {
        "name": "prisoners_dilemma_v0",
        "is_parallelizable": True,
        "render_modes": ["ansi"],
    }

    def __init__(self, rounds: int = 3, render_mode: str | None = None) -> None:
        if isinstance(rounds, bool) or not isinstance(rounds, int | np.integer) or not 1 <= rounds <= 50:
            raise ValueError(f"rounds must be an integer in 1..50, got {rounds!r}")
        self.rounds = int(rounds)
        self.render_mode = render_mode
        self.possible_agents = list(AGENTS)
        self.agents: list[str] = []
        self._obs_spaces = {
            a: spaces.Dict({"text": spaces.Text(MAX_TEXT, charset=string.printable)}) for a in AGENTS
        }
        self._act_spaces = {a: spaces.Text(MAX_TEXT, charset=string.printable) for a in AGENTS}
        self.np_random, self.np_random_seed = seeding.np_random(None)
        self.invalid_counts: dict[str, int] = dict.fromkeys(AGENTS, 0)
        self._round = 1
        self._phase = "talk"
        self._moves: list[dict[str, str]] = []
        """Per finished round: agent -> C, D or X."""
        self._said: dict[str, str] = dict.fromkeys(AGENTS, "")
        """This round's messages, escaped and cut."""
        self._staged: dict[str, tuple[object, str | None, bool]] = {}
        """Replies judged by `judge_reply` before `step`: agent -> (reply, judgement, invalid)."""

    def observation_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self._obs_spaces[agent]

    def action_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self._act_spaces[agent]

    def reset(
        self, seed: int | None = None, options: dict[str, Any] | None = None
    ) -> tuple[dict[str, dict[str, str]], dict[str, dict[str, Any]]]:
        if seed is not None:
            self.np_random, self.np_random_seed = seeding.np_random(seed)
        self.agents = list(AGENTS)
        self.invalid_counts = dict.fromkeys(AGENTS, 0)
        self._round, self._phase = 1, "talk"
        self._moves = []
        self._said = dict.fromkeys(AGENTS, "")
        self._staged = {}
        return self._observations(), self._infos()

    def judge_reply(self, agent: str, reply: object) -> str | None:
        """Judge `agent`'s reply for the current step now, counting it in `invalid_counts` if
        invalid; `step` then uses this judgement for the same reply object.

        Returns the move (C/D, or None when invalid) in the move phase, the delivered message
        in the talk phase. The AEC form calls this in the step that receives the reply.
        """
        if agent not in self.agents:
            raise ValueError(f"{agent!r} is not a live agent of this game: {self.agents}")
        self._unstage(agent)
        if self._phase == "move":
            judged = parse_move(reply)
            bad = judged is None
        else:
            # One line (whitespace runs collapsed): a message cannot forge lines of the prompt.
            judged = printable(" ".join(reply.split()) if isinstance(reply, str) else "", MAX_MESSAGE)
            bad = not isinstance(reply, str) or len(reply) > MAX_MESSAGE
        self.invalid_counts[agent] += int(bad)
        self._staged[agent] = (reply, judged, bad)
        return judged

    def _unstage(self, agent: str) -> None:
        """Forget a judged reply that `step` did not use, with its invalid count."""
        if agent in self._staged:
            self.invalid_counts[agent] -= int(self._staged.pop(agent)[2])

    def step(self, actions: dict[str, str]) -> tuple[
        dict[str, dict[str, str]],
        dict[str, float],
        dict[str, bool],
        dict[str, bool],
        dict[str, dict[str, Any]],
    ]:
        if not self.agents:
            raise RuntimeError("step() called after the game ended; call reset() first")
        unknown = set(actions) - set(self.agents)
        if unknown:
            raise ValueError(f"actions for agents not in the game: {sorted(unknown)}")
        judged: dict[str, str | None] = {}
        for agent in self.agents:
            reply = actions.get(agent)
            staged = self._staged.get(agent)
            if staged is not None and staged[0] is reply:
                judged[agent] = staged[1]
            else:
                judged[agent] = self.judge_reply(agent, reply)
        self._staged = {}
        rewards = dict.fromkeys(AGENTS, 0.0)
        if self._phase == "talk":
            self._said = {a: str(judged[a]) for a in AGENTS}
            self._phase = "move"
        else:
            moves = {a: judged[a] or INVALID for a in AGENTS}
            self._moves.append(moves)
            a, b = AGENTS
            rewards = {a: float(round_points(moves[a], moves[b])), b: float(round_points(moves[b], moves[a]))}
            if self._round == self.rounds:
                self._phase = "end"
            else:
                self._round += 1
                self._phase = "talk"
        done = self._phase == "end"
        observations, infos = self._observations(), self._infos()
        terminations = dict.fromkeys(AGENTS, done)
        truncations = dict.fromkeys(AGENTS, False)
        if done:
            self.agents = []
        return observations, rewards, terminations, truncations, infos

    def scores(self) -> dict[str, int]:
        """Each seat's points so far."""
        a, b = AGENTS
        return {
            a: sum(round_points(m[a], m[b]) for m in self._moves),
            b: sum(round_points(m[b], m[a]) for m in self._moves),
        }

    def _other(self, agent: str) -> str:
        return AGENTS[1 - AGENTS.index(agent)]

    def _observations(self) -> dict[str, dict[str, str]]:
        return {a: {"text": self._text(a)} for a in AGENTS}

    def _infos(self) -> dict[str, dict[str, Any]]:
        legal = {"talk": list(TALK_EXAMPLES), "move": list(MOVE_WORDS.values()), "end": []}
        infos = {}
        for agent in AGENTS:
            other = self._other(agent)
            pairs = ",".join(m[agent] + m[other] for m in self._moves)
            info: dict[str, Any] = {
                "invalid": self.invalid_counts[agent],
                "round": self._round,
                "phase": self._phase,
                "infostate": f"{self._phase}:{pairs}",
                "legal_moves": list(legal[self._phase]),
            }
            if self._phase == "end":
                scores = self.scores()
                last = self._moves[-1][agent]
                info["score"] = scores[agent]
                info["opponent_score"] = scores[other]
                info["last_action"] = MOVE_WORDS.get(last, "invalid")
                info["reason"] = "rounds"
            infos[agent] = info
        return infos

    def _result(self, agent: str) -> str:
        """The last round's result and the score, from `agent`'s side."""
        other = self._other(agent)
        last = self._moves[-1]
        mine, theirs = last[agent], last[other]
        scores = self.scores()
        return (
            f"Last round you {_PAST[mine]} and they {_PAST[theirs]}: you got "
            f"{round_points(mine, theirs)}, they got {round_points(theirs, mine)}. "
            f"Score: you {scores[agent]}, they {scores[other]}."
        )

    def _text(self, agent: str) -> str:
        if self._phase == "end":
            return f"{self._result(agent)}\nGame over after {self.rounds} rounds."
        if self._phase == "move":
            said = self._said[self._other(agent)]
            heard = f'They said: "{said}"' if said else "They said nothing."
            return f"Round {self._round} of {self.rounds}. {heard}\nReply with one word: cooperate or defect."
        ask = (
            f"Round {self._round} of {self.rounds}. Write a short message to the other player "
            f"(at most {MAX_MESSAGE} characters)."
        )
        if self._round == 1:
            return f"{RULES.format(rounds=self.rounds)}\n{ask}"
        return f"{self._result(agent)}\n{ask}"

    def render(self) -> str | None:
        if self.render_mode is None:
            gymnasium.logger.warn("render() called without a render_mode; use render_mode='ansi'.")
            return None
        a, b = AGENTS
        history = " ".join(m[a] + m[b] for m in self._moves) or "-"
        return f"prisoners_dilemma_v0 round={self._round} phase={self._phase} moves={history}"

    def close(self) -> None:
        pass


class _JudgedParallelToAEC(parallel_to_aec_wrapper):
    """PettingZoo's `parallel_to_aec_wrapper`, plus: each live seat's reply is judged
    (`judge_reply`) in the step that receives it, so `invalid_counts` moves with the decision.
    `unwrapped` is the `PrisonersDilemma` (as for `parallel_to_aec`)."""

    def step(self, action: str | None) -> None:
        agent = self.agent_selection
        if not (self.terminations[agent] or self.truncations[agent]):
            self.env.judge_reply(agent, action)  # type: ignore[attr-defined]
        super().step(action)


def parallel_env(**kwargs: Any) -> PrisonersDilemma:
    """Make the Parallel form, `PrisonersDilemma(**kwargs)`."""
    return PrisonersDilemma(**kwargs)


def env(**kwargs: Any) -> AECEnv[str, dict[str, str], str | None]:
    """Make the order-enforced AEC form: `parallel_to_aec` of `parallel_env(**kwargs)`, with each
    reply judged when it is made; `env.unwrapped` is the `PrisonersDilemma`."""
    return wrappers.OrderEnforcingWrapper(_JudgedParallelToAEC(parallel_env(**kwargs)))


# --- Scripted policies --------------------------------------------------------------------


def _last_opponent_move(info: dict[str, Any]) -> str | None:
    """The other seat's move in the last finished round (C, D or X), None in round 1."""
    pairs = info["infostate"].split(":", 1)[1]
    return pairs.split(",")[-1][1] if pairs else None


class _FixedPolicy:
    """Says `message` in the talk phase and plays `move(info)` in the move phase."""

    message = ""

    def move(self, info: dict[str, Any]) -> str:
        raise NotImplementedError

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """Return this policy's message or move for the phase in `info["phase"]`."""
        if info.get("phase") == "talk":
            return self.message
        if info.get("phase") != "move":
            raise ValueError(f"{type(self).__name__}.act called outside a talk or move phase: {info!r}")
        return MOVE_WORDS[self.move(info)]


class TitForTatPolicy(_FixedPolicy):
    """Cooperates in round 1, then repeats the other seat's last move (an invalid reply, which
    is paid as cooperation, counts as cooperation). Says so in the talk phase."""

    message = "I cooperate as long as you do."

    def move(self, info: dict[str, Any]) -> str:
        return DEFECT if _last_opponent_move(info) == DEFECT else COOPERATE


class AlwaysDefectPolicy(_FixedPolicy):
    """Defects every round, and says it will cooperate."""

    message = "Let's both cooperate."

    def move(self, info: dict[str, Any]) -> str:
        return DEFECT


class AlwaysCooperatePolicy(_FixedPolicy):
    """Cooperates every round."""

    message = "I will always cooperate."

    def move(self, info: dict[str, Any]) -> str:
        return COOPERATE


SCRIPTED_POLICIES: dict[str, type] = {
    "pd_tit_for_tat": TitForTatPolicy,
    "pd_always_defect": AlwaysDefectPolicy,
    "pd_always_cooperate": AlwaysCooperatePolicy,
}
"""Scripted policies of this game by name, for `games.scripted.SCRIPTED`."""

EVALUATION = GameEval(unit="points", per="game", scripted=tuple(SCRIPTED_POLICIES),
                      system_prompt="You are playing an iterated prisoner's dilemma. Keep every reply short.")
"""The evaluation hook: points per game; the seat with more points wins a pairing's game."""
