"""gspo: the ratio per sequence (GSPO), clipped per sequence, each sequence's loss its tokens' mean.

The sequence's ratio is the geometric mean of its tokens' ratios, exp(mean_t log(pi / pi_old)),
shared by its tokens; otherwise as grpo (correction weight, dual clip, KL), with seq_mean.
"""

from __future__ import annotations

import torch

from common.config import ClippedLoss, DualClip
from trainer.losses import LossInputs, LossOutputs
from trainer.losses.clipped import aggregate, clipped_objective, prepare, token_stats
from trainer.losses.kl import with_kl


class Options(ClippedLoss, DualClip):
    """GSPO uses tiny clip ranges (clip_low 3e-4, clip_high 4e-4)."""


def loss(x: LossInputs, cfg: Options) -> LossOutputs:
    p = prepare(x, cfg)
    seq_log_ratio = p.log_ratio.sum(dim=1) / p.lengths  # (B,) log of the geometric mean
    ratio = torch.exp(seq_log_ratio).unsqueeze(1).expand_as(x.logp)  # (B, T)
    per_token, dual = clipped_objective(ratio, p.adv, p.mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                        clip_ratio_c=cfg.clip_ratio_c)
    per_token = with_kl(per_token * p.weight, x.logp, x.ref_logp, p.mask, ratio, cfg)
    with torch.no_grad():
        low = ((ratio < 1.0 - cfg.clip_low) & (p.adv < 0)).float() * p.mask
        high = ((ratio > 1.0 + cfg.clip_high) & (p.adv > 0)).float() * p.mask
    return LossOutputs(loss=aggregate(per_token, p, x, "seq_mean"),
                       stats=token_stats(x, p, ratio=ratio, low=low, high=high, dual=dual,
                                         kl_estimator=cfg.kl_estimator))
