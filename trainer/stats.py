"""What one trainer step's update reports (trainer/step.py), as typed records: the trainer's metrics
(trainer/metrics.py) read their fields, and the names they are written under are declared once, in
common/metrics.py. The loss's own statistics are trainer/losses/'s `LossStats`."""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from trainer.losses import LossStats


@dataclass(frozen=True, slots=True)
class Mismatch:
    """The behaviour/proximal mismatch of some trained tokens (grpo.mismatch_stats): sums, so that
    micro-batches and ranks add up, each a share of the step's trained tokens unless said."""

    # Each figure is a float, or a 0-dim tensor on the device as one micro-batch's pass leaves it
    # (grpo.mismatch_stats), read back once a step (trainer/step.py `Sums`).
    gap: float | Tensor = 0.0  # |log pi_prox - log pi_behav| summed over the tokens, as a share of the trained tokens
    gap_max: float | Tensor = 0.0  # ... its largest on one token (a max, not a sum)
    masked: float | Tensor = 0.0  # share of the trained tokens the correction's weight dropped
    # staleness -> (|log ratio| summed, tokens) of the tokens sampled that many steps before: plain sums
    by_staleness: dict[int, tuple[float | Tensor, float | Tensor]] = field(default_factory=dict)

    def plus(self, other: Mismatch, *, share: float) -> Mismatch:
        """`self` with `other` added, its shares weighted by `share` (a micro-batch's of the step)."""
        stale = dict(self.by_staleness)
        for s, (gap, tokens) in other.by_staleness.items():
            had = stale.get(s, (0.0, 0.0))
            stale[s] = (had[0] + gap, had[1] + tokens)
        return Mismatch(gap=self.gap + other.gap * share, gap_max=max(self.gap_max, other.gap_max),
                        masked=self.masked + other.masked * share, by_staleness=stale)


@dataclass(frozen=True, slots=True)
class StepStats:
    """One trainer step's update, every rank's together. The defaults are an empty step's."""

    loss: float = 0.0  # the policy loss (GRPO family) or the cross-entropy (sft), mean over the applied updates
    grad_norm: float = 0.0  # global gradient norm before clipping, mean over the applied updates (0: none)
    entropy: float = 0.0  # mean per-token entropy of the policy over the trained tokens
    skipped: int = 0  # optimizer updates skipped: a non-finite loss or gradient norm
    tokens_trained: int = 0  # loss-masked completion tokens, every rank's
    tokens_forward: int = 0  # prompt and completion tokens through the model in one pass (for tokens/s)
    policy: LossStats | None = None  # the loss's own statistics (GRPO family); None for sft
    mismatch_mean: float = 0.0  # mean |log pi_prox - log pi_behav| over the trained tokens
    mismatch_max: float = 0.0  # ... its largest
    masked: float = 0.0  # share of the trained tokens the correction's weight dropped
    # staleness -> mean |log pi_prox - log pi_behav| of the tokens sampled that many steps before
    mismatch_by_staleness: dict[int, float] = field(default_factory=dict)
    # mean |log pi_prox - log pi_behav| of each of this rank's groups, in the order they were given
    # (nan: a group with no trained token): what the quarantine judges generators by
    group_mismatch: tuple[float, ...] = ()
    # mean k = log pi_behav - log pi_teacher over the trained tokens a teacher scored (0: none): the
    # per-token reverse KL to the teacher (on-policy distillation)
    teacher_kl: float = 0.0
    # the router's load-balancing loss (trainer/moe.py), mean over the trained tokens, unweighted by its
    # coefficient; None: the model config asks for none (every dense model)
    router_aux_loss: float | None = None
