"""sft: supervised cross-entropy (trainer.objective = "sft"), no advantages and no ratio."""

from __future__ import annotations

from torch import Tensor


def sft_loss(logp: Tensor, mask: Tensor, *, total_tokens: int) -> Tensor:
    """Supervised cross-entropy of one micro-batch, as its share of the step's mean: the negative
    log-likelihood (`logp` at temperature 1) summed over the masked tokens, divided by
    `total_tokens`, the step's masked-token count, so micro-batches and ranks add up exactly."""
    assert logp.shape == mask.shape, f"logp {tuple(logp.shape)} vs mask {tuple(mask.shape)}"
    assert total_tokens > 0, f"total_tokens must be > 0, got {total_tokens}"
    return -(logp * mask.float()).sum() / total_tokens
