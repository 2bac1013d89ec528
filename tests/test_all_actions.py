"""The exact all-actions gradient (``train.all_actions``): its weights are the gradient of the
payoff with respect to each decision's move logits, following them against a best response
finds Kuhn poker's equilibrium, and a job trains on them."""

from __future__ import annotations

import json
import math

import msgspec
import numpy as np
import pytest

from games.kuhn_poker import _MOVES, EVALUATION, INFO_STATES, exploitability
from learners.all_actions import all_actions_datums, all_actions_weights
from opentinker.config import JobConfig
from opentinker.control.config_checks import ConfigError, check_config
from opentinker.control.all_actions import pure, trained_rows, uniform

M = EVALUATION.measure("exploitability")
DECISIONS = M.decisions()


def _dist(logits: dict[str, float]) -> dict[str, dict[str, float]]:
    """P(aggressive move) = sigmoid(logit) at each decision."""
    out = {}
    for s in INFO_STATES:
        passive, aggressive = _MOVES[s[1:]]
        p = 1.0 / (1.0 + math.exp(-logits[s]))
        out[s] = {passive: 1.0 - p, aggressive: p}
    return out


def _aggressive(dist) -> dict[str, float]:
    return {s: dist[s][_MOVES[s[1:]][1]] for s in INFO_STATES}


def test_the_weights_are_the_payoffs_gradient_in_each_decisions_logits():
    rng = np.random.default_rng(0)
    logits = {s: float(rng.normal()) for s in INFO_STATES}
    dist = _dist(logits)
    opponents = [(0.5, pure(dict(M.best_response(dist)), DECISIONS)), (0.3, uniform(DECISIONS)), (0.2, dist)]
    fixed = [(w, {k: dict(v) for k, v in o.items()}) for w, o in opponents]  # the opponents held fixed
    weights, value = all_actions_weights(M.payoff, dist, fixed, rule="gradient")
    assert value == pytest.approx(sum(w * M.payoff(dist, o) for w, o in fixed))
    eps = 1e-6
    for s in INFO_STATES:
        assert sum(weights[s].values()) == pytest.approx(0.0, abs=1e-12)  # the renormalisation is in them
        up = dict(logits, **{s: logits[s] + eps})
        down = dict(logits, **{s: logits[s] - eps})
        numeric = sum(w * (M.payoff(_dist(up), o) - M.payoff(_dist(down), o)) for w, o in fixed) / (2 * eps)
        assert weights[s][_MOVES[s[1:]][1]] == pytest.approx(numeric, abs=1e-7), s
    with_mass, _ = all_actions_weights(M.payoff, dist, fixed, canonical=0.5, rule="gradient")
    for s in INFO_STATES:
        for a in dist[s]:
            assert with_mass[s][a] == pytest.approx(weights[s][a] + 0.5 * dist[s][a])
    for bad in ([], [(-1.0, dist)], [(0.0, dist)], [(math.inf, dist)]):
        with pytest.raises(ValueError, match="opponent"):
            all_actions_weights(M.payoff, dist, bad)
    with pytest.raises(ValueError, match="rule"):
        all_actions_weights(M.payoff, dist, fixed, rule="adam")
    some = set(INFO_STATES[::3])  # weighing only some decisions gives theirs, unchanged, and the same value
    for rule in ("gradient", "neurd"):
        whole, v_whole = all_actions_weights(M.payoff, dist, fixed, canonical=0.5, rule=rule)
        part, v_part = all_actions_weights(M.payoff, dist, fixed, canonical=0.5, rule=rule, at=some)
        assert part == {s: whole[s] for s in some} and v_part == v_whole


def _descend(logits: dict[str, float], rule: str, steps: int, lr: float) -> float:
    """``steps`` plain steps on each decision's logit against a best response; the
    exploitability at the end."""
    for _ in range(steps):
        dist = _dist(logits)
        w, _ = all_actions_weights(M.payoff, dist, [(1.0, pure(dict(M.best_response(dist)), DECISIONS))], rule=rule)
        for s in INFO_STATES:
            passive, aggressive = _MOVES[s[1:]]
            logits[s] += lr * (w[s][aggressive] - w[s][passive]) / (2.0 if rule == "gradient" else 1.0)
    return exploitability(_aggressive(_dist(logits)))


def test_neurd_moves_a_nearly_pure_policy_where_the_gradient_stalls():
    """From a nearly pure policy (every logit at +-6, exploitability 1/3 or more), the
    gradient's ``pi (1 - pi)`` keeps it there; NeuRD's weights do not shrink and it gets
    below 0.15 within 150 steps. The weights are each move's value over the decision's mean."""
    sat = {s: (6.0 if i % 2 else -6.0) for i, s in enumerate(INFO_STATES)}
    start = exploitability(_aggressive(_dist(sat)))
    assert start >= 1 / 3 - 1e-6
    assert _descend(dict(sat), "gradient", 150, 3.0) > 0.3
    assert _descend(dict(sat), "neurd", 150, 3.0) < 0.15
    dist = _dist(sat)
    w, _ = all_actions_weights(M.payoff, dist, [(1.0, uniform(DECISIONS))], canonical=0.25)
    for s in INFO_STATES:
        assert sum(w[s].values()) == pytest.approx(0.25)  # the advantages sum to 0, the canonical term to 0.25


def test_following_them_against_a_best_response_finds_the_equilibrium():
    """Exploitability descent (Lockhart et al. 2019) in a table of logits: from uniform play
    (0.458) to below 0.1 in 100 plain gradient steps (with a constant step the last iterate
    then circles the equilibrium at about 0.03-0.06)."""
    logits = {s: 0.0 for s in INFO_STATES}
    start = exploitability(_aggressive(_dist(logits)))
    for _ in range(100):
        dist = _dist(logits)
        weights, _ = all_actions_weights(M.payoff, dist, [(1.0, pure(dict(M.best_response(dist)), DECISIONS))],
                                         rule="gradient")
        for s in INFO_STATES:
            logits[s] += 20.0 * weights[s][_MOVES[s[1:]][1]]
    end = exploitability(_aggressive(_dist(logits)))
    assert start == pytest.approx(11 / 24) and end < 0.1, end


def test_each_scored_reply_becomes_a_datum_with_its_weight_on_the_reply():
    seqs = [np.arange(10, dtype=np.int32), np.arange(7, dtype=np.int32)]
    datums = all_actions_datums(seqs, [2, 3], [np.array([-0.5, -0.25], np.float32), np.array([-1, -2, -3], np.float32)],
                                [0.75, -0.5])
    assert [d.tokens.tolist() for d in datums] == [s.tolist() for s in seqs]
    np.testing.assert_array_equal(datums[0].loss_inputs["mask"], [0] * 8 + [1, 1])
    np.testing.assert_array_equal(datums[0].loss_inputs["advantages"], [0] * 8 + [0.75, 0.75])
    np.testing.assert_array_equal(datums[1].loss_inputs["sampler_logprobs"], [0] * 4 + [-1, -2, -3])
    with pytest.raises(ValueError, match="weights"):
        all_actions_datums(seqs, [2, 3], [np.zeros(2), np.zeros(3)], [1.0])


def _job(tmp_path, **over) -> JobConfig:
    raw = {"name": "aa", "out_dir": str(tmp_path), "game": "kuhn_poker_v0",
           "model": {"base": "tiny-random", "threads": 1, "device": "cpu"},
           "runtime": {"backend": "local", "env_runners": 1, "timeout_s": 120},
           "train": {"steps": 2, "checkpoint_every": 0, "groups_per_step": 2, "group_size": 2, "lr": 1e-2,
                     "all_actions": 1.0, "all_actions_only": True, "canonical_coef": 0.1},
           "sampling": {"max_tokens": 3},
           "eval": {"every": 0, "hands_per_stratum": 1, "head_to_head_per_stratum": 0, "cross_play_per_stratum": 0},
           "league": {"snapshot_every": 1, "keep": 2, "matchmaking": "hard"},
           "policies": [{"name": "main", "opponents": {"best_response": 2, "past": 1, "random": 1}}]}
    for k, v in over.items():
        raw[k] = {**raw[k], **v} if isinstance(v, dict) and isinstance(raw.get(k), dict) else v
    return msgspec.convert(raw, JobConfig)


def test_a_config_asking_for_what_cannot_be_computed_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="train.all_actions: tictactoe_v0's evaluation hook gives no exact payoff"):
        check_config(_job(tmp_path, game="tictactoe_v0", policies=[{"name": "main", "opponents": {"random": 1}}]))
    with pytest.raises(ConfigError, match="'kuhn_equilibrium': the all-actions gradient needs"):
        check_config(_job(tmp_path, policies=[{"name": "main", "opponents": {"kuhn_equilibrium": 1}}]))
    with pytest.raises(msgspec.ValidationError, match="not with a critic"):
        _job(tmp_path, train={"advantage": "gae"})
    with pytest.raises(msgspec.ValidationError, match="need all_actions > 0"):
        _job(tmp_path, train={"all_actions": 0.0})
    with pytest.raises(msgspec.ValidationError, match="all_actions_decisions and canonical_coef need all_actions"):
        _job(tmp_path, train={"all_actions": 0.0, "all_actions_only": False, "canonical_coef": 0.0,
                              "all_actions_decisions": 4})
    with pytest.raises(msgspec.ValidationError, match="all_actions_decisions"):
        _job(tmp_path, train={"all_actions_decisions": -1})


def test_a_step_trains_the_replies_of_its_drawn_decisions_only():
    """``train.all_actions_decisions = k``: the rows of k whole decisions (every legal move's
    reply of each, in the scored order), drawn afresh each step and the same on a rerun of
    that step; 0 or k >= the decisions: every row."""
    sizes = [2, 3, 2, 4, 2, 3]  # legal moves per decision
    decisions = [type("D", (), {"legal_moves": tuple("m" * i for i in range(1, n + 1))})() for n in sizes]
    starts = np.cumsum([0] + sizes)
    every = list(range(int(starts[-1])))
    assert trained_rows(decisions, 0, (0, 1)) == every and trained_rows(decisions, 9, (0, 1)) == every
    drawn = [trained_rows(decisions, 3, (0, step)) for step in range(1, 6)]
    for rows in drawn:
        whole = [j for j in range(len(sizes)) if starts[j] in rows]
        assert len(whole) == 3  # three decisions, each with every one of its replies, in order
        assert rows == [i for j in whole for i in range(starts[j], starts[j + 1])]
    assert len({tuple(r) for r in drawn}) > 1  # a fresh draw each step
    assert trained_rows(decisions, 3, (0, 2)) == drawn[1]  # a resumed step draws the same
    assert trained_rows(decisions, 3, (1, 2)) != drawn[1] or trained_rows(decisions, 3, (2, 2)) != drawn[1]


@pytest.mark.slow
def test_a_job_trains_on_the_all_actions_datums_alone(tmp_path, tiny_path, monkeypatch):
    """Three steps on the tiny model: each step the learner gets one datum per decision and
    legal move (24) and trains on them alone; the payoff against the mix and the canonical
    mass are logged, and the policy's exploitability is measured at every step. The policy is
    scored afresh at every step, a league snapshot (frozen) once while it is in the league."""
    from collections import Counter

    from opentinker.control.coordinator import BARE, SPELLINGS, Coordinator
    from opentinker.run import run_job

    scored: Counter[str] = Counter()
    real = Coordinator._score_replies

    async def counting(self, policy, m, spellings=SPELLINGS):
        if spellings == BARE:  # the training step's scoring (evaluations score other spellings)
            scored[policy] += 1
        return await real(self, policy, m, spellings)

    monkeypatch.setattr(Coordinator, "_score_replies", counting)
    res = run_job(_job(tmp_path, train={"steps": 3}), run_dir=tmp_path / "run")
    rows = [json.loads(line) for line in (res.run_dir / "metrics.jsonl").read_text().splitlines()]
    trains = [r for r in rows if r["kind"] == "train"]
    assert len(trains) == 3
    for r in trains:
        assert r["train/main/all_actions_datums"] == 24.0 and r["train/main/all_actions/decisions"] == 12.0
        assert math.isfinite(r["train/main/all_actions/payoff"]) and 0 < r["train/main/all_actions/canonical_mass"] < 1
        assert 0 <= r["train/main/exploitability"] <= 1.5 and r["train/main/grad_norm"] > 0
    assert trains[0]["train/main/version"] < trains[1]["train/main/version"] < trains[2]["train/main/version"]
    # main at each step; main__s1 is in the past pool of steps 2 and 3, scored at the first.
    assert scored["main"] == 3 and scored["main__s1"] == 1, scored
    assert set(scored) <= {"main", "main__s1", "main__s2"} and scored["main__s2"] <= 1, scored


def test_a_linear_schedule_lowers_the_learning_rate_to_the_last_step(tmp_path):
    """``train.lr_schedule = "linear"``: step s of n trains at ``lr * (1 - (s - 1) / n)``."""
    from opentinker.control.runtime import _learner_kwargs
    from opentinker.training.learner import Learner
    from protocols.messages import AdamParams

    cfg = _job(tmp_path, train={"steps": 4, "lr_schedule": "linear", "lr": 0.5})
    kw = _learner_kwargs(cfg, "tcp://127.0.0.1:1", "main", "")
    assert kw["lr_decay_steps"] == 4
    learner = Learner("main", "tcp://127.0.0.1:1", "dr_grpo", "ppo", {}, AdamParams(lr=0.5, grad_clip=2.0),
                      lr_decay_steps=kw["lr_decay_steps"])
    assert [learner.adam_at(s).lr for s in (1, 2, 3, 4)] == [0.5, 0.375, 0.25, 0.125]
    assert learner.adam_at(3).grad_clip == 2.0
    assert _learner_kwargs(_job(tmp_path), "tcp://127.0.0.1:1", "main", "")["lr_decay_steps"] == 0
