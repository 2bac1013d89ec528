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
                for k, v in (("chips", x), ("ci95", 0.1), ("invalid_rate", 0.5), ("hands", 12))}

    console = Console(width=200, record=True)
    console.print(summary_table(ev(0.25), ev(0.75), ["main"], 3, GameEval(unit="chips", per="game")))
    text = console.export_text()
    lines = [ln for ln in text.splitlines() if ln.startswith("│") and "vs" in ln]
    labels = [ln.split("│")[2].strip() for ln in lines]
    assert labels == [
        "chips/game vs random (95% CI)", "games vs random", "invalid replies vs random",
        "chips/game vs referential_heuristic (95% CI)", "invalid replies vs referential_heuristic",
        "chips/game vs base model (95% CI)", "invalid replies vs base",
    ]
    assert "+0.250 ± 0.100" in lines[3] and "+0.750 ± 0.100" in lines[3]
