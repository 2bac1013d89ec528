"""Exact tic-tac-toe outcomes of a policy (``games.tictactoe.exact_outcomes``): known values of
random play, an independent recursion over boards for deterministic policies, pruning,
blunders, refusals; and the benchmark that scores a model with it."""

from __future__ import annotations

import json
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest
from conftest import check_provenance

from games.tictactoe import (
    AGENTS,
    EMPTY,
    MARKS,
    board_after,
    exact_outcomes,
    minimax_moves,
    to_move,
    winner_mark,
)

ROOT = Path(__file__).resolve().parent.parent


def _empty(board: str) -> list[str]:
    return [str(i + 1) for i in range(9) if board[i] == EMPTY]


def uniform(histories):
    return [{c: 1 / len(_empty(board_after(h))) for c in _empty(board_after(h))} for h in histories]


def optimal(histories):
    out = []
    for h in histories:
        b = board_after(h)
        best = [str(c) for c in minimax_moves(b, to_move(b))]
        out.append({c: 1 / len(best) for c in best})
    return out


def lowest(histories):
    """Always the lowest empty cell: a deterministic policy that loses to best play."""
    return [{_empty(board_after(h))[0]: 1.0} for h in histories]


@pytest.fixture(scope="module")
def random_x():
    """Uniform X against random, the whole tree (a few seconds)."""
    return exact_outcomes("player_x", "random", uniform, prune=0)


def test_random_play_against_random_has_its_known_values(random_x):
    # Uniform play on both sides: X wins 58.49% of games, O 28.81%, 12.70% are drawn.
    x = random_x
    assert (x.win, x.draw, x.loss) == pytest.approx((0.58492, 0.12698, 0.28810), abs=1e-5)
    assert x.unresolved == 0


def test_optimal_play_never_loses_and_draws_minimax():
    for agent in AGENTS:
        r = exact_outcomes(agent, "tictactoe_minimax", optimal, prune=0)
        assert r.draw == pytest.approx(1.0) and r.loss == 0 and r.win == 0
        assert all(b == 0 for _, _, b in r.decisions) and r.blunders() == []
        assert exact_outcomes(agent, "random", optimal, prune=0).loss == 0
    # The same game seen from the other side: uniform X against optimal O.
    assert exact_outcomes("player_x", "tictactoe_minimax", uniform, prune=0).loss == pytest.approx(
        exact_outcomes("player_o", "random", optimal, prune=0).win, abs=1e-12)


@cache
def _recurse(board: str, agent_mark: str, opponent: str) -> float:
    """Expected result of the ``lowest`` policy from ``board``: an independent recursion."""
    w = winner_mark(board)
    if w is not None:
        return 1.0 if w == agent_mark else -1.0
    if EMPTY not in board:
        return 0.0
    mover = to_move(board)
    if mover == agent_mark:
        i = board.index(EMPTY)
        return _recurse(board[:i] + mover + board[i + 1:], agent_mark, opponent)
    cells = ([c - 1 for c in minimax_moves(board, mover)] if opponent == "tictactoe_minimax"
             else [i for i in range(9) if board[i] == EMPTY])
    return sum(_recurse(board[:i] + mover + board[i + 1:], agent_mark, opponent) for i in cells) / len(cells)


@pytest.mark.parametrize("opponent", ["random", "tictactoe_minimax"])
@pytest.mark.parametrize("agent", AGENTS)
def test_a_deterministic_policy_matches_a_recursion_over_boards(agent, opponent):
    r = exact_outcomes(agent, opponent, lowest, prune=0)
    assert r.score == pytest.approx(_recurse(EMPTY * 9, MARKS[AGENTS.index(agent)], opponent), abs=1e-12)
    assert r.win + r.draw + r.loss == pytest.approx(1.0)


def test_pruning_leaves_out_only_what_the_policy_rarely_plays(random_x):
    full = random_x
    pruned = exact_outcomes("player_x", "random", uniform, prune=1 / 100)  # X's third move is 1/315 < 1/100
    assert pruned.unresolved > 0 and len(pruned.decisions) < len(full.decisions)
    assert pruned.win + pruned.draw + pruned.loss + pruned.unresolved == pytest.approx(1.0)
    assert pruned.win <= full.win and pruned.loss <= full.loss
    # A deterministic policy is followed whole whatever the threshold: the opponent's replies are not pruned.
    assert exact_outcomes("player_o", "random", lowest, prune=0.5).unresolved == 0


def test_blunders_are_moves_that_lose_to_best_play():
    # X takes the centre; an edge reply loses against best play, a corner does not.
    def edge_after_centre(histories):
        return [{"2": 1.0} if h == ("5",) else optimal([h])[0] for h in histories]

    r = exact_outcomes("player_o", "tictactoe_minimax", edge_after_centre, prune=0)
    # Minimax opens on any of the 9 cells (all draw); after the centre, best play wins against the edge.
    assert r.loss == pytest.approx(1 / 9) and r.draw == pytest.approx(8 / 9)
    assert r.blunders() == [(("5",), pytest.approx(1 / 9), 1.0)]


def test_refusals_name_what_was_wrong():
    with pytest.raises(ValueError, match="agent must be one of"):
        exact_outcomes("player_z", "random", uniform)
    with pytest.raises(ValueError, match="not 'kuhn_equilibrium'"):
        exact_outcomes("player_x", "kuhn_equilibrium", uniform)
    with pytest.raises(ValueError, match=r"empty cells \['1', '2', '3', '4', '6', '7', '8', '9'\], got \{'5': 1.0\}"):
        exact_outcomes("player_o", "random", lambda hs: [{"5": 1.0} for _ in hs])
    with pytest.raises(ValueError, match="must sum to 1"):
        exact_outcomes("player_x", "random", lambda hs: [{"1": 0.5} for _ in hs])
    with pytest.raises(ValueError, match="gave 0 distributions for 1 histories"):
        exact_outcomes("player_x", "random", lambda hs: [])
    with pytest.raises(ValueError, match="cell '5' cannot be played"):
        board_after(("5", "5"))


@pytest.mark.slow
def test_the_benchmark_scores_a_model(tmp_path, tiny_path):
    out = tmp_path / "exact.json"
    subprocess.run([sys.executable, "benchmarks/tictactoe_exact.py", "--paths", "base", "--model", "tiny-random",
                    "--opponents", "minimax", "--prune", "0.05", "--json", str(out)],
                   cwd=ROOT, check=True, timeout=600, capture_output=True)
    r = json.loads(out.read_text())
    check_provenance(r, "tictactoe_exact.py")
    seats = r["rows"][0]["opponents"]["minimax"]["seats"]
    for s in seats.values():
        assert s["win"] + s["draw"] + s["loss"] + s["unresolved"] == pytest.approx(1.0)
        assert s["decisions"] >= 1 and 0 < s["legal_mass"] <= 1
    assert r["rows"][0]["opponents"]["minimax"]["score"] == pytest.approx(
        (seats["player_x"]["score"] + seats["player_o"]["score"]) / 2)


def test_the_benchmark_finds_a_runs_adapter_or_its_newest_checkpoint(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    from tictactoe_exact import _target

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text('game = "tictactoe_v0"\nsystem_prompt = "S"\ngame_kwargs = { brief = true }\n'
                                     '[sampling]\ntemperature = 0.5\n')
    with pytest.raises(SystemExit, match="no saved adapter of policy 'main'"):
        _target(str(run), "main", "smollm2-135m")
    for step in (3, 12):
        (run / f"checkpoints/step_{step}/adapters/main").mkdir(parents=True)
        (run / f"checkpoints/step_{step}/adapters/main/adapter_config.json").write_text("{}")
    assert _target(str(run), "main", "m") == ("run", str(run / "checkpoints/step_12/adapters/main"), "m", 0.5, "S")
    (run / "adapters/main").mkdir(parents=True)
    (run / "adapters/main/adapter_config.json").write_text("{}")
    assert _target(str(run), "main", "m")[1] == str(run / "adapters/main")
    (run / "config.toml").write_text('game = "kuhn_poker_v0"\n')
    with pytest.raises(SystemExit, match="a run of 'kuhn_poker_v0', not tictactoe_v0"):
        _target(str(run), "main", "m")
    with pytest.raises(SystemExit, match="neither a run folder"):
        _target(str(tmp_path), "main", "m")
