"""Data set rows as prompts: loading a source's `datasets` data set and turning a row into a prompt
(messages or text, and the meta its reward reads). The producer draws training prompts with it,
the evaluator held-out and evaluation problems, so both read a row the same way.

A `source` here is one of common.config's source variants (not imported: tasks stand alone); a
field its kind does not have reads as unset.
"""

from __future__ import annotations

import hashlib
import importlib
import string
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks import gsm8k

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
    images: tuple[bytes, ...] = ()  # a visual task's images (PNG bytes), shown before the user's text


@dataclass(frozen=True, slots=True)
class Skipped:
    id: str  # the id the row would have had
    reason: str  # why the row is not a prompt


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


def load(source: Any, *, field: str):
    """The source's `datasets.Dataset` (or `IterableDataset` when streaming); an `image_column` of
    `datasets`' Image type left as its files' bytes (not decoded into pictures: the engine and the
    trainer each decode the same bytes)."""
    ds = _load(source, field=field)
    column = getattr(source, "image_column", "")
    feature = (getattr(ds, "features", None) or {}).get(column) if column else None
    if feature is not None:
        import datasets

        inner = getattr(feature, "feature", None)  # a list of images
        if isinstance(feature, datasets.Image):
            ds = ds.cast_column(column, datasets.Image(decode=False))
        elif isinstance(inner, datasets.Image):
            ds = ds.cast_column(column, type(feature)(datasets.Image(decode=False)))
    return ds


def _load(source: Any, *, field: str):
    import datasets

    datasets.disable_progress_bars()
    if getattr(source, "taskset", ""):  # a verifiers source: the taskset's tasks are its rows
        from tasks import verifiers_tasksets

        try:
            return verifiers_tasksets.dataset(source)
        except verifiers_tasksets.TasksetError as err:
            raise DataError(f"{field}.{err}") from None
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


def check_columns(source: Any, have: list[str], *, field: str) -> None:
    """Fail naming the field when the config names a column the data set does not have."""
    def named(field: str) -> Any:  # what the source names; a kind without the field names nothing
        return getattr(source, field, "")

    wanted = [("prompt_column", named("prompt_column")), ("messages_column", named("messages_column")),
              ("answer_column", named("answer_column")), ("image_column", named("image_column"))]
    wanted += [(f"meta_columns.{i}", c) for i, c in enumerate(named("meta_columns"))]
    wanted += [("template", name) for _, name, _, _ in string.Formatter().parse(named("template"))
               if name is not None]
    for name, column in wanted:
        if column and column not in have:
            raise DataError(f"{field}.{name}: column {column!r} is not in {named('path')!r}; "
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


def row_messages(row: dict[str, Any], *, source: Any) -> list[dict[str, str]]:
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


def row_user_text(row: dict[str, Any], *, source: Any) -> str:
    """The user message a row makes through the source's `template` or `prompt_column`; ValueError
    if it makes none."""
    if getattr(source, "template", ""):
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


def row_images(value: Any, *, source: Any) -> tuple[bytes, ...]:
    """The image files an `image_column` cell names: a path (relative to the data file's directory),
    bytes, a {bytes, path} map (a `datasets` Image column as Parquet stores it), or a list of these;
    ValueError naming the column and what is wrong. Their format and size are the producer's check
    (common/images.py), as for a synthetic task's images."""
    column = source.image_column
    cells = value if isinstance(value, list) else [value]
    if not cells or any(c is None or c == "" for c in cells):
        raise ValueError(f"column {column!r} is empty")
    out = []
    for cell in cells:
        if isinstance(cell, dict):  # datasets' Image feature: the file's bytes, else its path
            cell = cell.get("bytes") or cell.get("path")
        if isinstance(cell, bytes):
            out.append(cell)
        elif isinstance(cell, str):
            path = Path(cell).expanduser()
            if not path.is_absolute():
                where = Path(source.path).expanduser()
                path = (where if where.is_dir() else where.parent) / path
            try:
                out.append(path.read_bytes())
            except OSError as err:
                raise ValueError(f"column {column!r}: cannot read the image {str(path)!r} "
                                 f"({err.strerror or type(err).__name__})") from None
        else:
            raise ValueError(f"column {column!r} holds a {type(cell).__name__}, not an image's path or bytes")
    return tuple(out)


def row_prompt(row: dict[str, Any], *, source: Any, prompt_id: str) -> Prompt:
    """The prompt a data set row makes; ValueError naming what is wrong if it makes none."""
    meta: dict[str, Any] = {"source": source.name}
    if source.messages_column:  # a verifiers source's rows are chat prompts too
        messages = row_messages(row, source=source)
    else:
        messages = [{"role": "user", "content": row_user_text(row, source=source)}]
        if source.system_prompt:
            messages = [{"role": "system", "content": source.system_prompt}, *messages]
    if getattr(source, "answer_column", ""):
        meta["answer"] = extract_answer(row.get(source.answer_column), extractor=source.answer_extractor)
    for c in getattr(source, "meta_columns", ()):
        meta[c] = row.get(c)
    if getattr(source, "taskset", ""):  # which task of which taskset: its reward scores against it
        from tasks.verifiers_tasksets import META_COLUMNS

        meta.update({c: row[c] for c in META_COLUMNS})
    if getattr(source, "image_column", ""):
        return Prompt(id=prompt_id, messages=messages, text=None, meta=meta,
                      images=row_images(row.get(source.image_column), source=source))
    if getattr(source, "chat", True):  # an sft source: conversations stay chat
        return Prompt(id=prompt_id, messages=messages, text=None, meta=meta)
    return Prompt(id=prompt_id, messages=None, text="\n\n".join(m["content"] for m in messages), meta=meta)




# ---------------------------------------------------------------------- synthetic problems


def synthetic_prompt(source: Any, *, seed: int, index: int, prompt_id: str) -> Prompt:
    """The `index`-th problem of a synthetic task's source, drawn from `seed` by the task's module
    (tasks/<kind>.py: `make_prompt`; a visual task's returns its images as a third item)."""
    made = importlib.import_module(f"tasks.{source.kind}").make_prompt(source, seed=seed, index=index)
    question, meta, images = made if len(made) == 3 else (*made, ())
    return Prompt(id=prompt_id, messages=[{"role": "user", "content": question}], text=None,
                  meta={**meta, "source": source.name}, images=tuple(images))


# ---------------------------------------------------------------------- the held-out split


def held_out(prompt: Prompt, fraction: float) -> bool:
    """Whether `prompt` belongs to the evaluation split: a hash of what the model is shown, below
    `fraction`. Decided by content, not position: a problem drawn twice (arithmetic has only so
    many) or a row repeated in a file is on the same side every time."""
    shown = prompt.text if prompt.messages is None else "\x1e".join(m["content"] for m in prompt.messages)
    shown += "".join(f"\x1e{hashlib.sha256(img).hexdigest()}" for img in prompt.images)  # a visual task's pictures
    return zlib.crc32(shown.encode()) / 2**32 < fraction


# Draws in a row without a new problem, per unit of the held-out fraction, after which a synthetic
# task counts as exhausted: a task with problems left unseen (a share u of its held-out ones) goes
# that long without a new one with probability about exp(-SATURATED_AFTER * u).
SATURATED_AFTER = 200


def eval_prompts(source: Any, *, count: int, seed: int, holdout: float | None) -> list[Prompt]:
    """Up to `count` distinct problems of `source` to evaluate on. holdout None: an evaluation
    source (a test split), its first rows (synthetic: drawn from `seed`); a fraction: only problems
    in the held-out split the producer never trains on."""
    out: dict[str, Prompt] = {}  # distinct by what the model is shown
    # A synthetic task has only so many distinct problems (arithmetic's default: 882, 5% of them
    # held out): drawing stops once `patience` draws in a row bring no new one, not after millions.
    patience = None
    if source.synthetic:
        tries = count if holdout is None else int(count * 200 / max(holdout, 1e-3))
        patience = int(SATURATED_AFTER / max(holdout or 1.0, 1e-3))
        candidates = (synthetic_prompt(source, seed=seed, index=i, prompt_id=f"eval:{source.name}:{i}")
                      for i in range(tries))
    else:
        ds = load(source, field=f"eval source {source.name!r}")
        check_columns(source, columns(ds), field=f"eval source {source.name!r}")
        candidates = (_row_or_none(row, source, i) for i, row in enumerate(ds))
    since_new = 0
    for p in candidates:
        since_new += 1
        if p is not None and (holdout is None or held_out(p, holdout)):
            if out.setdefault(repr((p.messages, p.text, p.images)), p) is p:
                since_new = 0
            if len(out) == count:
                break
        if patience is not None and since_new > patience:
            break
    return list(out.values())


def _row_or_none(row: dict[str, Any], source: Any, index: int) -> Prompt | None:
    try:
        return row_prompt(row, source=source, prompt_id=f"eval:{source.name}:{index}")
    except (ValueError, KeyError, TypeError, IndexError):  # a row that makes no prompt
        return None
