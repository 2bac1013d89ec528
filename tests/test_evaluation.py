import math

import numpy as np
import pytest

import games
from games import kuhn_poker
from opentinker.eval.evaluation import SPELLINGS, policy_from_logprobs, policy_sequences, stratified_mean_ci


def test_stratified_interval_by_hand():
    mean, hw = stratified_mean_ci([[1.0, -1.0], [2.0, 2.0, 2.0]])
    assert mean == pytest.approx(1.0)
    # var = (s1^2/n1 + s2^2/n2) / H^2 = (2/2 + 0/3) / 4
    assert hw == pytest.approx(1.96 * math.sqrt(0.25))
    # A stratum with one sample has an unknown variance: no interval rather than a false 0.
    mean, hw = stratified_mean_ci([[1.0, -1.0], [2.0]])
    assert mean == pytest.approx(1.0) and math.isnan(hw)


def test_policy_from_logprobs_and_uniform_exploitability(chat_tok):
    # Through the game's evaluation hook, as the coordinator does.
    measure = games.evaluation("kuhn_poker_v0").measure("exploitability")
    decisions = measure.decisions()
    seqs, n_reply = policy_sequences(chat_tok, "You are a poker player.", decisions)
    k = len(SPELLINGS)
    assert len(seqs) == len(n_reply) == 12 * 2 * k
    assert all(s[-1] == chat_tok.eos_id for s in seqs)
    # Each reply is scored by its own tokens only: equal log-probs everywhere -> uniform.
    flat = [np.full(len(s), -0.1, np.float32) for s in seqs]
    dist, mass = policy_from_logprobs(flat, n_reply, decisions)
    assert set(dist) == set(kuhn_poker.INFO_STATES)
    assert all(sum(d.values()) == pytest.approx(1.0) for d in dist.values())
    assert measure.value(dist) == pytest.approx(kuhn_poker.exploitability({s: 0.5 for s in kuhn_poker.INFO_STATES}), abs=0.05)
    # Put all mass on the aggressive spellings at every state: always bet / call.
    sharp = [np.full(len(s), -0.01 if (i // k) % 2 else -30.0, np.float32) for i, s in enumerate(seqs)]
    dist, mass = policy_from_logprobs(sharp, n_reply, decisions)
    assert all(d["bet" if "bet" in d else "call"] > 0.999 for d in dist.values())
    assert measure.value(dist) == pytest.approx(1 / 3, abs=1e-3)
    # The equilibrium's own probabilities give exploitability 0 through the same path.
    eq = kuhn_poker.equilibrium_policy(0.2)
    exact = {d.infostate: {d.legal_moves[0]: 1 - eq[d.infostate], d.legal_moves[1]: eq[d.infostate]} for d in decisions}
    assert measure.value(exact) == pytest.approx(0.0, abs=1e-12)
    with pytest.raises(ValueError, match="log-prob rows"):
        policy_from_logprobs(flat[:-1], n_reply[:-1], decisions)


def test_summary_table_has_a_row_per_opponent_in_order():
    from rich.console import Console

    from games import GameEval
    from opentinker.eval.report import summary_table

    def ev(x):
        return {f"eval/main/vs_{o}/{k}": v for o in ("base", "referential_heuristic", "random")
                for k, v in (("chips", x), ("ci95", 0.1), ("invalid_rate", 0.5), ("hands", 12),
                             ("opponent_invalid_rate", 0.4 if o == "base" else 0.0))}

    console = Console(width=200, record=True)
    console.print(summary_table(ev(0.25), ev(0.75), ["main"], 3, GameEval(unit="chips", per="game")))
    text = console.export_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("│") and "vs" in ln]
    labels = [ln.split("│")[2].strip() for ln in lines]
    assert labels == [
        "chips/game vs random (95% CI)", "games vs random", "invalid replies vs random",
        "chips/game vs referential_heuristic (95% CI)", "invalid replies vs referential_heuristic",
        "chips/game vs base model (95% CI)", "invalid replies vs base", "opponent's invalid replies vs base",
    ]  # the opponent's invalid replies only where it made some (an LLM opponent)
    assert "+0.250 ± 0.100" in lines[3] and "+0.750 ± 0.100" in lines[3]


def test_pairing_metrics_count_the_opponents_invalid_replies_beside_the_policys():
    """A game the base model ends with an invalid reply is a "win" the policy did not play for:
    the pairing reports the opponent's invalid rate beside the policy's own."""
    from games import GameEval
    from opentinker.eval.evaluation import pairing_metrics
    from protocols.messages import EpisodeSpec, EpisodeSummary, PolicyKind, PolicyRef

    mine, base = PolicyRef(kind=PolicyKind.ADAPTER, name="main"), PolicyRef(kind=PolicyKind.BASE)
    specs, summaries = [], []
    for i, (seat, rewards, invalid, turns) in enumerate([
        ("player_0", {"player_0": 0.0, "player_1": -1.0}, {"player_1": 1}, {"player_0": 3, "player_1": 3}),
        ("player_1", {"player_0": -1.0, "player_1": 0.0}, {"player_0": 1, "player_1": 1}, {"player_0": 2, "player_1": 2}),
        ("player_0", {"player_0": 1.0, "player_1": -1.0}, {}, {"player_0": 4, "player_1": 3}),
    ]):
        other = "player_1" if seat == "player_0" else "player_0"
        specs.append(EpisodeSpec(episode_id=i, group_id=i % 2, game="connect_four_v3", seed=i,
                                 seats={seat: mine, other: base}))
        summaries.append(EpisodeSummary(episode_id=i, group_id=i % 2, seed=i, rewards=rewards, invalid=invalid,
                                        turns=turns))
    m = pairing_metrics(GameEval(unit="points", per="game", competitive=True), "main", specs, summaries)
    assert (m["wins"], m["draws"], m["losses"]) == (3.0, 0.0, 0.0)
    assert m["invalid_rate"] == pytest.approx(1 / 9)  # the policy's seat: 1 invalid of 3 + 2 + 4 turns
    assert m["opponent_invalid_rate"] == pytest.approx(2 / 8)  # the base's: 1 + 1 of 3 + 2 + 3


def test_record_decision_refuses_replies_that_lead_elsewhere():
    from games import tictactoe
    from games.evaluation import record_decision

    env = tictactoe.env(brief=True)
    env.reset(seed=0)
    d = record_decision(env, "X...O....", "player_x", 0, ("1", "5"), [str(c) for c in range(2, 10) if c != 5])
    assert d.replies == ("1",) and len(d.observations) == 2 and d.infostate == "X...O...."
    env.reset(seed=0)
    with pytest.raises(ValueError, match=r"replies \['1'\] lead to 'X\.\.\.\.\.\.\.\.'.*not player_x's"):
        record_decision(env, "X........", "player_x", 0, ("1",), ["2"])
