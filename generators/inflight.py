"""In-flight weight updates (generator.inflight_updates): what a group's versions are when its
completions went on under newer weights.

The engine reports, per completion, where each weight version began (`Sampled.versions`). A group
is as stale as its oldest token: its `version` is the oldest version any of its tokens was sampled
with, and each completion whose tokens are not all of that version carries its own `versions`.
"""

from __future__ import annotations

from engines.base import Sampled


def group_versions(samples: list[Sampled], *, added_at: int) -> tuple[int, list[list[tuple[int, int]] | None]]:
    """The group's version (its oldest token's) and each completion's `Completion.versions` (None
    where every token is of the group's version). `added_at`: the engine's version when the prompt
    joined it, for engines that do not report versions."""
    spans = [s.versions or [(0, added_at)] for s in samples]
    oldest = min(v for span in spans for _, v in span)
    return oldest, [None if span == [(0, oldest)] else list(span) for span in spans]
