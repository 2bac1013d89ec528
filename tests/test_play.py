"""``opentinker play``: a person (a script on stdin) against the tiny-random model, on Kuhn
poker with a run folder's adapter and on a bridged PettingZoo env with the base model, through
the function with text streams and through the command in a subprocess; invalid lines are
asked again, the game ends, the rewards are printed; end of input stops cleanly."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import games
from opentinker.cli import main
from opentinker.play import play, play_game, refusal
from test_eval_cli import make_run

ROOT = Path(__file__).resolve().parents[1]


def rewards(text: str) -> dict[str, float]:
    """The seats' rewards from the ``rewards:`` line of a game."""
    (line,) = re.findall(r"^rewards: (.*)$", text, re.MULTILINE)
    return {seat: float(r) for seat, r in re.findall(r"(\w+) \((?:you|agent)\) ([+-][\d.]+)", line)}


@pytest.fixture(scope="module")
def kuhn_run(tmp_path_factory, tiny_path) -> Path:
    return make_run(tmp_path_factory.mktemp("play"), tiny_path)


def test_play_kuhn_against_a_run_reasks_an_invalid_line(kuhn_run):
    # player_0 acts first: "xyzzy" is refused, "check" is legal; "call" answers a bet.
    out = io.StringIO()
    code = play("kuhn_poker_v0", str(kuhn_run), seat="player_0", seed=3, threads=1,
                inp=io.StringIO("xyzzy\ncheck\ncall\ncall\n"), out=out)
    text = out.getvalue()
    assert code == 0
    assert "against adapter main" in text and "you are player_0" in text
    assert "Kuhn poker, cards J<Q<K. You have the" in text and "legal moves: check, bet" in text
    assert text.count("'xyzzy' is not a legal move here; try again.") == 1
    assert text.index("'xyzzy' is not a legal move") < text.index("player_1 (agent): ")  # asked before any move
    r = rewards(text)
    assert set(r) == {"player_0", "player_1"} and sum(r.values()) == 0 and r["player_0"] != 0  # zero-sum, decided
    assert f"your total over 1 game(s): {r['player_0']:+g}" in text


def test_play_stops_cleanly_at_the_end_of_input(kuhn_run):
    out = io.StringIO()
    assert play("kuhn_poker_v0", str(kuhn_run / "adapters" / "main"), seat="player_0", threads=1,
                inp=io.StringIO("fold?\n"), out=out) == 0
    text = out.getvalue()
    assert "'fold?' is not a legal move here" in text and text.rstrip().endswith("end of input: stopped.")
    assert "rewards:" not in text


def test_play_a_bridged_env_through_stdin():
    env = {**os.environ, "PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false"}
    moves = "banana\n9\n4\n0\n8\n2\n6\n1\n3\n5\n7\n"
    proc = subprocess.run([sys.executable, "-m", "opentinker.cli", "play", "pettingzoo.classic.tictactoe_v3",
                           "--model", "tiny-random", "--seat", "player_1", "--threads", "1"],
                          input=moves, capture_output=True, text=True, timeout=120, cwd=ROOT, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "against the base model (tiny-random)" in out
    assert "Legal moves: 0, 1, 2, 3, 4, 5, 6, 7, 8." in out  # the env's own text shows the moves
    assert "'banana' is not a legal move here; try again." in out
    assert "'9' is not a legal move here; try again." in out
    assert out.count("is not a legal move here") >= 2
    r = rewards(out)
    assert set(r) == {"player_1", "player_2"}
    assert "the game is over (you are player_1)" in out


def test_refusal_replays_a_bridged_game():
    # connect four: column 0 filled by six moves; a seventh into it is illegal, another is fine
    game = "pettingzoo.classic.connect_four_v3"
    env = games.make(game)
    env.reset(seed=0)
    history = ["0"] * 6
    for move in history:
        env.step(move)
    assert refusal(game, {}, 0, history, env, "0") == ""
    assert refusal(game, {}, 0, history, env, "seven") == ""
    assert refusal(game, {}, 0, history, env, "1") is None
    assert env.unwrapped.invalid_counts == {a: 0 for a in env.possible_agents}  # the real env untouched
    assert env.agent_selection == "player_0" and not any(env.terminations.values())


class ColumnZero:
    """A stand-in agent that always drops into column 0 (the real one is tested above)."""

    def __init__(self, tok) -> None:
        self.tok, self.system_prompt, self.seeds = tok, "You play connect four.", []

    def reply(self, renderer, seed: int) -> str:
        self.seeds.append(seed)
        renderer.add_reply(self.tok.encode("0") + [self.tok.eos_id], stopped=True)
        return "0"


def test_play_game_refuses_a_full_column_mid_game(chat_tok):
    # you (player_0) and the agent fill column 0; your next "0" is refused, "3" is played; the
    # agent's next "0" is illegal: it forfeits (-1), you get 0.
    agent, out = ColumnZero(chat_tok), io.StringIO()
    totals = play_game("pettingzoo.classic.connect_four_v3", {}, 7, 0, "player_0", agent,
                       io.StringIO("0\n0\n0\n0\n3\n"), out)
    text = out.getvalue()
    assert totals == {"player_0": 0.0, "player_1": -1.0}
    assert text.count("is not a legal move here") == 1 and "'0' is not a legal move here; try again." in text
    assert text.count("player_1 (agent): '0'") == 4 and text.rstrip().endswith("A reply was invalid, a forfeit.")
    assert text.count("[invalid]") == 1 and len(set(agent.seeds)) == 4  # a seed per turn


def test_play_errors_exit_2(kuhn_run, capsys):
    assert main(["play", "kuhn_poker_v0", "--agent", str(kuhn_run), "--seat", "player_9", "--threads", "1"]) == 2
    assert "opentinker play: --seat 'player_9': kuhn_poker_v0 has the seats player_0, player_1" in capsys.readouterr().err
    assert main(["play", "no_such_game_v0"]) == 2
    assert capsys.readouterr().err.startswith("opentinker play: unknown game: 'no_such_game_v0'")
    assert main(["play", "kuhn_poker_v0", "--agent", "/nowhere"]) == 2
    assert capsys.readouterr().err == "opentinker play: /nowhere: no such file or folder\n"
    assert main(["play", "kuhn_poker_v0", "--temperature", "0"]) == 2
    assert "--temperature: between" in capsys.readouterr().err
