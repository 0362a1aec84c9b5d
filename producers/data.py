"""Prompt sources: built-in synthetic tasks and Hugging Face `datasets` data sets, each with its
position (epoch, offset), and the deterministic mixture that picks a source per prompt.

A source hands out one row at a time as a prompt, or as the reason the row cannot be one.
Its position is all the producer needs to store to resume exactly: the same (seed, epoch,
offset) gives the same row. Epochs reshuffle with a permutation drawn from (seed, name, epoch).
"""

from __future__ import annotations

import random
import zlib
from typing import Any

import numpy as np

from common.config import SourceConfig
from common.images import MAX_IMAGE_BYTES, MAX_IMAGES, check_images
from tasks.rows import (  # noqa: F401 - the producer's names for them
    FORMATS,
    DataError,
    Prompt,
    Skipped,
    check_columns,
    columns,
    detect_format,
    extract_answer,
    held_out,
    load,
    row_prompt,
    synthetic_prompt,
)

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


# ---------------------------------------------------------------------- sources


class Source:
    """One source of prompts and its position: `epoch`, and `offset` (rows taken this epoch)."""

    def __init__(self, config: SourceConfig, *, seed: int, field: str, epoch: int = 0, offset: int = 0,
                 holdout: float = 0.0, max_images: int = MAX_IMAGES, max_image_bytes: int = MAX_IMAGE_BYTES):
        """holdout: the share of problems kept for evaluation (tasks.rows.held_out); they are passed
        over, as if the source did not have them. A row whose images break [limits] (max_images,
        max_image_bytes) or are not PNG or JPEG files is skipped, saying why."""
        assert epoch >= 0 and offset >= 0, f"position must be >= 0, got epoch {epoch} offset {offset}"
        self.config, self.seed, self.epoch, self.offset = config, seed, epoch, offset
        self.holdout = holdout
        self.image_limits = {"max_images": max_images, "max_image_bytes": max_image_bytes}
        self.name = config.name
        self.ds = None
        self.size: int | None = None  # rows per epoch; None when endless or streamed
        self._order: np.ndarray | None = None
        self._rows = None  # a streamed epoch's iterator, positioned at `offset`
        self._good_this_epoch = offset > 0  # a whole epoch without a prompt stops the run
        if not config.synthetic:  # rows of a data set (or of a taskset's tasks)
            self.ds = load(config, field=field)
            check_columns(config, columns(self.ds), field=field)
            if not config.streaming:
                self.size = len(self.ds)
                if self.size == 0:
                    raise DataError(f"{field}.path: {getattr(config, 'path', '')!r} has no rows")
                assert offset < self.size, f"{field}: stored offset {offset} beyond {self.size} rows"

    def take(self) -> Prompt | Skipped:
        """The next row as a prompt (or as why it is none), held-out ones passed over; the position
        moves past it."""
        for _ in range(100_000):
            made = self._take()
            if not (self.holdout and isinstance(made, Prompt) and held_out(made, self.holdout)):
                return made
        raise DataError(f"source {self.name!r}: 100000 problems in a row are held out for evaluation "
                        f"(eval.holdout = {self.holdout}); the source has too few distinct problems")

    def _take(self) -> Prompt | Skipped:
        c = self.config
        if c.synthetic:
            made = synthetic_prompt(c, seed=self.seed, index=self.offset, prompt_id=f"{self.name}:0:{self.offset}")
            self.offset += 1
            return made
        index, row = self._next_row()
        prompt_id = f"{self.name}:{self.epoch}:{index}"
        try:
            made: Prompt | Skipped = row_prompt(row, source=c, prompt_id=prompt_id)
            if made.images:
                check_images(list(made.images), f"row {prompt_id}", **self.image_limits)
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

