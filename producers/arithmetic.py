"""The built-in synthetic arithmetic task: "What is 8 + 9?" with its integer answer."""

from __future__ import annotations

import random
from dataclasses import dataclass

INSTRUCTION = "Answer with just the number."


@dataclass(frozen=True, slots=True)
class Problem:
    question: str  # the user message
    answer: int  # ground truth for the reward


def problem(*, seed: int, index: int, max_operand: int, ops: list[str]) -> Problem:
    """The `index`-th problem of the sequence `seed` names: the same arguments, the same problem."""
    rng = random.Random(f"arithmetic:{seed}:{index}")
    a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
    op = rng.choice(ops)
    answer = {"+": a + b, "-": a - b, "*": a * b}[op]
    return Problem(question=f"What is {a} {op} {b}? {INSTRUCTION}", answer=answer)
