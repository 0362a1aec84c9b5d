"""The GRPO family's policy losses: one file each, chosen by [trainer.loss]'s `type`.

A loss is trainer/losses/<type>.py: its settings, an `Options` class (a subclass of
common.config's LossOptions, or ClippedLoss for a clipped ratio: pydantic fields, each with its
comment, imported only from pydantic, typing and common, since common.config reads the class from
the file without importing it), and `loss(inputs: LossInputs, cfg) -> LossOutputs`, `cfg` the
config's variant of that type (common.config's LOSSES[type], which subclasses the file's Options);
or `bind(cfg) -> Loss` where the loss is loaded at start-up (custom.py: any `module:function` of
that shape, its settings as keyword arguments). Adding a loss is that file and its test: the
config takes `type = "<file name>"` with its options, --help lists it with its docstring's first line.
`LossInputs` is one micro-batch; the loss is its share of the whole (mini-)batch's mean (the
normalisers are counts of the whole batch, over every rank), so the micro-batches' losses and
stats add up exactly.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

from torch import Tensor

from common.config import CORRECTIONS, ClippedLoss, CorrectionConfig, LossConfig


@dataclass(frozen=True, slots=True)
class LossInputs:
    """One micro-batch, as the loss sees it. (B, T): completions x trained positions."""

    logp: Tensor  # (B, T) the policy's log-probs of the sampled tokens, with gradient; 0 off the mask
    behaviour_logp: Tensor  # (B, T) the generator's: the policy that sampled the tokens
    advantages: Tensor  # (B,) one per completion; (B, T) one per token under on-policy distillation
    # (trainer/grpo.py: token_advantages), which a custom loss given a teacher must take too
    mask: Tensor  # (B, T) 1 where a token is trained
    total_tokens: int  # trained tokens of the whole (mini-)batch, every micro-batch and rank
    total_seqs: int = 0  # its sequences with a trained token (a per-sequence mean divides by it)
    norm_tokens: int = 0  # completions x max_new_tokens (Dr. GRPO's constant normaliser)
    prox_logp: Tensor | None = None  # (B, T) the proximal policy: no-grad, weights at the step's start;
    # None where the correction takes none (takes_proximal: behaviour_clip)
    ref_logp: Tensor | None = None  # (B, T) the frozen reference's; None without a KL term


@dataclass(frozen=True, slots=True)
class LossStats:
    """A micro-batch's statistics, each a share of the (mini-)batch's trained tokens, so that they
    add up over micro-batches and ranks. The defaults are an empty step's. The trainer's metrics
    (common/metrics.py's PolicyStats) carry them under the same field names. A loss may give each
    as a 0-dim tensor where it computed it (the built-in losses do: no read back to the host per
    micro-batch, which on a GPU would wait for its pass to finish) or as a float; the step reads
    them all back once, at its end (trainer/step.py `Sums`), and reports floats."""

    clip_low: float | Tensor = 0.0  # tokens whose ratio is clipped at the lower bound (where that acts)
    clip_high: float | Tensor = 0.0  # ... at the upper bound
    clip_region: float | Tensor = 0.0  # clip_low + clip_high
    clip_dual: float | Tensor = 0.0  # tokens the dual clip bounds
    ratio: float | Tensor = 1.0  # mean ratio pi / pi_old
    tis: float | Tensor = 1.0  # mean behaviour weight of the correction (1: none)
    kl: float | Tensor = 0.0  # mean KL estimate to the reference (0: no reference)


class LossOutputs(NamedTuple):
    loss: Tensor  # () the micro-batch's share of the (mini-)batch's loss, with gradient
    stats: LossStats


Loss = Callable[[LossInputs], LossOutputs]


def loss_function(cfg: LossConfig) -> Loss:
    """The loss `cfg` chooses, its settings bound: trainer/losses/<type>.py's `loss`, or what its
    `bind` returns (a custom loss's function with its kwargs; ValueError if it cannot be loaded)."""
    module = importlib.import_module(f"trainer.losses.{cfg.type}")
    return module.bind(cfg) if hasattr(module, "bind") else partial(module.loss, cfg=cfg)


def correction_of(cfg: LossConfig) -> CorrectionConfig:
    """`cfg`'s off-policy correction; a custom loss takes behaviour_clip's (no proximal pass)."""
    return cfg.correction if isinstance(cfg, ClippedLoss) else CORRECTIONS["behaviour_clip"]()


def takes_proximal(cfg: LossConfig) -> bool:
    """Whether `cfg` takes its PPO ratio against the proximal policy (the weights at the step's
    start), so that the step runs a no-grad pass for it (LossInputs.prox_logp): what its
    correction's Options declares as `proximal` (common.config's CorrectionOptions: true unless the
    correction's file sets it false, as behaviour_clip's does: its ratio is against the behaviour
    policy, the sampler's log-probs). Every place that decides on the proximal pass asks this."""
    return correction_of(cfg).proximal


def kl_coef_of(cfg: LossConfig) -> float:
    """`cfg`'s KL coefficient; above 0 the trainer keeps a frozen reference model."""
    return cfg.kl_coef if isinstance(cfg, ClippedLoss) else 0.0


def zero_advantage_adds_nothing(cfg: LossConfig) -> bool:
    """Whether a completion whose advantage is 0 adds nothing to `cfg`'s gradient: true of the
    built-in clipped losses (each token's loss is its advantage times a factor of the ratio)
    without a KL term; a custom loss is not known to be such."""
    return isinstance(cfg, ClippedLoss) and cfg.kl_coef == 0
