"""decoupled: AReaL's decoupled PPO, ratio pi / pi_prox, clipped, times the behaviour weight
min(pi_prox / pi_behav, tis_cap)."""

from __future__ import annotations

import torch
from pydantic import Field
from torch import Tensor

from common.config import CorrectionOptions


class Options(CorrectionOptions):
    # Cap of the behaviour weight pi_prox / pi_behav.
    tis_cap: float = Field(2.0, gt=0.0)


def weight(log_w: Tensor, mask: Tensor, cfg: Options) -> Tensor:
    """exp(log_w) capped at `cfg.tis_cap`, (B, T); `log_w` = log pi_prox - log pi_behav, 0 off the mask."""
    return torch.exp(log_w).clamp(max=cfg.tis_cap)
