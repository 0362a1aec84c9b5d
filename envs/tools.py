"""Tool calls in the model's text, and their answers.

Two formats:
  "hermes"  `<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>`: the format of
            the chat templates that render tools (Qwen2.5/3, Hermes, SmolLM3); the tools' JSON
            schemas reach the model through `apply_chat_template(..., tools=...)`
  "tag"     `<NAME>ARGUMENT</NAME>` with NAME a tool's name and its one argument as plain text,
            e.g. `<calc>123456 + 654321</calc>`: for small models whose template has no tools (the
            environment's system message explains it)

`call_tools` runs every call in a turn; a tool that raises, an unknown tool or a call that does
not parse answers with an error message the model sees, so the episode goes on. A tool that
hangs is stopped by the step's time limit (generators/environments.py), which answers the same way.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

MAX_ANSWER_CHARS = 2000  # a tool's answer is cut to this many characters

_HERMES = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)


@dataclass(frozen=True, slots=True)
class Call:
    name: str
    arguments: dict[str, Any] | str  # keyword arguments ("hermes") or the one text argument ("tag")
    error: str | None = None  # why the call did not parse; None: it did


def parse_calls(text: str, *, format: str, names: list[str]) -> list[Call]:
    """The tool calls in a model's turn, in order (none: the turn calls no tool)."""
    if format == "hermes":
        calls = []
        for body in _HERMES.findall(text):
            try:
                d = json.loads(body)
                name, arguments = d["name"], d.get("arguments", {})
                if not isinstance(name, str) or not isinstance(arguments, dict):
                    raise TypeError("name must be a string and arguments an object")
            except (ValueError, KeyError, TypeError) as err:
                calls.append(Call(name="", arguments={}, error=f"the tool call does not parse: {err}"))
                continue
            calls.append(Call(name=name, arguments=arguments))
        return calls
    if format == "tag":
        if not names:
            return []
        pattern = "|".join(re.escape(n) for n in names)
        return [Call(name=m[1], arguments=m[2].strip())
                for m in re.finditer(rf"<({pattern})>(.*?)</\1>", text, re.S)]
    raise ValueError(f"tool-call format must be 'hermes' or 'tag', got {format!r}")


def call_tools(calls: list[Call], tools: dict[str, Callable[..., Any]]) -> list[str]:
    """Each call's answer as text: the tool's result, or "error: ..." when it cannot run or raises."""
    answers = []
    for call in calls:
        if call.error is not None:
            answers.append(f"error: {call.error}")
            continue
        fn = tools.get(call.name)
        if fn is None:
            answers.append(f"error: no tool named {call.name!r} (have {sorted(tools)})")
            continue
        try:
            result = fn(**call.arguments) if isinstance(call.arguments, dict) else fn(call.arguments)
        except Exception as err:  # user code: the model sees the error and the episode goes on
            answers.append(f"error: {type(err).__name__}: {err}"[:MAX_ANSWER_CHARS])
            continue
        answers.append(str(result)[:MAX_ANSWER_CHARS])
    return answers
