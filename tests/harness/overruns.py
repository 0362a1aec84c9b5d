"""A scorer that overruns its group's budget: a method held back until the test lets it go."""

from __future__ import annotations

import contextlib
import functools
import threading
from collections.abc import Iterator

import pytest


@contextlib.contextmanager
def held_back(monkeypatch: pytest.MonkeyPatch, cls: type, name: str) -> Iterator[None]:
    """`cls.name` waits, before doing its work, until the block ends (at most 120 s: a guard against a
    hang), so a call made in the block overruns any budget shorter than the block."""
    release = threading.Event()
    original = getattr(cls, name)

    @functools.wraps(original)  # its signature too: a scorer passes what the signature takes
    def stuck(self, *args, **kwargs):
        release.wait(timeout=120)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(cls, name, stuck)
    try:
        yield
    finally:
        release.set()
