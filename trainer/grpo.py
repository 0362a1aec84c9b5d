"""GRPO's pure parts: group-relative advantages, token log-probs and entropy, the policy loss.

The loss is one function whose options select a member of the GRPO family: the PPO ratio per
token or per sequence (GSPO), token-mean, sequence-mean or Dr. GRPO's constant-normalised
aggregation (normalised by counts of the whole (mini-)batch, so micro-batches add up exactly),
an off-policy correction between the behaviour policy (the generator's log-probs) and the
proximal one (the weights at the start of the step): PPO's clip against the behaviour policy,
decoupled PPO's capped weight, or token/sequence masking; an optional dual clip; and an
optional KL penalty to a frozen reference with Schulman's k1/k2/k3 estimators (and TRL's
bias-corrected k3). Log-probs can be taken under the sampler's top-k/top-p truncation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

Estimator = Literal["grpo", "dr_grpo", "rloo"]
RatioLevel = Literal["token", "sequence"]
Aggregation = Literal["token_mean", "seq_mean", "token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3", "k3_is"]
Correction = Literal["behaviour_clip", "decoupled", "token_mask", "sequence_mask"]

TRUNCATED_LOGP = -1e4  # log-prob of a token the sampler's truncation cut (probability 0)


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


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float, *, top_k: int = 0,
                   top_p: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) at each target id: (B, T, V), (B, T) -> (B, T).

    With `top_k` > 0 or `top_p` < 1 the distribution is the sampler's truncated one, renormalised:
    temperature, then top-k (the k largest, ties kept), then top-p (the smallest set of largest
    tokens whose probability reaches top_p), as Hugging Face's and vLLM's samplers apply them. A
    target outside the kept set gets TRUNCATED_LOGP (finite, so masks never make NaN from it).
    """
    assert logits.shape[:2] == targets.shape, f"logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}"
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    scaled = logits.float() / temperature  # (B, T, V)
    if top_k > 0 or top_p < 1.0:
        scaled = truncate(scaled, top_k=top_k, top_p=top_p)
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T), -inf where cut
    return (picked - torch.logsumexp(scaled, dim=-1)).clamp(min=TRUNCATED_LOGP)  # (B, T)


def truncate(scaled: Tensor, *, top_k: int, top_p: float) -> Tensor:
    """`scaled` logits (..., V) with the tokens top-k and then top-p cut set to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]  # (..., 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scaled, dim=-1)  # (..., V)
        cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        cut[..., -1] = False  # the most likely token always stays
        scaled = scaled.masked_fill(torch.zeros_like(cut).scatter(-1, order, cut), float("-inf"))
    return scaled


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position: (B, T, V) -> (B, T), in nats."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(-1)  # (B, T)


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: KLEstimator, ratio: Tensor | None = None) -> Tensor:
    """Per-token estimate of KL(policy || reference) from tokens sampled by the policy.

    With log r = ref_logp - logp (Schulman, "Approximating KL divergence"), as values and as
    losses (their expected gradient over tokens sampled from the policy pi):
    - k1 = -log r: unbiased value, high variance, can be negative. Its gradient is grad log pi,
      whose expectation is 0: as a loss it only adds noise, it does not pull towards the reference.
    - k2 = (log r)^2 / 2: biased value, low variance. Its gradient, -log r * grad log pi, is in
      expectation the gradient of KL(pi || ref): the penalty its name says.
    - k3 = (r - 1) - log r: unbiased value, low variance, >= 0 (GRPO's). Its gradient,
      (1 - r) grad log pi, is in expectation that of the reverse direction, KL(ref || pi).
    - k3_is: k3 times `ratio` = pi / pi_old (with its gradient), TRL's bias-corrected k3
      (`use_bias_correction_kl`, DeepSeek-V3.2): the samples come from pi_old, not pi, and the
      ratio reweights them to pi, so the value is an unbiased estimate of KL(pi || ref) off-policy.
    """
    log_r = ref_logp - logp  # (B, T)
    if estimator == "k1":
        return -log_r
    if estimator == "k2":
        return 0.5 * log_r.square()
    if estimator in ("k3", "k3_is"):
        k3 = torch.expm1(log_r) - log_r
        return k3 * ratio if estimator == "k3_is" and ratio is not None else k3
    raise ValueError(f"unknown KL estimator {estimator!r}; expected k1, k2, k3 or k3_is")


def behaviour_weight(prox: Tensor, behaviour: Tensor, mask: Tensor, *, correction: Correction, tis_cap: float,
                     mask_low: float, mask_high: float) -> Tensor:
    """The no-gradient per-token weight of the behaviour/proximal mismatch, (B, T).

    - behaviour_clip: 1 (the PPO ratio itself is against the behaviour policy).
    - decoupled: min(pi_prox / pi_behav, tis_cap), AReaL's capped behaviour weight.
    - token_mask: pi_prox / pi_behav where it lies in [mask_low, mask_high], else 0 (the token
      is dropped: MIS, icepop).
    - sequence_mask: the sequence's geometric mean of pi_prox / pi_behav where it lies in the
      band, else 0 for the whole sequence (TRL's sequence_mask).
    """
    log_w = (prox - behaviour) * mask  # (B, T), 0 off the mask
    if correction == "behaviour_clip":
        return torch.ones_like(log_w)
    if correction == "decoupled":
        return torch.exp(log_w).clamp(max=tis_cap)
    if correction == "token_mask":
        w = torch.exp(log_w)
        return torch.where((w >= mask_low) & (w <= mask_high), w, torch.zeros_like(w))
    if correction == "sequence_mask":
        w = torch.exp(log_w.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).unsqueeze(1)  # (B, 1)
        return torch.where((w >= mask_low) & (w <= mask_high), w, torch.zeros_like(w)).expand_as(log_w)
    raise ValueError(f"unknown correction {correction!r}; expected behaviour_clip, decoupled, token_mask "
                     "or sequence_mask")


def grpo_loss(logp: Tensor, behaviour_logp: Tensor, advantages: Tensor, mask: Tensor, *,
              clip_low: float, clip_high: float, total_tokens: int, old_logp: Tensor | None = None,
              correction: Correction = "behaviour_clip", ratio_level: RatioLevel = "token",
              aggregation: Aggregation = "token_mean", total_seqs: int = 0, norm_tokens: int = 0,
              tis_cap: float = 2.0, mask_low: float = 0.5, mask_high: float = 2.0, clip_ratio_c: float = 0.0,
              ref_logp: Tensor | None = None, kl_coef: float = 0.0,
              kl_estimator: KLEstimator = "k3") -> tuple[Tensor, dict[str, float]]:
    """PPO-clipped policy loss of one micro-batch, as its share of the whole (mini-)batch's mean.

    `old_logp` is the proximal policy: a no-grad pass with the weights at the start of the
    update; the corrections other than behaviour_clip need it. Per token:
        old   = behaviour_logp (behaviour_clip) or old_logp (the others);
        ratio = exp(logp - old), or with ratio_level "sequence" (GSPO) the sequence's
                geometric mean exp(mean_t(logp - old)), shared by its tokens;
        pg    = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A), and with dual
                clip (clip_ratio_c > 1) at most -A * clip_ratio_c where A < 0 (verl);
        w     = behaviour_weight(old_logp, behaviour_logp), no gradient (see there);
        loss  = w * pg + kl_coef * kl(logp, ref_logp).
    Aggregation: "token_mean" sums the masked per-token losses and divides by `total_tokens`,
    the batch's trained-token count; "seq_mean" averages each sequence over its own tokens and
    divides the sum by `total_seqs`, the batch's count of sequences with a trained token;
    "token_sum_norm" (Dr. GRPO) divides the sum by the constant `norm_tokens` (completions in
    the batch x max_new_tokens). Either way the micro-batches' losses (and the stats, shares of
    the batch's token count) add up.
    """
    assert logp.shape == behaviour_logp.shape == mask.shape, (
        f"logp {tuple(logp.shape)}, behaviour_logp {tuple(behaviour_logp.shape)}, mask {tuple(mask.shape)} differ")
    assert advantages.shape == logp.shape[:1], f"advantages {tuple(advantages.shape)} vs batch {logp.shape[0]}"
    assert total_tokens > 0, f"total_tokens must be > 0, got {total_tokens}"
    assert aggregation != "seq_mean" or total_seqs > 0, "seq_mean needs total_seqs > 0"
    assert aggregation != "token_sum_norm" or norm_tokens > 0, "token_sum_norm needs norm_tokens > 0"
    assert correction == "behaviour_clip" or old_logp is not None, f"correction {correction!r} needs old_logp"
    assert clip_ratio_c == 0 or clip_ratio_c > 1, f"clip_ratio_c must be 0 (off) or > 1, got {clip_ratio_c}"
    mask = mask.float()
    behaviour_logp = behaviour_logp.float()
    prox = None if old_logp is None else old_logp.float().detach()
    old = behaviour_logp if correction == "behaviour_clip" or prox is None else prox
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
    if clip_ratio_c > 0:  # dual clip: a negative advantage's loss is bounded by -A * c
        dual = torch.minimum(per_token, -adv * clip_ratio_c)
        dual_active = ((adv < 0) & (per_token > -adv * clip_ratio_c)).float() * mask
        per_token = torch.where(adv < 0, dual, per_token)
    else:
        dual_active = torch.zeros_like(mask)
    weight = torch.ones_like(per_token) if prox is None else behaviour_weight(
        prox, behaviour_logp, mask, correction=correction, tis_cap=tis_cap, mask_low=mask_low, mask_high=mask_high)
    per_token = per_token * weight
    if kl_coef > 0:
        assert ref_logp is not None, "kl_coef > 0 needs ref_logp"
        kl = kl_penalty(logp, ref_logp.float().detach(), kl_estimator, ratio=ratio) * mask  # (B, T)
        per_token = per_token + kl_coef * kl
    if aggregation == "seq_mean":
        loss = ((per_token * mask).sum(dim=1) / lengths).sum() / total_seqs
    elif aggregation == "token_sum_norm":
        loss = (per_token * mask).sum() / norm_tokens
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
            "clip_ratio/dual_mean": share(dual_active),
            "ratio/mean": share(ratio),
            "tis/mean": share(weight),
            "kl": share(kl_penalty(logp, ref_logp.float(), kl_estimator, ratio=ratio))
            if ref_logp is not None else 0.0,
        }
    return loss, stats


def mismatch_stats(prox: Tensor, behaviour: Tensor, mask: Tensor, weight_zero: Tensor, staleness: Tensor, *,
                   total_tokens: int) -> dict[str, float]:
    """Behaviour/proximal mismatch of one micro-batch: |log pi_prox - log pi_behav| summed per
    token as a share of `total_tokens`, its max, the share of tokens a mask dropped
    (`weight_zero`), and per staleness the sum and count of |log ratio| (added over micro-batches
    and ranks, divided at the end). `staleness` is per token, (B, T): a completion that went on
    under newer weights has tokens of several; each counts under its own."""
    mask = mask.float()
    gap = (prox.float() - behaviour.float()).abs() * mask  # (B, T)
    stats = {"mismatch/abs_log_ratio_mean": (gap.sum() / total_tokens).item(),
             "mismatch/abs_log_ratio_max": gap.max().item() if gap.numel() else 0.0,
             "mismatch/masked": ((weight_zero.float() * mask).sum() / total_tokens).item()}
    trained = torch.where(mask > 0, staleness, torch.full_like(staleness, -1))  # (B, T), -1 off the mask
    for s in sorted(set(trained.flatten().tolist()) - {-1}):  # a few values: read to the host
        tokens = (staleness == s).float() * mask  # (B, T), no boolean indexing: shapes stay fixed
        stats[f"staleness/{s}/gap_sum"] = (gap * tokens).sum().item()
        stats[f"staleness/{s}/tokens"] = tokens.sum().item()
    return stats


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
    correction: Correction = "behaviour_clip"
    ratio_level: RatioLevel = "token"
    aggregation: Aggregation = "token_mean"
    tis_cap: float = 2.0  # decoupled: cap of the behaviour weight
    mask_low: float = 0.5  # token_mask / sequence_mask: the band the behaviour weight must lie in
    mask_high: float = 2.0
    clip_ratio_c: float = 0.0  # dual clip; 0: off
    kl_coef: float = 0.0  # 0: no KL penalty (and no reference forward pass)
    kl_estimator: KLEstimator = "k3"
