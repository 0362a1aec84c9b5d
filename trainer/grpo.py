"""GRPO's pure parts: group-relative advantages, token log-probs, the clipped policy loss."""

from __future__ import annotations

import torch
from torch import Tensor


def group_advantages(rewards: Tensor, eps: float = 1e-6) -> Tensor:
    """(r - group mean) / (group std + eps) for rewards of shape (G, n): G groups of n completions.

    The std is the unbiased one (divides by n - 1), as TRL's GRPOTrainer computes it; a group
    whose rewards are all equal gets advantage 0 everywhere.
    """
    assert rewards.dim() == 2, f"rewards must be (groups, completions), got shape {tuple(rewards.shape)}"
    assert rewards.shape[1] >= 2, f"a group needs at least 2 completions, got {rewards.shape[1]}"
    rewards = rewards.float()
    mean = rewards.mean(dim=1, keepdim=True)  # (G, 1)
    std = rewards.std(dim=1, keepdim=True, unbiased=True)  # (G, 1)
    return (rewards - mean) / (std + eps)  # (G, n)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) at each target id: (B, T, V), (B, T) -> (B, T)."""
    assert logits.shape[:2] == targets.shape, f"logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}"
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    scaled = logits.float() / temperature  # (B, T, V)
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(scaled, dim=-1)  # (B, T)


def grpo_loss(logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_low: float, clip_high: float, total_tokens: int) -> tuple[Tensor, dict[str, float]]:
    """PPO-clipped policy loss, token-mean over the whole step.

    ratio = exp(logp - behaviour_logp) per token; per-token loss is
    -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A). The masked sum is divided by
    `total_tokens`, the trained-token count of the whole step, so the losses (and the stats,
    which are shares of the same count) of its micro-batches add up to the step's mean.
    """
    assert logp.shape == behaviour_logp.shape == mask.shape, (
        f"logp {tuple(logp.shape)}, behaviour_logp {tuple(behaviour_logp.shape)}, mask {tuple(mask.shape)} differ")
    assert advantages.shape == logp.shape[:1], f"advantages {tuple(advantages.shape)} vs batch {logp.shape[0]}"
    assert total_tokens > 0, f"total_tokens must be > 0, got {total_tokens}"
    mask = mask.float()
    # Zero the log-ratio off the mask: padding then gives ratio 1, never exp(large) = inf.
    ratio = torch.exp((logp - behaviour_logp.float()) * mask)  # (B, T)
    adv = advantages.float().unsqueeze(1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    loss = (per_token * mask).sum() / total_tokens

    with torch.no_grad():
        # The clip is active (its gradient is zero) where the bound the advantage pushes
        # towards is crossed: below 1 - clip_low with A < 0, above 1 + clip_high with A > 0.
        low = ((ratio < 1.0 - clip_low) & (adv < 0)).float() * mask
        high = ((ratio > 1.0 + clip_high) & (adv > 0)).float() * mask
        stats = {
            "clip_ratio/low_mean": (low.sum() / total_tokens).item(),
            "clip_ratio/high_mean": (high.sum() / total_tokens).item(),
            "clip_ratio/region_mean": ((low + high).sum() / total_tokens).item(),
            "ratio/mean": ((ratio * mask).sum() / total_tokens).item(),
        }
    return loss, stats
