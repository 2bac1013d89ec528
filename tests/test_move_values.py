"""``train.move_values``: every legal move at each decision a step played, moved by the game's
exact value of it (tic-tac-toe's ``move_values`` against random and minimax). The values are
the game's (checked at every live position against an independent expectimax and minimax);
the term moves each legal move's logit by exactly its weight; the assembly puts the moves at
the decision positions; a real model's best move gains; a job asks for it only where it can
work, and a tiny tic-tac-toe job trains with it."""

from __future__ import annotations

import msgspec
import numpy as np
import pytest
import torch
from test_exact_gae import _job as exact_gae_job
from test_games_more import AGENT_OF, live_positions

from games.tictactoe import minimax_moves, move_values, state_value, winner_mark
from learners import assemble, compute_loss, move_weights
from learners.move_values import turn_move_values
from opentinker.config import ConfigError, JobConfig
from opentinker.control.config_checks import check_config
from opentinker.engine.shared_forward import Hidden, project_move_logprobs
from protocols.messages import (
    AdamParams,
    Datum,
    LoraSpec,
    ParseOutcome,
    PolicyKind,
    PolicyRef,
    StopReason,
    Trajectory,
    Turn,
)


def _after_vs_random(after: str, me: str) -> float:
    """``me``'s expected result having moved to ``after``, random to move, best play after
    (written here apart from the game's own)."""
    if winner_mark(after) is not None:
        return 1.0
    if "." not in after:
        return 0.0
    other = "O" if me == "X" else "X"
    replies = [after[:j] + other + after[j + 1:] for j in range(9) if after[j] == "."]
    return float(np.mean([-1.0 if winner_mark(r) else 0.0 if "." not in r else state_value(r, AGENT_OF[me], "random")
                          for r in replies]))


def test_each_cells_value_is_its_expected_result_with_best_play_after() -> None:
    live = live_positions()
    assert len(live) == 4520
    for board, mark in live.items():
        agent = AGENT_OF[mark]
        empty = [str(i + 1) for i in range(9) if board[i] == "."]
        vs_random = move_values(board, agent, "random")
        assert list(vs_random) == empty  # the legal moves, in their order
        for cell, v in vs_random.items():
            i = int(cell) - 1
            assert v == pytest.approx(_after_vs_random(board[:i] + mark + board[i + 1:], mark), abs=1e-12)
        assert max(vs_random.values()) == state_value(board, agent, "random")
        vs_minimax = move_values(board, agent, "tictactoe_minimax")
        assert set(vs_minimax.values()) <= {-1.0, 0.0, 1.0}
        best = max(vs_minimax.values())
        assert best == state_value(board, agent, "tictactoe_minimax")
        assert {str(c) for c in minimax_moves(board, mark)} <= {c for c, v in vs_minimax.items() if v == best}
    # A win now is worth 1, a missed block loses against minimax.
    assert move_values("XX.OO....", "player_x", "random")["3"] == 1.0
    assert move_values("XX..O....", "player_o", "tictactoe_minimax") == {
        "3": 0.0, "4": -1.0, "6": -1.0, "7": -1.0, "8": -1.0, "9": -1.0}
    for board, agent, opponent, match in [("XX.OO....", "player_o", "random", "X's move"),
                                          ("XXXOO....", "player_o", "random", "over"),
                                          ("XX.OO....", "player_x", "self", "not 'self'")]:
        with pytest.raises(ValueError, match=match):
            move_values(board, agent, opponent)


def test_the_term_moves_each_legal_moves_logit_by_its_weight() -> None:
    """``d loss / d z = -coef * w`` on a decision's legal moves' tokens, plus the gradient of
    ``-coef * log`` of their total probability; 0 at positions without moves; a continuation
    row (one token, weight 1) is that token's log-likelihood. The metrics count decisions and continuations, the legal moves' mass, the
    best moves' share of it and the continuation's probability."""
    torch.manual_seed(0)
    logits = torch.randn(4, 10, dtype=torch.float64, requires_grad=True)
    hidden = Hidden(h_U_H=logits, tokens_U=torch.zeros(4, dtype=torch.long), rows=[], taken=[])
    tokens = torch.tensor([[2, 5, 7], [-1, -1, -1], [1, 3, -1], [4, -1, -1]], dtype=torch.float32)  # gathered: float
    w = torch.tensor([[0.5, -0.25, -0.25], [0.0, 0.0, 0.0], [0.3, -0.3, 0.0], [1.0, 0.0, 0.0]])
    lp = project_move_logprobs(torch.nn.Identity(), hidden, torch.arange(4), tokens)
    out = compute_loss("move_values", torch.zeros(4), {"move_logprobs": lp, "move_weights": w, "move_tokens": tokens},
                       {"coef": 2.0})
    out.loss_sum.backward()
    p = torch.softmax(logits.detach(), -1)
    want = torch.zeros(4, 10, dtype=torch.float64)
    want[0, [2, 5, 7]] = torch.tensor([-1.0, 0.5, 0.5], dtype=torch.float64)
    want[2, [1, 3]] = torch.tensor([-0.6, 0.6], dtype=torch.float64)
    for row, legal in ((0, [2, 5, 7]), (2, [1, 3])):  # - log of the legal mass: p - p / mass on the legal
        want[row] += 2.0 * p[row]
        want[row, legal] -= 2.0 * p[row, legal] / p[row, legal].sum()
    want[3] = 2.0 * p[3]
    want[3, 4] -= 2.0
    torch.testing.assert_close(logits.grad, want)
    mass = [p[0, [2, 5, 7]].sum(), p[2, [1, 3]].sum()]
    assert (out.metrics["decisions"], out.metrics["continuations"]) == (2.0, 1.0)
    assert out.metrics["legal_mass"] == pytest.approx(float(sum(mass) / 2), rel=1e-5)
    assert out.metrics["best_share"] == pytest.approx(float((p[0, 2] / mass[0] + p[2, 1] / mass[1]) / 2), rel=1e-5)
    assert out.metrics["continuation_prob"] == pytest.approx(float(p[3, 4]), rel=1e-5)
    assert move_weights(np.array([1.0, 0.0, -0.5])) == pytest.approx([0.8333333, -0.1666667, -0.6666667])


def test_settled_moves_are_left_alone_and_the_rest_move_only_the_mix() -> None:
    """``settled``: a decision whose best move holds more than ``1 - settled`` of the legal
    mass loses every weight, and elsewhere a worse-than-average move under ``settled``; the
    others move the legal moves' log-shares (``d / d z_j = -coef * (k_j - q_j sum k)`` on the
    legal moves, nothing elsewhere), so a decision with nothing settled moves as the plain
    term does, and one wholly settled moves only its legal mass."""
    logits = torch.tensor([[4.5, 0.5, -3.0, 1.0, 0.5, 0.2],    # q about (0.981, 0.018, 0.0005): played right
                           [0.3, 0.1, -0.2, 0.0, 0.4, 0.6],    # nothing settled
                           [0.0, 1.0, -5.0, 0.3, 0.1, 0.0]],   # q about (0.27, 0.73, 0.002): move 2 settled
                          dtype=torch.float64, requires_grad=True)
    hidden = Hidden(h_U_H=logits, tokens_U=torch.zeros(3, dtype=torch.long), rows=[], taken=[])
    tokens = torch.tensor([[0, 1, 2]] * 3, dtype=torch.float32)
    w = torch.tensor([[0.6, -0.1, -0.5]] * 3)
    q = torch.softmax(logits.detach()[:, :3], -1)
    assert q[0, 0] > 0.98 and q[2, 2] < 0.02 < q[2, 0] < q[2, 1] and (q[1] > 0.02).all()

    def grad(settled: float) -> tuple[torch.Tensor, dict]:
        logits.grad = None
        lp = project_move_logprobs(torch.nn.Identity(), hidden, torch.arange(3), tokens)
        out = compute_loss("move_values", torch.zeros(3), {"move_logprobs": lp, "move_weights": w,
                                                            "move_tokens": tokens}, {"coef": 2.0, "settled": settled})
        out.loss_sum.backward()
        return logits.grad.clone(), out.metrics

    plain, m0 = grad(0.0)
    assert "settled_share" not in m0
    got, m = grad(0.02)
    assert m["settled_share"] == pytest.approx(4 / 9)  # row 0's three moves, row 2's worst
    torch.testing.assert_close(got[1], plain[1])  # nothing settled in row 1: the plain term
    p = torch.softmax(logits.detach(), -1)
    for row, kept in ((0, [0.0, 0.0, 0.0]), (2, [0.6, -0.1, 0.0])):
        want = 2.0 * p[row]  # - log of the legal mass, as in the plain term
        want[:3] -= 2.0 * p[row, :3] / p[row, :3].sum()
        k = torch.tensor(kept, dtype=torch.float64)
        want[:3] += -2.0 * (k - q[row] * k.sum())
        torch.testing.assert_close(got[row], want, atol=1e-6, rtol=1e-5)  # the term computes in float32
    from learners.move_values import settled_weights

    k = settled_weights(w, q.float(), torch.ones(3, 3, dtype=torch.bool), 0.02)
    torch.testing.assert_close(k, torch.tensor([[0.0, 0.0, 0.0], [0.6, -0.1, -0.5], [0.6, -0.1, 0.0]]))


def _turn(obs: int, sampled: list[int], replies: list[list[int]] | None = None,
          values: list[float] | None = None, by: dict[str, list[float]] | None = None) -> Turn:
    return Turn(obs_tokens=np.arange(100, 100 + obs, dtype=np.int32), sampled_tokens=np.asarray(sampled, np.int32),
                sampler_logprobs=np.full(len(sampled), -1.0, np.float32),
                policy=PolicyRef(kind=PolicyKind.ADAPTER, name="p"), stop_reason=StopReason.STOP, parse=ParseOutcome.OK,
                reward=0.0, move_tokens=None if replies is None else np.asarray(replies, np.int32),
                move_values=None if values is None else np.asarray(values, np.float32),
                move_values_by={o: np.asarray(v, np.float32) for o, v in (by or {}).items()})


def _trajectory(episode: int, turns: list[Turn], reward: float = 1.0) -> Trajectory:
    return Trajectory(episode_id=episode, group_id=0, seat="player_x", seed=0, policy="p", turns=turns,
                      total_reward=reward)


def _rows(datum: Datum) -> dict[int, tuple[list[int], list[float]]]:
    """The datum's move rows: position -> (tokens, weights)."""
    tokens, weights = datum.loss_inputs["move_tokens"], datum.loss_inputs["move_weights"]
    return {int(t): (tokens[t].tolist(), weights[t].tolist()) for t in np.nonzero((tokens >= 0).any(axis=1))[0]}


def test_the_assembly_puts_each_decisions_moves_and_the_replys_rest_at_their_positions() -> None:
    """Turn k's legal moves at its decision position (its first sampled token) weighted by
    value minus mean; after it, while the sampled reply is a legal move's canonical reply, that
    reply's next token with weight 1 (the stop token after "12" even where "9" was sampled);
    nothing after a reply that is no legal move's or once it leaves the canonical one."""
    a = _trajectory(0, [_turn(5, [12, 0], [[11, 0], [12, 0], [13, 0]], [1.0, 0.0, -1.0]), _turn(4, [7, 7])])
    b = _trajectory(1, [_turn(3, [21, 9], [[21, 0], [22, 0]], [0.5, 0.5]),
                        _turn(2, [99], [[23, 0], [24, 0], [25, 0], [26, 0]], [0, 0, 0, 1])], -1.0)
    c = _trajectory(2, [_turn(2, [31, 40, 0], [[31, 32, 0], [33, 0, -1]], [0.0, 1.0])])
    out = assemble([c, b, a], "dr_grpo", {}, moves=True)
    assert out.metrics["n_move_decisions"] == 4.0
    da, db, dc = out.datums
    assert da.loss_inputs["move_tokens"].shape == (13, 4) and db.loss_inputs["move_weights"].shape == (8, 4)
    assert _rows(da) == {5: ([11, 12, 13, -1], pytest.approx([1.0, 0.0, -1.0, 0.0])), 6: ([0, -1, -1, -1], [1, 0, 0, 0])}
    assert _rows(db) == {3: ([21, 22, -1, -1], [0, 0, 0, 0]), 4: ([0, -1, -1, -1], [1, 0, 0, 0]),
                         7: ([23, 24, 25, 26], pytest.approx([-0.25, -0.25, -0.25, 0.75]))}
    assert _rows(dc) == {2: ([31, 33, -1, -1], [-0.5, 0.5, 0, 0]), 3: ([32, -1, -1, -1], [1, 0, 0, 0])}
    assert "move_tokens" not in assemble([a], "dr_grpo", {}).datums[0].loss_inputs  # only when asked
    none = assemble([_trajectory(0, [_turn(5, [7, 7])])], "dr_grpo", {}, moves=True)
    assert none.datums[0].loss_inputs["move_tokens"].shape == (7, 1) and none.metrics["n_move_decisions"] == 0.0
    bad = _trajectory(0, [_turn(5, [11, 0], [[11, 0], [12, 0]], [1.0, float("nan")])])
    with pytest.raises(ValueError, match="episode 0 seat 'player_x' turn 0: move_values must be finite"):
        assemble([bad], "dr_grpo", {}, moves=True)
    odd = _trajectory(0, [_turn(5, [11, 0], [[11, 0], [12, 0]], [1.0])])
    with pytest.raises(ValueError, match="turn 0: move_tokens of shape"):
        assemble([odd], "dr_grpo", {}, moves=True)
    empty = _trajectory(0, [_turn(5, [11, 0], [[11, 0], [-1, -1]], [1.0, 0.0])])
    with pytest.raises(ValueError, match="turn 0: a legal move without reply tokens"):
        assemble([empty], "dr_grpo", {}, moves=True)


def test_move_values_against_weighs_each_opponents_values() -> None:
    """With ``move_values_against`` a decision's weights come from the weighted sum of its
    moves' values against the named opponents, not from the episode's own; an opponent the
    turn has no values against is refused, naming the turn."""
    by = {"random": [0.9, 0.2, -0.5], "tictactoe_minimax": [-1.0, 0.0, 0.0]}
    turn = _turn(5, [12, 0], [[11, 0], [12, 0], [13, 0]], by["random"], by)
    assert turn_move_values(turn).tolist() == pytest.approx(by["random"])
    mix = {"tictactoe_minimax": 1.0, "random": 0.5}
    assert turn_move_values(turn, mix).tolist() == pytest.approx([-0.55, 0.1, -0.25])
    (d,) = assemble([_trajectory(0, [turn])], "dr_grpo", {}, moves=True, move_values_against=mix).datums
    assert _rows(d)[5][1] == pytest.approx([-0.55 + 0.7 / 3, 0.1 + 0.7 / 3, -0.25 + 0.7 / 3], abs=1e-6)  # the safe cell best
    (own,) = assemble([_trajectory(0, [turn])], "dr_grpo", {}, moves=True).datums
    assert _rows(own)[5][1] == pytest.approx([0.7, 0.0, -0.7], abs=1e-6)  # against random alone the unsafe one is
    with pytest.raises(ValueError, match="episode 0 seat 'player_x' turn 0: move values against 'minimax' wanted, "
                                         "the turn has them against random, tictactoe_minimax"):
        assemble([_trajectory(0, [turn])], "dr_grpo", {}, moves=True, move_values_against={"minimax": 1.0})
    short = _turn(5, [12, 0], [[11, 0], [12, 0], [13, 0]], by["random"], {"random": [0.0, 1.0]})
    with pytest.raises(ValueError, match="turn 0: move values against 'random' of shape \\(2,\\), want \\(3,\\)"):
        assemble([_trajectory(0, [short])], "dr_grpo", {}, moves=True, move_values_against={"random": 1.0})


@pytest.mark.parametrize("engine", ["own", "peft"])
def test_a_models_best_move_gains_and_its_worst_loses(tiny_path, engine):
    """One step on the term alone (zero advantages: the policy loss has no gradient) raises
    the log-prob of the best move's token at the decision and lowers the worst's."""
    from opentinker.engine.host import ModelHost

    host = ModelHost(tiny_path, threads=1, engine=engine)
    host.create_adapter("p", LoraSpec(seed=1))
    rng = np.random.default_rng(0)
    tokens = rng.integers(10, 2000, 12).astype(np.int32)
    mask = np.zeros(12, np.float32)
    mask[9:] = 1
    moves = np.full((12, 3), -1, np.int32)
    moves[9] = [40, 41, 42]
    weights = np.zeros((12, 3), np.float32)
    weights[9] = [1.0, 0.0, -1.0]
    datum = Datum(tokens=tokens, loss_inputs={"mask": mask, "advantages": np.zeros(12, np.float32),
                                              "sampler_logprobs": -mask, "move_tokens": moves, "move_weights": weights})

    def logp() -> np.ndarray:
        seqs = [np.concatenate([tokens[:9], [t]]).astype(np.int32) for t in (40, 41, 42)]
        return np.array([host.logprobs("p", [s])[0][-1] for s in seqs])

    before = logp()
    _, metrics = host.forward_backward("p", [datum], "importance_sampling", {"move_values": 1.0}, 3.0)
    assert metrics["move_values/decisions"] == 1.0 and 0 < metrics["move_values/best_share"] < 1
    host.optim_step("p", AdamParams(lr=0.05))
    change = logp() - before
    assert change[0] > 0 > change[2] and change[0] > change[1] > change[2], change
    with pytest.raises(ValueError, match=r"needs \['move_tokens', 'move_weights'\]"):
        host.forward_backward("p", [Datum(tokens=tokens, loss_inputs={"mask": mask, "advantages": mask,
                                                                        "sampler_logprobs": -mask})],
                              "importance_sampling", {"move_values": 1.0}, 3.0)


def _job(tmp_path, train_over: dict | None = None, **over) -> JobConfig:
    """test_exact_gae's tiny tic-tac-toe job, trained with the term instead."""
    train = {"steps": 2, "checkpoint_every": 0, "groups_per_step": 2, "group_size": 2, "lr": 1e-2, "move_values": 1.0,
             **(train_over or {})}
    return exact_gae_job(tmp_path, **{"name": "moves", "train": train, **over})


def test_move_values_needs_a_game_that_values_moves_against_an_opponent(tmp_path):
    with pytest.raises(ConfigError, match="train.move_values: kuhn_poker_v0's evaluation hook gives no exact values "
                                          "of moves"):
        check_config(_job(tmp_path, game="kuhn_poker_v0", policies=[{"name": "main", "opponents": {"random": 1}}]))
    with pytest.raises(ConfigError, match="tictactoe_v0 values moves against random, tictactoe_minimax only, and the "
                                          "policy plays none of them"):
        check_config(_job(tmp_path, policies=[{"name": "main", "opponents": {"self": 1}}]))
    check_config(_job(tmp_path, policies=[{"name": "main", "opponents": {"self": 1, "random": 1}}]))
    check_config(_job(tmp_path))
    with pytest.raises(ConfigError, match="train.move_values_against: 'minimax': tictactoe_v0 values moves against "
                                          "random, tictactoe_minimax only"):
        check_config(_job(tmp_path, {"move_values_against": {"minimax": 1.0}}))
    check_config(_job(tmp_path, {"move_values_against": {"tictactoe_minimax": 1.0, "random": 0.5}}))
    with pytest.raises(msgspec.ValidationError, match="move_values_settled needs move_values > 0"):
        _job(tmp_path, {"move_values": 0.0, "move_values_settled": 0.02})
    with pytest.raises(msgspec.ValidationError, match="move_values_settled"):
        _job(tmp_path, {"move_values_settled": 0.5})
    for bad in ({"move_values": 0.0}, {"move_values_against": {"random": 0.0}}):
        with pytest.raises(msgspec.ValidationError, match="move_values_against needs move_values > 0 and a positive "
                                                          "weight"):
            _job(tmp_path, {"move_values_against": {"random": 1.0}, **bad})


def test_the_learner_gets_the_mix_of_move_values(tmp_path):
    """``train.move_values_against`` reaches the learner, whose assembly weighs by it."""
    from opentinker.control.runtime import _learner_kwargs

    mix = {"tictactoe_minimax": 1.0, "random": 0.5}
    kw = _learner_kwargs(_job(tmp_path, {"move_values_against": mix}), "tcp://127.0.0.1:1", "main", "")
    assert kw["move_values_against"] == mix and kw["loss_config"]["move_values"] == 1.0
    assert _learner_kwargs(_job(tmp_path), "tcp://127.0.0.1:1", "main", "")["move_values_against"] == {}
    # ``move_values_settled`` rides as the term's own setting: the main loss never sees it.
    from learners import split_terms, term_config

    lc = _learner_kwargs(_job(tmp_path, {"move_values_settled": 0.02}), "tcp://127.0.0.1:1", "main", "")["loss_config"]
    assert lc["move_values/settled"] == 0.02
    config, terms = split_terms(lc)
    assert "move_values/settled" not in config and terms["move_values"] == 1.0
    assert term_config(lc, "move_values", 1.0) == {"coef": 1.0, "settled": 0.02}


@pytest.mark.slow
def test_a_tictactoe_job_trains_on_its_moves_values(tmp_path, tiny_path):
    """Two steps of a real job (each move valued against minimax and random, whichever the
    episode played: the values against both cross the bus): the decisions against random and
    minimax carry their moves, and the term trains on them and on the rest of the replies that
    are legal moves."""
    from opentinker.run import run_job

    result = run_job(_job(tmp_path, {"move_values_against": {"tictactoe_minimax": 1.0, "random": 0.5}}))
    trains = [r for r in result.rows if r["kind"] == "train"]
    assert [r["step"] for r in trains] == [1, 2]
    for r in trains:
        assert r["train/main/n_move_decisions"] >= 4
        assert r["train/main/loss/move_values/decisions"] == r["train/main/n_move_decisions"]
        assert 0 < r["train/main/loss/move_values/best_share"] <= 1
        assert r["train/main/loss/move_values/continuations"] > 0  # the explored replies go on canonically
