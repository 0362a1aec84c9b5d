"""token_mask: pi_prox / pi_behav where it lies in [mask_low, mask_high], else 0: the token is
dropped (MIS, icepop)."""

import torch
from torch import Tensor

from common.config import TokenMask


def weight(log_w: Tensor, mask: Tensor, cfg: TokenMask) -> Tensor:
    """exp(log_w) inside the band, 0 outside, (B, T); `log_w` = log pi_prox - log pi_behav, 0 off the mask."""
    w = torch.exp(log_w)
    return torch.where((w >= cfg.mask_low) & (w <= cfg.mask_high), w, torch.zeros_like(w))
