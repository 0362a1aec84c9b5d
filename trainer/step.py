"""The update of one trainer step, for each objective: `train_step` (the GRPO family) and `sft_step`.

Both share the same frame. Under torchrun each rank passes its own groups: token and sequence
counts are summed over the ranks, so the loss is normalised by the global count and any world
size gives the same update (FSDP averages gradients over ranks: the loss is scaled by the world
size to undo it). Ranks run the same number of micro-batches (FSDP's collectives pair up); a rank
short of them repeats its last one with an empty mask, which adds nothing. Stats are each rank's
share of global counts, summed over the ranks at the end.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from common.messages import SampleGroup
from trainer.batch import MicroBatch, micro_batches
from trainer.devices import model_device, to_device
from trainer.grpo import Estimator, LossOptions, grpo_loss, sft_loss
from trainer.logprobs import sequence_logprobs
from trainer.parallel import all_max, all_sum, world_size


@dataclass(frozen=True)
class StepBatches:
    """This rank's micro-batches of one step, padded to every rank's count, and the step's counts
    summed over the ranks."""

    batches: list[MicroBatch]
    tokens: int  # trained (loss-masked) completion tokens
    seqs: int  # sequences with a trained token
    tokens_in: int  # prompt + completion tokens through the model in one pass over the batches


def step_batches(groups: list[SampleGroup], *, micro_batch_size: int, micro_batch_tokens: int,
                 estimator: Estimator = "grpo", overlong: str = "none", overlong_penalty: float = 0.0,
                 objective: str = "grpo", device: torch.device | None = None) -> StepBatches:
    """`groups` as micro-batches (trainer/batch.py), padded with empty ones to the most any rank has,
    their tensors on `device` (None: where collate made them, the CPU)."""
    batches, tokens, seqs = micro_batches(groups, micro_batch_size=micro_batch_size,
                                          micro_batch_tokens=micro_batch_tokens, estimator=estimator,
                                          overlong=overlong, overlong_penalty=overlong_penalty, objective=objective)
    tokens_in = sum(int(mb.attention_mask.sum()) for mb in batches)
    tokens, seqs, tokens_in = (int(x) for x in all_sum([tokens, seqs, tokens_in]))
    empty = replace(batches[-1], mask=torch.zeros_like(batches[-1].mask))
    batches += [empty] * (all_max(len(batches)) - len(batches))
    if device is not None:
        batches = [to_device(mb, device) for mb in batches]
    return StepBatches(batches=batches, tokens=tokens, seqs=seqs, tokens_in=tokens_in)


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float) -> float:
    """Clip the accumulated gradients to `max_grad_norm` and take the optimizer step; return the
    gradient norm before clipping (of the whole model: under FSDP every rank gets the same)."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    return float(grad_norm)


def sum_over_ranks(stats: dict[str, float]) -> dict[str, float]:
    """`stats` summed over the ranks (each rank's are shares of global counts), keys in sorted order."""
    names = sorted(stats)
    return dict(zip(names, all_sum([stats[k] for k in names]), strict=True))


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
               loss: LossOptions, ref_model: torch.nn.Module | None, temperature: float,
               estimator: Estimator, overlong: str, overlong_penalty: float, micro_batch_size: int,
               micro_batch_tokens: int, updates: int, recompute_old_logp: bool,
               max_grad_norm: float, chunk_tokens: int = 1024) -> dict[str, float]:
    """`updates` optimizer steps of the GRPO family over `groups`, gradients accumulated over micro-batches.

    The PPO ratio is taken against the policy at the start of the step: a no-grad pass when
    `updates` > 1 or `recompute_old_logp`, else the behaviour log-probs stand in for it. Stats
    are averaged over the updates; entropy is that of the policy that started the step.
    """
    batched = step_batches(groups, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                           estimator=estimator, overlong=overlong, overlong_penalty=overlong_penalty,
                           device=model_device(model))
    batches, total_tokens, world = batched.batches, batched.tokens, world_size()
    base = {"tokens/trained": float(total_tokens), "tokens/forward": 0.0}
    if total_tokens == 0:  # every completion masked (overlong = "mask"): nothing to learn from
        return {**base, "loss/policy": 0.0, "grad_norm": 0.0, "entropy": 0.0, "kl": 0.0,
                "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0,
                "ratio/mean": 1.0, "tis/mean": 1.0}

    def forward_logp(m: torch.nn.Module, mb: MicroBatch, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        return sequence_logprobs(m, mb.input_ids, mb.attention_mask, mb.targets, temperature=temperature,
                                 entropy=entropy, chunk_tokens=chunk_tokens)  # (B, T), (B, T) or None

    model.train()
    with torch.no_grad():
        old = [forward_logp(model, mb)[0] for mb in batches] if updates > 1 or recompute_old_logp \
            else [None] * len(batches)
        ref = [forward_logp(ref_model, mb)[0] for mb in batches] if ref_model is not None \
            else [None] * len(batches)
    stats: dict[str, float] = {"loss/policy": 0.0, "grad_norm": 0.0, "entropy": 0.0}
    for update in range(updates):
        optimizer.zero_grad(set_to_none=True)
        for mb, old_logp, ref_logp in zip(batches, old, ref, strict=True):
            logp, entropy = forward_logp(model, mb, entropy=update == 0)
            mb_loss, mb_stats = grpo_loss(
                logp, mb.behaviour_logp, mb.advantages, mb.mask, old_logp=old_logp, ref_logp=ref_logp,
                total_tokens=total_tokens, total_seqs=batched.seqs, clip_low=loss.clip_low,
                clip_high=loss.clip_high, ratio_level=loss.ratio_level, aggregation=loss.aggregation,
                tis_cap=loss.tis_cap, kl_coef=loss.kl_coef, kl_estimator=loss.kl_estimator)
            (mb_loss * world).backward()
            stats["loss/policy"] += mb_loss.item() / updates
            for k, v in mb_stats.items():  # each is a share of total_tokens: they add up
                stats[k] = stats.get(k, 0.0) + v / updates
            if update == 0:
                stats["entropy"] += (entropy * mb.mask).sum().item() / total_tokens
        grad_norm = clip_and_step(model, optimizer, max_grad_norm=max_grad_norm)
        stats["grad_norm"] += grad_norm / world / updates  # summed over ranks below
    return {**sum_over_ranks(stats), **base, "tokens/forward": float(batched.tokens_in * updates)}


def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
             micro_batch_size: int, micro_batch_tokens: int, max_grad_norm: float,
             chunk_tokens: int = 1024) -> dict[str, float]:
    """One optimizer step of supervised cross-entropy over `groups`' loss-masked completion
    tokens, normalised by the global masked-token count as `train_step`'s token_mean (so any
    world size gives the same update)."""
    batched = step_batches(groups, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                           objective="sft", device=model_device(model))
    total_tokens, world = batched.tokens, world_size()
    base = {"tokens/trained": float(total_tokens), "tokens/forward": float(batched.tokens_in)}
    if total_tokens == 0:
        return {**base, "loss/sft": 0.0, "grad_norm": 0.0, "entropy": 0.0}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    stats = {"loss/sft": 0.0, "entropy": 0.0}
    for mb in batched.batches:
        logp, entropy = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                          entropy=True, chunk_tokens=chunk_tokens)  # (B, T), (B, T)
        mb_loss = sft_loss(logp, mb.mask, total_tokens=total_tokens)
        (mb_loss * world).backward()
        stats["loss/sft"] += mb_loss.item()
        stats["entropy"] += (entropy * mb.mask).sum().item() / total_tokens
    stats["grad_norm"] = clip_and_step(model, optimizer, max_grad_norm=max_grad_norm) / world  # summed below
    return {**sum_over_ranks(stats), **base}
