"""LLM judges: a causal LM asked about each completion, its answer parsed into the reward.

A source names one among its `reward_funcs` as "judge:PATH?parser=P[&template=T][&max_new_tokens=N]
[&name=C]": PATH a local causal-LM directory (as `save_pretrained` writes it; no hub download); P a
built-in parser of the judge's answer (`PARSERS`): "yesno" (yes 1.0, no 0.0), "score10" (an integer
1-10, divided by 10), "boxed" (the number in the last \\boxed{}); T a template, the name of a built-in
one (`TEMPLATES`, default: the parser's own) or a file holding one: a Python format string with
{completion} and optionally {prompt}, nothing else; N the answer's token bound (default 64); C the
component's name (default: the directory's name), logged as rewards/<C>/mean and /std.

The generator runs it as it runs a reward model (common/reward_models.py, generators/scoring.py):
in its own process, on its device, in its model's dtype, on the model thread with the group's budget.
The whole group is one batched greedy `generate`: each completion's question is the template filled
with the prompt (for messages, the last user message) and the completion's text, put as the user's
message under the judge's chat template when its tokenizer has one (else as plain text), padded on
the left. An answer the parser cannot read is that completion's reward error (naming the judge, the
parser and an excerpt of the answer), not a 0: the trainer learns nothing from it, as from any failed
reward. A timeout, an exception or a model that cannot be loaded is every completion's error.

At start-up the entry is checked without torch: its query, parser and template, and a directory whose
config.json names a causal LM (`*ForCausalLM`, `*LMHeadModel`); else a ValueError naming the entry.

A judge whose PATH is a URL ("judge:http://host:8000/v1?model=M&parser=P") is a chat model served
there: common/served_judges.py.
"""

from __future__ import annotations

import json
import math
import re
import string
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import loaded_models
from common.loaded_models import DTYPES

PREFIX = "judge:"  # a reward_funcs entry that starts with it is an LLM judge
KEYS = ("parser", "template", "max_new_tokens", "name")
EXCERPT = 80  # characters of an unreadable answer shown in its error


def _yesno(answer: str) -> float:
    m = re.match(r"\W*(yes|no)\b", answer, re.IGNORECASE)
    if m is None:
        raise ValueError("no leading yes or no")
    return 1.0 if m.group(1).lower() == "yes" else 0.0


def _score10(answer: str) -> float:
    m = re.search(r"-?\d+(?:\.\d+)?", answer)
    if m is None:
        raise ValueError("no score")
    if not re.fullmatch(r"\d+", m.group()) or not 1 <= int(m.group()) <= 10:
        raise ValueError(f"score {m.group()} is not an integer from 1 to 10")
    return int(m.group()) / 10


def _boxed(answer: str) -> float:
    found = re.findall(r"\\boxed\{([^{}]*)\}", answer)
    if not found:
        raise ValueError("no \\boxed{}")
    try:
        value = float(found[-1].strip().replace(",", ""))
    except ValueError:
        raise ValueError(f"the last \\boxed{{{found[-1][:20]}}} holds no number") from None
    if not math.isfinite(value):
        raise ValueError(f"the last \\boxed{{{found[-1][:20]}}} is not finite")
    return value


# parser name: the answer's value, or ValueError saying what it lacks
PARSERS: dict[str, Callable[[str], float]] = {"yesno": _yesno, "score10": _score10, "boxed": _boxed}

TEMPLATES = {
    "yesno": ("Question:\n{prompt}\n\nResponse:\n{completion}\n\n"
              "Is the response a correct and helpful answer to the question? Answer yes or no."),
    "score10": ("Question:\n{prompt}\n\nResponse:\n{completion}\n\n"
                "Rate the response from 1 (worst) to 10 (best). Answer with the integer only."),
    "boxed": ("Question:\n{prompt}\n\nResponse:\n{completion}\n\n"
              "Score the response. Put the score, a number, in \\boxed{{}} at the end."),
}


def parse(parser: str, answer: str) -> float:
    """The value `parser` reads from a judge's `answer`; ValueError saying why there is none."""
    return PARSERS[parser](answer)


def question(template: str, prompt: Any, completion: Any) -> str:
    """`template` filled with a prompt and a completion, each text or messages (TRL's conversational
    form: the prompt's last user message, the completion's last message's content)."""
    if isinstance(prompt, list):
        users = [m["content"] for m in prompt if m.get("role") == "user"]
        prompt = users[-1] if users else (prompt[-1]["content"] if prompt else "")
    if isinstance(completion, list):
        completion = completion[-1]["content"] if completion else ""
    return template.format(prompt=prompt, completion=completion)


def is_judge(name: str) -> bool:
    """Whether a reward entry names an LLM judge ("judge:PATH?...")."""
    return name.startswith(PREFIX)


def template(name: str, value: str) -> str:
    """The template `value` names (a built-in or a file), checked; ValueError naming the entry `name`."""
    if value in TEMPLATES:
        text = TEMPLATES[value]
    else:
        try:
            text = Path(value).expanduser().read_text()
        except OSError as err:
            raise ValueError(f"reward {name!r}: template {value!r} is neither a built-in ({', '.join(TEMPLATES)}) "
                             f"nor a readable file ({type(err).__name__})") from None
    try:
        fields = {f for _, f, _, _ in string.Formatter().parse(text) if f is not None}
    except ValueError as err:
        raise ValueError(f"reward {name!r}: template {value!r} is no format string: {err}") from None
    if "completion" not in fields or fields - {"prompt", "completion"}:
        raise ValueError(f"reward {name!r}: template {value!r} has fields {sorted(fields)}; it needs {{completion}} "
                         f"and may have {{prompt}}, nothing else (write a literal brace as {{{{ or }}}})")
    return text


def check(name: str) -> dict[str, Any]:
    """{path, parser, template, max_new_tokens, name} of a "judge:PATH?..." entry, checked (PATH from
    its config.json alone); ValueError naming the entry when any is wrong."""
    path_text, _, query = name.removeprefix(PREFIX).partition("?")
    opts = loaded_models.entry_options(name, query, KEYS, "a judge")
    parser = opts.get("parser", "")
    if parser not in PARSERS:
        raise ValueError(f"reward {name!r}: parser {parser!r} is not one of {', '.join(PARSERS)} "
                         f"(judge:PATH?parser=yesno)")
    try:
        max_new_tokens = int(opts.get("max_new_tokens", "64"))
    except ValueError:
        max_new_tokens = 0
    if max_new_tokens < 1:
        raise ValueError(f"reward {name!r}: max_new_tokens must be a positive integer, got "
                         f"{opts['max_new_tokens']!r}")
    path = Path(path_text).expanduser()
    if not path_text or not path.is_dir():
        raise ValueError(f"reward {name!r}: no directory {path_text!r} (a judge is a local causal-LM directory "
                         f"with config.json, as save_pretrained writes it)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"reward {name!r}: {path} has no readable config.json, so it is no model directory "
                         f"({type(err).__name__}: {err})") from None
    architectures = [str(a) for a in config.get("architectures") or []]
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise ValueError(f"reward {name!r}: {path} holds {', '.join(architectures) or 'no architecture'}, not a "
                         f"causal LM (AutoModelForCausalLM, e.g. Qwen2ForCausalLM)")
    component = opts.get("name") or path.resolve().name
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", component):
        raise ValueError(f"reward {name!r}: name {component!r} may hold only letters, digits, '_', '.', '-'")
    return {"path": path.resolve(), "parser": parser, "template": template(name, opts.get("template", parser)),
            "max_new_tokens": max_new_tokens, "name": component}


class Judge:
    """A "judge:PATH?..." entry as a TRL reward function: a float per completion, or the completion's
    error (a string) where the judge's answer does not parse. Its state: the checked entry (the loaded
    model is the process's, shared by every judge on that directory)."""

    errors_per_completion = True  # common.rewards: a string among its values is that completion's error

    def __init__(self, name: str, *, dtype: str = "float32", device: str | None = None) -> None:
        """name: the entry (checked: `check`). dtype: the generator's model dtype. device: None = the
        process's visible GPU, else the CPU."""
        assert dtype in DTYPES, f"dtype must be one of {DTYPES}, got {dtype!r}"
        spec = check(name)
        self.entry = name
        self.path: Path = spec["path"]
        self.parser: str = spec["parser"]
        self.template: str = spec["template"]
        self.max_new_tokens: int = spec["max_new_tokens"]
        self.__name__: str = spec["name"]
        self.dtype = dtype
        self.device = device

    def __repr__(self) -> str:
        return f"Judge({self.entry!r})"

    def load(self) -> tuple[Any, Any]:
        """(model, tokenizer), loaded on the first call in this process; RuntimeError naming the entry
        when they cannot be (every later call says the same, without trying again)."""
        return loaded_models.load(f"judge {self.entry!r}", self.path, head="causal", device=self.device,
                                  dtype=self.dtype)

    def questions(self, prompts: list[Any], completions: list[Any], tokenizer: Any) -> list[str]:
        """The judge's input per completion: the template filled, under its chat template if any."""
        out = []
        for p, c in zip(prompts, completions, strict=True):
            text = question(self.template, p, c)
            if tokenizer.chat_template:
                text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                     add_generation_prompt=True)
            out.append(text)
        return out

    def answers(self, prompts: list[Any], completions: list[Any]) -> list[str]:
        """The judge's greedy answer to each completion, the group in one `generate`."""
        import torch

        model, tokenizer = self.load()
        inputs = tokenizer(text=self.questions(prompts, completions, tokenizer), return_tensors="pt",
                           padding=True, padding_side="left", add_special_tokens=False).to(model.device)
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=self.max_new_tokens,
                                 pad_token_id=tokenizer.pad_token_id, temperature=None, top_p=None, top_k=None)
        return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)

    def __call__(self, prompts: list[Any], completions: list[Any]) -> list[float | str]:
        """Each completion's parsed value, or its error naming the judge, parser and answer."""
        values: list[float | str] = []
        for answer in self.answers(prompts, completions):
            try:
                values.append(parse(self.parser, answer))
            except ValueError as why:
                values.append(f"judge {self.__name__}: parser {self.parser!r}: {why}, in the answer "
                              f"{answer.strip()[:EXCERPT]!r}")
        return values
