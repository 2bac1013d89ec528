"""The exact all-actions policy gradient of a small game, from its payoff function.

Where a game can compute a policy's expected payoff exactly from its action probabilities (a
:class:`~games.evaluation.ExactMeasure` with ``payoff``: Kuhn poker's 12 decisions), the
gradient of that payoff needs no sampled episodes. The payoff ``V`` against a fixed opponent is
linear in the probabilities at each one decision ``s`` (each decision is met at most once in a
game), so ``V = sum_a pi(a|s) Q(s, a)`` with ``Q(s, a)`` the payoff when ``s`` always plays
``a``, and with ``pi(.|s)`` a softmax over the legal moves' scores (here the model's log-probs
of their canonical replies),

    dV / d log p(a|s) = pi(a|s) (Q(s, a) - V),

the all-actions policy gradient (every move weighted by its probability and value, not one
sampled move by its return), exact rather than estimated. Against a best response to the current policy it is the
exploitability descent of Lockhart et al. (2019, "Computing approximate equilibria in
sequential adversarial games by exploitability descent"); against a mixture of opponents
(past selves, random play) it is the gradient of the mixture's payoff.

That gradient vanishes where the policy is nearly pure (``pi(a|s) (1 - pi(a|s))`` in a
two-move decision): a small model that starts out always saying one word never moves. The
default rule is therefore Neural Replicator Dynamics (Hennes et al. 2020, "Neural Replicator
Dynamics: multiagent learning via hedging policy gradients"): each move's score moves by its
advantage over the decision's mean, ``Q(s, a) - mean_b Q(s, b)``, without the ``pi(a|s)``
factor, and no further than a threshold (``rule="neurd"``; ``"gradient"`` is the gradient
above). Both are zero at an
equilibrium's mixed decisions, where the moves' values are equal.

Each ``(s, a)`` becomes a datum whose reply tokens carry that weight as their advantage: a
policy loss at ratio 1 then has exactly this gradient. The weights of one decision sum to 0
(without the canonical term), so the renormalisation over the legal moves is already in them. ``canonical`` adds
``canonical * pi(a|s)`` to each weight: the gradient of ``log sum_a p(a|s)``, the model's total
probability of the canonical replies, which keeps the exact measure describing what the policy
actually says without moving the mix between moves.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from protocols.messages import Datum

RULES = ("neurd", "gradient")
"""The update rules of :func:`all_actions_weights`."""

Distribution = Mapping[str, Mapping[str, float]]
"""``{decision: {move: probability}}``, each inner mapping summing to 1."""


def _pure(dist: Distribution, s: str, move: str) -> dict[str, Mapping[str, float]]:
    out = dict(dist)
    out[s] = {m: float(m == move) for m in dist[s]}
    return out


def all_actions_weights(
    payoff: Callable[[Distribution, Distribution], float],
    dist: Distribution,
    opponents: Sequence[tuple[float, Distribution]],
    canonical: float = 0.0,
    rule: str = "neurd",
    floor: float = 0.01,
    at: Collection[str] | None = None,
) -> tuple[dict[str, dict[str, float]], float]:
    """Per decision and move, ``Q(s, a) - mean_b Q(s, b)`` (``rule="neurd"``) or
    ``pi(a|s) (Q(s, a) - V(s))`` (``"gradient"``), plus ``canonical * pi(a|s)``; and the
    payoff ``V`` of ``dist`` against the opponents.

    Args:
        payoff: the expected payoff per game of the first policy against the second (seats
            averaged); linear in the probabilities at each decision.
        dist: the policy, ``{decision: {move: probability}}``.
        opponents: ``[(weight, distribution)]``; weights >= 0 with a positive sum (they are
            normalised), e.g. a best response to ``dist`` and past selves.
        canonical: the weight of the canonical replies' total probability.
        rule: ``"neurd"`` or ``"gradient"``.
        floor: NeuRD's threshold (Hennes et al. stop a logit at a bound), on probabilities: a
            move below ``floor`` is pushed no further down, one above ``1 - floor`` no further up.
        at: the decisions to weigh (each costs a payoff per legal move); None: every one. A
            decision's weights do not depend on which others are weighed.

    Raises:
        ValueError: no opponent, a negative or non-finite weight, all weights zero, or an
            unknown rule.
    """
    if rule not in RULES:
        raise ValueError(f"rule: unknown {rule!r}, expected one of {', '.join(RULES)}")
    if not opponents:
        raise ValueError("all_actions_weights needs at least one opponent")
    ws = [w for w, _ in opponents]
    if any(not (w >= 0 and w < float("inf")) for w in ws) or sum(ws) <= 0:
        raise ValueError(f"opponent weights must be finite, >= 0 and not all 0; got {ws}")
    total = sum(ws)
    mix = [(w / total, o) for w, o in opponents if w > 0]

    def value(d: Distribution) -> float:
        return sum(w * payoff(d, o) for w, o in mix)

    v = value(dist)
    weights: dict[str, dict[str, float]] = {}
    for s, probs in dist.items():
        if at is not None and s not in at:
            continue
        q = {a: value(_pure(dist, s, a)) for a in probs}
        if rule == "neurd":
            mean = sum(q.values()) / len(q)
            adv = {a: q[a] - mean for a in probs}
            # NeuRD's threshold: no push down for a move already below `floor`, none up for one
            # above 1 - floor (a shared model otherwise spends its update on moves decided long
            # ago: pushing a nearly dead reply's tokens down also moves them where they are wanted).
            adv = {a: 0.0 if (x < 0 and probs[a] < floor) or (x > 0 and probs[a] > 1 - floor) else x
                   for a, x in adv.items()}
            weights[s] = {a: adv[a] + canonical * probs[a] for a in probs}
        else:
            v_s = sum(probs[a] * q[a] for a in probs)  # = v, up to rounding (linearity at s)
            weights[s] = {a: probs[a] * (q[a] - v_s) + canonical * probs[a] for a in probs}
    return weights, v


def all_actions_datums(
    sequences: Sequence[np.ndarray], n_reply: Sequence[int], logprobs: Sequence[np.ndarray],
    weights: Sequence[float],
) -> list[Datum]:
    """One datum per scored reply: ``sequences[i]`` (``int32[T_i]``: a decision's dialogue,
    then the reply and its stop token), the last ``n_reply[i]`` tokens in the loss with
    advantage ``weights[i]`` and the scoring's log-probs as the sampler's (``logprobs[i]``:
    ``float32[>= n_reply[i]]``, the last ones those of the reply), so the ratio starts at 1."""
    if not len(sequences) == len(n_reply) == len(logprobs) == len(weights):
        raise ValueError(f"{len(sequences)} sequences, {len(n_reply)} reply lengths, {len(logprobs)} log-prob rows "
                         f"and {len(weights)} weights")
    out = []
    for seq, n, lp, w in zip(sequences, n_reply, logprobs, weights):
        t = len(seq)
        mask = np.zeros(t, np.float32)
        mask[t - n:] = 1.0
        sampler = np.zeros(t, np.float32)
        sampler[t - n:] = np.asarray(lp, np.float32)[-n:]
        out.append(Datum(tokens=np.asarray(seq, np.int32),
                         loss_inputs={"mask": mask, "advantages": mask * np.float32(w), "sampler_logprobs": sampler}))
    return out
