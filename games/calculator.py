"""Calculator: one seat answers an arithmetic problem, with a `calc` tool it may call.

| Creation     | `games.make("calculator_v0", digits=(3, 2))`                                 |
|--------------|-----------------------------------------------------------------------------|
| API          | PettingZoo AEC on `games.dialogue.DialogueEnv`, in `games.tool_use.ToolUse`  |
| Agents       | `["solver"]`                                                                |
| Tools        | `calc(expression)`: the exact value of an arithmetic expression             |
| Observation  | `Dict({"text": Text(2048, charset=string.printable)})`                      |
| Action       | `Text(2048, charset=string.printable)`: a tool call or the answer           |
| Rewards      | 1 for the exact answer, else 0 (so the mean reward is the success rate)     |

**Game.** The moderator asks "What is 347 * 28?": the product of a `digits[0]`-digit and a
`digits[1]`-digit number, drawn from `self.np_random`. A 135M model cannot multiply these in
its head; with the tool it only has to call it and copy the result.

**Tool.** `calc` (JSON schema: `{"expression": string, at most 200 characters}`) evaluates
`+ - * / // % **`, unary minus and parentheses over integers and decimals, exactly (fractions;
an integer result reads "9716", another "0.3333333333"); a power above 100, a number above
10^100 or anything else (names, calls, attributes) fails, which is an invalid call. It reads
nothing and writes nothing. Call format, limits and invalid calls: `games.tool_use`
(3 calls per problem here).

**What the seat sees.** "Moderator: What is 347 * 28?" and the prompt "Reply with the exact
number only, or call calc."; after a call, the tool's result (a `tool` message to the model).

**Legal replies.** The answer is the last number in the reply ("9716", "It is 9,716." are
9716); a reply with no number, or a tool call past the limit, is invalid: the problem ends unsolved (reward 0, not the
dialogue games' -1, so the reward stays a success indicator), counted in
`infos[agent]["invalid"]`.

**End.** After the answer (reason "answered"), or the invalid reply.

**Infos.** Those of `games.dialogue` and `games.tool_use`, plus `expression` ("347 * 28")
and, at the end, `answer` (the number read, or None) and `correct`.

**Scripted.** `calc_tool_user` calls `calc` with the problem's expression and answers the
result: it solves every problem. `calc_no_tool` never calls and answers its estimate (two
significant figures): the baseline of a seat without the tool.

**Version history.** v0: initial release.
"""

from __future__ import annotations

import ast
import operator
import re
from fractions import Fraction
from typing import Any, ClassVar

import numpy as np
from pettingzoo import AECEnv
from pettingzoo.utils import wrappers

from games.dialogue import DialogueEnv, check_decision
from games.evaluation import GameEval
from games.tool_use import ToolUse
from games.tools import CALL_OPEN, Result, Tool, format_call

AGENTS = ("solver",)
MAX_POWER = 100
MAX_MAGNITUDE = 10**100
_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?")
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression (see the card); ValueError naming what is
    not allowed, ZeroDivisionError for a division by zero."""
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        raise ValueError(f"not an arithmetic expression: {expression!r}") from None

    def ev(node: ast.AST) -> Fraction:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return Fraction(str(node.value))
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
            v = ev(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            a, b = ev(node.left), ev(node.right)
            if isinstance(node.op, ast.Pow) and (b.denominator != 1 or abs(b) > MAX_POWER):
                raise ValueError(f"powers must be whole numbers up to {MAX_POWER}")
            v = _BINARY[type(node.op)](a, b)
            if isinstance(node.op, ast.Pow):
                v = Fraction(v)
            if abs(v) > MAX_MAGNITUDE:
                raise ValueError("the result is too large")
            return v
        raise ValueError(f"only numbers, + - * / // % ** and parentheses are allowed, not {type(node).__name__}")

    return ev(tree)


def show(value: Fraction) -> str:
    """ "9716" for an integer, else ten significant digits ("0.3333333333")."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.10g}"


def calc(expression: str) -> str:
    """The `calc` tool: `show(evaluate(expression))`."""
    return show(evaluate(expression))


CALC = Tool(
    name="calc",
    description="Evaluate an arithmetic expression exactly, e.g. 347 * 28.",
    parameters={"type": "object", "properties": {"expression": {"type": "string", "maxLength": 200}},
                "required": ["expression"], "additionalProperties": False},
    fn=calc,
)


def read_answer(text: str) -> Fraction | None:
    """The last number in `text` ("It is 9,716." -> 9716), or None."""
    found = _NUMBER.findall(text)
    return Fraction(found[-1].replace(",", "")) if found else None


def estimate(value: int) -> int:
    """`value` rounded to two significant figures (a mental estimate)."""
    digits = len(str(abs(value)))
    return int(round(value, -max(digits - 2, 0)))


class raw_env(DialogueEnv):
    """Calculator AEC env (without its tool wrapper); see the module docstring for the card."""

    metadata: ClassVar[dict[str, Any]] = {"name": "calculator_v0", "is_parallelizable": False,
                                          "render_modes": ["ansi"]}

    def __init__(self, digits: tuple[int, int] | list[int] = (3, 2), render_mode: str | None = None) -> None:
        if len(digits) != 2 or not all(isinstance(d, int) and 1 <= d <= 9 for d in digits):
            raise ValueError(f"digits must be two whole numbers in 1..9, got {digits!r}")
        super().__init__(AGENTS, max_rounds=1, max_reply=300, render_mode=render_mode)
        self.digits = tuple(digits)
        self.expression, self.value = "", 0
        self.answer: Fraction | None = None

    def _deal(self, options: dict[str, Any]) -> None:
        a, b = options.get("operands") or [int(self.np_random.integers(10 ** (d - 1), 10**d)) for d in self.digits]
        self.expression, self.value, self.answer = f"{a} * {b}", int(a) * int(b), None
        self.announce(f"What is {self.expression}?")

    def _turn(self, agent: str, text: str) -> str | None:
        if CALL_OPEN in text:  # a call past the limit reaches the game: its numbers are no answer
            return "a tool call past the limit"
        self.answer = read_answer(text)
        if self.answer is None:
            return "no number in the reply"
        self.end("answered")
        return None

    def _prompt(self, agent: str) -> str:
        return "Reply with the exact number only, or call calc."

    def _legal_moves(self, agent: str) -> list[str]:
        return [format_call("calc", {"expression": self.expression}), str(estimate(self.value))]

    def legal_moves_after_tool(self, agent: str, results: list[Result]) -> list[str] | None:
        """After a call: the last good result, as the answer (`games.tool_use`)."""
        good = [r.content for r in results if r.ok and read_answer(r.content) is not None]
        return good[-1:] or None

    def _rewards(self) -> dict[str, float]:
        return {"solver": float(self.answer == self.value)}

    def _final_rewards(self) -> dict[str, float]:
        return self._rewards() if self._forfeiter is None else {"solver": 0.0}

    def _seat_info(self, agent: str) -> dict[str, Any]:
        info: dict[str, Any] = {"expression": self.expression}
        if self._done():
            info.update(answer=None if self.answer is None else show(self.answer),
                        correct=self.answer == self.value)
        return info


def env(max_calls_per_turn: int = 3, **kwargs: Any) -> AECEnv[str, dict[str, str], str]:
    """Make the order-enforced calculator game with its `calc` tool (`raw_env(**kwargs)`)."""
    return wrappers.OrderEnforcingWrapper(
        ToolUse(raw_env(**kwargs), {"solver": [CALC]}, max_calls_per_turn=max_calls_per_turn,
                max_calls=max_calls_per_turn))


class ToolUserPolicy:
    """Calls `calc` with the problem, then answers its result: solves every problem."""

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """The call, or (after a result) the result."""
        check_decision(info, ("expression", "tool_result"), "calculator_v0")
        if info["tool_result"] is None:
            return format_call("calc", {"expression": info["expression"]})
        return info["tool_result"]


class NoToolPolicy:
    """Never calls a tool: answers its two-significant-figure estimate of the product."""

    def act(self, observation: str, info: dict[str, Any], rng: np.random.Generator) -> str:
        """The estimate, as a number."""
        check_decision(info, ("expression",), "calculator_v0")
        return str(estimate(int(evaluate(info["expression"]))))


SCRIPTED_POLICIES: dict[str, type] = {"calc_tool_user": ToolUserPolicy, "calc_no_tool": NoToolPolicy}
"""Scripted policies of this game by name, for `games.scripted.SCRIPTED`."""

SYSTEM_PROMPT = ("You solve arithmetic problems exactly. Call the calc tool to compute, then reply with "
                 "the number only.")

EVALUATION = GameEval(unit="success", per="problem", scripted=tuple(SCRIPTED_POLICIES), competitive=False,
                      system_prompt=SYSTEM_PROMPT)
"""The evaluation hook: the success rate (reward 1 or 0) with its 95% interval, and the tool
calls and invalid calls per problem the runtime reports for every game with tools."""
