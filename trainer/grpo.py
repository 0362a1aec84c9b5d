"""GRPO's pure parts: group-relative advantages, token log-probs and entropy, the policy loss.

The loss is one function whose options select a member of the GRPO family: the PPO ratio per
token or per sequence (GSPO), token-mean or sequence-mean aggregation (both normalised by
counts of the whole step, so micro-batches add up exactly), a truncated importance-sampling
weight (TIS) between the policy that started the step and the behaviour policy, and an
optional KL penalty to a frozen reference with Schulman's k1/k2/k3 estimators.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Estimator = Literal["grpo", "dr_grpo", "rloo"]
RatioLevel = Literal["token", "sequence"]
Aggregation = Literal["token_mean", "seq_mean"]
KLEstimator = Literal["k1", "k2", "k3"]


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


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float) -> Tensor:
    """log_softmax(logits / temperature) at each target id: (B, T, V), (B, T) -> (B, T)."""
    assert logits.shape[:2] == targets.shape, f"logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}"
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    scaled = logits.float() / temperature  # (B, T, V)
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T)
    return picked - torch.logsumexp(scaled, dim=-1)  # (B, T)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position: (B, T, V) -> (B, T), in nats."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(-1)  # (B, T)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator) -> Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    With log r = ref_logp - logp (Schulman, "Approximating KL divergence"):
    k1 = -log r (unbiased, high variance, can be negative); k2 = (log r)^2 / 2 (biased, low
    variance); k3 = (r - 1) - log r (unbiased, low variance, >= 0; the one GRPO uses).
    """
    log_r = ref_logp - logp  # (B, T)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2 or k3")


def grpo_loss(logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_low: float, clip_high: float, total_tokens: int, old_logp: Tensor | None = None,
              ratio_level: RatioLevel = "token", aggregation: Aggregation = "token_mean",
              total_seqs: int = 0, tis_cap: float = 0.0, ref_logp: Tensor | None = None,
              kl_coef: float = 0.0, kl_estimator: KLEstimator = "k3") -> tuple[Tensor, dict[str, float]]:
    """PPO-clipped policy loss of one micro-batch, as its share of the whole step's mean.

    `old_logp` is the policy at the start of the step (a no-grad pass); None means the behaviour
    log-probs stand in for it (one update per batch, no separate pass). Per token:
        ratio = exp(logp - old_logp), or with ratio_level "sequence" (GSPO) the sequence's
                geometric mean exp(mean_t(logp - old_logp)), shared by its tokens;
        pg    = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A);
        tis   = min(exp(old_logp - behaviour_logp), tis_cap), no gradient (1 when tis_cap is 0);
        loss  = tis * pg + kl_coef * kl(logp, ref_logp).
    Aggregation: "token_mean" sums the masked per-token losses and divides by `total_tokens`,
    the step's trained-token count; "seq_mean" averages each sequence over its own tokens and
    divides the sum by `total_seqs`, the step's count of sequences with a trained token. Either
    way the micro-batches' losses (and the stats, shares of the step's token count) add up.
    """
    assert logp.shape == behaviour_logp.shape == mask.shape, (
        f"logp {tuple(logp.shape)}, behaviour_logp {tuple(behaviour_logp.shape)}, mask {tuple(mask.shape)} differ")
    assert advantages.shape == logp.shape[:1], f"advantages {tuple(advantages.shape)} vs batch {logp.shape[0]}"
    assert total_tokens > 0, f"total_tokens must be > 0, got {total_tokens}"
    assert aggregation != "seq_mean" or total_seqs > 0, "seq_mean needs total_seqs > 0"
    mask = mask.float()
    behaviour_logp = behaviour_logp.float()
    old = behaviour_logp if old_logp is None else old_logp.float().detach()
    lengths = mask.sum(dim=1).clamp(min=1.0)  # (B,) trained tokens per sequence
    # Zero the log-ratio off the mask: padding then gives ratio 1, never exp(large) = inf.
    log_ratio = (logp - old) * mask  # (B, T)
    if ratio_level == "sequence":
        seq_log_ratio = log_ratio.sum(dim=1) / lengths  # (B,) log of the geometric mean
        ratio = torch.exp(seq_log_ratio).unsqueeze(1).expand_as(logp)  # (B, T)
    else:
        ratio = torch.exp(log_ratio)  # (B, T)
    adv = advantages.float().unsqueeze(1)  # (B, 1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    if tis_cap > 0:
        tis = torch.exp((old - behaviour_logp) * mask).clamp(max=tis_cap)  # (B, T), no gradient
        per_token = per_token * tis
    else:
        tis = torch.ones_like(per_token)
    if kl_coef > 0:
        assert ref_logp is not None, "kl_coef > 0 needs ref_logp"
        kl = kl_penalty(logp, ref_logp.float().detach(), kl_estimator) * mask  # (B, T)
        per_token = per_token + kl_coef * kl
    else:
        kl = torch.zeros_like(per_token)
    if aggregation == "seq_mean":
        loss = ((per_token * mask).sum(dim=1) / lengths).sum() / total_seqs
    else:
        loss = (per_token * mask).sum() / total_tokens

    with torch.no_grad():
        # The clip is active (its gradient is zero) where the bound the advantage pushes
        # towards is crossed: below 1 - clip_low with A < 0, above 1 + clip_high with A > 0.
        low = ((ratio < 1.0 - clip_low) & (adv < 0)).float() * mask
        high = ((ratio > 1.0 + clip_high) & (adv > 0)).float() * mask

        def share(x: Tensor) -> float:
            return ((x * mask).sum() / total_tokens).item()

        stats = {
            "clip_ratio/low_mean": (low.sum() / total_tokens).item(),
            "clip_ratio/high_mean": (high.sum() / total_tokens).item(),
            "clip_ratio/region_mean": ((low + high).sum() / total_tokens).item(),
            "ratio/mean": share(ratio),
            "tis/mean": share(tis),
            "kl": share(kl_penalty(logp, ref_logp.float(), kl_estimator)) if ref_logp is not None else 0.0,
        }
    return loss, stats


def sft_loss(logp: Tensor, mask: Tensor, *, total_tokens: int) -> Tensor:
    """Supervised cross-entropy of one micro-batch, as its share of the step's mean: the negative
    log-likelihood (`logp` at temperature 1) summed over the masked tokens, divided by
    `total_tokens`, the step's masked-token count, so micro-batches and ranks add up exactly."""
    assert logp.shape == mask.shape, f"logp {tuple(logp.shape)} vs mask {tuple(mask.shape)}"
    assert total_tokens > 0, f"total_tokens must be > 0, got {total_tokens}"
    return -(logp * mask.float()).sum() / total_tokens


@dataclass(frozen=True, slots=True)
class LossOptions:
    """The loss's choices among the GRPO family (see `grpo_loss`); defaults are plain GRPO."""

    clip_low: float = 0.2
    clip_high: float = 0.2
    ratio_level: RatioLevel = "token"
    aggregation: Aggregation = "token_mean"
    tis_cap: float = 0.0  # 0: no TIS weight
    kl_coef: float = 0.0  # 0: no KL penalty (and no reference forward pass)
    kl_estimator: KLEstimator = "k3"
