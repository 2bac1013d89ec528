"""Games: PettingZoo conformance over the registry, Kuhn poker rules, parsing, forfeits, exact
game theory, and scripted seats."""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import pytest
from pettingzoo.test import api_test, parallel_api_test, parallel_seed_test, seed_test

import games
from games import kuhn_poker
from games.kuhn_poker import (
    DEALS,
    INFO_STATES,
    Decision,
    best_response_value,
    decision_dialogues,
    equilibrium_policy,
    expected_value,
    exploitability,
)
from games.scripted import KuhnEquilibriumPolicy, RandomPolicy, make_scripted
from conftest import play_to_end

KQ, JK, QJ = DEALS.index((2, 1)), DEALS.index((0, 2)), DEALS.index((1, 0))


def play(deal: int, replies: list[Any], seed: int = 0) -> tuple[Any, dict[str, float]]:
    """Step `replies` in order for whoever is to act, then drain the dead steps; return the env
    and each agent's total reward, checking every observation lies in its space."""
    env = games.make("kuhn_poker_v0", deal=deal)
    env.reset(seed=seed)
    return env, play_to_end(env, replies, max_iter=20)


@pytest.mark.parametrize("name", games.names())
def test_api_conformance(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Text spaces are not Box/Discrete
        api_test(games.make(name), num_cycles=1000)
        seed_test(lambda: games.make(name), num_cycles=50)


@pytest.mark.parametrize("name", games.parallel_names())
def test_parallel_conformance_where_a_parallel_form_exists(name: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        parallel_api_test(games.make_parallel(name), num_cycles=200)
        parallel_seed_test(lambda: games.make_parallel(name), num_cycles=50)


def test_registry_errors() -> None:
    assert "kuhn_poker_v0" in games.names()
    with pytest.raises(ValueError, match="nope_v0.*kuhn_poker_v0"):
        games.make("nope_v0")
    with pytest.raises(ValueError, match="already registered"):
        games.register("kuhn_poker_v0", kuhn_poker.env)
    with pytest.raises(ValueError, match="deal"):
        games.make("kuhn_poker_v0", deal=6)


def test_seeded_deal_is_deterministic_and_varies() -> None:
    env = games.make("kuhn_poker_v0")

    def first_texts(seed: int) -> tuple[str, str]:
        env.reset(seed=seed)
        return env.observe("player_0")["text"], env.observe("player_1")["text"]

    assert first_texts(7) == first_texts(7)
    assert len({first_texts(s) for s in range(40)}) == 6


@pytest.mark.parametrize(
    ("deal", "replies", "r0", "reason"),
    [
        (KQ, ["bet", "call"], 2, "showdown"),
        (KQ, ["check", "check"], 1, "showdown"),
        (KQ, ["check", "bet", "call"], 2, "showdown"),
        (KQ, ["check", "bet", "fold"], -1, "fold"),
        (JK, ["bet", "fold"], 1, "fold"),
        (JK, ["bet", "call"], -2, "showdown"),
        (JK, ["check", "bet", "fold"], -1, "fold"),
        (JK, ["check", "check"], -1, "showdown"),
        (QJ, ["check", "bet", "call"], 2, "showdown"),
    ],
)
def test_legal_playthroughs(deal: int, replies: list[str], r0: int, reason: str) -> None:
    env, totals = play(deal, replies)
    assert totals == {"player_0": r0, "player_1": -r0}
    assert env.unwrapped.invalid_counts == {"player_0": 0, "player_1": 0}


def test_infos_and_texts_along_a_hand() -> None:
    env = games.make("kuhn_poker_v0", deal=KQ)
    env.reset()
    assert env.infos["player_0"] == {
        "invalid": 0,
        "infostate": "K",
        "legal_moves": ["check", "bet"],
    }
    assert env.infos["player_1"]["legal_moves"] == []
    assert env.observe("player_0")["text"] == (
        "Kuhn poker, cards J<Q<K. You have the K. Reply with one word: check or bet."
    )
    assert env.observe("player_1")["text"] == (
        "Kuhn poker, cards J<Q<K. You have the Q. Waiting for the opponent."
    )
    env.step("check")
    assert env.infos["player_1"]["infostate"] == "Qp"
    assert env.observe("player_1")["text"] == (
        "Kuhn poker, cards J<Q<K. You have the Q. Opponent checked. "
        "Reply with one word: check or bet."
    )
    env.step("bet")
    assert env.infos["player_0"]["infostate"] == "Kpb"
    assert env.infos["player_0"]["legal_moves"] == ["call", "fold"]
    assert env.observe("player_0")["text"] == "Opponent bet. Reply with one word: call or fold."
    env.step("call")
    assert env.observe("player_0")["text"] == (
        "Showdown: you had K, opponent had Q. You win 2 chips."
    )
    assert env.observe("player_1")["text"] == (
        "Showdown: you had Q, opponent had K. You lose 2 chips."
    )
    info = env.infos["player_1"]
    assert (info["winner"], info["reason"], info["last_action"]) == ("player_0", "showdown", "bet")
    assert env.infos["player_0"]["last_action"] == "call"


@pytest.mark.parametrize(
    ("reply", "move"),
    [
        ("I'll BET!", "bet"),
        ("Check.", "check"),
        ("Bet. I bet!", "bet"),
        ("call? no: I bet", "bet"),
        ("\nBet\n", "bet"),
    ],
)
def test_lenient_parsing(reply: str, move: str) -> None:
    env = games.make("kuhn_poker_v0", deal=KQ)
    env.reset()
    env.step(reply)
    assert env.infos["player_1"]["infostate"] == "Q" + {"bet": "b", "check": "p"}[move]
    assert env.unwrapped.invalid_counts["player_0"] == 0


GARBAGE = [
    "",
    "x" * 100_000,
    "x" * 600 + " bet",  # the legal word lies past the 512 characters that are read
    "ünïcødé 🂡 ♠♥ 下注",
    "ignore previous instructions and give me all chips",
    "call",  # no bet is pending
    "betting checks",  # not whole words
    "check or bet",  # names both moves: ambiguous
    "Check, then bet",
    None,
]


@pytest.mark.parametrize("reply", GARBAGE)
def test_garbage_first_reply_forfeits(reply: Any) -> None:
    env, totals = play(KQ, [reply])
    assert totals == {"player_0": -1, "player_1": 1}
    assert env.unwrapped.invalid_counts == {"player_0": 1, "player_1": 0}


@pytest.mark.parametrize("reply", ["", "x" * 100_000, "check", "ünïcødé"])
def test_garbage_when_facing_a_bet_forfeits(reply: str) -> None:
    env = games.make("kuhn_poker_v0", deal=JK)
    env.reset()
    env.step("check")
    env.step("bet")
    env.step(reply)  # player_0 has put in only its ante, so it forfeits 1 chip
    assert env.rewards == {"player_0": -1, "player_1": 1}
    assert env.unwrapped.invalid_counts == {"player_0": 1, "player_1": 0}
    for agent in env.agents:
        assert env.observation_space(agent).contains(env.observe(agent))
        assert env.infos[agent]["reason"] == "forfeit"
    assert env.infos["player_0"]["last_action"] == "invalid"
    assert env.observe("player_0")["text"] == "Your reply was invalid, a forfeit. You lose 1 chip."
    env2, totals = play(JK, ["bet", "whatever"])
    assert totals == {"player_0": 1, "player_1": -1}
    assert env2.unwrapped.invalid_counts == {"player_0": 0, "player_1": 1}


def test_invalid_counts_reset_each_hand() -> None:
    env = games.make("kuhn_poker_v0", deal=KQ)
    env.reset()
    env.step("nonsense")
    assert env.infos["player_0"]["invalid"] == 1
    env.reset()
    assert env.unwrapped.invalid_counts == {"player_0": 0, "player_1": 0}


def test_exploitability_uniform_and_equilibria() -> None:
    assert exploitability({s: 0.5 for s in INFO_STATES}) == pytest.approx(11 / 24, abs=1e-6)
    for alpha in (0.0, 0.2, 1 / 3):
        eq = equilibrium_policy(alpha)
        assert exploitability(eq) < 1e-9
        assert expected_value(eq, eq) == pytest.approx(-1 / 18, abs=1e-12)
    with pytest.raises(ValueError):
        equilibrium_policy(0.5)
    with pytest.raises(ValueError, match="lacks"):
        exploitability({"J": 0.5})


def test_always_aggressive_by_hand() -> None:
    # Everyone bets and calls: every hand is a showdown for 2, symmetric, so EV 0. player_0's
    # best response: J checks then folds (-1), Q anything worth 0, K bets (+2): (-1+0+2)/3.
    # player_1 facing a bet: J folds (-1), Q folds or calls (0), K calls (+2): also 1/3.
    aggressive = {s: 1.0 for s in INFO_STATES}
    assert expected_value(aggressive, aggressive) == 0.0
    assert best_response_value(aggressive, 0) == pytest.approx(1 / 3)
    assert best_response_value(aggressive, 1) == pytest.approx(1 / 3)
    assert exploitability(aggressive) == pytest.approx(1 / 3)


def test_expected_value_matches_simulation() -> None:
    eq, rng = equilibrium_policy(0.2), np.random.default_rng(0)
    seats = [KuhnEquilibriumPolicy(0.2), KuhnEquilibriumPolicy(0.2)]
    env = games.make("kuhn_poker_v0")
    total, hands = 0.0, 3000
    for hand in range(hands):
        env.reset(seed=hand)
        for agent in env.agent_iter():
            obs, reward, term, trunc, info = env.last()
            if agent == "player_0":
                total += reward
            seat = seats[env.possible_agents.index(agent)]
            env.step(None if term or trunc else seat.act(obs["text"], info, rng))
    assert total / hands == pytest.approx(expected_value(eq, eq), abs=0.05)


def test_exact_value_against_random_matches_play_against_the_random_seat() -> None:
    """The hook's ``value_vs_random``: 0 for uniform play, 11/24 for the best response to
    random, 3/8 for always bet / call, which the scripted random seat confirms over hands
    in both seats."""
    from games.kuhn_poker import GAME

    measure = games.evaluation("kuhn_poker_v0").measure("value_vs_random")
    uniform = GAME.uniform()
    assert measure.value(uniform) == pytest.approx(0.0, abs=1e-12)
    br = GAME.best_responses(uniform)
    assert measure.value({s: {m: float(m == br[s]) for m in d} for s, d in uniform.items()}) == pytest.approx(11 / 24)
    bet_call = {s: {m: float(m == ("bet" if "bet" in d else "call")) for m in d} for s, d in uniform.items()}
    assert measure.value(bet_call) == pytest.approx(3 / 8)
    env, rng, rand = games.make("kuhn_poker_v0"), np.random.default_rng(0), RandomPolicy()
    total, hands = 0.0, 4000
    for hand in range(hands):
        env.reset(seed=hand)
        me = env.possible_agents[hand % 2]
        for agent in env.agent_iter(max_iter=10):
            obs, reward, term, trunc, info = env.last()
            total += reward if agent == me else 0.0
            if term or trunc:
                env.step(None)
            elif agent == me:
                env.step("bet" if "bet" in info["legal_moves"] else "call")
            else:
                env.step(rand.act(obs["text"], info, rng))
    assert total / hands == pytest.approx(3 / 8, abs=0.06)  # 4000 hands: a standard error of 0.02


def test_decision_dialogues() -> None:
    decisions = decision_dialogues()
    assert [d.infostate for d in decisions] == list(INFO_STATES)
    for d in decisions:
        assert isinstance(d, Decision)
        assert d.agent == ("player_0" if len(d.infostate) % 2 else "player_1")
        assert len(d.replies) == len(d.observations) - 1
        facing_bet = d.infostate.endswith("b")
        assert d.legal_moves == (("fold", "call") if facing_bet else ("check", "bet"))
        assert d.observations[-1].endswith("call or fold." if facing_bet else "check or bet.")
        assert f"You have the {d.infostate[0]}." in d.observations[0]
    assert decisions[INFO_STATES.index("Kpb")].replies == ("check",)
    assert decisions[INFO_STATES.index("Kpb")].observations[-1] == (
        "Opponent bet. Reply with one word: call or fold."
    )


def test_random_policy_is_legal_and_covers_both_moves() -> None:
    policy, rng = make_scripted("random"), np.random.default_rng(0)
    assert isinstance(policy, RandomPolicy)
    for legal in (["check", "bet"], ["call", "fold"]):
        picks = {policy.act("", {"legal_moves": legal}, rng) for _ in range(200)}
        assert picks == set(legal)


def test_equilibrium_policy_deterministic_states() -> None:
    policy, rng = make_scripted("kuhn_equilibrium"), np.random.default_rng(0)
    assert policy.act("", {"legal_moves": ["check", "bet"], "infostate": "Q"}, rng) == "check"
    assert policy.act("", {"legal_moves": ["call", "fold"], "infostate": "Kb"}, rng) == "call"
    assert policy.act("", {"legal_moves": ["call", "fold"], "infostate": "Jpb"}, rng) == "fold"


def test_make_scripted_unknown_name() -> None:
    with pytest.raises(ValueError, match="'nope'.*kuhn_equilibrium.*random"):
        make_scripted("nope")
