"""The built-in countdown task: reach a target from given numbers with + - * /, each number at
most once, and its reward. Every problem is solvable: its target is the value of an expression
drawn first."""

from __future__ import annotations

import ast
import random
import re
from collections import Counter
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from pydantic import BaseModel, Field

INSTRUCTION = ("Use + - * / and parentheses, each number at most once. "
               "Answer with just the expression, e.g. (3 + 5) * 2.")


class Options(BaseModel):
    """`kind = "countdown"`: reach a target from given numbers, drawn from the run's seed."""

    # numbers given per problem, each drawn from [1, max_number].
    numbers: int = Field(4, ge=2, le=6)
    # the largest number given.
    max_number: int = Field(25, ge=2)


@dataclass(frozen=True, slots=True)
class Problem:
    question: str  # the user message
    numbers: list[int]  # the numbers allowed, each at most once
    target: int  # the value to reach
    solution: str  # one expression that reaches it (not sent to the model)


def problem(*, seed: int, index: int, numbers: int, max_number: int) -> Problem:
    """The `index`-th problem of the sequence `seed` names: the same arguments, the same problem."""
    rng = random.Random(f"countdown:{seed}:{index}")
    while True:
        nums = [rng.randint(1, max_number) for _ in range(numbers)]
        used = rng.sample(nums, rng.randint(2, numbers))
        value, expr = Fraction(used[0]), str(used[0])
        for x in used[1:]:
            op = rng.choice("+-*/")
            if op == "/" and (value % x != 0):
                op = "+"
            value = {"+": value + x, "-": value - x, "*": value * x, "/": value / x}[op]
            expr = f"({expr} {op} {x})"
        if value.denominator == 1 and 1 <= value <= 1000:
            target = int(value)
            question = f"Using the numbers {nums}, make {target}. {INSTRUCTION}"
            return Problem(question=question, numbers=nums, target=target, solution=expr[1:-1])


def make_prompt(options: Any, *, seed: int, index: int) -> tuple[str, dict[str, Any]]:
    """The user message of a source's `index`-th problem, and the meta its reward reads."""
    p = problem(seed=seed, index=index, numbers=options.numbers, max_number=options.max_number)
    return p.question, {"numbers": p.numbers, "target": p.target}


def dataset(*, size: int, seed: int = 0, **options: Any):
    """A `datasets.Dataset` of `size` problems (columns question, numbers, target), to save as
    a file and train on as a dataset source, or to look at; `options`: Options' fields (its
    defaults where left out: the problems a source of kind "countdown" draws)."""
    from datasets import Dataset

    o = Options(**options)
    ps = [problem(seed=seed, index=i, numbers=o.numbers, max_number=o.max_number) for i in range(size)]
    return Dataset.from_dict({"question": [p.question for p in ps],
                              "numbers": [p.numbers for p in ps],
                              "target": [p.target for p in ps]})


# ---------------------------------------------------------------------- the reward

_ANSWER_TAG = re.compile(r"<answer>(.*?)</answer>", re.S)
_EXPRESSION = re.compile(r"[\d\s+\-*/().]*\d[\d\s+\-*/().]*")
_OPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b,
        ast.Mult: lambda a, b: a * b, ast.Div: lambda a, b: a / b}


def evaluate(expression: str) -> tuple[Fraction, list[int]]:
    """(exact value, integers used) of an expression of integers, + - * / and parentheses.

    Parsed with `ast`, never `eval`; anything else (names, calls, powers, unary minus, floats)
    raises ValueError, and so does a division by zero.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as err:
        raise ValueError(f"not an expression: {expression!r}") from err
    used: list[int] = []

    def walk(node: ast.AST) -> Fraction:
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            left, right = walk(node.left), walk(node.right)
            if isinstance(node.op, ast.Div) and right == 0:
                raise ValueError("division by zero")
            return _OPS[type(node.op)](left, right)
        if isinstance(node, ast.Constant) and type(node.value) is int:
            used.append(node.value)
            return Fraction(node.value)
        raise ValueError(f"{type(node).__name__} is not allowed in an expression")

    return walk(tree.body), used


def reward(*, prompt: str, completion: str, completion_ids: list[int],
           meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the completion's expression equals `meta["target"]` using only `meta["numbers"]`,
    each at most once; else 0.0.

    The expression is the last <answer>...</answer>, else the longest run of digits, operators
    and parentheses on the last line that has one; a trailing "= N" is ignored.
    """
    target, numbers = meta["target"], meta["numbers"]
    assert isinstance(target, int) and isinstance(numbers, list), \
        f"tasks.countdown reward: meta needs int 'target' and list 'numbers', got {target!r}, {numbers!r}"
    tags = _ANSWER_TAG.findall(completion)
    text = tags[-1] if tags else completion
    lines = [ln.split("=")[0] for ln in text.strip().splitlines() if _EXPRESSION.search(ln.split("=")[0])]
    if not lines:
        return {"correct": 0.0}
    expression = max(_EXPRESSION.findall(lines[-1]), key=len)
    try:
        value, used = evaluate(expression)
    except ValueError:
        return {"correct": 0.0}
    fits = not (Counter(used) - Counter(numbers))
    return {"correct": 1.0 if fits and value == target else 0.0}
