"""Reward functions: plain callables from one completion to its reward.

A reward function takes keyword arguments `prompt` (the prompt's text: the last user message,
or the raw text), `completion` (decoded text), `completion_ids` and `meta` (the PromptTask's
ground truth), and returns either a number (one component, named "reward") or named components
`{component: value}`; the scalar reward is the components' sum. A source names one function;
to combine rewards, write a function that calls others and merges their components:

    from generators.rewards import final_answer, format as answer_format

    def answer_and_format(**kw):  # reward = "my_rewards:answer_and_format"
        return {**final_answer(**kw), "format": 0.1 * answer_format(**kw)["format"]}

The generator runs them in worker processes with a timeout (generators/scoring.py).
"""

from __future__ import annotations

import ast
import importlib
import math
import re
from collections import Counter
from collections.abc import Callable
from fractions import Fraction
from typing import Any

RewardFn = Callable[..., dict[str, float] | float]

_INTEGER = re.compile(r"-?\d+")


def arithmetic(*, prompt: str, completion: str, completion_ids: list[int],
               meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the last integer in the completion equals `meta["answer"]`, else 0.0."""
    answer = meta["answer"]
    assert isinstance(answer, int) and not isinstance(answer, bool), \
        f"arithmetic reward: meta['answer'] must be an int, got {answer!r}"
    found = _INTEGER.findall(completion)
    return {"correct": 1.0 if found and int(found[-1]) == answer else 0.0}


# ---------------------------------------------------------------------- final answer (GSM8K)

_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (nested braces allowed), or None."""
    span = _last_boxed(text)
    return text[span[0]:span[1]].strip() if span else None


def _last_boxed(text: str) -> tuple[int, int] | None:
    """(start, end) of the content of the last closed \\boxed{...} in `text`, or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    depth, i = 1, starts[-1]
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return i, j
    return None


def hashes(text: str) -> str | None:
    """What follows the last "####" in `text` (GSM8K's final-answer mark), or None."""
    found = _HASHES.findall(text)
    return found[-1].strip() if found else None


def normalize(answer: str) -> str:
    """An answer as text fit to compare: no thousands commas, $, %, spaces or final period;
    a number in its shortest form ("42.0" -> "42")."""
    a = answer.strip().replace(",", "").replace("$", "").replace("%", "").rstrip(".").strip()
    a = a.replace(" ", "")
    try:
        x = Fraction(a)
    except (ValueError, ZeroDivisionError):
        return a
    return str(x.numerator) if x.denominator == 1 else str(float(x))


def final_answer(*, prompt: str, completion: str, completion_ids: list[int],
                 meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the completion's final answer equals `meta["answer"]`, else 0.0.

    The final answer is the last \\boxed{...}, else what follows the last "####", else the last
    number in the text. Both sides are normalized (commas, $, "42.0" == "42").
    """
    assert "answer" in meta, "final_answer reward: the prompt's meta has no 'answer'"
    said = boxed(completion)
    if said is None:
        said = hashes(completion)
    if said is None:
        numbers = _NUMBER.findall(completion)
        said = numbers[-1] if numbers else None
    correct = said is not None and normalize(said) == normalize(str(meta["answer"]))
    return {"correct": 1.0 if correct else 0.0}


# ---------------------------------------------------------------------- format

_LAST_ANSWER_TAG = re.compile(r"<answer>(.*)</answer>\s*", re.S)
_AFTER_BOX = re.compile(r"(?:\s|\$|\\\]|\\\)|\.)*")  # closing math delimiters, a period


# Named `format` (shadowing the builtin here) so that a config says "generators.rewards:format".
def format(*, prompt: str, completion: str, completion_ids: list[int],
           meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the completion ends in a marked final answer, else 0.0; correctness is not judged.

    Marked: "#### <answer>" on the last line (GSM8K), a last \\boxed{<answer>} followed by nothing but
    whitespace, "$", "\\]", "\\)" or ".", or a last <answer>...</answer> followed by whitespace
    only (DeepSeek-R1 style, with or without a <think> block before it); the answer is not empty.
    Meant to be combined with an answer reward, usually with a small weight, so that a model
    learns to state its answer where the answer rewards look for it.
    """
    text = completion.rstrip()
    last_line = text.rsplit("\n", 1)[-1]
    if "####" in last_line and last_line.rsplit("####", 1)[1].strip():
        return {"format": 1.0}
    span = _last_boxed(text)
    if span and text[span[0]:span[1]].strip() and _AFTER_BOX.fullmatch(text, span[1] + 1):
        return {"format": 1.0}
    tag = _LAST_ANSWER_TAG.fullmatch(text, max(text.rfind("<answer>"), 0))
    if tag and tag[1].strip():
        return {"format": 1.0}
    return {"format": 0.0}


# ---------------------------------------------------------------------- countdown

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


def countdown(*, prompt: str, completion: str, completion_ids: list[int],
              meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the completion's expression equals `meta["target"]` using only `meta["numbers"]`,
    each at most once; else 0.0.

    The expression is the last <answer>...</answer>, else the longest run of digits, operators
    and parentheses on the last line that has one; a trailing "= N" is ignored.
    """
    target, numbers = meta["target"], meta["numbers"]
    assert isinstance(target, int) and isinstance(numbers, list), \
        f"countdown reward: meta needs int 'target' and list 'numbers', got {target!r}, {numbers!r}"
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


# ---------------------------------------------------------------------- loading


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
