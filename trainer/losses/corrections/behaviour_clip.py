"""behaviour_clip: no weight (1); the PPO ratio itself is against the behaviour policy."""

import torch
from torch import Tensor

from common.config import BehaviourClip


def weight(log_w: Tensor, mask: Tensor, cfg: BehaviourClip) -> Tensor:
    """1 everywhere: (B, T)."""
    return torch.ones_like(log_w)
