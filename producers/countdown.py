"""The built-in countdown task: reach a target from given numbers with + - * /, each number at
most once. Every problem is solvable: its target is the value of an expression drawn first."""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

INSTRUCTION = ("Use + - * / and parentheses, each number at most once. "
               "Answer with just the expression, e.g. (3 + 5) * 2.")


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


def dataset(*, size: int, seed: int = 0, numbers: int = 4, max_number: int = 25):
    """A `datasets.Dataset` of `size` problems (columns question, numbers, target), to save as
    a file and train on as a dataset source, or to look at."""
    from datasets import Dataset

    ps = [problem(seed=seed, index=i, numbers=numbers, max_number=max_number) for i in range(size)]
    return Dataset.from_dict({"question": [p.question for p in ps],
                              "numbers": [p.numbers for p in ps],
                              "target": [p.target for p in ps]})
