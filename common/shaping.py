"""The rewards a group's advantages are computed from, and the advantages, as the trainer sees
them: one definition for the trainer (trainer/batch.py), the generators' dynamic sampling
(drop_zero_variance), so a group dropped as uninformative is one the trainer would have learnt
nothing from, and `rollouts view`, which colours each completion by the advantage it trains with."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from common.messages import SampleGroup

if TYPE_CHECKING:
    from torch import Tensor

Estimator = Literal["grpo", "dr_grpo", "rloo"]


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


def group_advantages(rewards: Tensor, estimator: Estimator = "grpo", eps: float = 1e-6) -> Tensor:
    """Advantages of rewards shaped (G, n): G groups of n completions.

    - grpo: (r - group mean) / (group std + eps), the std unbiased (divides by n - 1) as TRL's
      GRPOTrainer computes it; a group whose rewards are all equal gets 0 everywhere.
    - dr_grpo: r - group mean (Dr. GRPO drops the std, which over-weights easy/hard groups).
    - rloo: r - mean of the other n - 1 rewards (leave-one-out baseline) = n / (n - 1) * (r - mean).
    """
    assert rewards.dim() == 2, f"rewards must be (groups, completions), got shape {tuple(rewards.shape)}"
    n = rewards.shape[1]
    assert n >= 2, f"a group needs at least 2 completions, got {n}"
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)  # (G, 1)
    if estimator == "grpo":
        std = rewards.std(dim=1, keepdim=True, unbiased=True)  # (G, 1)
        return (rewards - mean) / (std + eps)  # (G, n)
    if estimator == "dr_grpo":
        return rewards - mean  # (G, n)
    if estimator == "rloo":
        others = (rewards.sum(dim=1, keepdim=True) - rewards) / (n - 1)  # (G, n)
        return rewards - others
    raise ValueError(f"unknown advantage estimator {estimator!r}; expected grpo, dr_grpo or rloo")


def completion_advantages(group: SampleGroup, *, estimator: Estimator = "grpo", overlong: str = "none",
                          overlong_penalty: float = 0.0) -> list[float | None]:
    """Each completion's group-relative advantage from its shaped rewards; None for a completion
    with no reward to learn from (its reward failed), and for all of them when fewer than 2 of the
    group were scored (the trainer trains on none of those tokens)."""
    import torch

    rewards = shaped_rewards(group, overlong=overlong, overlong_penalty=overlong_penalty)
    scored = [x for x in rewards if x is not None]
    if len(scored) < 2:
        return [None] * len(rewards)
    kept = iter(group_advantages(torch.tensor([scored], dtype=torch.float32), estimator)[0].tolist())  # (n_scored,)
    return [None if x is None else next(kept) for x in rewards]
