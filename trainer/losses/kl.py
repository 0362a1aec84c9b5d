"""The KL penalty to a frozen reference, per token, that the clipped losses can add."""

from __future__ import annotations

import torch
from torch import Tensor

from common.config import ClippedLoss


def kl_penalty(logp: Tensor, ref_logp: Tensor, estimator: str, ratio: Tensor | None = None) -> Tensor:
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


def with_kl(per_token: Tensor, logp: Tensor, ref_logp: Tensor | None, mask: Tensor, ratio: Tensor,
            cfg: ClippedLoss) -> Tensor:
    """`per_token` (B, T) plus `cfg.kl_coef` times the KL estimate on the mask (no change at 0)."""
    if cfg.kl_coef <= 0:
        return per_token
    assert ref_logp is not None, "kl_coef > 0 needs ref_logp"
    kl = kl_penalty(logp, ref_logp.float().detach(), cfg.kl_estimator, ratio=ratio) * mask  # (B, T)
    return per_token + cfg.kl_coef * kl
