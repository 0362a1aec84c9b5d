"""Loss inputs worked out by hand."""

from __future__ import annotations

import torch


def clip_case():
    """(logp, behaviour, advantages, mask) of two rows whose ratios reach both clip bounds."""
    # Row 0 (A = +1) ratios 1.5, 0.9, [padding]; row 1 (A = -1) ratios 0.5, 1.1, 1.0.
    ratios = torch.tensor([[1.5, 0.9, 1.0], [0.5, 1.1, 1.0]])
    behaviour = torch.full((2, 3), -2.0)
    logp = (behaviour + ratios.log()).requires_grad_()
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    return logp, behaviour, torch.tensor([1.0, -1.0]), mask
