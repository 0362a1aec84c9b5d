"""cispo: the clipped ratio as a no-gradient weight on each token's log-likelihood (MiniMax-M1).

Per token: loss = -sg(clip(r, 1 - clip_low, 1 + clip_high)) * w * A * log pi, r = pi / pi_old, w
the correction's weight, plus the KL term; token_mean. Unlike PPO's clip, which zeroes the
gradient of a token past the bound (often the rare, decisive ones), every token keeps its
gradient A * grad log pi, scaled by its clipped ratio. "clip_ratio/low_mean" and "_high_mean" are
the shares of tokens whose weight was clipped, whatever their advantage.
"""

from __future__ import annotations

import torch

from common.config import ClippedLoss
from trainer.losses import LossInputs, LossOutputs
from trainer.losses.clipped import aggregate, prepare, token_stats
from trainer.losses.kl import with_kl


class Options(ClippedLoss):
    """MiniMax leaves the ratio unbounded below (clip_low 1)."""


def loss(x: LossInputs, cfg: Options) -> LossOutputs:
    p = prepare(x, cfg)
    ratio = torch.exp(p.log_ratio)  # (B, T)
    is_weight = torch.clamp(ratio, 1.0 - cfg.clip_low, 1.0 + cfg.clip_high).detach()  # (B, T)
    per_token = with_kl(-is_weight * p.weight * p.adv * x.logp, x.logp, x.ref_logp, p.mask, ratio, cfg)
    with torch.no_grad():
        low = (ratio < 1.0 - cfg.clip_low).float() * p.mask
        high = (ratio > 1.0 + cfg.clip_high).float() * p.mask
    return LossOutputs(loss=aggregate(per_token, p, x, "token_mean"),
                       stats=token_stats(x, p, ratio=ratio, low=low, high=high, dual=torch.zeros_like(p.mask),
                                         kl_estimator=cfg.kl_estimator))
