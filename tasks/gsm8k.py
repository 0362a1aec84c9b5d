"""Final-answer problems (GSM8K and the like, from a data set): reading a reference solution's
final answer, and the reward that compares a completion's final answer with it.

The problems come from a data set (`[[data.sources]]` with `answer_column`); this module holds
how their answers are read (`solution_answer`, `boxed`) and judged (`reward`), so that the
producer's reading of a `\\boxed{}` and the reward's are the same code.
"""

from __future__ import annotations

import re
from fractions import Fraction
from typing import Any

_SOLUTION = re.compile(r"####\s*(.+?)\s*$", re.S)


def solution_answer(text: str) -> str | None:
    """The final answer of a GSM8K reference solution ("... #### 1,234" -> "1234"), or None."""
    m = _SOLUTION.search(text)
    return m[1].replace(",", "").strip() if m else None


_BOXED = re.compile(r"\\boxed\s*\{")
_HASHES = re.compile(r"####\s*([^\n]*)")
_NUMBER = re.compile(r"-?\$?\d[\d,]*(?:\.\d+)?")


def boxed(text: str) -> str | None:
    """The content of the last \\boxed{...} in `text` (nested braces allowed), or None."""
    span = last_boxed(text)
    return text[span[0]:span[1]].strip() if span else None


def last_boxed(text: str) -> tuple[int, int] | None:
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


def reward(*, prompt: str, completion: str, completion_ids: list[int],
           meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the completion's final answer equals `meta["answer"]`, else 0.0.

    The final answer is the last \\boxed{...}, else what follows the last "####", else the last
    number in the text. Both sides are normalized (commas, $, "42.0" == "42").
    """
    assert "answer" in meta, "tasks.gsm8k reward: the prompt's meta has no 'answer'"
    said = boxed(completion)
    if said is None:
        said = hashes(completion)
    if said is None:
        numbers = _NUMBER.findall(completion)
        said = numbers[-1] if numbers else None
    correct = said is not None and normalize(said) == normalize(str(meta["answer"]))
    return {"correct": 1.0 if correct else 0.0}
