"""behaviour_clip: no weight (1); the PPO ratio itself is against the behaviour policy, clipped,
staleness and engine mismatch going into the clipped ratio, no extra pass."""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import Tensor

from common.config import CorrectionOptions


class Options(CorrectionOptions):
    """No settings: PPO's ratio pi / pi_behav, clipped."""

    proximal: ClassVar[bool] = False  # no proximal pass: the ratio is against the behaviour policy


def weight(log_w: Tensor, mask: Tensor, cfg: Options) -> Tensor:
    """1 everywhere: (B, T)."""
    return torch.ones_like(log_w)
