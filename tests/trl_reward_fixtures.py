"""Reward functions in TRL's calling conventions for tests/test_trl_rewards.py, importable by name
from the spawned reward workers: TRL's own where a test needs one made by a factory, and functions
that ask for what TRL's GRPOTrainer passes beyond the data (`trainer_state`, `log_extra`,
`log_metric`, `environments`) or are `async def`."""

import asyncio

from trl.rewards import get_repetition_penalty_reward

# TRL's own, unchanged: its factory's reward (a callable object taking `completion_ids` only).
repetition_penalty_reward = get_repetition_penalty_reward(ngram_size=2, max_penalty=-1.0)


def by_step(completions, trainer_state, **kwargs):
    """Curriculum shaping as TRL's docs show it: the trainer's step, for every completion."""
    return [float(trainer_state.global_step)] * len(completions)


def by_epoch(completions, trainer_state, **kwargs):
    """Reads a TrainerState field rollouts does not give."""
    return [float(trainer_state.epoch)] * len(completions)


async def async_length(prompts, completions, **kwargs):
    """An async TRL function: the length of each completion, after yielding to the loop."""
    await asyncio.sleep(0)
    return [float(len(c)) for c in completions]


ARRIVED: set[str] = set()  # which of `first` and `second` have started, in this process


async def _meet(me: str, other: str, n: int) -> list[float]:
    """Waits (up to 10000 turns of the event loop) for `other` to start: returns only if both run
    in the same loop at the same time, as TRL's asyncio.gather runs them."""
    ARRIVED.add(me)
    for _ in range(10_000):
        if other in ARRIVED:
            return [1.0] * n
        await asyncio.sleep(0)
    raise TimeoutError(f"{other} never started while {me} waited")


async def first(completions, **kwargs):
    return await _meet("first", "second", len(completions))


async def second(completions, **kwargs):
    return await _meet("second", "first", len(completions))


async def async_half(**_) -> float:
    """A per-completion function, async."""
    await asyncio.sleep(0)
    return 0.5


def needs_log_metric(completions, log_metric, **kwargs):
    log_metric("seen", float(len(completions)))
    return [1.0] * len(completions)


def needs_log_extra(completions, log_extra, **kwargs):
    log_extra("seen", list(completions))
    return [1.0] * len(completions)


def needs_environments(completions, environments, **kwargs):
    return [1.0] * len(environments)


def reads_log_metric(completions, **kwargs):
    """Takes TRL's `log_metric` from **kwargs without asking for it by name."""
    kwargs["log_metric"]("seen", 1.0)
    return [1.0] * len(completions)


def logs_if_given(completions, log_extra=None, log_metric=None, **kwargs):
    """As trl.rewards' functions are written: logs only when the trainer gives the callables."""
    if log_metric is not None:
        log_metric("seen", 1.0)
    return [1.0] * len(completions)
