"""decoupled: AReaL's decoupled PPO, the behaviour weight min(pi_prox / pi_behav, tis_cap)."""

import torch
from torch import Tensor

from common.config import Decoupled


def weight(log_w: Tensor, mask: Tensor, cfg: Decoupled) -> Tensor:
    """exp(log_w) capped at `cfg.tis_cap`, (B, T); `log_w` = log pi_prox - log pi_behav, 0 off the mask."""
    return torch.exp(log_w).clamp(max=cfg.tis_cap)
