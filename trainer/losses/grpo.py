"""grpo: PPO's clipped ratio per token (GRPO; DAPO and Dr. GRPO by their aggregation).

Per token: ratio r = pi / pi_old (pi_old the proximal policy where the correction takes that
pass, else the behaviour one: losses.takes_proximal), loss = w * -min(r A, clip(r, 1 - clip_low,
1 + clip_high) A) + kl_coef * kl, the dual clip bounding it where A < 0, w the correction's
no-gradient weight; aggregated by loss_agg.
"""

from __future__ import annotations

from typing import Literal

import torch

from common.config import ClippedLoss, DualClip
from trainer.losses import LossInputs, LossOutputs
from trainer.losses.clipped import aggregate, clipped_objective, prepare, token_stats
from trainer.losses.kl import with_kl


class Options(ClippedLoss, DualClip):
    # How the per-token losses become the step's loss:
    # "token_mean": their sum / the step's trained-token count (DAPO). Long completions weigh more.
    # "seq_mean": mean over each sequence's tokens, then mean over the step's sequences (GRPO paper);
    #   carries GRPO's length bias (a short wrong answer is pushed down harder per token).
    # "token_sum_norm": their sum / a constant, completions x rollout.max_new_tokens (Dr. GRPO): no
    #   length bias and no dependence on the step's lengths either.
    loss_agg: Literal["token_mean", "seq_mean", "token_sum_norm"] = "token_mean"


def loss(x: LossInputs, cfg: Options) -> LossOutputs:
    p = prepare(x, cfg)
    ratio = torch.exp(p.log_ratio)  # (B, T)
    per_token, dual = clipped_objective(ratio, p.adv, p.mask, clip_low=cfg.clip_low, clip_high=cfg.clip_high,
                                        clip_ratio_c=cfg.clip_ratio_c)
    per_token = with_kl(per_token * p.weight, x.logp, x.ref_logp, p.mask, ratio, cfg)
    with torch.no_grad():  # the clip acts (its gradient is 0) past the bound the advantage pushes towards
        low = ((ratio < 1.0 - cfg.clip_low) & (p.adv < 0)).float() * p.mask
        high = ((ratio > 1.0 + cfg.clip_high) & (p.adv > 0)).float() * p.mask
    return LossOutputs(loss=aggregate(per_token, p, x, cfg.loss_agg),
                       stats=token_stats(x, p, ratio=ratio, low=low, high=high, dual=dual,
                                         kl_estimator=cfg.kl_estimator))
