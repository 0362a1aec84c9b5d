"""A pytest plugin for tests/test_docs.py: after collection, one line with how many tests were
collected and how many of them carry each marker (`-p tests.harness.marker_counts`), so that one
collection gives every count the README states."""

from __future__ import annotations

import json

import pytest

PREFIX = "marker-counts: "


def pytest_collection_finish(session: pytest.Session) -> None:
    counts = {"total": len(session.items)}
    for item in session.items:
        for name in {m.name for m in item.iter_markers()}:
            counts[name] = counts.get(name, 0) + 1
    print(PREFIX + json.dumps(counts, sort_keys=True))
