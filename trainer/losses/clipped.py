"""The parts every loss with a clipped ratio shares: the ratio's denominator by correction, the
behaviour weight, the aggregation over the batch and the token statistics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from common.config import ClippedLoss
from trainer.losses import LossInputs, LossStats, takes_proximal
from trainer.losses.corrections import behaviour_weight
from trainer.losses.kl import kl_penalty


@dataclass(frozen=True, slots=True)
class Prepared:
    """A micro-batch's tensors in float32, as the clipped losses use them."""

    mask: Tensor  # (B, T) 1.0 where trained
    old: Tensor  # (B, T) the ratio's denominator: behaviour (behaviour_clip) or proximal log-probs
    log_ratio: Tensor  # (B, T) logp - old, 0 off the mask: padding gives ratio 1, never exp(large) = inf
    lengths: Tensor  # (B,) trained tokens per sequence, at least 1
    adv: Tensor  # (B, 1), or (B, T) where each token has its own (on-policy distillation)
    weight: Tensor  # (B, T) the correction's no-gradient behaviour weight (1 without a proximal pass)


def prepare(x: LossInputs, cfg: ClippedLoss) -> Prepared:
    """Check `x` and take what every clipped loss needs of it."""
    assert x.logp.shape == x.behaviour_logp.shape == x.mask.shape, (
        f"logp {tuple(x.logp.shape)}, behaviour_logp {tuple(x.behaviour_logp.shape)}, mask {tuple(x.mask.shape)} "
        "differ")
    assert x.advantages.shape in (x.logp.shape[:1], x.logp.shape), \
        f"advantages {tuple(x.advantages.shape)} vs batch {tuple(x.logp.shape)}"
    assert x.total_tokens > 0, f"total_tokens must be > 0, got {x.total_tokens}"
    proximal = takes_proximal(cfg)
    assert not proximal or x.prox_logp is not None, f"correction {cfg.correction.type!r} needs prox_logp"
    mask = x.mask.float()
    behaviour = x.behaviour_logp.float()
    prox = x.prox_logp.float().detach() if proximal and x.prox_logp is not None else None  # none: not taken
    old = behaviour if prox is None else prox
    lengths = mask.sum(dim=1).clamp(min=1.0)  # (B,)
    log_ratio = (x.logp - old) * mask  # (B, T)
    weight = torch.ones_like(x.logp) if prox is None else behaviour_weight(prox, behaviour, mask, cfg.correction)
    return Prepared(mask=mask, old=old, log_ratio=log_ratio, lengths=lengths, adv=token_adv(x.advantages),
                    weight=weight)


def token_adv(advantages: Tensor) -> Tensor:
    """The advantages as the tokens take them: (B,) -> (B, 1), one per completion broadcast over its
    tokens; (B, T), each token's own (trainer/grpo.py: token_advantages), as they are."""
    return advantages.float().unsqueeze(1) if advantages.dim() == 1 else advantages.float()


def clipped_objective(ratio: Tensor, adv: Tensor, mask: Tensor, *, clip_low: float, clip_high: float,
                      clip_ratio_c: float) -> tuple[Tensor, Tensor]:
    """PPO's per-token loss -min(r A, clip(r, 1 - clip_low, 1 + clip_high) A), (B, T), with the dual
    clip (clip_ratio_c > 1: at most -A * clip_ratio_c where A < 0, verl's); and where the dual clip
    acts (B, T)."""
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high) * adv
    per_token = -torch.minimum(unclipped, clipped)  # (B, T)
    if clip_ratio_c <= 0:
        return per_token, torch.zeros_like(mask)
    dual = torch.minimum(per_token, -adv * clip_ratio_c)
    dual_active = ((adv < 0) & (per_token > -adv * clip_ratio_c)).float() * mask
    return torch.where(adv < 0, dual, per_token), dual_active


def aggregate(per_token: Tensor, p: Prepared, x: LossInputs,
              how: Literal["token_mean", "seq_mean", "token_sum_norm"]) -> Tensor:
    """The masked per-token losses as the micro-batch's share of the batch's loss: "token_mean"
    divides their sum by the batch's trained tokens; "seq_mean" averages each sequence over its
    own tokens and divides the sum by the batch's sequences; "token_sum_norm" (Dr. GRPO) divides
    the sum by the constant completions x max_new_tokens."""
    if how == "seq_mean":
        assert x.total_seqs > 0, "seq_mean needs total_seqs > 0"
        return ((per_token * p.mask).sum(dim=1) / p.lengths).sum() / x.total_seqs
    if how == "token_sum_norm":
        assert x.norm_tokens > 0, "token_sum_norm needs norm_tokens > 0"
        return (per_token * p.mask).sum() / x.norm_tokens
    return (per_token * p.mask).sum() / x.total_tokens


@torch.no_grad()
def token_stats(x: LossInputs, p: Prepared, *, ratio: Tensor, low: Tensor, high: Tensor, dual: Tensor,
                kl_estimator: str) -> LossStats:
    """The stats of a clipped loss: `low` / `high` where the lower / upper clip acts (B, T, masked),
    `dual` where the dual clip does; each a share of the batch's trained tokens, a 0-dim tensor on
    the batch's device (read back once a step, not once a micro-batch)."""
    def share(t: Tensor) -> Tensor:
        return (t * p.mask).sum() / x.total_tokens

    return LossStats(
        clip_low=low.sum() / x.total_tokens, clip_high=high.sum() / x.total_tokens,
        clip_region=(low + high).sum() / x.total_tokens, clip_dual=share(dual), ratio=share(ratio),
        tis=share(p.weight),
        kl=share(kl_penalty(x.logp, x.ref_logp.float(), kl_estimator, ratio=ratio)) if x.ref_logp is not None else 0.0)
