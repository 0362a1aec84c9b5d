"""sequence_mask: the sequence's geometric mean of pi_prox / pi_behav where it lies in
[mask_low, mask_high], else 0 for the whole sequence (TRL's sequence_mask)."""

import torch
from torch import Tensor

from common.config import SequenceMask


def weight(log_w: Tensor, mask: Tensor, cfg: SequenceMask) -> Tensor:
    """Each sequence's geometric-mean weight, or 0, on all its positions: (B, T)."""
    w = torch.exp(log_w.sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)).unsqueeze(1)  # (B, 1)
    return torch.where((w >= cfg.mask_low) & (w <= cfg.mask_high), w, torch.zeros_like(w)).expand_as(log_w)
