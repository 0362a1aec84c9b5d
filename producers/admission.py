"""Admission control: how many prompts may be admitted so that no sample grows too stale."""

from __future__ import annotations


def admission_limit(*, version: int, max_staleness: int, prompts_per_step: int, dropped: int) -> int:
    """Total prompts that may have been admitted by now (AReaL's rule).

    A prompt admitted while the trainer is at `version` is trained at the latest at step
    `(admitted // prompts_per_step)`, so admitting at most `(max_staleness + version + 1) *
    prompts_per_step` keeps its staleness within `max_staleness`. Admitted prompts `dropped` for
    good (too stale, by dynamic sampling, dead-lettered: common.progress's `read_dropped`, which
    counts only prompts this producer admitted, each once) never fill a step, so they do not
    count against the limit; otherwise one dropped group would stall the run for good.
    """
    assert version >= 0 and max_staleness >= 0 and prompts_per_step >= 1 and dropped >= 0
    return (max_staleness + version + 1) * prompts_per_step + dropped
