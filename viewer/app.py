"""The page: one Starlette route rendering a Jinja2 template, its filters as query parameters.

    GET /?step=N&min_step=N&max_step=N&version=N&generator=NAME&min_reward=X&max_reward=X&limit=N
         &colour=advantage|logprob

Each request reads the groups afresh (a live run's stream moves on; a recording is read once), the
run's history of trained groups where there is one (those the stream no longer holds, read with the
filters applied), and the trainer's metrics.jsonl where there is one (the steps, and which groups
each trained).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response
from starlette.routing import Route
from starlette.templating import Jinja2Templates

from common.metrics import StepMetrics, read_metrics
from viewer.groups import (
    Advantages,
    Filters,
    GroupView,
    Loaded,
    chosen,
    group_view,
    legend,
    trained_steps,
    with_history,
)

TEMPLATES = Path(__file__).parent / "templates"
COLOURS = ("advantage", "logprob")  # what tokens are coloured by
CACHED = 2_000  # groups laid out kept in memory (a group's layout never changes)


@dataclass
class Views:
    """Groups already laid out for the page, by entry and id (decoding tokens is the costly part)."""

    done: dict[tuple[str, str], GroupView] = field(default_factory=dict)

    def of(self, entry: str, group: Any, *, tokenizer: Any, how: Advantages) -> GroupView:
        key = (entry, group.id)
        if key not in self.done:
            if len(self.done) >= CACHED:
                self.done.clear()
            self.done[key] = group_view(entry, group, tokenizer=tokenizer, how=how)
        return self.done[key]


class BadQuery(ValueError):
    """A query parameter that does not parse: the page answers 400 naming it."""


def filters(query: dict[str, str]) -> Filters:
    def number(name: str, kind: type) -> Any:
        raw = query.get(name, "").strip()
        if not raw:
            return None
        try:
            return kind(raw)
        except ValueError:
            raise BadQuery(f"{name}={raw!r}: expected {'an integer' if kind is int else 'a number'}") from None

    limit = number("limit", int)
    if limit is not None and limit < 1:
        raise BadQuery(f"limit={limit}: expected at least 1")
    return Filters(step=number("step", int), min_step=number("min_step", int), max_step=number("max_step", int),
                   version=number("version", int),
                   generator=query.get("generator", "").strip() or None, min_reward=number("min_reward", float),
                   max_reward=number("max_reward", float), limit=limit or Filters.limit)


def metrics_of(path: Path | None) -> tuple[list[StepMetrics], str | None]:
    """The trainer's steps from `path`, and why there are none where there are none."""
    if path is None:
        return [], "no metrics file given (--metrics)"
    if not path.is_file():
        return [], f"no metrics file at {path} yet"
    try:
        return read_metrics(path), None
    except ValueError as err:
        return [], str(err)


def make_app(*, load: Callable[[], Loaded], tokenizer: Any, how: Advantages, metrics: Path | None,
             run: str, history: Path | None = None) -> Starlette:
    """The viewer's web app: `load` gives the groups (called once per request), `history` the run's
    trained groups beyond them (common/history.py; None: none), `tokenizer` decodes them (None:
    tokens shown by id), `how` is how the trainer computes advantages."""
    templates = Jinja2Templates(directory=TEMPLATES)
    views = Views()

    async def page(request: Request) -> Response:
        query = dict(request.query_params)
        try:
            f = filters(query)
        except BadQuery as err:
            return PlainTextResponse(f"rollouts view: {err}\n", status_code=400)
        colour = query.get("colour") if query.get("colour") in COLOURS else "advantage"
        try:
            loaded = load()
        except redis.exceptions.ConnectionError as err:  # Redis went away while the page is up
            return PlainTextResponse(f"rollouts view: cannot read the samples stream: {err}\n", status_code=503)
        if history is not None:
            loaded = with_history(loaded, history, f)
        steps, no_steps = metrics_of(metrics)
        trained = {**trained_steps(steps), **loaded.steps}
        shown = [(views.of(eid, g, tokenizer=tokenizer, how=how), trained.get(g.id))
                 for eid, g in chosen(loaded.groups, f, trained)]
        return templates.TemplateResponse(request, "page.html", {
            "run": run, "loaded": loaded, "shown": shown, "f": f, "colour": colour, "steps": steps,
            "no_steps": no_steps, "generators": sorted({g.generator for _, g in loaded.groups}),
            "versions": sorted({g.version for _, g in loaded.groups}), "how": how, "legend": legend(),
            "tokenizer": tokenizer is not None})

    return Starlette(routes=[Route("/", page)])
