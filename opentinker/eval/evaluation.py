"""Evaluation helpers: stratified intervals, and a policy's exact measures (a game's hook).

* :func:`stratified_mean_ci`: the mean over equally weighted strata (start x seat) and its 95%
  normal interval, ``1.96 * sqrt(sum_h s_h^2 / n_h) / H``; :func:`pairing_metrics`: one
  pairing's games as metrics (that mean and interval, invalid rate, wins / draws / losses).
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
from collections.abc import Sequence

import numpy as np

from games.evaluation import DecisionPoint, GameEval
from opentinker.rollout.render import ChatTokenizer, SeatRenderer
from protocols.messages import EpisodeSpec, EpisodeSummary, PolicyKind


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


def game_result(rewards: dict[str, float], seat: str) -> int:
    """0 (won), 1 (drawn) or 2 (lost) for ``seat``: won when its reward exceeds the mean
    reward of the other seats."""
    mine = rewards[seat]
    if len(rewards) == 1:  # a one-seat game (a task): nobody to beat
        return 1
    others = float(np.mean([r for a, r in rewards.items() if a != seat]))
    return 0 if mine > others else 1 if mine == others else 2


def pairing_metrics(game_eval: GameEval, policy: str, specs: Sequence[EpisodeSpec],
                    summaries: Sequence[EpisodeSummary]) -> dict[str, float]:
    """One pairing's metrics from its games (``specs[i]`` played as ``summaries[i]``; the
    policy's seat is the one its adapter held), without the ``eval/<policy>/vs_<opponent>/``
    prefix: the game's unit (stratified over ``EpisodeSpec.group_id``), ``ci95``,
    ``invalid_rate``, ``hands``, in a game with tools ``tool_calls`` and ``invalid_tool_calls``
    (per game, the policy's seat) and, in a competitive game, ``wins`` / ``draws`` / ``losses``
    (:func:`game_result`). ``opponent_invalid_rate``: the other seats' invalid replies per turn
    (0 for random and scripted seats; an LLM opponent's invalid reply often ends the game, a
    "win" the policy did not play for)."""
    strata: dict[int, list[float]] = {}
    invalid = turns = calls = bad_calls = their_invalid = their_turns = 0
    outcome = np.zeros(3, dtype=np.int64)  # wins, draws, losses
    for spec, s in zip(specs, summaries):
        seat = next(a for a, r in spec.seats.items() if r.kind is PolicyKind.ADAPTER and r.name == policy)
        strata.setdefault(spec.group_id, []).append(s.rewards[seat])
        invalid += s.invalid.get(seat, 0)
        turns += s.turns.get(seat, 0)
        calls += s.tool_calls.get(seat, 0)
        bad_calls += s.invalid_tool_calls.get(seat, 0)
        their_invalid += sum(n for a, n in s.invalid.items() if a != seat)
        their_turns += sum(n for a, n in s.turns.items() if a != seat)
        outcome[game_result(s.rewards, seat)] += 1
    mean, ci = stratified_mean_ci(list(strata.values()))
    out = {game_eval.unit: mean, "ci95": ci, "invalid_rate": invalid / max(turns, 1), "hands": float(len(specs)),
           "opponent_invalid_rate": their_invalid / max(their_turns, 1)}
    if any(s.tool_calls for s in summaries):
        out.update(tool_calls=calls / max(len(specs), 1), invalid_tool_calls=bad_calls / max(len(specs), 1))
    if game_eval.competitive:
        out.update(wins=float(outcome[0]), draws=float(outcome[1]), losses=float(outcome[2]))
    return out


SPELLINGS = ("{}", "{}.", "{cap}", "{cap}.")
"""Surface forms of a canonical reply that count as that reply."""
BARE = ("{}",)
"""The canonical reply alone: a quarter of the cost, for a best response at every step."""


def decision_prompt(tok: ChatTokenizer, system_prompt: str, d: DecisionPoint) -> np.ndarray:
    """``int32[T]``: the seat's conversation up to decision ``d`` as the runner renders it (each
    earlier observation, then the seat's reply closed by the stop token), ending with the
    generation prompt of its next reply."""
    r = SeatRenderer(tok, system_prompt)
    for obs, reply in zip(d.observations[:-1], d.replies):
        r.observe(obs)
        r.add_reply(tok.encode(reply) + [tok.eos_id], stopped=True)
    r.observe(d.observations[-1])
    return r.prompt()


def policy_sequences(
    tok: ChatTokenizer, system_prompt: str, decisions: Sequence[DecisionPoint],
    spellings: Sequence[str] = SPELLINGS,
) -> tuple[list[np.ndarray], list[int]]:
    """Token sequences (per decision, per legal move in order, each of its ``spellings``: the
    decision's dialogue, then the reply and the stop token) and, for each, the number of
    trailing reply tokens that score it."""
    seqs, n_reply = [], []
    for d in decisions:
        prefix = decision_prompt(tok, system_prompt, d)
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
