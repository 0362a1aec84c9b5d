"""A calculator tool for arithmetic whose operands are too large to work out in the head.

Prompts are the arithmetic task's ("What is 48213 + 90877? Answer with just the number.", with
`meta["answer"]`; a source of kind "arithmetic" with a large `max_operand`). The model may write
`<calc>48213 + 90877</calc>` (any number of times, one turn each); the calculator answers with
the value. A turn without a call is the final answer: reward 1 when its last integer is the
answer, else 0, and the episode is done.

    [[data.sources]]
    name = "big"
    kind = "arithmetic"
    max_operand = 100000
    environment = "envs.calculator"
"""

from __future__ import annotations

import ast
import operator
import re
from typing import Any

from envs.base import Step
from envs.tools import call_tools, parse_calls

# A worked example: the default model (135M) calls the tool a few times in a hundred without one.
system = ("You have a calculator. To use it, reply with only <calc>EXPRESSION</calc>, for example "
          "<calc>4821 + 377</calc>, and its value comes back. Then answer with just the number.\n\n"
          "Example:\nUser: What is 1520 - 38?\nAssistant: <calc>1520 - 38</calc>\nCalculator: 1482\n"
          "Assistant: 1482")
tools = [{"type": "function", "function": {
    "name": "calc", "description": "The value of an arithmetic expression of integers (+, -, *, parentheses).",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]
error_role = "tool"

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}
_MAX_DIGITS = 200  # a result longer than this is refused (no 10**10**10)
_INTEGER = re.compile(r"-?\d+")


def calc(expression: str) -> int:
    """The value of an integer expression of +, -, * and parentheses; ValueError for anything else."""
    def value(node: ast.AST) -> int:
        if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            out = _OPS[type(node.op)](value(node.left), value(node.right))
            if len(str(abs(out))) > _MAX_DIGITS:
                raise ValueError(f"result longer than {_MAX_DIGITS} digits")
            return out
        raise ValueError(f"not an integer expression of + - * ( ): {ast.unparse(node)!r}")

    try:
        tree = ast.parse(expression.replace(",", ""), mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot read {expression!r}") from None
    return value(tree.body)


def start(meta: dict[str, Any]) -> dict[str, Any]:
    answer = meta["answer"]
    assert isinstance(answer, int) and not isinstance(answer, bool), \
        f"envs.calculator: meta['answer'] must be an int, got {answer!r}"
    return {"answer": answer, "calls": 0}


def step(state: dict[str, Any], text: str) -> Step:
    calls = parse_calls(text, format="tag", names=["calc"])
    if calls:
        answers = call_tools(calls, {"calc": calc})
        return Step(state={**state, "calls": state["calls"] + len(calls)},
                    messages=[{"role": "tool", "content": a} for a in answers])
    found = _INTEGER.findall(text.replace(",", ""))
    correct = 1.0 if found and int(found[-1]) == state["answer"] else 0.0
    return Step(state=state, done=True, reward=correct, rewards={"correct": correct})
