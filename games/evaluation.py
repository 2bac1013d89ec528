"""The evaluation hook: what a game tells the runtime about measuring a policy in it.

A game declares a :class:`GameEval` beside its rules and registers it with the game
(``games.register(name, factory, evaluation=...)``); ``games.evaluation(name)`` returns it, and
a default one for a game that declares none (a bridged PettingZoo env). The runtime reads only
this: it never names a game.

* ``unit`` / ``per``: what a seat's total reward counts ("chips" per "hand", "points" per
  "game"); ``unit`` names the metric (``eval/<policy>/vs_<opponent>/<unit>``).
* ``starts``: the strata of an evaluation, one dict of game kwargs per start (Kuhn poker: its
  6 deals); each start is played from every seat, with the same seeds every time.
* ``scripted``: the scripted seats (``games.SCRIPTED``) that can play this game, beside
  ``random`` which plays every game.
* ``competitive``: seats are opponents, so a game has a winner (the seat with the larger
  reward) and pairings feed ratings; False for a cooperative game.
* ``references``: reference levels of the reward for plots (Kuhn: a best response to random).
* ``exact``: exact measures of a policy computed from its action probabilities at a list of
  decisions (Kuhn poker's exploitability): :class:`ExactMeasure`, which may also give a
  best response to the policy (an exact exploiter to train against).
* ``state_values``: the exact value of a decision's state to the seat that acts, against a
  named scripted opponent, played well from there on (tic-tac-toe: minimax against
  ``tictactoe_minimax``, expectimax against ``random``): :class:`StateValues`, the critic of
  the ``exact_gae`` advantage (``learners.advantages``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol


class DecisionPoint(Protocol):
    """One decision as the deciding seat lives it (for teacher-forced scoring)."""

    infostate: str
    """The decision's key (an information state)."""
    observations: tuple[str, ...]
    """The seat's user messages in order; the last one asks for this decision."""
    replies: tuple[str, ...]
    """The seat's earlier replies (one fewer than ``observations``)."""
    legal_moves: tuple[str, ...]
    """The canonical one-word replies of the legal moves."""


@dataclass(frozen=True)
class Decision:
    """One information state as the seat lives it: its user messages and earlier replies (a
    :class:`DecisionPoint`)."""

    infostate: str
    """The game's information state, e.g. Kuhn poker's "Qpb"."""
    agent: str
    """The seat that decides."""
    deal: int
    """The game's index of the deal used to drive the env (the seat's texts do not depend on
    what it cannot see)."""
    observations: tuple[str, ...]
    """The seat's user messages in order; the last one asks for this decision."""
    replies: tuple[str, ...]
    """The seat's earlier canonical replies; len(observations) - 1 of them."""
    legal_moves: tuple[str, ...]
    """The canonical one-word replies of the legal moves, in the game's order."""


def record_decision(env: Any, infostate: str, agent: str, deal: int, replies: Sequence[str],
                    legal_moves: Sequence[str]) -> Decision:
    """Step ``replies`` on ``env`` (reset, dealt ``deal``) for whoever is to act, recording what
    ``agent`` reads and says; then ``agent`` must be to act at ``infostate`` (its
    ``infos[agent]["infostate"]``) with ``legal_moves`` (in the order the measure reads them),
    else ValueError naming where ``replies`` lead instead."""
    observations: list[str] = []
    own: list[str] = []
    for reply in replies:
        if env.agent_selection == agent:
            observations.append(env.observe(agent)["text"])
            own.append(reply)
        env.step(reply)
    info = env.infos[agent]
    if env.agent_selection != agent or info["infostate"] != infostate or set(info["legal_moves"]) != set(legal_moves):
        raise ValueError(f"replies {list(replies)} lead to {info['infostate']!r} ({info['legal_moves']}), "
                             f"not {agent}'s {infostate!r} ({list(legal_moves)})")
    observations.append(env.observe(agent)["text"])
    return Decision(infostate, agent, deal, tuple(observations), tuple(own), tuple(legal_moves))


PAIRING_METRICS = ("ci95", "invalid_rate", "hands", "wins", "draws", "losses", "tool_calls", "invalid_tool_calls")
"""The runtime's own metrics of a pairing beside the unit's (``eval/<p>/vs_<o>/<name>``)."""
POLICY_METRICS = ("canonical_mass", "version")
"""The runtime's own metrics of a policy beside its exact measures (``eval/<p>/<name>``)."""

Distribution = Mapping[str, Mapping[str, float]]
"""``{infostate: {move: probability}}``, each inner mapping summing to 1 over the legal moves."""


@dataclass(frozen=True)
class ExactMeasure:
    """A number computed exactly from a policy's action probabilities at ``decisions()``.

    The runtime scores every legal move's canonical reply at every decision (teacher-forced
    log-probabilities), renormalises over the legal moves, and calls ``value`` with the
    resulting :data:`Distribution`; the metric is ``eval/<policy>/<name>``."""

    name: str
    decisions: Callable[[], Sequence[DecisionPoint]]
    value: Callable[[Distribution], float]
    better: Literal["lower", "higher"] = "lower"
    references: Mapping[str, float] = field(default_factory=dict)
    """Reference levels for plots, e.g. ``{"uniform play": 0.458, "equilibrium": 0.0}``."""
    description: str = ""
    payoff: Callable[[Distribution, Distribution], float] | None = None
    """The expected reward per game of the first policy against the second, each seat played
    equally often: linear in the probabilities at each decision. With it a job can train on
    the exact all-actions gradient (``train.all_actions``, :mod:`learners.all_actions`)."""
    best_response: Callable[[Distribution], Mapping[str, str]] | None = None
    """``{infostate: move}``: a pure best response to the policy in every seat, which the
    scripted ``table`` seat plays (the opponent ``best_response`` of a job: an exact
    exploiter, as AlphaStar's league has learned ones)."""

    def __post_init__(self) -> None:
        if not self.name.isidentifier() or self.name in POLICY_METRICS:
            raise ValueError(f"ExactMeasure.name must be an identifier (it names a metric) other than "
                             f"{', '.join(POLICY_METRICS)}; got {self.name!r}")

@dataclass(frozen=True)
class StateValues:
    """Exact values of decision states: ``value(infostate, agent, opponent)`` is the expected
    final reward of ``agent``, to act at ``infostate`` (its ``infos[agent]["infostate"]``), when
    it plays best from there on against the scripted policy ``opponent`` (one of
    ``opponents``). Raises ``ValueError`` for a state or opponent it does not value."""

    opponents: tuple[str, ...]
    value: Callable[[str, str, str], float]
    moves: Callable[[str, str, str], Mapping[str, float]] | None = None
    """``moves(infostate, agent, opponent)``: ``{move: value}`` for every legal move at the
    state, keyed by its canonical reply (the ``legal_moves``): the expected final reward when
    ``agent`` plays it, then best against ``opponent`` (``value`` is their maximum). With it a
    job can move every legal reply at each decision it played (``train.move_values``)."""

    def __post_init__(self) -> None:
        if not self.opponents:
            raise ValueError("StateValues.opponents needs at least one scripted opponent")


@dataclass(frozen=True)
class GameEval:
    """How a game is evaluated; see the module docstring."""

    unit: str = "reward"
    per: str = "game"
    starts: tuple[Mapping[str, Any], ...] = ({},) * 6
    scripted: tuple[str, ...] = ()
    competitive: bool = True
    system_prompt: str = "You are playing a game. Reply with your move only."
    references: Mapping[str, float] = field(default_factory=dict)
    exact: tuple[ExactMeasure, ...] = ()
    state_values: StateValues | None = None

    def __post_init__(self) -> None:
        if not self.unit.isidentifier() or self.unit in PAIRING_METRICS:
            raise ValueError(f"GameEval.unit must be an identifier (it names a metric) other than "
                             f"{', '.join(PAIRING_METRICS)}; got {self.unit!r}")
        if not self.starts:
            raise ValueError("GameEval.starts needs at least one start")
        if not self.system_prompt:
            raise ValueError("GameEval.system_prompt must be non-empty")

    @property
    def label(self) -> str:
        """The unit as an axis label, e.g. ``chips/hand``."""
        return f"{self.unit}/{self.per}"

    def exploiter(self) -> ExactMeasure | None:
        """The first exact measure that gives a best response, if any."""
        return next((m for m in self.exact if m.best_response is not None), None)

    def with_payoff(self) -> ExactMeasure | None:
        """The first exact measure that gives payoffs, if any."""
        return next((m for m in self.exact if m.payoff is not None), None)

    def measure(self, name: str) -> ExactMeasure:
        """The exact measure called ``name`` (``KeyError`` naming the ones there are)."""
        for m in self.exact:
            if m.name == name:
                return m
        raise KeyError(f"no exact measure {name!r}; this game has {[m.name for m in self.exact] or 'none'}")
