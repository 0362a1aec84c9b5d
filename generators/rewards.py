"""Reward functions: plain callables from one completion to named reward components.

A reward function takes keyword arguments `prompt` (the prompt's text: the last user message,
or the raw text), `completion` (decoded text), `completion_ids` and `meta` (the PromptTask's
ground truth), and returns `{component: value}`; the scalar reward is the components' sum.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., dict[str, float]]

_INTEGER = re.compile(r"-?\d+")


def arithmetic(*, prompt: str, completion: str, completion_ids: list[int],
               meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the last integer in the completion equals `meta["answer"]`, else 0.0."""
    answer = meta["answer"]
    assert isinstance(answer, int) and not isinstance(answer, bool), \
        f"arithmetic reward: meta['answer'] must be an int, got {answer!r}"
    found = _INTEGER.findall(completion)
    return {"correct": 1.0 if found and int(found[-1]) == answer else 0.0}


def score(fn: RewardFn, *, prompt: str, completion: str, completion_ids: list[int],
          meta: dict[str, Any]) -> tuple[float, dict[str, float], str | None]:
    """(reward, components, error): a reward that raises or returns garbage scores 0 with the error."""
    try:
        rewards = fn(prompt=prompt, completion=completion, completion_ids=completion_ids, meta=meta)
    except Exception as err:  # user code: any failure is the completion's recorded reward error
        return 0.0, {}, f"{type(err).__name__}: {err}"[:500]
    if not isinstance(rewards, dict) or not all(
            isinstance(k, str) and isinstance(v, int | float) and not isinstance(v, bool)
            and math.isfinite(v) for k, v in rewards.items()):
        return 0.0, {}, f"reward returned {rewards!r:.200}, expected a dict of finite numbers"
    rewards = {k: float(v) for k, v in rewards.items()}
    return sum(rewards.values()), rewards, None
