"""Games beyond Kuhn poker: tic-tac-toe rules, parsing, forfeits and exact minimax play; the
PettingZoo text bridge over two small masked AEC envs defined here (pettingzoo.classic needs
pygame, which is not a dependency); `make_parallel`."""

from __future__ import annotations

import string
import warnings
from typing import Any

import gymnasium
import numpy as np
import pytest
from conftest import play_to_end
from gymnasium import spaces
from gymnasium.utils import seeding
from pettingzoo import AECEnv
from pettingzoo.test import api_test, seed_test
from pettingzoo.utils import wrappers

import games
from games.bridge import default_parse_reply, printable
from games.scripted import MinimaxPolicy, RandomPolicy, make_scripted
from games.tictactoe import (
    minimax_move,
    minimax_moves,
    parse_reply,
    state_value,
    winner_mark,
)

# --- tic-tac-toe --------------------------------------------------------------------------

X, O = "player_x", "player_o"


def play_ttt(replies: list[Any]) -> tuple[Any, dict[str, float]]:
    """Step `replies` for whoever is to act, drain the dead steps; return the env and totals,
    checking every observation lies in its space."""
    env = games.make("tictactoe_v0")
    env.reset(seed=0)
    return env, play_to_end(env, replies, max_iter=30)


def test_registry_parallel_forms_only_for_simultaneous_games() -> None:
    assert {"kuhn_poker_v0", "tictactoe_v0"} <= set(games.names())
    for name in (n for n in games.names() if n != "prisoners_dilemma_v0"):
        with pytest.raises(ValueError, match="no parallel form.*games.make"):
            games.make_parallel(name)
    assert games.make_parallel("prisoners_dilemma_v0").metadata["name"] == "prisoners_dilemma_v0"
    with pytest.raises(ValueError, match="unknown game 'nope_v0'"):
        games.make_parallel("nope_v0")


def test_tictactoe_texts_and_infos() -> None:
    env = games.make("tictactoe_v0")
    env.reset()
    assert env.observe(X)["text"] == (
        "Tic-tac-toe. You are X.\n1 2 3\n4 5 6\n7 8 9\n"
        "Reply with the number of an empty cell (1-9)."
    )
    assert env.observe(O)["text"] == (
        "Tic-tac-toe. You are O.\n1 2 3\n4 5 6\n7 8 9\nWaiting for the opponent."
    )
    assert env.infos[X] == {
        "invalid": 0,
        "infostate": ".........",
        "legal_moves": [str(c) for c in range(1, 10)],
    }
    assert env.infos[O]["legal_moves"] == []
    env.step("5")
    assert env.observe(O)["text"] == (
        "Tic-tac-toe. You are O. Opponent took cell 5.\n1 2 3\n4 X 6\n7 8 9\n"
        "Reply with the number of an empty cell (1-9)."
    )
    assert env.infos[O]["infostate"] == "....X...."
    assert env.infos[O]["legal_moves"] == ["1", "2", "3", "4", "6", "7", "8", "9"]
    env.step("1")
    for cell in ("2", "4", "3", "7"):
        env.step(cell)
    assert (
        env.observe(X)["text"]
        == "Tic-tac-toe. You are X.\nO X X\nO X 6\nO 8 9\nYou lose: three in a row."
    )
    assert (
        env.observe(O)["text"]
        == "Tic-tac-toe. You are O.\nO X X\nO X 6\nO 8 9\nYou win: three in a row."
    )
    info = env.infos[X]
    assert (info["winner"], info["reason"], info["last_action"]) == (O, "line", "3")


def test_tictactoe_brief_messages_after_a_seats_first_move() -> None:
    env = games.make("tictactoe_v0", brief=True)
    env.reset()
    full_x = "Tic-tac-toe. You are X.\n1 2 3\n4 5 6\n7 8 9\nReply with the number of an empty cell (1-9)."
    assert env.observe(X)["text"] == full_x  # no move yet: the whole message
    env.step("5")
    assert env.observe(O)["text"] == (  # O's first message is whole too
        "Tic-tac-toe. You are O. Opponent took cell 5.\n1 2 3\n4 X 6\n7 8 9\n"
        "Reply with the number of an empty cell (1-9).")
    assert env.observe(X)["text"] == "1 2 3\n4 X 6\n7 8 9\nWaiting for the opponent."
    env.step("1")
    assert env.observe(X)["text"] == "Opponent took cell 1.\nO 2 3\n4 X 6\n7 8 9"
    assert env.infos[X]["legal_moves"] == ["2", "3", "4", "6", "7", "8", "9"]  # infos as before
    for cell in ("2", "4", "3", "7"):
        env.step(cell)
    assert env.observe(X)["text"] == "O X X\nO X 6\nO 8 9\nYou lose: three in a row."
    assert env.observe(O)["text"] == "O X X\nO X 6\nO 8 9\nYou win: three in a row."
    assert env.rewards == {X: -1, O: 1}
    with pytest.raises(ValueError, match="brief must be true or false, got 'yes'"):
        games.make("tictactoe_v0", brief="yes")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Text spaces are not Box/Discrete
        api_test(games.make("tictactoe_v0", brief=True), num_cycles=300)


@pytest.mark.parametrize(
    ("replies", "rx", "reason"),
    [
        (["1", "4", "2", "5", "3"], 1, "line"),  # X's top row
        (["1", "2", "3", "5", "4", "8"], -1, "line"),  # O's middle column
        (["1", "2", "5", "3", "9"], 1, "line"),  # X's main diagonal
        (["1", "3", "2", "5", "9", "7"], -1, "line"),  # O's anti-diagonal
        (["1", "2", "3", "5", "4", "6", "8", "7", "9"], 0, "draw"),
    ],
)
def test_tictactoe_playthroughs(replies: list[str], rx: int, reason: str) -> None:
    env, totals = play_ttt(replies)
    assert totals == {X: rx, O: -rx}
    assert env.unwrapped.invalid_counts == {X: 0, O: 0}


def test_tictactoe_draw_text() -> None:
    env = games.make("tictactoe_v0")
    env.reset()
    for cell in ["1", "2", "3", "5", "4", "6", "8", "7", "9"]:
        env.step(cell)
    assert env.observe(O)["text"] == (
        "Tic-tac-toe. You are O.\nX O X\nX O O\nO X X\nDraw: the board is full."
    )
    assert env.infos[X]["winner"] is None and env.infos[X]["reason"] == "draw"
    assert env.rewards == {X: 0, O: 0}


@pytest.mark.parametrize(
    ("reply", "cell"),
    [("5", 5), ("Cell 5.", 5), ("I take cell 5!", 5), ("5, 5", 5), ("cell5", 5), ("\n9\n", 9)],
)
def test_tictactoe_lenient_parsing(reply: str, cell: int) -> None:
    assert parse_reply(reply, ".........") == cell


TTT_GARBAGE = [
    "",
    "x" * 100_000,
    "x" * 600 + " 5",  # past the 512 characters that are read
    "ünïcødé ✗ ◯ 五",
    "5 and 7",  # two empty cells: ambiguous
    "1 2 3\n4 5 6\n7 8 9",  # an echo of the board
    "10",  # no lone digit 1-9
    "0",
    "ten",
    None,
    7,
]


@pytest.mark.parametrize("reply", TTT_GARBAGE)
def test_tictactoe_garbage_forfeits(reply: Any) -> None:
    env, totals = play_ttt(["5", reply])  # O's reply is the garbage
    assert totals == {X: 1, O: -1}
    assert env.unwrapped.invalid_counts == {X: 0, O: 1}


def test_tictactoe_occupied_cell_forfeits_with_texts() -> None:
    env = games.make("tictactoe_v0")
    env.reset()
    env.step("5")
    env.step("Cell 5, the centre.")
    assert env.rewards == {X: 1, O: -1}
    assert env.unwrapped.invalid_counts == {X: 0, O: 1}
    assert env.infos[O]["invalid"] == 1 and env.infos[O]["last_action"] == "invalid"
    assert env.infos[X]["reason"] == "forfeit" and env.infos[X]["winner"] == X
    assert env.observe(O)["text"].endswith("Your reply was invalid, a forfeit. You lose.")
    assert env.observe(X)["text"].endswith("Opponent's reply was invalid, a forfeit. You win.")
    for agent in env.agents:
        assert env.observation_space(agent).contains(env.observe(agent))
    env.reset()
    assert env.unwrapped.invalid_counts == {X: 0, O: 0}


def test_minimax_known_positions() -> None:
    assert minimax_move("XX.OO....", "X") == 3  # win now
    assert minimax_move("XX..O....", "O") == 3  # block
    assert minimax_moves("XX.OO....", "X") == (3,)
    assert set(minimax_moves(".........", "X")) <= set(range(1, 10))
    for board, player, match in [
        ("XX.OO...", "X", "9 characters"),
        ("XX.OO...Z", "X", "9 characters"),
        ("XX.......", "O", "inconsistent"),
        ("X........", "X", "O's move"),
        ("XXXOO....", "O", "over"),
    ]:
        with pytest.raises(ValueError, match=match):
            minimax_moves(board, player)


def _match(seats: dict[str, Any], seed: int) -> dict[str, float]:
    env, rng = games.make("tictactoe_v0"), np.random.default_rng(seed)
    env.reset(seed=seed)
    totals = {a: 0.0 for a in env.possible_agents}
    for agent in env.agent_iter(max_iter=30):
        obs, reward, term, trunc, info = env.last()
        totals[agent] += reward
        env.step(None if term or trunc else seats[agent].act(obs["text"], info, rng))
    assert not env.agents and env.unwrapped.invalid_counts == {X: 0, O: 0}
    return totals


def test_minimax_never_loses_to_random_and_draws_itself() -> None:
    minimax, rand = make_scripted("tictactoe_minimax"), make_scripted("random")
    assert isinstance(minimax, MinimaxPolicy) and isinstance(rand, RandomPolicy)
    wins = 0
    for seed in range(200):
        as_x = _match({X: minimax, O: rand}, seed)
        as_o = _match({X: rand, O: minimax}, 1000 + seed)
        assert as_x[X] >= 0 and as_o[O] >= 0
        wins += (as_x[X] > 0) + (as_o[O] > 0)
    assert wins > 300  # random play loses most games to perfect play
    for seed in range(30):
        assert _match({X: minimax, O: minimax}, seed) == {X: 0, O: 0}
    fixed = MinimaxPolicy(randomize=False)
    assert _match({X: fixed, O: fixed}, 0) == {X: 0, O: 0}


class _BestVsRandom:
    """Plays the cell of the highest ``state_value`` against random after it (the greedy
    policy of the game's own values)."""

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        board, me = info["infostate"], "X" if info["infostate"].count("X") == info["infostate"].count("O") else "O"

        def after(cell: int) -> float:
            b = board[:cell - 1] + me + board[cell:]
            if winner_mark(b) is not None:
                return 1.0
            if "." not in b:
                return 0.0
            replies = [b[:j] + ("O" if me == "X" else "X") + b[j + 1:] for j in range(9) if b[j] == "."]
            return float(np.mean([-1.0 if winner_mark(r) else 0.0 if "." not in r else
                                  state_value(r, AGENT_OF[me], "random") for r in replies]))

        return str(max((int(c) for c in info["legal_moves"]), key=after))


AGENT_OF = {"X": "player_x", "O": "player_o"}


def live_positions() -> dict[str, str]:
    """Every live tic-tac-toe position (4,520: no line, an empty cell) and the mark to move."""
    live, frontier = {".........": "X"}, ["........."]
    while frontier:
        board = frontier.pop()
        mark = live[board]
        for i in range(9):
            if board[i] == ".":
                nxt = board[:i] + mark + board[i + 1:]
                if nxt not in live and winner_mark(nxt) is None and "." in nxt:
                    live[nxt] = "O" if mark == "X" else "X"
                    frontier.append(nxt)
    return live


def test_tictactoe_state_values_against_random_and_minimax() -> None:
    """The game's exact values: a win now is +1 against either; the empty board is a draw
    against minimax and worth what greedy play on the values scores against random (400
    games); random is never harder to play than minimax; bad input is refused."""
    assert state_value("XX.OO....", "player_x", "random") == state_value("XX.OO....", "player_x",
                                                                         "tictactoe_minimax") == 1.0
    assert state_value(".........", "player_x", "tictactoe_minimax") == 0.0
    v = state_value(".........", "player_x", "random")
    scores = [_match({X: _BestVsRandom(), O: make_scripted("random")}, seed)[X] for seed in range(400)]
    assert 0.9 < v < 1.0 and abs(np.mean(scores) - v) < 3 * np.std(scores) / np.sqrt(len(scores)) + 0.01
    live = live_positions()
    assert len(live) == 4520
    for board, mark in live.items():
        agent = AGENT_OF[mark]
        assert state_value(board, agent, "random") >= state_value(board, agent, "tictactoe_minimax") - 1e-12
    for board, agent, opponent, match in [("XX.OO....", "player_o", "random", "X's move"),
                                          ("XXXOO....", "player_o", "random", "over"),
                                          ("XX.OO....", "player_x", "self", "not 'self'"),
                                          ("XX.OO....", "dealer", "random", "agent must be")]:
        with pytest.raises(ValueError, match=match):
            state_value(board, agent, opponent)


def test_random_policy_plays_only_empty_cells() -> None:
    rand = make_scripted("random")
    for seed in range(50):
        totals = _match({X: rand, O: rand}, seed)
        assert totals[X] == -totals[O] and totals[X] in (-1, 0, 1)


# --- small masked AEC envs to bridge -------------------------------------------------------


class MaskedRPS(AECEnv):
    """Three rounds of rock-paper-scissors, moves hidden until both are in; a seat may not repeat
    its own previous move (the mask). Observation: [round, opponent's last move + 1 or 0]."""

    metadata = {"name": "masked_rps_v0", "is_parallelizable": False}
    MOVES = ("rock", "paper", "scissors")

    def __init__(self) -> None:
        super().__init__()
        self.possible_agents = ["player_0", "player_1"]
        self.action_spaces = {a: spaces.Discrete(3) for a in self.possible_agents}
        self.observation_spaces = {
            a: spaces.Dict(
                {
                    "observation": spaces.Box(0, 3, (2,), dtype=np.int64),
                    "action_mask": spaces.Box(0, 1, (3,), dtype=np.int8),
                }
            )
            for a in self.possible_agents
        }

    def observation_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.action_spaces[agent]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        self.agents = list(self.possible_agents)
        self.agent_selection = "player_0"
        self.rewards = {a: 0 for a in self.agents}
        self._cumulative_rewards = {a: 0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {} for a in self.agents}
        self.round = 0
        self.prev = {a: -1 for a in self.agents}
        self.pending: int | None = None

    def observe(self, agent: str) -> dict[str, np.ndarray]:
        other = "player_1" if agent == "player_0" else "player_0"
        mask = np.ones(3, dtype=np.int8)
        if self.prev[agent] >= 0:
            mask[self.prev[agent]] = 0
        seen = self.prev[other] + 1  # completed rounds only: the pending move stays hidden
        return {"observation": np.array([self.round, seen]), "action_mask": mask}

    def step(self, action: int | None) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        self._cumulative_rewards[agent] = 0
        self.rewards = {a: 0 for a in self.agents}
        assert action is not None and self.observe(agent)["action_mask"][action] == 1
        if agent == "player_0":
            self.pending = int(action)
            self.agent_selection = "player_1"
        else:
            a0, a1 = self.pending, int(action)
            self.prev = {"player_0": a0, "player_1": a1}
            self.pending = None
            r0 = 0 if a0 == a1 else (1 if (a0 - a1) % 3 == 1 else -1)
            self.rewards = {"player_0": r0, "player_1": -r0}
            self.round += 1
            if self.round == 3:
                self.terminations = {a: True for a in self.agents}
            self.agent_selection = "player_0"
        self._accumulate_rewards()

    def close(self) -> None:
        pass


class Nim(AECEnv):
    """One pile of 5-15 stones (drawn from the seeded `np_random`); a move takes 1-3 stones
    (`Discrete(3, start=1)`: the action id is the number taken), never more than remain; whoever
    takes the last stone wins +1, the other -1."""

    metadata = {"name": "nim_v0", "is_parallelizable": False}

    def __init__(self) -> None:
        super().__init__()
        self.possible_agents = ["first", "second"]
        self.np_random, _ = seeding.np_random(None)
        self.observation_spaces = {
            a: spaces.Dict(
                {
                    "observation": spaces.Box(0, 15, (1,), dtype=np.int64),
                    "action_mask": spaces.Box(0, 1, (3,), dtype=np.int8),
                }
            )
            for a in self.possible_agents
        }
        self.action_spaces = {a: spaces.Discrete(3, start=1) for a in self.possible_agents}

    def observation_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.observation_spaces[agent]

    def action_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
        return self.action_spaces[agent]

    def reset(self, seed: int | None = None, options: dict[str, Any] | None = None) -> None:
        if seed is not None:
            self.np_random, _ = seeding.np_random(seed)
        self.pile = int(self.np_random.integers(5, 16))
        self.agents = list(self.possible_agents)
        self.agent_selection = "first"
        self.rewards = {a: 0 for a in self.agents}
        self._cumulative_rewards = {a: 0 for a in self.agents}
        self.terminations = {a: False for a in self.agents}
        self.truncations = {a: False for a in self.agents}
        self.infos = {a: {"pile": self.pile} for a in self.agents}

    def observe(self, agent: str) -> dict[str, np.ndarray]:
        mask = (np.arange(1, 4) <= self.pile).astype(np.int8)
        return {"observation": np.array([self.pile]), "action_mask": mask}

    def step(self, action: int | None) -> None:
        agent = self.agent_selection
        if self.terminations[agent] or self.truncations[agent]:
            self._was_dead_step(action)
            return
        self._cumulative_rewards[agent] = 0
        self.rewards = {a: 0 for a in self.agents}
        assert action is not None and 1 <= action <= min(3, self.pile)
        self.pile -= int(action)
        other = "second" if agent == "first" else "first"
        if self.pile == 0:
            self.rewards = {agent: 1, other: -1}
            self.terminations = {a: True for a in self.agents}
        self.infos = {a: {"pile": self.pile} for a in self.agents}
        self.agent_selection = other
        self._accumulate_rewards()

    def close(self) -> None:
        pass


def nim_label(agent: str, action: int) -> str:
    return f"take {action} stone{'s' * (action > 1)}"


def rps_label(agent: str, action: int) -> str:
    return MaskedRPS.MOVES[action]


BRIDGES = {
    "rps_bare": lambda: games.from_pettingzoo(MaskedRPS, name="rps_text_v0"),
    "rps_labels": lambda: games.from_pettingzoo(
        MaskedRPS, name="rps_text_v0", render_moves=rps_label
    ),
    "nim_labels": lambda: games.from_pettingzoo(
        Nim,
        name="nim_text_v0",
        render_observation=lambda agent, obs: f"Nim. {obs['observation'][0]} stones left.",
        render_moves=nim_label,
        max_length=256,
    ),
    "nim_bare": lambda: games.from_pettingzoo(Nim(), name="nim_text_v0"),
}


@pytest.mark.parametrize("inner", [MaskedRPS, Nim])
def test_fixture_envs_conform(inner: type) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # small Dict observations
        api_test(wrappers.OrderEnforcingWrapper(inner()), num_cycles=200)


@pytest.mark.parametrize("key", BRIDGES)
def test_bridge_api_conformance(key: str) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        api_test(BRIDGES[key](), num_cycles=200)
        seed_test(BRIDGES[key], num_cycles=50)


def _reply(key: str, agent: str, action: int, rng: np.random.Generator) -> str:
    """A valid text reply for `action` in the bridge `key`, varied in form."""
    label = {"rps_labels": rps_label, "nim_labels": nim_label}.get(key)
    forms = [str(action), f"I choose {action}."]
    if label is not None:
        forms += [f"{action}) {label(agent, action)}", label(agent, action).upper()]
    return forms[int(rng.integers(len(forms)))]


@pytest.mark.parametrize("key", BRIDGES)
def test_bridge_equivalence(key: str) -> None:
    """Same seed, same moves (ids to the wrapped env, text to the bridge): same trajectory."""
    inner_cls = MaskedRPS if key.startswith("rps") else Nim
    for seed in range(15):
        inner, bridged = wrappers.OrderEnforcingWrapper(inner_cls()), BRIDGES[key]()
        inner.reset(seed=seed)
        bridged.reset(seed=seed)
        rng = np.random.default_rng(seed)
        for steps in range(100):
            if not inner.agents:
                break
            assert bridged.agents == inner.agents
            assert bridged.agent_selection == inner.agent_selection
            agent = inner.agent_selection
            i_obs, i_rew, i_term, i_trunc, _ = inner.last()
            b_obs, b_rew, b_term, b_trunc, b_info = bridged.last()
            assert (b_rew, b_term, b_trunc) == (i_rew, i_term, i_trunc)
            assert bridged.observation_space(agent).contains(b_obs), b_obs
            if i_term or i_trunc:
                inner.step(None)
                bridged.step(None)
                continue
            start = int(inner.action_space(agent).start)
            legal = [start + int(i) for i in np.flatnonzero(i_obs["action_mask"])]
            assert b_info["legal_moves"] == [str(a) for a in legal]
            action = legal[int(rng.integers(len(legal)))]
            inner.step(action)
            bridged.step(_reply(key, agent, action, rng))
            assert bridged.rewards == inner.rewards
            assert bridged.terminations == inner.terminations
            assert bridged.truncations == inner.truncations
        assert not inner.agents and not bridged.agents and steps < 99
        assert bridged.unwrapped.invalid_counts == {a: 0 for a in inner.possible_agents}


def test_bridge_texts() -> None:
    env = BRIDGES["nim_labels"]()
    env.reset(seed=3)
    pile = env.unwrapped.env.pile
    assert env.observe("first")["text"] == (
        f"Nim. {pile} stones left.\n"
        "Legal moves: 1) take 1 stone, 2) take 2 stones, 3) take 3 stones.\n"
        "Reply with the number of one legal move."
    )
    assert env.observe("second")["text"] == f"Nim. {pile} stones left.\nWaiting for your turn."
    assert env.infos["first"] == {
        "pile": pile,
        "invalid": 0,
        "infostate": f"Nim. {pile} stones left.",
        "legal_moves": ["1", "2", "3"],
    }
    bare = BRIDGES["rps_bare"]()
    bare.reset()
    assert bare.observe("player_0")["text"] == (
        "Observation: [0, 0]\nLegal moves: 0, 1, 2.\nReply with the number of one legal move."
    )
    bare.step("1")
    bare.step("2")
    assert bare.observe("player_0")["text"] == (
        "Observation: [1, 3]\nLegal moves: 0, 2.\nReply with the number of one legal move."
    )
    assert bare.rewards == {"player_0": -1, "player_1": 1}


@pytest.mark.parametrize(
    ("reply", "action"),
    [
        ("take 2 stones", 2),  # the label's own digit is not a second mention
        ("TAKE 3 STONES please", 3),
        ("2) take 2 stones", 2),
        ("1", 1),
        ("take 1 stone", 1),
        ("take 2 stones or 3", None),
        ("1 2", None),
        ("take 1 stone, no, take 2 stones", None),
        ("4", None),
        ("", None),
        (None, None),
    ],
)
def test_default_parse_with_labels(reply: Any, action: int | None) -> None:
    legal = {a: nim_label("first", a) for a in (1, 2, 3)}
    assert default_parse_reply(reply, legal) == action


BRIDGE_GARBAGE = [
    "",
    "x" * 100_000,
    "x" * 1100 + " 1",  # past the 1024 characters that are read
    "ünïcødé ✊✋✌ 石头",
    "0 or 2",  # ambiguous
    "1",  # repeats player_0's previous move: masked out
    "paper",  # labels are not read by the bare bridge
    "99",
    None,
]


@pytest.mark.parametrize("reply", BRIDGE_GARBAGE)
def test_bridge_garbage_forfeits(reply: Any) -> None:
    env = BRIDGES["rps_bare"]()
    env.reset(seed=0)
    env.step("1")
    env.step("1")  # a tie: round 1 over, player_0 may not play 1 now
    env.step(reply)
    assert env.rewards == {"player_0": -1, "player_1": 0}
    assert env.terminations == {"player_0": True, "player_1": True}
    assert env.unwrapped.invalid_counts == {"player_0": 1, "player_1": 0}
    assert env.infos["player_0"]["invalid"] == 1 and env.infos["player_1"]["reason"] == "forfeit"
    assert env.infos["player_0"]["legal_moves"] == []
    assert env.observe("player_0")["text"].endswith("\nYour reply was invalid, a forfeit.")
    assert env.observe("player_1")["text"].endswith("\nA reply was invalid, a forfeit.")
    totals = {"player_0": 0.0, "player_1": 0.0}
    for agent in env.agent_iter(max_iter=10):
        obs, reward, term, _, _ = env.last()
        assert term and env.observation_space(agent).contains(obs)
        totals[agent] += reward
        env.step(None)
    assert not env.agents and totals == {"player_0": -1, "player_1": 0}
    assert env.unwrapped.env.round == 1  # the wrapped env was not stepped by the bad reply


def test_bridge_overrides_escaping_and_length() -> None:
    env = games.from_pettingzoo(
        MaskedRPS,
        name="rps_text_v0",
        render_observation=lambda agent, obs: "♠ " * 500,
        render_moves=rps_label,
        parse_reply=lambda reply, legal: 0 if reply == "R" else None,
        max_length=128,
    )
    env.reset()
    text = env.observe("player_0")["text"]
    assert env.observation_space("player_0").contains({"text": text}) and len(text) <= 128
    assert text.startswith("\\u2660 \\u2660") and "...\nLegal moves: 0) rock" in text
    assert text.endswith("Reply with the number of one legal move.")
    env.step("R")
    assert env.unwrapped.env.pending == 0
    env.step("0")  # the custom parser reads only "R"
    assert env.unwrapped.invalid_counts["player_1"] == 1
    assert printable("é\x00ok", 100) == "\\xe9\\x00ok"
    assert set(printable("日本" * 50, 40)) <= set(string.printable)


def test_bridge_rejects_unsuitable_envs() -> None:
    class NoMask(MaskedRPS):
        def observation_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
            return spaces.Box(0, 3, (2,), dtype=np.int64)

    class TextActions(MaskedRPS):
        def action_space(self, agent: str) -> gymnasium.spaces.Space[Any]:
            return spaces.Text(8)

    # Without an action mask every action is legal.
    nomask = games.from_pettingzoo(NoMask, name="x_v0")
    nomask.reset(seed=0)
    assert nomask.unwrapped.infos[nomask.agent_selection]["legal_moves"] == ["0", "1", "2"]
    with pytest.raises(TypeError, match="not Discrete"):
        games.from_pettingzoo(TextActions(), name="x_v0")
    with pytest.raises(TypeError, match="AECEnv"):
        games.from_pettingzoo(lambda: object(), name="x_v0")  # type: ignore[arg-type,return-value]
