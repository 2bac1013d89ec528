"""Tools (games.tools, games.tool_use): the call format, running calls under limits, invalid
calls, the calculator task and a tool-using seat in a two-seat game."""

from __future__ import annotations

import json
import re
import time
import warnings
from pathlib import Path

import numpy as np
import pytest
from pettingzoo.test import api_test

import games
from games.calculator import CALC, calc, estimate, evaluate
from games.tool_use import ToolUse, find_tool_use
from games.tools import (
    Call,
    Outcome,
    Tool,
    format_call,
    parse_calls,
    run_call,
    tool_instructions,
)

OBJ = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"], "additionalProperties": False}


def tool(fn, **kw) -> Tool:
    return Tool(name=kw.pop("name", "t"), description="a test tool", parameters=kw.pop("parameters", OBJ), fn=fn, **kw)


def test_calls_are_read_in_the_hermes_format_and_as_a_bare_json_object():
    assert parse_calls("9716") is None
    assert parse_calls('{"answer": 3}') is None  # JSON, but not a call: a move
    calls = parse_calls('Sure. <tool_call>{"name": "calc", "arguments": {"expression": "2*3"}}</tool_call>'
                        '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1\\"}"}</tool_call>')
    assert calls == [Call("calc", {"expression": "2*3"}), Call("calc", {"expression": "1"})]
    assert parse_calls('{"name": "calc", "arguments": {"expression": "1"}}') == [Call("calc", {"expression": "1"})]
    # A call cut by the token limit (no closing tag) is still read; broken JSON is malformed.
    assert parse_calls('<tool_call>{"name": "calc", "arguments": {}}') == [Call("calc", {})]
    bad = parse_calls("<tool_call>calc(2*3)</tool_call>")
    assert len(bad) == 1 and "not JSON" in bad[0].error
    assert "arguments must be a JSON object" in parse_calls('<tool_call>{"name": "c", "arguments": [1]}'
                                                           "</tool_call>")[0].error
    assert format_call("calc", {"expression": "2*3"}) == ('<tool_call>{"name": "calc", "arguments": '
                                                          '{"expression": "2*3"}}</tool_call>')
    assert parse_calls(format_call("calc", {"expression": "2*3"})) == [Call("calc", {"expression": "2*3"})]


def test_a_declaration_has_the_openai_shape_and_bad_ones_are_refused():
    assert CALC.schema() == {"type": "function", "function": {
        "name": "calc", "description": CALC.description, "parameters": dict(CALC.parameters)}}
    assert json.loads(tool_instructions([CALC.schema()]).splitlines()[1]) == CALC.schema()
    with pytest.raises(ValueError, match="tool name"):
        tool(abs, name="no spaces")
    with pytest.raises(ValueError, match="type 'object'"):
        tool(abs, parameters={"type": "string"})
    with pytest.raises(ValueError, match="not a valid JSON schema"):
        tool(abs, parameters={"type": "object", "properties": {"x": {"type": "nonsense"}}})


def test_every_kind_of_call_has_its_outcome_and_an_error_result():
    tools = {"t": tool(lambda x: x * 2), "boom": tool(lambda x: 1 // 0, name="boom")}
    ok = run_call(tools, Call("t", {"x": 21}))
    assert (ok.outcome, ok.content, ok.ok) == (Outcome.OK, "42", True)
    cases = [
        (Call(error="the call is not JSON"), Outcome.MALFORMED, "malformed tool call"),
        (Call("nope", {"x": 1}), Outcome.UNKNOWN_TOOL, "unknown tool 'nope'; tools: boom, t"),
        (Call("t", {"x": "one"}), Outcome.BAD_ARGUMENTS, "x: 'one' is not of type 'integer'"),
        (Call("t", {}), Outcome.BAD_ARGUMENTS, "'x' is a required property"),
        (Call("t", {"x": 1, "y": 2}), Outcome.BAD_ARGUMENTS, "Additional properties"),
        (Call("boom", {"x": 1}), Outcome.FAILED, "boom failed: ZeroDivisionError"),
    ]
    for call, outcome, words in cases:
        r = run_call(tools, call)
        assert r.outcome is outcome and not r.ok and r.content.startswith("Error: ") and words in r.content, r


def test_a_call_runs_under_its_time_and_output_limits():
    def spin(x):
        while True:
            x += 1

    t0 = time.monotonic()
    r = run_call({"t": tool(spin, timeout_s=0.2)}, Call("t", {"x": 0}))
    assert r.outcome is Outcome.TIMEOUT and "longer than 0.2 s" in r.content
    assert time.monotonic() - t0 < 30  # bounded: the deadline stops the loop
    big = run_call({"t": tool(lambda x: "é" * 10_000, max_output=100)}, Call("t", {"x": 1}))
    assert big.ok and big.cut and big.content.startswith("\\xe9" * 25)
    assert big.content.endswith("[cut: 39900 more characters]") and len(big.content) < 140
    structured = run_call({"t": tool(lambda x: {"v": [x]})}, Call("t", {"x": 1}))
    assert structured.content == '{"v": [1]}'


def test_a_tool_cannot_reach_files_or_the_network_unless_the_game_says_so(tmp_path):
    path = tmp_path / "secret.txt"
    path.write_text("s3cret")

    def read(x):
        return path.read_text()

    def connect(x):
        import socket

        with socket.create_connection(("127.0.0.1", 9), timeout=0.5):
            return "connected"

    for fn in (read, connect):
        r = run_call({"t": tool(fn)}, Call("t", {"x": 0}))
        assert r.outcome is Outcome.FAILED and "PermissionError" in r.content and "s3cret" not in r.content
    allowed = run_call({"t": tool(read, io=True)}, Call("t", {"x": 0}))
    assert allowed.ok and allowed.content == "s3cret"
    assert path.read_text() == "s3cret"  # the guard is per tool thread: the rest of the process is unaffected


def test_the_calculator_is_exact_and_refuses_everything_but_arithmetic():
    assert calc("347 * 28") == "9716" and calc("1/3") == "0.3333333333" and calc("-(2**10) // 3") == "-342"
    assert calc("0.1 + 0.2") == "0.3"
    for bad, words in (("__import__('os')", "not Call"), ("2 ** 1000", "powers"), ("10**99 * 10**99", "too large"),
                       ("x + 1", "not Name"), ("1 +", "not an arithmetic")):
        with pytest.raises(ValueError, match=words):
            evaluate(bad)
    assert estimate(9716) == 9700 and estimate(29400) == 29000 and estimate(7) == 7


def play(env, replies: list[str]) -> tuple[list[tuple[str, str, dict]], dict[str, float]]:
    """Feed ``replies`` to whoever acts; the (seat, observation, info) of every decision, and
    every seat's total reward."""
    seen, it, totals = [], iter(replies), dict.fromkeys(env.possible_agents, 0.0)
    for agent in env.agent_iter(max_iter=50):
        obs, _, term, trunc, info = env.last()
        if term or trunc:
            env.step(None)
            continue
        seen.append((agent, obs["text"], dict(info)))
        env.step(next(it))
        for a, r in env.rewards.items():
            totals[a] += r
    return seen, totals


def test_the_calculator_returns_results_as_observations_and_counts_invalid_calls():
    env = games.make("calculator_v0")
    env.reset(options={"operands": [347, 28]})
    call = format_call("calc", {"expression": "347 * 28"})
    seen, totals = play(env, ["<tool_call>oops</tool_call>", '<tool_call>{"name": "calculator", "arguments": {}}</tool_call>',
                      call, "The answer is 9,716."])
    malformed = "Error: malformed tool call: the call is not JSON (Expecting value at character 0)."
    assert [s[1] for s in seen[1:]] == [malformed, "Error: unknown tool 'calculator'; tools: calc.", "9716"]
    assert [s[2]["tool_result"] for s in seen] == [None] + [s[1] for s in seen[1:]]
    assert seen[-1][2]["legal_moves"] == ["9716"]  # the game's examples after a result
    box = find_tool_use(env)
    assert (box.tool_calls["solver"], box.invalid_tool_calls["solver"]) == (3, 2)
    assert box.outcomes == {Outcome.MALFORMED: 1, Outcome.UNKNOWN_TOOL: 1, Outcome.OK: 1}
    assert totals == {"solver": 1.0} and env.unwrapped.invalid_counts["solver"] == 0


def test_calls_past_the_limit_go_to_the_game_and_forfeit():
    env = games.make("calculator_v0")
    env.reset(options={"operands": [347, 28]})
    call = format_call("calc", {"expression": "1 + 1"})
    seen, totals = play(env, [call] * 4)
    assert len(seen) == 4 and find_tool_use(env).tool_calls["solver"] == 3
    assert find_tool_use(env).over_limit["solver"] == 1 and env.unwrapped.invalid_counts["solver"] == 1
    assert totals == {"solver": 0.0}


# Without the tool an estimate is exact only by luck (seed 0-19: once).
@pytest.mark.parametrize("policy, solved", [("calc_tool_user", 20), ("calc_no_tool", 1)])
def test_the_scripted_seats_with_and_without_the_tool(policy, solved):
    seat, rng = games.make_scripted(policy), np.random.default_rng(0)
    wins = calls = 0
    for seed in range(20):
        env = games.make("calculator_v0")
        env.reset(seed=seed)
        for _ in env.agent_iter(max_iter=10):
            obs, _, term, trunc, info = env.last()
            env.step(None if term or trunc else seat.act(obs["text"], info, rng))
        wins += env.unwrapped.answer == env.unwrapped.value
        calls += find_tool_use(env).tool_calls["solver"]
    assert wins == solved and calls == (20 if policy == "calc_tool_user" else 0)


def test_a_seat_with_a_tool_in_a_two_seat_negotiation():
    env = games.make("negotiation_v0", value_tool=True)
    values = {"player_0": {"book": 2, "hat": 3, "ball": 1}, "player_1": {"book": 4, "hat": 1, "ball": 2}}
    env.reset(options={"pool": {"book": 1, "hat": 2, "ball": 2}, "values": values})
    box = find_tool_use(env)
    assert [s["function"]["name"] for s in box.schemas("player_0")] == ["value_of"] and box.schemas("player_1") == []
    seen, totals = play(env, [format_call("value_of", {"item": "hats"}), format_call("value_of", {"item": "cars"}),
                      "propose: books=0 hats=2 balls=0", "accept"])
    bad = "Error: bad arguments for value_of (item: 'cars' is not one of ['book', 'hat', 'ball', 'books', 'hats', 'balls'])."
    assert [(a, info.get("tool_result")) for a, _, info in seen] == [
        ("player_0", None), ("player_0", "3"), ("player_0", bad), ("player_1", None)]
    assert "ask the value_of tool" in seen[0][1] and "hat 3" not in seen[0][1]
    assert "Your values: book 4, hat 1, ball 2" in seen[3][1]
    # The tool's exchange is player_0's alone: player_1 sees the proposal, not the calls.
    assert "value_of" not in seen[3][1] and "tool_call" not in env.unwrapped.transcript("player_1")
    assert (box.tool_calls, box.invalid_tool_calls) == ({"player_0": 2, "player_1": 0}, {"player_0": 1, "player_1": 0})
    assert env.unwrapped.shares["player_0"] == {"book": 0, "hat": 2, "ball": 0}
    assert totals == {"player_0": 6.0, "player_1": 8.0}


def test_tools_for_a_seat_the_game_lacks_are_an_error():
    with pytest.raises(ValueError, match=r"tools for seats \['nobody'\]"):
        ToolUse(games.calculator.raw_env(), {"nobody": [CALC]})


def load_docs_example() -> dict:
    """Execute the python block after "<!-- example: capitals -->" in docs/games.md."""
    text = (Path(__file__).resolve().parents[1] / "docs/games.md").read_text()
    block = re.search(r"<!-- example: capitals -->\s*```python\n(.*?)```", text, re.DOTALL)
    assert block, "docs/games.md lost its tools example"
    namespace: dict = {"__name__": "capitals"}
    exec(compile(block.group(1), "docs/games.md", "exec"), namespace)  # noqa: S102 (our own docs)
    return namespace


def test_the_docs_example_conforms_and_plays_as_documented():
    capitals = load_docs_example()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        api_test(capitals["env"](), num_cycles=100)
    env = capitals["env"]()
    env.reset(options={"country": "Peru"})
    seen, totals = play(env, [format_call("capital", {"country": "Peru"}), "Lima"])
    assert seen[0][1] == ("Moderator: What is the capital of Peru?\n"
                          "Name the capital, or look it up with the capital tool.")
    assert (seen[1][1], seen[1][2]["tool_result"], totals) == ("Lima", "Lima", {"student": 1.0})
    env.reset(options={"country": "Peru"})
    seen, totals = play(env, [format_call("capital", {"country": "Atlantis"}), "Atlantis City"])
    assert seen[1][1] == "Error: capital failed: KeyError: 'Atlantis'" and totals == {"student": 0.0}
    assert find_tool_use(env).invalid_tool_calls == {"student": 1}
