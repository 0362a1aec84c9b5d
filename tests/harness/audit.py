"""The accounting of a run: every admitted prompt trained, dropped for a counted reason, or pending,
exactly once."""

from __future__ import annotations

from common.audit import accounting, unaccounted

__all__ = ["accounting", "assert_accounted", "report", "unaccounted"]


def assert_accounted(acc: dict[str, int]) -> None:
    """Every admitted prompt is trained, dropped for a counted reason, or pending, exactly once."""
    assert not unaccounted(acc), (unaccounted(acc), acc)


def report(fault: str, at_kill: dict, after: dict) -> None:
    """Print what was in flight when `fault` struck and how the run accounted for it after."""
    in_flight = at_kill["prompts_pending"] + at_kill["samples_pending"]
    print(f"\n{fault}: in flight when it struck: {in_flight} (prompts being generated "
          f"{at_kill['prompts_pending']}, groups read by the trainer and unacknowledged {at_kill['samples_pending']}; "
          f"waiting: prompts {at_kill['prompts_waiting']}, groups {at_kill['samples_waiting']}; "
          f"admitted {at_kill['admitted']})")
    print(f"{fault}: after recovery: admitted {after['admitted']} = trained {after['trained']} + dropped "
          f"{after['dropped']} (stale {after['dropped_stale']}, dead {after['dead_groups'] + after['dead_prompts']}) "
          f"+ pending {after['pending']}; duplicates {after['duplicate']} (refused {after['duplicate_refused']})")
