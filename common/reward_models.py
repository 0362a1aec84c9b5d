"""Reward models, as TRL's GRPOTrainer runs them: a sequence-classification model scores each prompt
+ completion, and its `logits[:, 0]` is the reward.

A source names one among its `reward_funcs` as "model:PATH" (PATH a local model directory, as
`save_pretrained` writes it; there is no hub download), or "model:PATH?tokenizer=TOKPATH" to score
with the tokenizer in the directory TOKPATH instead of PATH's own (TRL's `reward_processing_classes`,
the list parallel to `reward_funcs`: an entry given is that model's tokenizer and chat template;
one left None is AutoTokenizer of the model's path), weighted by `reward_weights` like any
function. It is a reward component named after the directory (TRL names it after the model id's
last part), logged as rewards/<name>/mean and /std.

What TRL does, done here the same way (its `_calculate_rewards`): the texts are prompt + completion
as strings for a text source, or for a conversational one (`common.rewards.conversational`) the
prompt's messages with the completion as the assistant's message, rendered by the reward model's
own chat template (`apply_chat_template(..., tokenize=False)`); they are tokenized by the model's
own tokenizer (TRL's default `reward_processing_classes`: AutoTokenizer of the model) or the one
the entry names (its chat template too), padded on the right, without special tokens, in one batch
for the whole group; the model is loaded with `num_labels=1` and its config's pad token set to the
tokenizer's (its eos when it has none, as TRL sets it), so that it reads the last real token of
each row. A tokenizer with more tokens than the model has embeddings is refused when they load
(TRL does not check: a token past the table fails the forward, on a GPU as a device-side assert).

At start-up a "model:PATH" entry is checked from its config.json alone (no weights read, no torch):
a directory whose architecture is a `*ForSequenceClassification` with one label, and TOKPATH a
directory with a tokenizer's files, else a ValueError naming the entry. The weights are loaded on
the first group that needs them, once per process (several sources naming one directory share it),
on the process's device (its visible GPU, else the CPU) in the dtype the generator's model runs in.
The generator runs reward models itself, not in its reward workers (generators/scoring.py): one
copy per generator, on its GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common import loaded_models
from common.loaded_models import DTYPES

PREFIX = "model:"  # a reward_funcs entry that starts with it is a reward model's directory
KEYS = ("tokenizer",)  # its options, after a "?"
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json")


def is_model(name: str) -> bool:
    """Whether a reward entry names a reward model ("model:PATH") rather than a function."""
    return name.startswith(PREFIX)


def check(name: str) -> tuple[Path, Path]:
    """The model's and the tokenizer's directories a "model:PATH[?tokenizer=TOKPATH]" entry names,
    resolved; ValueError naming the entry when PATH is not a sequence-classification model with one
    label (read from its config.json), or TOKPATH holds no tokenizer."""
    path_text, _, query = name.removeprefix(PREFIX).partition("?")
    opts = loaded_models.entry_options(name, query, KEYS, "a reward model")
    path = Path(path_text).expanduser()
    if not str(path) or not path.is_dir():
        raise ValueError(f"reward {name!r}: no directory {str(path)!r} (a reward model is a local directory "
                         f"with config.json, as save_pretrained writes it)")
    try:
        config = json.loads((path / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"reward {name!r}: {path} has no readable config.json, so it is no model directory "
                         f"({type(err).__name__}: {err})") from None
    architectures = config.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"reward {name!r}: {path} holds {', '.join(map(str, architectures)) or 'no architecture'}, "
                         f"not a sequence-classification model (AutoModelForSequenceClassification, e.g. "
                         f"Qwen2ForSequenceClassification)")
    labels = len(config.get("id2label") or {}) or config.get("num_labels", 1)
    if labels != 1:
        raise ValueError(f"reward {name!r}: {path} has {labels} labels; a reward model has one "
                         f"(TRL loads it with num_labels=1)")
    if "tokenizer" not in opts:
        return path.resolve(), path.resolve()
    tokenizer = Path(opts["tokenizer"]).expanduser()
    if not opts["tokenizer"] or not any((tokenizer / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(f"reward {name!r}: tokenizer {opts['tokenizer']!r} is no directory holding a tokenizer "
                         f"(one of {', '.join(TOKENIZER_FILES)}, as save_pretrained writes them)")
    return path.resolve(), tokenizer.resolve()


class RewardModel:
    """A "model:PATH" entry as a reward function with TRL's signature: a float per completion.
    Its state: where the model is and how to load it (the loaded model is the process's, shared)."""

    def __init__(self, name: str, *, dtype: str = "float32", device: str | None = None) -> None:
        """name: the "model:PATH" entry (checked: `check`). dtype: the generator's model dtype.
        device: None = the process's visible GPU, else the CPU."""
        assert dtype in DTYPES, f"dtype must be one of {DTYPES}, got {dtype!r}"
        self.entry = name
        self.path, self.tokenizer = check(name)  # the tokenizer's directory: the model's own unless named
        self.__name__ = self.path.name  # its component, as TRL names it (the model id's last part)
        self.dtype = dtype
        self.device = device

    def __repr__(self) -> str:
        return f"RewardModel({self.entry!r})"

    def load(self) -> tuple[Any, Any]:
        """(model, tokenizer), loaded on the first call in this process; RuntimeError naming the
        entry when they cannot be (every later call says the same, without trying again)."""
        return loaded_models.load(f"reward model {self.entry!r}", self.path, head="classifier", device=self.device,
                                  dtype=self.dtype, tokenizer=self.tokenizer)

    def texts(self, prompts: list[Any], completions: list[Any], tokenizer: Any) -> list[str]:
        """What the model reads, as TRL's trainer makes it: prompt + completion, or for messages the
        conversation with the completion as the assistant's turn under the model's chat template."""
        if prompts and isinstance(prompts[0], list):  # conversational (TRL's is_conversational)
            return [tokenizer.apply_chat_template(p + c, tokenize=False) for p, c in zip(prompts, completions,
                                                                                         strict=True)]
        return [p + c for p, c in zip(prompts, completions, strict=True)]

    def __call__(self, prompts: list[Any], completions: list[Any]) -> list[float]:
        """logits[:, 0] of each prompt + completion, the group in one batch (TRL's signature: the
        reward scorer calls it once per group, as it calls TRL's functions)."""
        import torch

        model, tokenizer = self.load()
        inputs = tokenizer(text=self.texts(prompts, completions, tokenizer), return_tensors="pt", padding=True,
                           padding_side="right", add_special_tokens=False).to(model.device)
        with torch.inference_mode():
            logits = model(**inputs).logits[:, 0]
        return [float(v) for v in logits.float().cpu()]
