"""The rewards a group's advantages are computed from, as the trainer sees them: one definition
for the trainer (trainer/batch.py) and the generators' dynamic sampling (drop_zero_variance), so a
group dropped as uninformative is one the trainer would have learnt nothing from."""

from __future__ import annotations

from common.messages import SampleGroup


def shaped_rewards(group: SampleGroup, *, overlong: str = "none", overlong_penalty: float = 0.0) -> list[float | None]:
    """Each completion's reward with the overlong penalty applied (`overlong` = "penalty": minus
    `overlong_penalty` where it was cut at max_new_tokens); None where its reward failed (raised,
    timed out, returned garbage: `reward_error`): such a completion has no reward to learn from."""
    penalty = overlong_penalty if overlong == "penalty" else 0.0
    return [None if c.reward_error is not None else c.reward - (penalty if c.finish == "length" else 0.0)
            for c in group.completions]


def zero_variance(group: SampleGroup, *, overlong: str = "none", overlong_penalty: float = 0.0) -> bool:
    """True where the group teaches nothing under group-relative advantages: its scored
    completions' shaped rewards are all equal, or fewer than 2 were scored."""
    scored = [x for x in shaped_rewards(group, overlong=overlong, overlong_penalty=overlong_penalty) if x is not None]
    return len(scored) < 2 or len(set(scored)) == 1
