"""Reward functions, loaded by name and called safely: plain callables from one completion to its reward.

A reward function takes keyword arguments `prompt` (the prompt's text: the last user message,
or the raw text), `completion` (decoded text), `completion_ids` and `meta` (the PromptTask's
ground truth), and returns either a number (one component, named "reward") or named components
`{component: value}`; the scalar reward is the components' sum. A source names one function as
"module:function"; the built-ins live beside their tasks (`tasks/`, e.g. "tasks.gsm8k:reward").

The generator runs them in worker processes with a timeout (generators/scoring.py).
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

RewardFn = Callable[..., dict[str, float] | float]

def load(name: str) -> RewardFn:
    """The reward function `name` ("module:function") refers to; ValueError if there is none."""
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward {name!r} cannot be loaded: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn


def _finite_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def score(fn: RewardFn, *, prompt: str, completion: str, completion_ids: list[int],
          meta: dict[str, Any]) -> tuple[float, dict[str, float], str | None]:
    """(reward, components, error): a number is one component named "reward", a dict is named
    components; a reward that raises or returns anything else (NaN, a string, a bool) scores 0
    with the error."""
    try:
        rewards = fn(prompt=prompt, completion=completion, completion_ids=completion_ids, meta=meta)
    except Exception as err:  # user code: any failure is the completion's recorded reward error
        return 0.0, {}, f"{type(err).__name__}: {err}"[:500]
    if _finite_number(rewards):
        rewards = {"reward": rewards}
    if not isinstance(rewards, dict) or not all(
            isinstance(k, str) and _finite_number(v) for k, v in rewards.items()):
        return 0.0, {}, f"reward returned {rewards!r:.200}, expected a finite number or a dict of them"
    rewards = {str(k): float(v) for k, v in rewards.items()}
    return sum(rewards.values()), rewards, None
