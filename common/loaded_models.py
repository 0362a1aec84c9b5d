"""The models a reward entry scores with in the generator's process (a reward model's sequence
classifier, common/reward_models.py; an LLM judge's causal LM, common/judges.py), with their
tokenizers: each loaded on the first call in the process and shared by every entry naming the same
directory, head, device and dtype; one that cannot be loaded is remembered with why, and every later
call says the same without trying again. A teacher's model (common/teacher.py) is remembered here
too (`remembered`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal
from urllib.parse import parse_qsl

DTYPES = ("float32", "bfloat16", "float16")
Head = Literal["causal", "classifier"]  # AutoModelForCausalLM, AutoModelForSequenceClassification (one label)

def entry_options(name: str, query: str, keys: tuple[str, ...], what: str) -> dict[str, str]:
    """The `key=value&...` options after a reward entry's "?"; ValueError naming the entry when the
    query does not parse or holds a key outside `keys` (`what`: "a judge", "a reward model", ...)."""
    try:
        opts = dict(parse_qsl(query, keep_blank_values=True, strict_parsing=bool(query)))
    except ValueError:
        raise ValueError(f"reward {name!r}: its query {query!r} is not key=value&...") from None
    unknown = sorted(set(opts) - set(keys))
    if unknown:
        raise ValueError(f"reward {name!r}: unknown {', '.join(unknown)} ({what} takes {', '.join(keys)})")
    return opts


_loading = threading.Lock()
# (path, head or engine, device, dtype, ...): what was loaded (a model, with its tokenizer for a
# reward entry), or why it cannot be
_loaded: dict[tuple, Any] = {}


def remembered(key: tuple, load_once: Callable[[], Any]) -> Any:
    """What `load_once()` returned the first time `key` was asked for in this process (a model, or
    the string saying why it cannot be loaded), without calling it again."""
    with _loading:
        if key not in _loaded:
            _loaded[key] = load_once()
        return _loaded[key]


def load(what: str, path: Path, *, head: Head, device: str | None, dtype: str,
         tokenizer: Path | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of the directory `path`, in eval mode on `device` (None: the process's
    visible GPU, else the CPU) in `dtype`, its tokenizer padding with its eos token where it has no
    pad token; RuntimeError "`what` cannot be loaded: why" (`what` names the entry) when they cannot be.
    `tokenizer`: the tokenizer's directory (TRL's reward_processing_classes), None = `path`; one with
    more tokens than the model has embeddings cannot be loaded with it."""
    import torch

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = tokenizer or path
    loaded = remembered((path, head, device, dtype, tokenizer),
                        lambda: _load(path, head=head, device=device, dtype=dtype, tokenizer_path=tokenizer))
    if isinstance(loaded, str):
        raise RuntimeError(f"{what} cannot be loaded: {loaded}")
    return loaded


def _load(path: Path, *, head: Head, device: str, dtype: str, tokenizer_path: Path) -> tuple[Any, Any] | str:
    """The model and its tokenizer, ready for a padded batch; or why they cannot be loaded."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_path)
        if tokenizer.pad_token_id is None:  # TRL pads with eos then
            tokenizer.pad_token = tokenizer.eos_token
        if tokenizer.pad_token_id is None:
            return f"{tokenizer_path}: its tokenizer has neither a pad nor an eos token to pad a batch with"
        if head == "causal":
            model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        else:
            model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=getattr(torch, dtype))
            # the model scores the last token that is not padding: padding is the tokenizer's
            model.config.get_text_config().pad_token_id = tokenizer.pad_token_id
            model.config.pad_token_id = tokenizer.pad_token_id
        embeddings = model.get_input_embeddings().num_embeddings
        if len(tokenizer) > embeddings:  # a token past the table: an IndexError, on a GPU a device-side assert
            return (f"the tokenizer at {tokenizer_path} has {len(tokenizer)} tokens, more than the {embeddings} "
                    f"embeddings of the model at {path}")
        return model.eval().to(device), tokenizer
    except Exception as err:  # a broken checkpoint, a device out of memory: the reward's recorded error
        return f"{type(err).__name__}: {err}"[:500]
