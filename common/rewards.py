"""Reward functions, loaded by name and called safely: today's per-completion callables and TRL's.

A source lists one or more reward functions by "module:function" (`reward_funcs`, with
`reward_weights` as TRL's GRPOConfig has them; or the single `reward`). What a function is called
with is decided by its signature:

- TRL's (a parameter named `completions`): called once per group with lists, one item per
  completion: `prompts`, `completions`, `completion_ids`, and every key of the prompt's meta (the
  data set's columns: `answer`, `source`, `meta_columns`) as a keyword argument. A chat prompt
  comes as its messages and each completion as `[{"role": "assistant", "content": text}]`, a text
  prompt as text; TRL does the same. It returns a list with a float, or None ("not mine"), per
  completion; the component is named after the function.
- Per completion (anything else): keyword arguments `prompt` (the last user message, or the raw
  text), `completion` (decoded text), `completion_ids` and `meta` (the PromptTask's ground truth);
  it returns a number (one component, named "reward" when it is the source's only function, else
  after the function) or named components `{component: value}`.

A completion's reward is the weighted sum over functions of their components; a None is left out
of the sum (TRL's rule), and of the components. The built-ins live beside their tasks (`tasks/`,
e.g. "tasks.gsm8k:reward"). A function that raises or returns anything else (NaN, a string, a
bool, a list of the wrong length) scores the completions it was given 0 with the error.

The generator runs them in worker processes with a timeout (generators/scoring.py).
"""

from __future__ import annotations

import importlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

RewardFn = Callable[..., Any]
Result = tuple[float, dict[str, float], str | None]  # (reward, components, error)


@dataclass(frozen=True, slots=True)
class RewardFunc:
    """One of a source's reward functions, loaded."""

    name: str  # the function's __name__: its component (TRL's) and its metrics' name
    fn: RewardFn
    weight: float  # its share of the reward (TRL's reward_weights)
    batched: bool  # TRL's signature: called once per group with lists
    only: bool  # the source's only function: a number it returns is the component "reward"


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


def is_batched(fn: RewardFn) -> bool:
    """Whether `fn` has TRL's signature: a parameter named `completions`."""
    try:
        return "completions" in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: called per completion
        return False


def load_all(funcs: list[tuple[str, float]]) -> list[RewardFunc]:
    """A source's reward functions from [("module:function", weight), ...]; ValueError naming the
    one that does not load, or two that would log under the same name."""
    assert funcs, "a source needs at least one reward function"
    loaded = []
    for name, weight in funcs:
        fn = load(name)
        loaded.append(RewardFunc(name=getattr(fn, "__name__", name.partition(":")[2]), fn=fn, weight=float(weight),
                                 batched=is_batched(fn), only=len(funcs) == 1))
    names = [f.name for f in loaded]
    if len(set(names)) < len(names):
        raise ValueError(f"reward functions {[n for n, _ in funcs]} share a name; each logs as rewards/<name>")
    return loaded


def _finite_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _error(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:500]


def score(fn: RewardFn, *, prompt: str, completion: str, completion_ids: list[int],
          meta: dict[str, Any]) -> Result:
    """(reward, components, error) of one per-completion function: a number is one component named
    "reward", a dict is named components; a reward that raises or returns anything else (NaN, a
    string, a bool) scores 0 with the error."""
    f = RewardFunc(name="reward", fn=fn, weight=1.0, batched=False, only=True)
    components, error = _call_one(f, prompt=prompt, completion=completion, completion_ids=completion_ids, meta=meta)
    if error is not None:
        return 0.0, {}, error
    return sum(components.values()), components, None


def _call_one(f: RewardFunc, *, prompt: str, completion: str, completion_ids: list[int],
              meta: dict[str, Any]) -> tuple[dict[str, float], str | None]:
    """A per-completion function's components, or the error."""
    try:
        rewards = f.fn(prompt=prompt, completion=completion, completion_ids=completion_ids, meta=meta)
    except Exception as err:  # user code: any failure is the completion's recorded reward error
        return {}, _error(err)
    if _finite_number(rewards):
        rewards = {"reward" if f.only else f.name: rewards}
    if not isinstance(rewards, dict) or not all(
            isinstance(k, str) and _finite_number(v) for k, v in rewards.items()):
        return {}, f"reward returned {rewards!r:.200}, expected a finite number or a dict of them"
    return {str(k): float(v) for k, v in rewards.items()}, None


def _call_group(f: RewardFunc, *, prompt: str, messages: list[dict[str, str]] | None,
                completions: list[tuple[str, list[int]]], meta: dict[str, Any]) -> list[float | None] | str:
    """A TRL function's value per completion (None: it has none for it), or the error."""
    n = len(completions)
    chat = messages is not None
    kwargs: dict[str, Any] = {k: [v] * n for k, v in meta.items()}  # the data set's columns, per completion
    kwargs.update(
        prompts=[messages if chat else prompt] * n,
        completions=[[{"role": "assistant", "content": text}] if chat else text for text, _ in completions],
        completion_ids=[ids for _, ids in completions])
    params = inspect.signature(f.fn).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}  # TRL asks for **kwargs; be lenient
    try:
        values = f.fn(**kwargs)
    except Exception as err:  # user code
        return _error(err)
    if not isinstance(values, list | tuple) or len(values) != n or not all(
            v is None or _finite_number(v) for v in values):
        return f"{f.name} returned {values!r:.200}, expected a list of {n} finite numbers or None"
    return [None if v is None else float(v) for v in values]


def score_group(funcs: list[RewardFunc], *, prompt: str, messages: list[dict[str, str]] | None,
                completions: list[tuple[str, list[int]]], meta: dict[str, Any]) -> Iterator[Result]:
    """(reward, components, error) per completion, in order, as each is scored: TRL functions are
    called once, before the first; per-completion ones for each completion."""
    group = {f.name: _call_group(f, prompt=prompt, messages=messages, completions=completions, meta=meta)
             for f in funcs if f.batched}
    for i, (text, ids) in enumerate(completions):
        reward, components, errors = 0.0, {}, []
        for f in funcs:
            if f.batched:
                values = group[f.name]
                if isinstance(values, str):
                    errors.append(values)
                    continue
                parts = {} if values[i] is None else {f.name: values[i]}
            else:
                parts, error = _call_one(f, prompt=prompt, completion=text, completion_ids=ids, meta=meta)
                if error is not None:
                    errors.append(error)
                    continue
            clash = set(parts) & set(components)
            if clash:
                errors.append(f"{f.name} gives components {sorted(clash)} another reward function gives too")
            components.update(parts)
            reward += f.weight * sum(parts.values())
        yield (0.0, {}, "; ".join(errors)[:500]) if errors else (reward, components, None)
