"""Evaluation helpers: stratified intervals, and an LLM policy's exact Kuhn exploitability.

* :func:`stratified_mean_ci`: the mean over equally weighted strata (deal x seat) and its 95%
  normal interval, ``1.96 * sqrt(sum_h s_h^2 / n_h) / H``.
* :func:`kuhn_policy_sequences` / :func:`kuhn_policy_from_logprobs`: an LLM's probability of
  each legal action at each of Kuhn poker's 12 information states comes from the
  teacher-forced log-probs of the canonical one-word replies (with the stop token), summed
  over their spellings ``bet``, ``Bet``, ``bet.``, ``Bet.`` and renormalised over the two
  legal moves; the policy's exploitability is then exact (``games.kuhn_poker.exploitability``,
  OpenSpiel's NashConv / 2). The mass the model puts on these replies at all is reported
  beside it (``canonical_mass``), with the invalid-reply rate of the evaluation games.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from games import kuhn_poker
from opentinker.rollout.render import ChatTokenizer, SeatRenderer


def stratified_mean_ci(strata: Sequence[Sequence[float]], z: float = 1.96) -> tuple[float, float]:
    """``(mean, half_width)`` of the equally weighted mean over strata; the half width is NaN
    when a stratum has a single sample (its variance is unknown, not zero)."""
    strata = [np.asarray(s, dtype=np.float64) for s in strata if len(s)]
    if not strata:
        return float("nan"), float("nan")
    H = len(strata)
    mean = float(np.mean([s.mean() for s in strata]))
    if any(len(s) < 2 for s in strata):
        return mean, float("nan")
    var = sum(s.var(ddof=1) / len(s) for s in strata) / H**2
    return mean, z * math.sqrt(var)


SPELLINGS = ("{}", "{}.", "{cap}", "{cap}.")
"""Surface forms of a canonical reply that count as that reply."""


def kuhn_policy_sequences(tok: ChatTokenizer, system_prompt: str) -> tuple[list[np.ndarray], list[int]]:
    """Token sequences (per information state: the passive move's spellings, then the
    aggressive move's) and, for each, the number of trailing reply tokens that score it."""
    seqs, n_reply = [], []
    for d in kuhn_poker.decision_dialogues():
        r = SeatRenderer(tok, system_prompt)
        for obs, reply in zip(d.observations[:-1], d.replies):
            r.observe(obs)
            r.add_reply(tok.encode(reply) + [tok.eos_id], stopped=True)
        r.observe(d.observations[-1])
        prefix = r.prompt()
        for move in d.legal_moves:
            for form in SPELLINGS:
                text = form.format(move, cap=move.capitalize())
                reply = np.asarray(tok.encode(text) + [tok.eos_id], dtype=np.int32)
                seqs.append(np.concatenate([prefix, reply]))
                n_reply.append(len(reply))
    return seqs, n_reply


def kuhn_policy_from_logprobs(
    logprobs: Sequence[np.ndarray], n_reply: Sequence[int]
) -> tuple[dict[str, float], float]:
    """``(policy, canonical_mass)``: P(aggressive move) per information state, and the mean
    probability the model puts on the two canonical replies at all (1 = always canonical)."""
    k = len(SPELLINGS)
    policy: dict[str, float] = {}
    mass = []
    for i, state in enumerate(kuhn_poker.INFO_STATES):
        lp = [float(np.sum(logprobs[j][-n_reply[j]:])) for j in range(2 * k * i, 2 * k * (i + 1))]
        top = max(lp)
        w = [math.exp(x - top) for x in lp]
        passive, aggressive = sum(w[:k]), sum(w[k:])
        policy[state] = aggressive / (passive + aggressive)
        mass.append(math.exp(top) * (passive + aggressive))
    return policy, float(np.mean(mass))
