"""The built-in synthetic visual task: a picture of a few shapes, "How many shapes are in the
picture?", and its reward (the exact count).

A vision-language task: `make_prompt` returns the picture (PNG bytes) as a third item beside the
question and the meta, and the prompt carries it to the generators (common/images.py). Each shape
(a square, a circle or a triangle, in one of a few colours) sits in its own cell of a 3 x 3 grid,
so none overlaps another and the count is unambiguous."""

from __future__ import annotations

import random
import re
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, Field, model_validator

QUESTION = "How many shapes are in the picture? Answer with just the number."
GRID = 3  # the picture is GRID x GRID cells, at most one shape in each
KINDS = ("square", "circle", "triangle")
COLOURS = ("red", "green", "blue", "orange", "purple", "black")


class Options(BaseModel):
    """`kind = "shapes"`: pictures of `min_shapes`..`max_shapes` shapes drawn from the run's seed."""

    # fewest shapes in a picture
    min_shapes: int = Field(1, ge=0, le=GRID * GRID)
    # most shapes in a picture (at most 9: one to a cell of the 3 x 3 grid)
    max_shapes: int = Field(5, ge=1, le=GRID * GRID)
    # side of the square picture, in pixels
    picture_size: int = Field(48, ge=GRID * 4, le=1024)

    @model_validator(mode="after")
    def _check_range(self) -> Options:
        if self.min_shapes > self.max_shapes:
            raise ValueError(f"min_shapes ({self.min_shapes}) must be at most max_shapes ({self.max_shapes})")
        return self


@dataclass(frozen=True, slots=True)
class Problem:
    shapes: list[tuple[str, str, int]]  # (kind, colour, grid cell) of each shape
    size: int  # the picture's side in pixels

    @property
    def answer(self) -> int:
        return len(self.shapes)


def problem(*, seed: int, index: int, min_shapes: int = 1, max_shapes: int = 5, size: int = 48) -> Problem:
    """The `index`-th picture of the sequence `seed` names: the same arguments, the same picture."""
    rng = random.Random(f"shapes:{seed}:{index}")
    count = rng.randint(min_shapes, max_shapes)
    cells = rng.sample(range(GRID * GRID), count)
    return Problem(shapes=[(rng.choice(KINDS), rng.choice(COLOURS), cell) for cell in sorted(cells)], size=size)


def picture(p: Problem) -> Any:
    """The problem's picture, a PIL image: white, each shape filling most of its cell."""
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (p.size, p.size), "white")
    draw = ImageDraw.Draw(image)
    cell = p.size / GRID
    for kind, colour, at in p.shapes:
        x0, y0 = (at % GRID) * cell + cell * 0.15, (at // GRID) * cell + cell * 0.15
        x1, y1 = x0 + cell * 0.7, y0 + cell * 0.7
        if kind == "square":
            draw.rectangle([x0, y0, x1, y1], fill=colour)
        elif kind == "circle":
            draw.ellipse([x0, y0, x1, y1], fill=colour)
        else:
            draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=colour)
    return image


def make_prompt(options: Any, *, seed: int, index: int) -> tuple[str, dict[str, Any], list[bytes]]:
    """The user message of a source's `index`-th problem, the meta its reward reads, and its
    picture (PNG bytes): a visual task's prompt."""
    import io

    p = problem(seed=seed, index=index, min_shapes=options.min_shapes, max_shapes=options.max_shapes,
                size=options.picture_size)
    png = io.BytesIO()
    picture(p).save(png, format="PNG")
    return QUESTION, {"answer": p.answer}, [png.getvalue()]


_INTEGER = re.compile(r"-?\d+")


def reward(*, prompt: str, completion: str, completion_ids: list[int],
           meta: dict[str, Any]) -> dict[str, float]:
    """1.0 when the last integer in the completion equals the number of shapes (`meta["answer"]`),
    else 0.0."""
    answer = meta["answer"]
    assert isinstance(answer, int) and not isinstance(answer, bool), \
        f"tasks.shapes reward: meta['answer'] must be an int, got {answer!r}"
    found = _INTEGER.findall(completion)
    return {"correct": 1.0 if found and int(found[-1]) == answer else 0.0}
