import math

import numpy as np
import pytest

from games import kuhn_poker
from opentinker.evaluation import SPELLINGS, kuhn_policy_from_logprobs, kuhn_policy_sequences, stratified_mean_ci


def test_stratified_interval_by_hand():
    mean, hw = stratified_mean_ci([[1.0, -1.0], [2.0, 2.0, 2.0]])
    assert mean == pytest.approx(1.0)
    # var = (s1^2/n1 + s2^2/n2) / H^2 = (2/2 + 0/3) / 4
    assert hw == pytest.approx(1.96 * math.sqrt(0.25))


def test_policy_from_logprobs_and_uniform_exploitability(chat_tok):
    seqs, n_reply = kuhn_policy_sequences(chat_tok, "You are a poker player.")
    k = len(SPELLINGS)
    assert len(seqs) == len(n_reply) == 12 * 2 * k
    assert all(s[-1] == chat_tok.eos_id for s in seqs)
    # Each reply is scored by its own tokens only: equal log-probs everywhere -> uniform.
    flat = [np.full(len(s), -0.1, np.float32) for s in seqs]
    policy, mass = kuhn_policy_from_logprobs(flat, n_reply)
    assert kuhn_poker.exploitability(policy) == pytest.approx(kuhn_poker.exploitability({s: 0.5 for s in kuhn_poker.INFO_STATES}), abs=0.05)
    # Put all mass on the aggressive spellings at every state: always bet / call.
    sharp = [np.full(len(s), -0.01 if (i // k) % 2 else -30.0, np.float32) for i, s in enumerate(seqs)]
    policy, mass = kuhn_policy_from_logprobs(sharp, n_reply)
    assert all(p > 0.999 for p in policy.values())
    assert kuhn_poker.exploitability(policy) == pytest.approx(1 / 3, abs=1e-3)
