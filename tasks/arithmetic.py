"""The built-in synthetic arithmetic task: "What is 8 + 9?" with its integer answer, and its reward."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, Field

INSTRUCTION = "Answer with just the number."


class Options(BaseModel):
    """`kind = "arithmetic"`: "What is 8 + 9?" problems drawn from the run's seed."""

    # operands are drawn from [0, max_operand].
    max_operand: int = Field(20, ge=1)
    # operators to draw from.
    ops: list[Literal["+", "-", "*"]] = Field(["+", "-"], min_length=1)


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


def make_prompt(options: Any, *, seed: int, index: int) -> tuple[str, dict[str, Any]]:
    """The user message of a source's `index`-th problem, and the meta its reward reads."""
    p = problem(seed=seed, index=index, max_operand=options.max_operand, ops=options.ops)
    return p.question, {"answer": p.answer}


def dataset(*, size: int, seed: int = 0, **options: Any):
    """A `datasets.Dataset` of `size` problems (columns question, answer), to save as a file and
    train on as a dataset source, or to look at; `options`: Options' fields (its defaults where
    left out: the problems a source of kind "arithmetic" draws)."""
    from datasets import Dataset

    o = Options(**options)
    ps = [problem(seed=seed, index=i, max_operand=o.max_operand, ops=o.ops) for i in range(size)]
    return Dataset.from_dict({"question": [p.question for p in ps], "answer": [p.answer for p in ps]})


_INTEGER = re.compile(r"-?\d+")


def reward(*, prompt: str, completion: str, completion_ids: list[int],
           meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the last integer in the completion equals `meta["answer"]`, else 0.0."""
    answer = meta["answer"]
    assert isinstance(answer, int) and not isinstance(answer, bool), \
        f"tasks.arithmetic reward: meta['answer'] must be an int, got {answer!r}"
    found = _INTEGER.findall(completion)
    return {"correct": 1.0 if found and int(found[-1]) == answer else 0.0}
