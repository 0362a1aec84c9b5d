"""Off-policy corrections, one file each, chosen by [trainer.loss.correction]'s `type`.

A correction is corrections/<type>.py: its settings, an `Options` class (a subclass of
common.config's CorrectionOptions, read from the file as a loss's is: trainer/losses/__init__.py),
and `weight(log_w, mask, cfg) -> Tensor`, the no-gradient
per-token weight (B, T) of the mismatch between the proximal policy (the weights at the start of
the step) and the behaviour policy that sampled the tokens, given `log_w` = log pi_prox -
log pi_behav (0 off the mask; `behaviour_weight` below computes it); a weight of 0 drops the
token. A correction takes the PPO ratio against the proximal policy (trainer/losses/clipped.py)
unless its Options sets the class variable `proximal = False` (behaviour_clip's): then the step
runs no proximal pass and its weight is 1 (trainer.losses.takes_proximal reads the declaration).
Adding one is that file and its test.
"""

from __future__ import annotations

import importlib

from torch import Tensor

from common.config import CorrectionConfig


def behaviour_weight(prox: Tensor, behaviour: Tensor, mask: Tensor, correction: CorrectionConfig) -> Tensor:
    """The no-gradient per-token weight (B, T) of `correction` (see each correction's file)."""
    log_w = (prox - behaviour) * mask  # (B, T), 0 off the mask
    return importlib.import_module(f"trainer.losses.corrections.{correction.type}").weight(log_w, mask, correction)
