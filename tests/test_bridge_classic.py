"""The PettingZoo text bridge on pettingzoo.classic envs: each env's prompt (its board as a grid,
the whole legal move list by the env's own move names, the instruction), games played through
the text interface ending as the wrapped env does, conformance, the length rule, and parsing."""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping
from typing import Any, ClassVar

import chess
import numpy as np
import pytest
from gymnasium import spaces
from pettingzoo import AECEnv
from pettingzoo.classic import chess_v6, connect_four_v3, go_v5, rps_v2, tictactoe_v3
from pettingzoo.classic.chess import chess_utils
from pettingzoo.test import api_test

import games
from games.bridge import INSTRUCTION, default_parse_reply, default_render_observation
from games.bridge_render import grid_text

GTP = "ABCDEFGHJKLMNOPQRST"
RLCARD = ("leduc_holdem_v4", "texas_holdem_v4", "texas_holdem_no_limit_v6")


def _rlcard_env(name: str) -> Callable[[], AECEnv]:
    def make() -> AECEnv:  # rlcard is in the test extra: these run in CI
        import importlib

        return importlib.import_module(f"pettingzoo.classic.{name}").env()

    return make


CLASSIC: dict[str, Callable[[], AECEnv]] = {
    "chess_v6": chess_v6.env,
    "connect_four_v3": connect_four_v3.env,
    "go_9x9": lambda: go_v5.env(board_size=9),
    "go_19x19": lambda: go_v5.env(board_size=19),
    "tictactoe_v3": tictactoe_v3.env,
    "rps_v2": rps_v2.env,
    **{name: _rlcard_env(name) for name in RLCARD},
}
INSTRUCTIONS = {
    "chess_v6": "Reply with one legal move in UCI notation (from square, to square, promotion "
    "piece if any), e.g. e2e4.",
    "go_9x9": "Reply with one legal move: a point such as D4, or pass.",
    "go_19x19": "Reply with one legal move: a point such as D4, or pass.",
    "connect_four_v3": INSTRUCTION,
    "tictactoe_v3": INSTRUCTION,
}


def _legal_ids(inner: AECEnv, agent: str) -> list[int]:
    obs = inner.observe(agent)
    if isinstance(obs, Mapping) and "action_mask" in obs:
        return [int(i) for i in np.flatnonzero(obs["action_mask"])]
    return list(range(int(inner.action_space(agent).n)))


def _names(key: str, inner: AECEnv, agent: str) -> dict[int, str]:
    """{legal id: the move's name}, worked out here from each env's own conventions."""
    ids, raw = _legal_ids(inner, agent), inner.unwrapped
    if key == "chess_v6":
        seat = raw.possible_agents.index(agent)
        names = {a: chess_utils.action_to_move(raw.board, a, seat).uci() for a in ids}
        assert set(names.values()) == {m.uci() for m in raw.board.legal_moves}  # python-chess's own
        return names
    if key.startswith("go"):
        n = raw._N  # flat id = n * row + col, row 0 at the top; GTP row 1 is the bottom
        return {a: "pass" if a == n * n else f"{GTP[a % n]}{n - a // n}" for a in ids}
    if key == "rps_v2":
        return {a: ("rock", "paper", "scissors")[a] for a in ids}
    if key in RLCARD:
        actions = raw.env.actions
        table = {m.value: m.name.lower() for m in actions} if isinstance(actions, type) else dict(enumerate(actions))
        return {a: table[a] for a in ids}
    return {a: str(a) for a in ids}


def _pair(key: str, seed: int) -> tuple[AECEnv, AECEnv]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        inner, bridged = CLASSIC[key](), games.from_pettingzoo(CLASSIC[key])
    inner.reset(seed=seed)
    bridged.reset(seed=seed)
    return inner, bridged


def _moves_line(prompt: str) -> str:
    lines = [line for line in prompt.splitlines() if line.startswith("Legal moves: ")]
    assert len(lines) == 1, prompt
    return lines[0]


@pytest.mark.parametrize("key", CLASSIC)
def test_first_prompt_holds_the_state_the_whole_move_list_and_the_instruction(key: str) -> None:
    inner, bridged = _pair(key, seed=0)
    agent = bridged.agent_selection
    prompt = bridged.observe(agent)["text"]
    assert bridged.observation_space(agent).contains({"text": prompt})
    names = _names(key, inner, agent)
    line = _moves_line(prompt)
    if key == "go_19x19":  # 362 names do not fit 1,024 characters beside the board
        assert line == "Legal moves: any empty point (.), or pass."
        assert len(names) == 19 * 19 + 1  # every point is empty and legal
    else:
        assert line == f"Legal moves: {', '.join(names.values())}."
        assert not prompt.split("\nLegal moves: ")[0].endswith("...")  # the state is whole
    assert prompt.endswith("\n" + INSTRUCTIONS.get(key, "Reply with one legal move."))
    assert len(prompt) <= 1024
    board = _board_lines(key, inner)
    for row in board:
        assert row in prompt, (row, prompt)


def _board_lines(key: str, inner: AECEnv) -> list[str]:
    """Lines the prompt's grid must hold."""
    raw = inner.unwrapped
    if key == "chess_v6":
        return [f"{8 - i} {row} {8 - i}" for i, row in enumerate(str(raw.board).splitlines())] + [
            "  a b c d e f g h"
        ]
    if key.startswith("go"):
        n = raw._N
        return ["   " + " ".join(GTP[:n])] + [f"{n - r:2d} " + " ".join("." * n) for r in range(n)]
    if key == "connect_four_v3":
        return ["0 1 2 3 4 5 6"] + [". . . . . . ."] * 6
    if key == "tictactoe_v3":
        return ["0 3 6", "1 4 7", "2 5 8"]
    if key == "rps_v2":
        return ["round 1 of 15", "last move: none yet"]
    return ["hand: "]


def test_chess_prompt_after_moves_and_for_black() -> None:
    _, bridged = _pair("chess_v6", seed=0)
    for reply in ("e2e4", "e7e5", "g1f3"):
        bridged.step(reply)
    prompt = bridged.observe("player_1")["text"]
    board = chess.Board()
    for uci in ("e2e4", "e7e5", "g1f3"):
        board.push_uci(uci)
    assert bridged.unwrapped.env.unwrapped.board == board
    assert prompt.startswith("Chess. You play black (the lowercase pieces), white the others. "
                             "Black to move, move 2. Last move: g1f3.")
    assert "6 . . . . . . . . 6\n5 . . . . p . . . 5\n4 . . . . P . . . 4\n3 . . . . . N . . 3" in prompt
    assert f"FEN: {board.fen()}" in prompt
    assert set(_moves_line(prompt)[13:-1].split(", ")) == {m.uci() for m in board.legal_moves}
    assert bridged.observe("player_0")["text"].endswith("\nWaiting for your turn.")


def test_go_compact_list_is_exact_mid_game() -> None:
    """On 19x19 the compact form "any empty point (.) except ..." read against the grid printed
    in the same prompt gives exactly the legal moves."""
    _, bridged = _pair("go_19x19", seed=0)
    rng = np.random.default_rng(0)
    for _ in range(150):
        agent = bridged.agent_selection
        ids = [i for i in _legal_ids(bridged.unwrapped.env, agent) if i != 361]
        bridged.step(_names("go_19x19", bridged.unwrapped.env, agent)[int(rng.choice(ids))])
    agent = bridged.agent_selection
    prompt = bridged.observe(agent)["text"]
    line = _moves_line(prompt)
    match = re.fullmatch(r"Legal moves: any empty point \(\.\)(?: except (.*))?, or pass\.", line)
    assert match, line
    barred = set(match.group(1).split(", ")) if match.group(1) else set()
    rows = {int(m.group(1)): m.group(2).split(" ")
            for m in re.finditer(r"^([ 0-9]{2}) ((?:[.XO] ){18}[.XO])$", prompt, re.MULTILINE)}
    assert sorted(rows) == list(range(1, 20))
    empty = {f"{GTP[c]}{r}" for r, cells in rows.items() for c, v in enumerate(cells) if v == "."}
    assert (empty - barred) | {"pass"} == set(_names("go_19x19", bridged.unwrapped.env, agent).values())
    assert bridged.observation_space(agent).contains({"text": prompt})


def _policy(key: str, ply: int, names: dict[int, str], rng: np.random.Generator) -> int:
    """A random legal move; go passes after a few dozen stones so that the game ends."""
    ids = list(names)
    if key.startswith("go"):
        pass_id = max(ids)
        ids = [a for a in ids if a != pass_id] if ply < (60 if key == "go_9x9" else 40) else []
        ids = ids or [pass_id]
    return ids[int(rng.integers(len(ids)))]


@pytest.mark.parametrize("key", CLASSIC)
def test_game_by_move_names_ends_as_the_wrapped_env(key: str) -> None:
    """Random legal moves, replied by name through the text (varied in case and wording), give
    the wrapped env's rewards, terminations and turn order at every step."""
    for seed in range(2 if key in ("chess_v6", "go_19x19") else 4):
        inner, bridged = _pair(key, seed)
        rng = np.random.default_rng(seed)
        totals_i = {a: 0.0 for a in inner.possible_agents}
        totals_b = dict(totals_i)
        for ply in range(2000):
            if not inner.agents:
                break
            agent = inner.agent_selection
            assert bridged.agent_selection == agent and bridged.agents == inner.agents
            _, i_rew, i_term, i_trunc, _ = inner.last()
            b_obs, b_rew, b_term, b_trunc, _ = bridged.last()
            assert (b_rew, b_term, b_trunc) == (i_rew, i_term, i_trunc)
            assert bridged.observation_space(agent).contains(b_obs)
            totals_i[agent] += i_rew
            totals_b[agent] += b_rew
            if i_term or i_trunc:
                inner.step(None)
                bridged.step(None)
                continue
            names = _names(key, inner, agent)
            if key not in ("go_19x19",):
                assert set(_moves_line(b_obs["text"])[13:-1].split(", ")) >= set(names.values())
            action = _policy(key, ply, names, rng)
            name = names[action]
            reply = [name, name.upper(), f"I play {name}."][int(rng.integers(3))]
            inner.step(action)
            bridged.step(reply)
            assert bridged.rewards == inner.rewards
            assert bridged.terminations == inner.terminations
            assert bridged.truncations == inner.truncations
        assert not inner.agents and not bridged.agents and ply < 1999
        assert totals_b == totals_i
        assert bridged.unwrapped.invalid_counts == {a: 0 for a in inner.possible_agents}


@pytest.mark.parametrize("key", ["chess_v6", "go_9x9", "tictactoe_v3", "connect_four_v3", "rps_v2"])
def test_classic_env_through_the_bridge_conforms(key: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(games.from_pettingzoo(CLASSIC[key]), num_cycles=100)


@pytest.mark.parametrize("key", ["tictactoe_v3", "connect_four_v3", "rps_v2"])
def test_classic_env_equivalence_by_id(key: str) -> None:
    """Replies by action id, as before names: same trajectory; `legal_moves` are the ids."""
    for seed in range(5):
        inner, bridged = _pair(key, seed)
        rng = np.random.default_rng(seed)
        for steps in range(300):
            if not inner.agents:
                break
            agent = inner.agent_selection
            assert bridged.agent_selection == agent
            _, i_rew, i_term, i_trunc, _ = inner.last()
            _, b_rew, b_term, b_trunc, b_info = bridged.last()
            assert (b_rew, b_term, b_trunc) == (i_rew, i_term, i_trunc)
            if i_term or i_trunc:
                inner.step(None)
                bridged.step(None)
                continue
            legal = _legal_ids(inner, agent)
            assert b_info["legal_moves"] == [str(a) for a in legal]
            action = legal[int(rng.integers(len(legal)))]
            inner.step(action)
            bridged.step(f"I play {action}.")
            assert bridged.rewards == inner.rewards and bridged.terminations == inner.terminations
        assert not inner.agents and not bridged.agents and steps < 299
        assert bridged.unwrapped.invalid_counts == {a: 0 for a in inner.possible_agents}


def test_chess_parser_reads_uci_and_rejects_illegal_uci() -> None:
    _, bridged = _pair("chess_v6", seed=0)
    legal = bridged.unwrapped._legal("player_0")
    syntax = bridged.unwrapped._view.name_syntax
    by_name = {name: a for a, name in legal.items()}
    assert default_parse_reply("e2e4", legal, name_syntax=syntax) == by_name["e2e4"]
    assert default_parse_reply("I'll open with E2E4.", legal, name_syntax=syntax) == by_name["e2e4"]
    assert default_parse_reply(str(by_name["g1f3"]), legal, name_syntax=syntax) == by_name["g1f3"]
    for bad in ("e2e5", "e7e5", "a1a1", "e2e4 or d2d4", "e2e4 and e2e5", "", "e2"):
        assert default_parse_reply(bad, legal, name_syntax=syntax) is None, bad
    bridged.step("e2e4")
    assert bridged.unwrapped.env.unwrapped.board.peek() == chess.Move.from_uci("e2e4")
    bridged.step("e7e6")
    bridged.step("e4e6")  # white: a well-formed UCI move that is not legal
    assert bridged.unwrapped.invalid_counts == {"player_0": 1, "player_1": 0}
    assert bridged.rewards == {"player_0": -1, "player_1": 0} and all(bridged.terminations.values())
    assert len(bridged.unwrapped.env.unwrapped.board.move_stack) == 2  # the wrapped env not stepped


def test_go_parser_reads_coordinates_and_pass() -> None:
    _, bridged = _pair("go_9x9", seed=0)
    legal = bridged.unwrapped._legal("black_0")
    syntax = bridged.unwrapped._view.name_syntax
    assert default_parse_reply("d4", legal, name_syntax=syntax) == 9 * 5 + 3  # row 4 is 5 from the top
    assert default_parse_reply("I PASS", legal, name_syntax=syntax) == 81
    assert default_parse_reply("J9", legal, name_syntax=syntax) == 8
    for bad in ("Z9", "A10", "I5", "D4 or pass"):  # off the 9x9 board, no I column, two moves
        assert default_parse_reply(bad, legal, name_syntax=syntax) is None, bad
    bridged.step("E5")
    assert "\n 5 . . . . X . . . .\n" in bridged.observe("white_0")["text"]
    bridged.step("E5")  # occupied
    assert bridged.unwrapped.invalid_counts["white_0"] == 1


def test_name_defaults_to_the_wrapped_envs_metadata() -> None:
    assert games.from_pettingzoo(chess_v6.env).metadata["name"] == "chess_v6"
    assert games.from_pettingzoo(tictactoe_v3.env(), "ttt_text_v0").metadata["name"] == "ttt_text_v0"

    class Nameless(AECEnv):
        metadata: ClassVar[dict[str, Any]] = {}
        possible_agents: ClassVar[list[str]] = ["a"]

        def action_space(self, agent: str) -> spaces.Space[Any]:
            return spaces.Discrete(2)

    with pytest.raises(ValueError, match="no name.*Nameless.*name="):
        games.from_pettingzoo(Nameless())


def test_length_limit_never_cuts_moves_or_instruction() -> None:
    """A small max_length cuts the board (ending in "..."), never the moves or instruction; a
    move list longer than three quarters of the limit leaves the state a quarter and overflows,
    inside the observation space."""
    _, bridged = _pair("chess_v6", seed=0)
    full = bridged.observe("player_0")["text"]
    tail = full[full.index("\nLegal moves: "):]
    for limit in (512, 256):  # the 240-character tail fits in 512 beside the cut board, not in 256
        small = games.from_pettingzoo(chess_v6.env, max_length=limit)
        small.reset(seed=0)
        text = small.observe("player_0")["text"]
        assert text.endswith(tail) and text[: -len(tail)].endswith("...")
        assert len(text) == max(limit, limit // 4 + len(tail))
        assert small.observation_space("player_0").contains({"text": text})
    tiny = games.from_pettingzoo(lambda: go_v5.env(board_size=9), max_length=128)
    tiny.reset(seed=0)
    text = tiny.observe("black_0")["text"]
    # The 9x9 list (82 names) is longer than 128: compact; the state keeps 32 characters.
    tail = ("\nLegal moves: any empty point (.), or pass.\n"
            "Reply with one legal move: a point such as D4, or pass.")
    assert text.endswith(tail) and len(text) == 32 + len(tail)
    assert tiny.observation_space("black_0").contains({"text": text})
    assert tiny.unwrapped.text_limit >= 32 + 1 + 82 * 4
    assert len(tiny.action_space("black_0").sample()) <= 128


class ManyActions(AECEnv):
    """One seat, one turn, 500 actions all legal, a 4x5 board observation; no move names."""

    metadata: ClassVar[dict[str, Any]] = {"name": "many_v0", "is_parallelizable": False}
    possible_agents: ClassVar[list[str]] = ["solo"]

    def observation_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Box(0, 9, (4, 5), dtype=np.int64)

    def action_space(self, agent: str) -> spaces.Space[Any]:
        return spaces.Discrete(500)

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self.agents = ["solo"]
        self.agent_selection = "solo"
        self.rewards = {"solo": 0}
        self._cumulative_rewards = {"solo": 0}
        self.terminations = {"solo": False}
        self.truncations = {"solo": False}
        self.infos = {"solo": {}}

    def observe(self, agent: str) -> np.ndarray:
        return np.arange(20).reshape(4, 5) % 10

    def step(self, action: int | None) -> None:
        if self.terminations["solo"]:
            self._was_dead_step(action)
            return
        self.rewards = {"solo": 1 if action == 499 else 0}
        self.terminations = {"solo": True}
        self._cumulative_rewards = {"solo": 0}
        self._accumulate_rewards()


def test_generic_env_grid_and_id_ranges() -> None:
    env = games.from_pettingzoo(ManyActions, max_length=256)
    env.reset()
    assert env.observe("solo")["text"] == (
        "Observation:\n0 1 2 3 4\n5 6 7 8 9\n0 1 2 3 4\n5 6 7 8 9\n"
        "Legal moves: 0-499.\nReply with the number of one legal move."
    )
    env.step("499")
    assert env.rewards == {"solo": 1}
    planes = np.zeros((2, 3, 2), dtype=np.int8)
    planes[0, 1, 0] = planes[1, 2, 1] = 1
    assert grid_text(planes) == "2x3 grid; a cell shows the plane (1-2) set there:\n. 1 .\n. . 2"
    assert default_render_observation("a", {"observation": np.eye(2), "action_mask": [1]}) == (
        "Observation:\n1 0\n0 1"
    )
    assert default_render_observation("a", np.array([0, 1])) == "Observation: [0, 1]"


@pytest.mark.parametrize("key", ["connect_four_v3", "tictactoe_v3", "chess_v6"])
def test_brief_messages_drop_the_header_and_instruction_once_the_seat_has_moved(key: str) -> None:
    """``brief``: a seat's first message is the full one; once it has moved, the state without
    the view's header line (board games) and the move list without the instruction; the game
    and ``infostate`` are the same as without it, and the env still conforms."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        full, brief = games.from_pettingzoo(CLASSIC[key]), games.from_pettingzoo(CLASSIC[key], brief=True)
    full.reset(seed=3)
    brief.reset(seed=3)
    rng = np.random.default_rng(3)
    seen: dict[str, int] = {}
    for _ in range(40):
        if not full.agents:
            break
        agent = full.agent_selection
        f_obs, f_rew, f_term, _, f_info = full.last()
        b_obs, b_rew, b_term, _, b_info = brief.last()
        assert (b_rew, b_term, b_info["infostate"], b_info["legal_moves"]) == (f_rew, f_term, f_info["infostate"],
                                                                               f_info["legal_moves"])
        if f_term:
            full.step(None)
            brief.step(None)
            continue
        f_lines, b_lines = f_obs["text"].split("\n"), b_obs["text"].split("\n")
        if seen.get(agent):
            header = 1 if key != "chess_v6" else 0
            assert b_lines == f_lines[header:-1], (f_lines, b_lines)  # no header, no instruction
            assert b_lines[-1].startswith("Legal moves: ")
        else:
            assert b_lines == f_lines and f_lines[-1] == INSTRUCTIONS[key]
        seen[agent] = seen.get(agent, 0) + 1
        move = f_info["legal_moves"][int(rng.integers(len(f_info["legal_moves"])))]
        name = _moves_line(f_obs["text"])[13:-1].split(", ")[f_info["legal_moves"].index(move)] \
            if key == "chess_v6" else move
        full.step(name)
        brief.step(name)
    assert max(seen.values()) >= 2
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        api_test(games.from_pettingzoo(CLASSIC[key], brief=True), num_cycles=50)


def test_brief_is_a_game_kwarg_of_an_imported_env_and_checked() -> None:
    """A job turns it on with ``game_kwargs.bridge_brief`` (the env's constructor never sees it);
    a value that is not a bool, or a text game given it, is refused by name."""
    env = games.make("pettingzoo.classic.connect_four_v3", bridge_brief=True)
    assert env.unwrapped.brief is True and games.make("pettingzoo.classic.connect_four_v3").unwrapped.brief is False
    with pytest.raises(ValueError, match=r"brief must be true or false, got 'yes'"):
        games.make("pettingzoo.classic.connect_four_v3", bridge_brief="yes")
    with pytest.raises(ValueError, match=r"bridge_brief is for an env the bridge converts"):
        games.make("games.tictactoe", bridge_brief=True)
