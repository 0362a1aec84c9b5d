"""GRPO's pure parts besides the loss: group-relative advantages, token log-probs (under the
sampler's top-k/top-p truncation) and entropy, and the behaviour/proximal mismatch metrics. The
policy losses are in trainer/losses/, one file each."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import Tensor

# The advantages are common's (the trainer's, and `rollouts view`'s colours): named here for the trainer.
from common.shaping import Estimator as Estimator
from common.shaping import group_advantages as group_advantages
from trainer.stats import Mismatch

TRUNCATED_LOGP = -1e4  # log-prob of a token the sampler's truncation cut (probability 0)


def token_advantages(advantages: Tensor, teacher_kl: Tensor | None, distill_weight: float) -> Tensor:
    """Each token's advantage under on-policy distillation: A_t = A - distill_weight * k_t, with
    k_t = log pi_behaviour - log pi_teacher of the sampled token (the per-token reverse KL to the
    teacher, as slime and prime-rl take it, on the student's sampling log-probs), 0 where no teacher
    scored it: (B,), (B, T) -> (B, T). Without a teacher (None) or at weight 0, `advantages` (B,)
    as they are: every loss expands them over the tokens itself (losses/clipped.py: prepare)."""
    if teacher_kl is None or distill_weight == 0:
        return advantages
    assert teacher_kl.shape[:1] == advantages.shape, \
        f"teacher_kl {tuple(teacher_kl.shape)} vs advantages {tuple(advantages.shape)}"
    return advantages.float().unsqueeze(1) - distill_weight * teacher_kl.float()  # (B, T)


def token_logprobs(logits: Tensor, targets: Tensor, temperature: float, *, top_k: int = 0,
                   top_p: float = 1.0) -> Tensor:
    """log_softmax(logits / temperature) at each target id: (B, T, V), (B, T) -> (B, T).

    With `top_k` > 0 or `top_p` < 1 the distribution is the sampler's truncated one, renormalised:
    temperature, then top-k (the k largest, ties kept), then top-p (the smallest set of largest
    tokens whose probability reaches top_p), as Hugging Face's and vLLM's samplers apply them. A
    target outside the kept set gets TRUNCATED_LOGP (finite, so masks never make NaN from it).
    """
    assert logits.shape[:2] == targets.shape, f"logits {tuple(logits.shape)} vs targets {tuple(targets.shape)}"
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    scaled = logits.float() / temperature  # (B, T, V)
    if top_k > 0 or top_p < 1.0:
        scaled = truncate(scaled, top_k=top_k, top_p=top_p)
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, T), -inf where cut
    return (picked - torch.logsumexp(scaled, dim=-1)).clamp(min=TRUNCATED_LOGP)  # (B, T)


def truncate(scaled: Tensor, *, top_k: int, top_p: float) -> Tensor:
    """`scaled` logits (..., V) with the tokens top-k and then top-p cut set to -inf."""
    if 0 < top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[..., -1:]  # (..., 1)
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        ascending, order = torch.sort(scaled, dim=-1)  # (..., V)
        cut = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - top_p
        cut[..., -1] = False  # the most likely token always stays
        scaled = scaled.masked_fill(torch.zeros_like(cut).scatter(-1, order, cut), float("-inf"))
    return scaled


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float) -> Tensor:
    """Entropy of softmax(logits / temperature) at each position: (B, T, V) -> (B, T), in nats."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)  # (B, T, V)
    return -(logp.exp() * logp).sum(-1)  # (B, T)


def mismatch_stats(prox: Tensor, behaviour: Tensor, mask: Tensor, weight_zero: Tensor, staleness: Tensor, *,
                   stale: Iterable[int], total_tokens: int) -> Mismatch:
    """Behaviour/proximal mismatch of one micro-batch: |log pi_prox - log pi_behav| summed per
    token as a share of `total_tokens`, its max, the share of tokens a mask dropped
    (`weight_zero`), and per staleness the sum and count of |log ratio| (added over micro-batches
    and ranks, divided at the end). `staleness` is per token, (B, T): a completion that went on
    under newer weights has tokens of several; each counts under its own. `stale`: the staleness
    values of the trained tokens, known on the host (trainer/step.py `mismatch`), so that nothing
    is read back from the device here: every figure is a 0-dim tensor where the tensors are."""
    mask = mask.float()
    gap = (prox.float() - behaviour.float()).abs() * mask  # (B, T)
    by_staleness = {}
    for s in sorted(set(stale)):
        tokens = (staleness == s).float() * mask  # (B, T), no boolean indexing: shapes stay fixed
        by_staleness[int(s)] = ((gap * tokens).sum(), tokens.sum())
    return Mismatch(gap=gap.sum() / total_tokens, gap_max=gap.max() if gap.numel() else 0.0,
                    masked=(weight_zero.float() * mask).sum() / total_tokens, by_staleness=by_staleness)
