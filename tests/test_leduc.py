"""Leduc hold'em: rules, texts, forfeits, exact game theory (OpenSpiel's values), the evaluation
hook read from an LLM's log-probs, and scripted seats."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import play_to_end

import games
from games import leduc_poker as L
from games.scripted import TABLE, make_scripted

# OpenSpiel's exploitability_test: NashConv of the uniform random policy on leduc_poker.
OPENSPIEL_UNIFORM_NASH_CONV = 4.747222222222222


def _random_policy(game, seed: int) -> dict[str, dict[str, float]]:
    rng = np.random.default_rng(seed)
    return {s: dict(zip(moves, rng.dirichlet(np.ones(len(moves))).tolist())) for s, (_, moves) in game.states.items()}


def _suited(policy: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    """A rank-level policy as a policy over OpenSpiel's 936 suited states (suits ignored)."""
    return {s: policy[s.replace("0", "").replace("1", "")] for s in L.openspiel_game().states}


def test_uniform_play_matches_openspiel_exactly() -> None:
    assert len(L.INFO_STATES) == 288 and len(L.openspiel_game().states) == 936
    assert len(L.DEALS) == 120 and len(L.GAME.nodes) == 85
    for game in (L.GAME, L.openspiel_game()):
        assert game.nash_conv(game.uniform()) == pytest.approx(OPENSPIEL_UNIFORM_NASH_CONV, abs=1e-12)
        assert game.exploitability(game.uniform()) == pytest.approx(2.373611111111111, abs=1e-12)


def test_rank_and_suited_states_agree_on_suit_blind_policies() -> None:
    for seed in range(3):
        policy = _random_policy(L.GAME, seed)
        assert L.openspiel_game().exploitability(_suited(policy)) == pytest.approx(L.exploitability(policy), abs=1e-12)
        assert L.openspiel_game().expected_value(_suited(policy), _suited(policy)) == pytest.approx(
            L.expected_value(policy, policy), abs=1e-12)


def test_best_response_value_is_its_play_and_beats_every_deviation() -> None:
    """Two independent ways to NashConv: the backward induction's value, and the expected value
    of the pure table it returns played against the policy; no single-state deviation of the
    table does better; exploitability >= 0."""
    for seed in range(3):
        policy = _random_policy(L.GAME, seed)
        nash_conv = 0.0
        for seat in (0, 1):
            value, table = L.best_response(policy, seat)
            assert set(table) == set(L.GAME.seat_states(seat))
            pure = {s: {m: float(m == table[s]) for m in L.GAME.states[s][1]} for s in table}
            played = L.expected_value(pure, policy) if seat == 0 else -L.expected_value(policy, pure)
            assert played == pytest.approx(value, abs=1e-12)
            rng = np.random.default_rng(seed)
            for s in rng.choice(sorted(table), 20, replace=False):
                for move in L.GAME.states[s][1]:
                    other = {**pure, s: {m: float(m == move) for m in L.GAME.states[s][1]}}
                    dev = L.expected_value(other, policy) if seat == 0 else -L.expected_value(policy, other)
                    assert dev <= value + 1e-12
            nash_conv += value
        assert nash_conv == pytest.approx(2 * L.exploitability(policy), abs=1e-12) and nash_conv > 0


def test_cfr_drives_exploitability_towards_equilibrium() -> None:
    assert L.GAME.exploitability(L.GAME.cfr(200)) < 0.1
    eq = L.equilibrium_policy()
    assert L.exploitability(eq) < 0.01
    assert L.expected_value(eq, eq) == pytest.approx(-0.0856, abs=0.005)  # Leduc's value for player_0
    with pytest.raises(ValueError, match="lacks info states"):
        L.exploitability({"J": {"check": 0.5, "bet": 0.5}})
    with pytest.raises(ValueError, match="not a distribution"):
        L.exploitability({**eq, "J": {"check": 0.7, "bet": 0.7}})


def test_rules_by_hand() -> None:
    assert L.legal_moves("") == ("check", "bet") and L.legal_moves("r") == ("fold", "call", "raise")
    assert L.legal_moves("rr") == ("fold", "call") and L.legal_moves("crr") == ("fold", "call")
    assert L.next_history("c", "check") == "cc/" and L.next_history("", "check") == "c"
    assert L.legal_moves("cc/rrc/") == () and L.legal_moves("rf") == ()
    assert L.stakes("rrc/") == (5, 5) and L.stakes("rrc/rr") == (9, 13) and L.stakes("crrc/crrc/") == (13, 13)
    J0, J1, Q0, K0 = 0, 1, 2, 4
    assert L.payoff0((K0, Q0, J0), "cc/cc/") == 1 and L.payoff0((K0, Q0, Q0 + 1), "cc/cc/") == -1  # a pair wins
    assert L.payoff0((J0, J1, K0), "rc/rc/") == 0  # equal ranks split
    assert L.payoff0((J0, K0, Q0), "rf") == 1 and L.payoff0((K0, J0, Q0), "rc/rrf") == -7


def test_a_hand_is_played_and_told_as_the_card_says() -> None:
    env = games.make("leduc_poker_v0", deal=L.DEALS.index((0, 2, 3)))  # J vs Q, board Q
    env.reset(seed=0)
    assert env.observe("player_0")["text"] == f"{L.HEADER} You have a J. Reply with one word: check or bet."
    assert env.observe("player_1")["text"] == f"{L.HEADER} You have a Q. Waiting for the opponent."
    env.step("I bet.")
    assert env.observe("player_1")["text"].endswith("Opponent bet. Reply with one word: fold, call or raise.")
    env.step("RAISE")
    assert env.observe("player_0")["text"] == "Opponent raised. Reply with one word: fold or call."
    env.step("call")
    assert env.observe("player_0")["text"] == "Board card: Q. Reply with one word: check or bet."
    assert env.infos["player_0"]["infostate"] == "Jrrc/Q"
    env.step("check")
    assert env.observe("player_1")["text"] == "Opponent called. Board card: Q. Opponent checked. Reply with one word: check or bet."
    env.step("bet")
    env.step("call")
    assert env.infos["player_1"]["winner"] == "player_1" and env.infos["player_1"]["reason"] == "showdown"
    assert env.observe("player_0")["text"] == "Showdown: you had J, opponent had Q, board Q. You lose 9 chips."
    assert play_to_end(env, [], max_iter=10) == {"player_0": -9, "player_1": 9}


@pytest.mark.parametrize("reply", ["fold", "check or bet", "", None, 7])
def test_invalid_replies_forfeit_the_stake(reply: object) -> None:
    env = games.make("leduc_poker_v0", deal=0, forfeit_penalty=2)
    env.reset()
    env.step("bet")
    env.step(reply if reply != "fold" else "fold or call")  # facing a bet, two words: invalid
    assert env.rewards == {"player_0": 3, "player_1": -3}
    assert env.infos["player_1"]["reason"] == "forfeit" and env.unwrapped.invalid_counts["player_1"] == 1
    env.reset()
    env.step("fold")  # no bet to fold to
    assert env.rewards == {"player_0": -3, "player_1": 3}
    with pytest.raises(ValueError, match="forfeit_penalty"):
        games.make("leduc_poker_v0", forfeit_penalty=11)
    with pytest.raises(ValueError, match="card0"):
        games.make("leduc_poker_v0", card0=6)


def test_card0_fixes_player_0s_card_and_the_rest_is_drawn() -> None:
    env = games.make("leduc_poker_v0", card0=5)
    seen = set()
    for seed in range(30):
        env.reset(seed=seed)
        assert env.unwrapped._cards[0] == 5
        seen.add(env.unwrapped._cards[1:])
    assert len(seen) > 5


def test_expected_value_matches_simulation_of_the_scripted_seats() -> None:
    eq, uniform = L.equilibrium_policy(), L.GAME.uniform()
    seats = [make_scripted("leduc_equilibrium"), make_scripted("random")]
    env, rng, total, hands = games.make("leduc_poker_v0"), np.random.default_rng(0), 0.0, 3000
    for hand in range(hands):
        env.reset(seed=hand)
        for agent in env.agent_iter():
            obs, reward, term, trunc, info = env.last()
            total += reward if agent == "player_0" else 0.0
            env.step(None if term or trunc else seats[env.possible_agents.index(agent)].act(obs["text"], info, rng))
    # The standard error of 3000 hands is about 0.1 chips.
    assert total / hands == pytest.approx(L.expected_value(eq, uniform), abs=0.35)


def test_the_hook_reads_an_llm_policy_and_its_exploiter_is_a_table(chat_tok) -> None:
    from opentinker.eval.evaluation import (
        SPELLINGS,
        policy_from_logprobs,
        policy_sequences,
    )

    hook = games.evaluation("leduc_poker_v0")
    assert hook.label == "chips/hand" and len(hook.starts) == 6 and "leduc_equilibrium" in hook.scripted
    measure = hook.measure("exploitability")
    decisions = measure.decisions()
    assert [d.infostate for d in decisions] == list(L.INFO_STATES)
    for d in decisions:
        assert len(d.replies) == len(d.observations) - 1 and d.legal_moves == L.GAME.states[d.infostate][1]
        assert d.observations[0].startswith(f"{L.HEADER} You have a {d.infostate[0]}.")
        assert d.observations[-1].endswith("or " + d.legal_moves[-1] + ".")
    seqs, n_reply = policy_sequences(chat_tok, "You are a poker player.", decisions)
    k = len(SPELLINGS)
    assert len(seqs) == k * sum(len(d.legal_moves) for d in decisions)
    # Equal log-probs per token: near uniform play (replies differ in token counts).
    flat = [np.full(len(s), -0.1, np.float32) for s in seqs]
    dist, _ = policy_from_logprobs(flat, n_reply, decisions)
    assert measure.value(dist) == pytest.approx(OPENSPIEL_UNIFORM_NASH_CONV / 2, abs=0.05)
    # Equal log-probs per reply: exactly uniform play, OpenSpiel's value.
    per_reply = [np.full(len(s), -1.0 / n, np.float32) for s, n in zip(seqs, n_reply)]
    dist, _ = policy_from_logprobs(per_reply, n_reply, decisions)
    assert measure.value(dist) == pytest.approx(OPENSPIEL_UNIFORM_NASH_CONV / 2, abs=1e-9)
    eq = L.equilibrium_policy()
    assert measure.value(eq) == pytest.approx(L.exploitability(eq), abs=1e-12)
    assert measure.payoff(eq, eq) == pytest.approx(0.0, abs=1e-12)
    assert measure.payoff(eq, dist) > 0.5  # the equilibrium beats uniform play
    table = measure.best_response(dist)
    assert set(table) == set(L.INFO_STATES)
    # Facing uniform play, raise a pair with the board and fold a J facing two raises.
    assert table["Jrrc/Jr"] == "raise" and table["Jrrc/Qrr"] == "fold"
    seat, rng = make_scripted(TABLE, table=table), np.random.default_rng(0)
    assert seat.act("", {"infostate": "Jrrc/Qrr", "legal_moves": ["fold", "call"]}, rng) == "fold"


@pytest.mark.slow
def test_the_bundled_leduc_league_runs_on_the_tiny_model(tmp_path, tiny_path) -> None:
    """One step of ``leduc_league`` (its own keys; the tiny model, one process, the smallest
    evaluation): one all-actions datum per legal move of each decision the step drew, and the
    exploitability of the policy logged at the step."""
    import json

    from opentinker.config import load_config
    from opentinker.run import run_job

    cfg = load_config("leduc_league", {
        "out_dir": str(tmp_path), "model": {"base": "tiny-random", "threads": 1, "device": "cpu"},
        "runtime": {"backend": "local", "env_runners": 1}, "train": {"steps": 1, "groups_per_step": 1},
        "eval": {"every": 0, "hands_per_stratum": 1, "final_hands_per_stratum": 1, "head_to_head_per_stratum": 0},
        "league": {"eval_per_stratum": 1}})
    res = run_job(cfg, run_dir=tmp_path / "run")
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    (train,) = [r for r in rows if r["kind"] == "train"]
    # Every decision is scored; the step trains the replies of its drawn decisions only.
    from opentinker.control.all_actions import trained_rows

    decisions = L.EVALUATION.with_payoff().decisions()
    assert len(decisions) == 288 and 0 < cfg.train.all_actions_decisions < 288
    assert train["train/main/all_actions/decisions"] == cfg.train.all_actions_decisions
    assert train["train/main/all_actions_datums"] == len(trained_rows(decisions, cfg.train.all_actions_decisions,
                                                                     (cfg.seed, 1)))
    assert 0 < train["train/main/exploitability"] < 13


def test_the_evaluation_hook_solves_the_best_response_to_random_once(monkeypatch) -> None:
    """Every process that imports ``games`` builds the poker hooks: the best response to
    uniform play is solved once for the hook (it was solved again for each of the 288
    information states, a second of CPU in every command), and its value is the same."""
    from games.tabular import TabularGame, poker_evaluation

    calls = []
    solve = TabularGame.best_response
    monkeypatch.setattr(TabularGame, "best_response", lambda self, policy, seat: calls.append(seat) or solve(
        self, policy, seat))
    ev = poker_evaluation(L.GAME, L.decision_dialogues, L.EVALUATION.starts, ("leduc_equilibrium",))
    assert len(calls) <= 4  # exploitability's two seats and the best response's two
    uniform = L.GAME.uniform()
    br = {**L.GAME.best_response(uniform, 0)[1], **L.GAME.best_response(uniform, 1)[1]}
    pure = {s: {m: float(m == br[s]) for m in moves} for s, moves in uniform.items()}
    value = next(m for m in ev.exact if m.name == "value_vs_random")
    assert value.references["best response to random"] == pytest.approx(L.GAME.payoff(pure, uniform))
