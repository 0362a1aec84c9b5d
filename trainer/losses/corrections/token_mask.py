"""token_mask: ratio pi / pi_prox, clipped, times pi_prox / pi_behav where that lies in [mask_low,
mask_high], else 0: the token is dropped (MIS, icepop)."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from common.config import CorrectionOptions


class Options(CorrectionOptions):
    # The lower end of the band [mask_low, mask_high] of pi_prox / pi_behav kept.
    mask_low: float = Field(0.5, ge=0.0, le=1.0)
    # The upper end of that band.
    mask_high: float = Field(2.0, ge=1.0)


def weight(log_w: Tensor, mask: Tensor, cfg: Options) -> Tensor:
    """exp(log_w) inside the band, 0 outside, (B, T); `log_w` = log pi_prox - log pi_behav, 0 off the mask."""
    w = torch.exp(log_w)
    return torch.where((w >= cfg.mask_low) & (w <= cfg.mask_high), w, torch.zeros_like(w))
