"""sequence_mask: as token_mask with the sequence's geometric mean of pi_prox / pi_behav: a sequence
outside [mask_low, mask_high] is dropped whole (TRL's sequence_mask)."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from common.config import CorrectionOptions


class Options(CorrectionOptions):
    # The lower end of the band [mask_low, mask_high] of the geometric mean kept.
    mask_low: float = Field(0.5, ge=0.0, le=1.0)
    # The upper end of that band.
    mask_high: float = Field(2.0, ge=1.0)


def weight(log_w: Tensor, mask: Tensor, cfg: Options) -> Tensor:
    """Each sequence's geometric-mean weight, or 0, on all its positions: (B, T)."""
    w = torch.exp(log_w.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).unsqueeze(1)  # (B, 1)
    return torch.where((w >= cfg.mask_low) & (w <= cfg.mask_high), w, torch.zeros_like(w)).expand_as(log_w)
