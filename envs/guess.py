"""Guess-the-number: a multi-turn game with feedback.

The secret is `meta["secret"]`, an integer in [1, `meta["high"]`] (default 100). Each model turn's
last integer is its guess; the game answers "higher" or "lower" as the user, until the guess is
right (reward 1, done). A turn without a number is told to guess one. Fewer guesses are better:
the reward is 1 - 0.1 per wrong guess before the right one, at least 0.5; an episode cut by its
turn limit scores 0.

Prompts come from a data set, e.g. the file `dataset(...)` writes:

    [[data.sources]]
    name = "guess"
    path = "guess.jsonl"
    prompt_column = "question"
    meta_columns = ["secret", "high"]
    environment = "envs.guess"
"""

from __future__ import annotations

import random
import re
from typing import Any

from envs.base import Step

system = "We play a game: guess my number. Answer each time with just one number."
error_role = "user"

_INTEGER = re.compile(r"-?\d+")


def start(meta: dict[str, Any]) -> dict[str, Any]:
    secret, high = meta["secret"], meta.get("high", 100)
    assert isinstance(secret, int) and isinstance(high, int) and 1 <= secret <= high, \
        f"envs.guess: meta needs an int secret in [1, high], got secret={secret!r}, high={high!r}"
    return {"secret": secret, "wrong": 0}


def step(state: dict[str, Any], text: str) -> Step:
    found = _INTEGER.findall(text)
    if not found:
        return Step(state=state, messages=[{"role": "user", "content": "Guess a number."}])
    guess, secret = int(found[-1]), state["secret"]
    if guess == secret:
        reward = max(1.0 - 0.1 * state["wrong"], 0.5)
        return Step(state=state, done=True, reward=reward, rewards={"solved": reward})
    hint = "Higher." if guess < secret else "Lower."
    return Step(state={**state, "wrong": state["wrong"] + 1}, messages=[{"role": "user", "content": hint}])


def dataset(*, size: int, seed: int = 0, high: int = 100):
    """A `datasets.Dataset` of `size` games (columns question, secret, high) to save as a file."""
    from datasets import Dataset

    rng = random.Random(f"guess:{seed}")
    secrets = [rng.randint(1, high) for _ in range(size)]
    question = f"I am thinking of a number between 1 and {high}. Guess it."
    return Dataset.from_dict({"question": [question] * size, "secret": secrets, "high": [high] * size})
