"""The evaluation hook: the runtime reads what a game declares and names no game itself."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import games
from games.evaluation import GameEval

ROOT = Path(__file__).resolve().parents[1]
GAME_MODULES = sorted(p.stem for p in (ROOT / "games").glob("*.py")
                      if p.stem not in {"__init__", "bridge", "dialogue", "evaluation", "scripted", "text_env", "tools",
                                        "tool_use"}
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
    with pytest.raises(ValueError, match="other than ci95, invalid_rate, hands"):
        GameEval(unit="wins")  # would overwrite the runtime's own pairing metric
    from games.evaluation import ExactMeasure

    with pytest.raises(ValueError, match="other than canonical_mass, version"):
        ExactMeasure(name="version", decisions=list, value=lambda d: 0.0)


def test_the_runtime_names_no_game_and_imports_no_game_module():
    """``opentinker/`` may name a game only as the config's default (and in its bundled job
    files, which are TOML): every other place reads the game's hook."""
    names = [n.removesuffix("_v0") for n in games.names()] + GAME_MODULES
    words = re.compile(r"|".join([*map(re.escape, names), "kuhn", "poker", "chips", "tic-tac-toe"]), re.IGNORECASE)
    found = []
    for path in sorted((ROOT / "opentinker").rglob("*.py")):
        text = path.read_text()
        for m in re.finditer(r"^\s*(?:from|import)\s+games\.(\w+)", text, re.MULTILINE):
            if m.group(1) not in {"evaluation", "scripted", "bridge", "tools", "tool_use"}:
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


def test_scripted_seats_from_a_message_are_checked():
    from opentinker.rollout.episodes import scripted_seat
    from protocols.messages import PolicyKind, PolicyRef

    ok = scripted_seat(PolicyRef(kind=PolicyKind.SCRIPTED, name="table", table=(("J", "check"),)))
    assert ok.table == {"J": "check"}
    for bad in (PolicyRef(kind=PolicyKind.SCRIPTED, name="table"),
                PolicyRef(kind=PolicyKind.SCRIPTED, name="random", table=(("J", "bet"),))):
        with pytest.raises(ValueError, match="goes with the seat 'table' and only with it"):
            scripted_seat(bad)
    with pytest.raises(ValueError, match="unknown scripted policy 'nope'"):
        scripted_seat(PolicyRef(kind=PolicyKind.SCRIPTED, name="nope"))


def test_an_env_runner_plays_only_the_registered_games_and_its_jobs(tiny_path):
    """A message naming a module is refused (it would import it): an env runner plays the
    registered games and the ones its job gave it."""
    import sys

    from opentinker.bus import Client, LoopThread, RemoteError
    from opentinker.rollout.env_runner import EnvRunner
    from protocols.messages import EpisodeSpec, ErrorCode, PolicyKind, PolicyRef, RunEpisodes, SamplingParams

    runner = EnvRunner("runner", "tcp://127.0.0.1:9", tiny_path, games=("pettingzoo.classic.rps_v2",))
    endpoint = runner.start()
    loop = LoopThread("test")
    try:
        async def ask(game: str) -> object:
            c = Client(loop.ctx, endpoint, name="t")
            seats = {a: PolicyRef(kind=PolicyKind.SCRIPTED, name="random") for a in ("player_0", "player_1")}
            spec = EpisodeSpec(episode_id=1, group_id=1, game=game, seed=3, seats=seats, train=False)
            try:
                return await c.request(RunEpisodes(episodes=[spec], sampling=SamplingParams(), system_prompt="x"), 30)
            except RemoteError as e:
                return e.error
            finally:
                c.close()

        assert "xml.dom.pulldom" not in sys.modules
        refused = loop.run(ask("xml.dom.pulldom"))
        assert refused.code is ErrorCode.INVALID and "unknown game 'xml.dom.pulldom'" in refused.message
        assert "xml.dom.pulldom" not in sys.modules  # never imported
        done = loop.run(ask("pettingzoo.classic.rps_v2"))  # the job's own: played (scripted seats)
        assert len(done.summaries) == 1 and set(done.summaries[0].rewards) == {"player_0", "player_1"}
    finally:
        loop.stop()
        runner.stop()
