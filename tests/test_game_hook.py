"""The evaluation hook: the runtime reads what a game declares and names no game itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import games
from games.evaluation import GameEval

ROOT = Path(__file__).resolve().parents[1]
GAME_MODULES = sorted(p.stem for p in (ROOT / "games").glob("*.py")
                      if p.stem not in {"__init__", "bridge", "dialogue", "evaluation", "scripted", "text_env"}
                      and not p.stem.startswith("bridge"))


def test_every_registered_game_declares_its_hook():
    for name in games.names():
        ev = games.evaluation(name)
        assert isinstance(ev, GameEval) and ev.unit.isidentifier() and ev.starts and ev.system_prompt, name
        assert ev.scripted, f"{name} declares no scripted seat of its own"
        for s in ev.scripted:
            assert s in games.SCRIPTED, (name, s)
        for kwargs in ev.starts:  # every start can be made
            games.make(name, **kwargs).reset(seed=0)
    kuhn = games.evaluation("kuhn_poker_v0")
    assert kuhn.label == "chips/hand" and len(kuhn.starts) == 6 and kuhn.measure("exploitability").better == "lower"
    with pytest.raises(KeyError, match="no exact measure 'nash'"):
        kuhn.measure("nash")


def test_bad_hooks_are_refused():
    with pytest.raises(ValueError, match="identifier"):
        GameEval(unit="chips/hand")
    with pytest.raises(ValueError, match="at least one start"):
        GameEval(starts=())


def test_the_runtime_names_no_game_and_imports_no_game_module():
    """``opentinker/`` may name a game only as the config's default (and in its bundled job
    files, which are TOML): every other place reads the game's hook."""
    names = [n.removesuffix("_v0") for n in games.names()] + GAME_MODULES
    words = re.compile(r"|".join([*map(re.escape, names), "kuhn", "poker", "chips", "tic-tac-toe"]), re.IGNORECASE)
    found = []
    for path in sorted((ROOT / "opentinker").rglob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"^\s*(?:from|import)\s+games\.(\w+)", text, re.MULTILINE):
            if m.group(1) not in {"evaluation", "scripted", "bridge"}:
                found.append(f"{path.relative_to(ROOT)} imports games.{m.group(1)}")
        for m in re.finditer(r"^\s*from\s+games\s+import\s+\(?([\w\s,]+)", text, re.MULTILINE):
            found += [f"{path.relative_to(ROOT)} imports games.{n}" for n in re.split(r"[\s,]+", m.group(1))
                      if n in GAME_MODULES]
        for i, line in enumerate(text.splitlines(), 1):
            if words.search(line) and not line.strip().startswith('game: Annotated[str, Meta(max_length=256)] = "kuhn_poker_v0"'):
                found.append(f"{path.relative_to(ROOT)}:{i}: {line.strip()}")
    assert found == []


def test_kuhn_best_response_is_a_best_response_and_the_table_seat_plays_it():
    import numpy as np

    from games import kuhn_poker
    from games.scripted import TABLE, make_scripted

    rng = np.random.default_rng(0)
    for _ in range(20):
        policy = {s: float(rng.random()) for s in kuhn_poker.INFO_STATES}
        for seat in (0, 1):
            br = kuhn_poker.best_response(policy, seat)
            value = (kuhn_poker.expected_value(br, policy) if seat == 0
                     else -kuhn_poker.expected_value(policy, br))
            assert value == pytest.approx(kuhn_poker.best_response_value(policy, seat), abs=1e-12)
    # Through the hook: against always bet/call, never bluff with J and fold it to a bet.
    hook = games.evaluation("kuhn_poker_v0").exploiter()
    always = {d.infostate: {d.legal_moves[0]: 0.0, d.legal_moves[1]: 1.0} for d in hook.decisions()}
    table = hook.best_response(always)
    assert set(table) == set(kuhn_poker.INFO_STATES)
    assert table["J"] == "check" and table["Jb"] == "fold" and table["Kb"] == "call"
    seat = make_scripted(TABLE, table=table)
    assert seat.act("", {"infostate": "Jb", "legal_moves": ["fold", "call"]}, rng) == "fold"
    with pytest.raises(ValueError, match="no legal move for info state 'Qx'"):
        seat.act("", {"infostate": "Qx", "legal_moves": ["fold", "call"]}, rng)


def test_kuhn_forfeit_chips():
    env = games.make("kuhn_poker_v0", deal=0, forfeit_chips=2)
    env.reset()
    env.step("no idea")
    assert env.rewards == {"player_0": -2, "player_1": 2} and "You lose 2 chips." in env.observe("player_0")["text"]
    env = games.make("kuhn_poker_v0", deal=0)  # the default: a forfeit folds the 1-chip stake
    env.reset()
    env.step("no idea")
    assert env.rewards == {"player_0": -1, "player_1": 1}
    with pytest.raises(ValueError, match="forfeit_chips must be an integer in"):
        games.make("kuhn_poker_v0", forfeit_chips=0)
