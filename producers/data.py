"""Prompt sources: built-in synthetic tasks and Hugging Face `datasets` data sets, each with its
position (epoch, offset), and the deterministic mixture that picks a source per prompt.

A source hands out one row at a time as a prompt, or as the reason the row cannot be one.
Its position is all the producer needs to store to resume exactly: the same (seed, epoch,
offset) gives the same row. Epochs reshuffle with a permutation drawn from (seed, name, epoch).
"""

from __future__ import annotations

import random
import string
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import SourceConfig
from tasks import arithmetic, countdown, gsm8k

# File extension -> `datasets` builder name.
FORMATS = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}


class DataError(ValueError):
    """A source cannot be read as configured (missing file or column); the text names the field."""


@dataclass(frozen=True, slots=True)
class Prompt:
    id: str  # "{source}:{epoch}:{index}"
    messages: list[dict[str, str]] | None  # chat messages; None when `text` is set
    text: str | None  # plain prompt text; None when `messages` is set
    meta: dict[str, Any]  # meta["source"], ground truth under "answer", meta_columns


@dataclass(frozen=True, slots=True)
class Skipped:
    id: str  # the id the row would have had
    reason: str  # why the row is not a prompt


# ---------------------------------------------------------------------- mixture


def choose(*, seed: int, index: int, weights: list[float]) -> int:
    """Which source the `index`-th admitted prompt comes from: a weighted draw that depends only
    on (seed, index), so a restarted producer makes the same choices."""
    assert weights and all(w > 0 for w in weights), f"weights must be positive, got {weights}"
    if len(weights) == 1:
        return 0
    x = random.Random(f"mixture:{seed}:{index}").random() * sum(weights)
    for i, w in enumerate(weights):
        x -= w
        if x < 0:
            return i
    return len(weights) - 1


def permutation(*, seed: int, name: str, epoch: int, size: int) -> np.ndarray:
    """The order of the rows in `epoch`: the same arguments, the same order."""
    rng = np.random.default_rng([seed, zlib.crc32(name.encode()), epoch])
    return rng.permutation(size)


# ---------------------------------------------------------------------- loading


def _data_files(path: Path, builder: str) -> list[str]:
    if not path.is_dir():
        return [str(path)]
    exts = [e for e, b in FORMATS.items() if b == builder]
    files = sorted(str(f) for f in path.rglob("*") if f.suffix in exts)
    if not files:
        raise DataError(f"path: no {'/'.join(exts)} files in {str(path)!r}")
    return files


def detect_format(path: Path, *, field: str) -> str:
    """The `datasets` builder for `path`: a saved data set ("disk"), a file's or a directory's
    extension, or "hub" when nothing local has that name ("openai/gsm8k")."""
    if path.is_dir() and any((path / f).exists() for f in ("state.json", "dataset_dict.json")):
        return "disk"
    if path.suffix in FORMATS:
        return FORMATS[path.suffix]
    if path.is_dir():
        found = {FORMATS[f.suffix] for f in path.rglob("*") if f.suffix in FORMATS}
        if len(found) != 1:
            raise DataError(f"{field}.format: cannot tell the format of {str(path)!r} "
                            f"(found {sorted(found) or 'no data files'}); set it")
        return found.pop()
    if path.exists():
        raise DataError(f"{field}.format: cannot tell the format of {str(path)!r}; set it")
    return "hub"


def load(source: SourceConfig, *, field: str):
    """The source's `datasets.Dataset` (or `IterableDataset` when streaming)."""
    import datasets

    datasets.disable_progress_bars()
    path = Path(source.path)
    fmt = detect_format(path, field=field) if source.format == "auto" else source.format
    if fmt != "hub" and not path.exists():
        raise DataError(f"{field}.path: {source.path!r} does not exist")
    try:
        if fmt == "disk":
            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if source.split not in ds:
                    raise DataError(f"{field}.split: {source.split!r} is not one of {list(ds)}")
                ds = ds[source.split]
            return ds.to_iterable_dataset() if source.streaming else ds
        if fmt == "hub":
            return datasets.load_dataset(source.path, source.subset or None, split=source.split,
                                         streaming=source.streaming)
        return datasets.load_dataset(fmt, data_files={source.split: _data_files(path, fmt)},
                                     split=source.split, streaming=source.streaming)
    except ConnectionError:  # a hub data set neither cached nor reachable
        if fmt != "hub":
            raise
        from huggingface_hub import constants

        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise DataError(f"{field}.path: hub data set {source.path!r} is not in the datasets cache "
                        f"({datasets.config.HF_DATASETS_CACHE}) and {why}; load it once where there is a "
                        "network with the same HF_HOME, or give a local file") from None
    except (FileNotFoundError, ValueError) as err:
        if isinstance(err, DataError):
            raise
        raise DataError(f"{field}.path: cannot load {source.path!r} as {fmt}: {err}") from None


def columns(ds) -> list[str]:
    """The data set's column names (a streamed one without known features: its first row's)."""
    if ds.column_names is not None:
        return list(ds.column_names)
    first = next(iter(ds), None)
    return [] if first is None else list(first)


def check_columns(source: SourceConfig, have: list[str], *, field: str) -> None:
    """Fail naming the field when the config names a column the data set does not have."""
    wanted = [("prompt_column", source.prompt_column), ("messages_column", source.messages_column),
              ("answer_column", source.answer_column)]
    wanted += [(f"meta_columns.{i}", c) for i, c in enumerate(source.meta_columns)]
    wanted += [("template", name) for _, name, _, _ in string.Formatter().parse(source.template)
               if name is not None]
    for name, column in wanted:
        if column and column not in have:
            raise DataError(f"{field}.{name}: column {column!r} is not in {source.path!r}; "
                            f"its columns are {have}")


# ---------------------------------------------------------------------- rows into prompts

def extract_answer(value: Any, *, extractor: str) -> Any:
    """The ground truth in an answer column's `value`; ValueError if it holds none."""
    if extractor == "none":
        if value is None or (isinstance(value, str) and not value.strip()):
            raise ValueError("empty answer")
        return value if isinstance(value, int | float | str) and not isinstance(value, bool) else str(value)
    if not isinstance(value, str):
        raise ValueError(f"answer is a {type(value).__name__}, not text")
    if extractor == "gsm8k":
        found = gsm8k.solution_answer(value)
        if found is None:
            raise ValueError("answer has no '#### N' final answer")
        return found
    found = gsm8k.boxed(value)  # the reward's own reading of \boxed{}
    if not found:
        raise ValueError("answer has no \\boxed{...}")
    return found


def row_messages(row: dict[str, Any], *, source: SourceConfig) -> list[dict[str, str]]:
    """The chat messages of a row of a `messages_column` source; ValueError if it holds none."""
    messages = row.get(source.messages_column)
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{source.messages_column!r} is not a non-empty list of messages")
    for m in messages:
        if not (isinstance(m, dict) and isinstance(m.get("role"), str)
                and isinstance(m.get("content"), str) and m["content"].strip()):
            raise ValueError(f"{source.messages_column!r} holds a message without text role "
                             "and content")
    messages = [{"role": m["role"], "content": m["content"]} for m in messages]
    if source.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": source.system_prompt}, *messages]
    return messages


def row_user_text(row: dict[str, Any], *, source: SourceConfig) -> str:
    """The user message a row makes through the source's `template` or `prompt_column`; ValueError
    if it makes none."""
    if source.template:
        for _, name, _, _ in string.Formatter().parse(source.template):
            if name is not None and (row.get(name) is None or row.get(name) == ""):
                raise ValueError(f"column {name!r} is empty")
        user = source.template.format(**row)
    else:
        user = row.get(source.prompt_column)
        if not isinstance(user, str):
            raise ValueError(f"{source.prompt_column!r} is a {type(user).__name__}, not text")
    if not user.strip():
        raise ValueError("the prompt is empty")
    return user


def row_prompt(row: dict[str, Any], *, source: SourceConfig, prompt_id: str) -> Prompt:
    """The prompt a data set row makes; ValueError naming what is wrong if it makes none."""
    meta: dict[str, Any] = {"source": source.name}
    if source.messages_column:
        messages = row_messages(row, source=source)
    else:
        messages = [{"role": "user", "content": row_user_text(row, source=source)}]
        if source.system_prompt:
            messages = [{"role": "system", "content": source.system_prompt}, *messages]
    if source.answer_column:
        meta["answer"] = extract_answer(row.get(source.answer_column), extractor=source.answer_extractor)
    for c in source.meta_columns:
        meta[c] = row.get(c)
    if source.chat:
        return Prompt(id=prompt_id, messages=messages, text=None, meta=meta)
    return Prompt(id=prompt_id, messages=None, text="\n\n".join(m["content"] for m in messages), meta=meta)


# ---------------------------------------------------------------------- sources


class Source:
    """One source of prompts and its position: `epoch`, and `offset` (rows taken this epoch)."""

    def __init__(self, config: SourceConfig, *, seed: int, field: str, epoch: int = 0, offset: int = 0):
        assert epoch >= 0 and offset >= 0, f"position must be >= 0, got epoch {epoch} offset {offset}"
        self.config, self.seed, self.epoch, self.offset = config, seed, epoch, offset
        self.name = config.name
        self.ds = None
        self.size: int | None = None  # rows per epoch; None when endless or streamed
        self._order: np.ndarray | None = None
        self._rows = None  # a streamed epoch's iterator, positioned at `offset`
        self._good_this_epoch = offset > 0  # a whole epoch without a prompt stops the run
        if config.kind in ("dataset", "sft"):
            self.ds = load(config, field=field)
            check_columns(config, columns(self.ds), field=field)
            if not config.streaming:
                self.size = len(self.ds)
                if self.size == 0:
                    raise DataError(f"{field}.path: {config.path!r} has no rows")
                assert offset < self.size, f"{field}: stored offset {offset} beyond {self.size} rows"

    def take(self) -> Prompt | Skipped:
        """The next row as a prompt (or as why it is none); the position moves past it."""
        c = self.config
        if c.kind == "arithmetic":
            p = arithmetic.problem(seed=self.seed, index=self.offset, max_operand=c.max_operand, ops=c.ops)
            made = Prompt(id=f"{self.name}:0:{self.offset}", messages=[{"role": "user", "content": p.question}],
                          text=None, meta={"answer": p.answer, "source": self.name})
            self.offset += 1
            return made
        if c.kind == "countdown":
            p = countdown.problem(seed=self.seed, index=self.offset, numbers=c.numbers, max_number=c.max_number)
            made = Prompt(id=f"{self.name}:0:{self.offset}", messages=[{"role": "user", "content": p.question}],
                          text=None, meta={"numbers": p.numbers, "target": p.target, "source": self.name})
            self.offset += 1
            return made
        index, row = self._next_row()
        prompt_id = f"{self.name}:{self.epoch}:{index}"
        try:
            made: Prompt | Skipped = row_prompt(row, source=c, prompt_id=prompt_id)
            self._good_this_epoch = True
        except (ValueError, KeyError, TypeError, IndexError) as err:  # what a bad row raises
            made = Skipped(id=prompt_id, reason=str(err) or type(err).__name__)
        self.offset += 1
        if self.size is not None and self.offset == self.size:
            self._next_epoch()
        return made

    def _next_epoch(self) -> None:
        if not self._good_this_epoch:
            raise DataError(f"source {self.name!r}: no row of epoch {self.epoch} makes a prompt")
        self.epoch, self.offset = self.epoch + 1, 0
        self._order, self._rows, self._good_this_epoch = None, None, False

    def _next_row(self) -> tuple[int, dict[str, Any]]:
        """(index, row) at the current position: the permuted row index, or a streamed row's
        place in its epoch."""
        c = self.config
        if self.size is not None:
            if self._order is None:
                self._order = (permutation(seed=self.seed, name=self.name, epoch=self.epoch, size=self.size)
                               if c.shuffle else np.arange(self.size))
            index = int(self._order[self.offset])
            return index, self.ds[index]
        while True:  # streamed: shuffle with a buffer seeded by (seed, name, epoch)
            if self._rows is None:
                ds = self.ds
                if c.shuffle:
                    seed = zlib.crc32(f"{self.seed}:{self.name}:{self.epoch}".encode())
                    ds = ds.shuffle(seed=seed, buffer_size=c.shuffle_buffer)
                self._rows = iter(ds.skip(self.offset) if self.offset else ds)
            row = next(self._rows, None)
            if row is not None:
                return self.offset, row
            self._next_epoch()

