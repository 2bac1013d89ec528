"""Evaluation helpers: stratified intervals, and a policy's exact measures (a game's hook).

* :func:`stratified_mean_ci`: the mean over equally weighted strata (start x seat) and its 95%
  normal interval, ``1.96 * sqrt(sum_h s_h^2 / n_h) / H``.
* :func:`policy_sequences` / :func:`policy_from_logprobs`: an LLM's probability of each legal
  move at each decision a game's :class:`~games.evaluation.ExactMeasure` lists comes from the
  teacher-forced log-probs of the canonical one-word replies (with the stop token), summed
  over their spellings ``bet``, ``Bet``, ``bet.``, ``Bet.`` and renormalised over the legal
  moves; the measure (e.g. an exploitability, OpenSpiel's NashConv / 2) is then exact.
  The mass the model puts on these replies at all is reported beside it
  (``canonical_mass``), with the invalid-reply rate of the evaluation games.
"""

from __future__ import annotations

import math
from typing import Sequence

import numpy as np

from games.evaluation import DecisionPoint
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
BARE = ("{}",)
"""The canonical reply alone: a quarter of the cost, for a best response at every step."""


def policy_sequences(
    tok: ChatTokenizer, system_prompt: str, decisions: Sequence[DecisionPoint],
    spellings: Sequence[str] = SPELLINGS,
) -> tuple[list[np.ndarray], list[int]]:
    """Token sequences (per decision, per legal move in order, each of its ``spellings``: the
    decision's dialogue, then the reply and the stop token) and, for each, the number of
    trailing reply tokens that score it."""
    seqs, n_reply = [], []
    for d in decisions:
        r = SeatRenderer(tok, system_prompt)
        for obs, reply in zip(d.observations[:-1], d.replies):
            r.observe(obs)
            r.add_reply(tok.encode(reply) + [tok.eos_id], stopped=True)
        r.observe(d.observations[-1])
        prefix = r.prompt()
        for move in d.legal_moves:
            for form in spellings:
                text = form.format(move, cap=move.capitalize())
                reply = np.asarray(tok.encode(text) + [tok.eos_id], dtype=np.int32)
                seqs.append(np.concatenate([prefix, reply]))
                n_reply.append(len(reply))
    return seqs, n_reply


def policy_from_logprobs(
    logprobs: Sequence[np.ndarray], n_reply: Sequence[int], decisions: Sequence[DecisionPoint],
    spellings: Sequence[str] = SPELLINGS,
) -> tuple[dict[str, dict[str, float]], float]:
    """``(distribution, canonical_mass)`` from the per-token log-probs of
    :func:`policy_sequences`' sequences (the same ``spellings``): ``{infostate: {move:
    probability}}`` over each decision's legal moves, and the mean probability the model puts
    on the canonical replies at all (1 = always canonical)."""
    k = len(spellings)
    expected = k * sum(len(d.legal_moves) for d in decisions)
    if len(logprobs) != expected or len(n_reply) != expected:
        raise ValueError(f"{len(logprobs)} log-prob rows and {len(n_reply)} reply lengths for {expected} scored "
                         f"replies of {len(decisions)} decisions")
    dist: dict[str, dict[str, float]] = {}
    mass = []
    j = 0
    for d in decisions:
        lp = [float(np.sum(logprobs[i][-n_reply[i]:])) for i in range(j, j + k * len(d.legal_moves))]
        j += k * len(d.legal_moves)
        top = max(lp)
        w = [math.exp(x - top) for x in lp]
        per_move = [sum(w[m * k:(m + 1) * k]) for m in range(len(d.legal_moves))]
        total = sum(per_move)
        dist[d.infostate] = {move: p / total for move, p in zip(d.legal_moves, per_move)}
        mass.append(math.exp(top) * total)
    return dist, float(np.mean(mass))
