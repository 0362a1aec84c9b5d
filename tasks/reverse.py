"""A synthetic task: reverse a word of random letters ("Reverse the letters of 'kbqe'."), and its
reward. A source of it is `kind = "reverse"`; this file is all there is of it."""

from __future__ import annotations

import random
import re
import string
from typing import Any

from pydantic import BaseModel, Field, model_validator

INSTRUCTION = "Answer with just the reversed letters."


class Options(BaseModel):
    """`kind = "reverse"`: reverse a word of random lowercase letters, drawn from the run's seed."""

    # letters per word, at least.
    min_letters: int = Field(3, ge=1)
    # letters per word, at most.
    max_letters: int = Field(8, ge=1)

    @model_validator(mode="after")
    def _check_letters(self) -> Options:
        if self.max_letters < self.min_letters:
            raise ValueError(f"max_letters: {self.max_letters} is below min_letters ({self.min_letters})")
        return self


def make_prompt(options: Any, *, seed: int, index: int) -> tuple[str, dict[str, Any]]:
    """The user message of a source's `index`-th problem, and the meta its reward reads: the same
    arguments, the same problem."""
    rng = random.Random(f"reverse:{seed}:{index}")
    size = rng.randint(options.min_letters, options.max_letters)
    word = "".join(rng.choice(string.ascii_lowercase) for _ in range(size))
    return f"Reverse the letters of '{word}'. {INSTRUCTION}", {"answer": word[::-1]}


_WORD = re.compile(r"[a-z]+")


def reward(*, prompt: str, completion: str, completion_ids: list[int], meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the completion's last word (lower case) is `meta["answer"]`, else 0.0."""
    words = _WORD.findall(completion.lower())
    return {"correct": 1.0 if words and words[-1] == meta["answer"] else 0.0}
