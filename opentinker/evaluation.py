"""Evaluation helpers: stratified intervals, and an LLM policy's exact Kuhn exploitability.

* :func:`stratified_mean_ci`: the mean over equally weighted strata (deal x seat) and its 95%
  normal interval, ``1.96 * sqrt(sum_h s_h^2 / n_h) / H``.
* :func:`kuhn_policy_sequences` / :func:`kuhn_policy_from_logprobs`: an LLM's probability of
  each legal action at each of Kuhn poker's 12 information states comes from the
  teacher-forced log-probs of the canonical one-word replies (with the stop token),
  renormalised over the two legal moves; the policy's exploitability is then exact
  (``games.kuhn_poker.exploitability``, OpenSpiel's NashConv / 2).
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from games import kuhn_poker
from opentinker.render import ChatTokenizer, SeatRenderer


def stratified_mean_ci(strata: Sequence[Sequence[float]], z: float = 1.96) -> tuple[float, float]:
    """``(mean, half_width)`` of the equally weighted mean over strata."""
    strata = [np.asarray(s, dtype=np.float64) for s in strata if len(s)]
    if not strata:
        return float("nan"), float("nan")
    H = len(strata)
    mean = float(np.mean([s.mean() for s in strata]))
    var = sum((s.var(ddof=1) if len(s) > 1 else 0.0) / len(s) for s in strata) / H**2
    return mean, z * math.sqrt(var)


def kuhn_policy_sequences(tok: ChatTokenizer, system_prompt: str) -> tuple[list[np.ndarray], list[int]]:
    """Token sequences (2 per information state, passive move first) and, for each, the
    number of trailing reply tokens whose log-probs score the move."""
    seqs, n_reply = [], []
    for d in kuhn_poker.decision_dialogues():
        r = SeatRenderer(tok, system_prompt)
        for obs, reply in zip(d.observations[:-1], d.replies):
            r.observe(obs)
            r.add_reply(tok.encode(reply) + [tok.eos_id], stopped=True)
        r.observe(d.observations[-1])
        prefix = r.prompt()
        for move in d.legal_moves:
            reply = np.asarray(tok.encode(move) + [tok.eos_id], dtype=np.int32)
            seqs.append(np.concatenate([prefix, reply]))
            n_reply.append(len(reply))
    return seqs, n_reply


def kuhn_policy_from_logprobs(
    logprobs: Sequence[np.ndarray], n_reply: Sequence[int]
) -> tuple[dict[str, float], float]:
    """``(policy, canonical_mass)``: P(aggressive move) per information state, and the mean
    probability the model puts on the two canonical replies at all (1 = always canonical)."""
    policy: dict[str, float] = {}
    mass = []
    for i, state in enumerate(kuhn_poker.INFO_STATES):
        lp = [float(np.sum(logprobs[2 * i + j][-n_reply[2 * i + j]:])) for j in (0, 1)]
        top = max(lp)
        w = [math.exp(x - top) for x in lp]
        policy[state] = w[1] / (w[0] + w[1])
        mass.append(math.exp(top) * (w[0] + w[1]))
    return policy, float(np.mean(mass))
