"""The format reward: does a completion end in a marked final answer? For any task whose answers
the final-answer rewards read; combine it with one of them (see `tasks/__init__.py`)."""

from __future__ import annotations

import re
from typing import Any

from tasks.gsm8k import last_boxed

_LAST_ANSWER_TAG = re.compile(r"<answer>(.*)</answer>\s*", re.S)
_AFTER_BOX = re.compile(r"(?:\s|\$|\\\]|\\\)|\.)*")  # closing math delimiters, a period


def reward(*, prompt: str, completion: str, completion_ids: list[int],
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
    span = last_boxed(text)
    if span and text[span[0]:span[1]].strip() and _AFTER_BOX.fullmatch(text, span[1] + 1):
        return {"format": 1.0}
    tag = _LAST_ANSWER_TAG.fullmatch(text, max(text.rfind("<answer>"), 0))
    if tag and tag[1].strip():
        return {"format": 1.0}
    return {"format": 0.0}
