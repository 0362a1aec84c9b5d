"""The learning-rate schedule: linear warm-up, then constant or cosine to zero."""

from __future__ import annotations

import math
from functools import partial

import torch


def lr_factor(step: int, *, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Multiplier of the peak lr for the update of trainer step `step` (0 for the first step).

    Warm-up: (step + 1) / (warmup_steps + 1), so the first step already moves and step
    `warmup_steps` reaches the peak. Then "constant" stays at 1 and "cosine" follows
    (1 + cos(pi * progress)) / 2 with progress = (step - warmup_steps) / (total_steps - warmup_steps),
    reaching 0 at `total_steps` and staying there.
    """
    assert step >= 0, f"step must be >= 0, got {step}"
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if schedule == "constant":
        return 1.0
    if schedule == "cosine":
        assert total_steps > warmup_steps, f"cosine needs total_steps {total_steps} > warmup_steps {warmup_steps}"
        progress = min(1.0, (step - warmup_steps) / (total_steps - warmup_steps))
        return 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr schedule {schedule!r}; expected constant or cosine")


def build_scheduler(optimizer: torch.optim.Optimizer, *, schedule: str, warmup_steps: int,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR stepped once per trainer step; its state (the step count) is saved for resume."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, partial(lr_factor, schedule=schedule, warmup_steps=warmup_steps, total_steps=total_steps))
