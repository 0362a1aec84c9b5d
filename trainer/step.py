"""The update of one trainer step, for each objective: `train_step` (the GRPO family) and `sft_step`.

Both share the same frame. Under torchrun each rank passes its own groups: token and sequence
counts are summed over the ranks, so the loss is normalised by the global count and any world
size gives the same update (FSDP averages gradients over ranks: the loss is scaled by the world
size to undo it). Ranks run the same number of micro-batches (FSDP's collectives pair up); a rank
short of them repeats its last one with an empty mask, which adds nothing. Stats are each rank's
share of global counts, summed over the ranks at the end.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from common.config import CorrectionConfig, LossConfig
from common.messages import SampleGroup
from trainer.batch import MicroBatch, mini_batches, with_mask
from trainer.devices import model_device, to_device
from trainer.grpo import Estimator, mismatch_stats
from trainer.logprobs import sequence_logprobs
from trainer.losses import Loss, LossInputs, LossStats, correction_of, loss_function
from trainer.losses.corrections import behaviour_weight
from trainer.losses.sft import sft_loss
from trainer.parallel import all_max, all_sum, any_rank, gather, world_size


@dataclass(frozen=True)
class StepBatches:
    """This rank's micro-batches of one (mini-)batch, padded to every rank's count, and its counts
    summed over the ranks."""

    batches: list[MicroBatch]
    tokens: int  # trained (loss-masked) completion tokens
    seqs: int  # sequences with a trained token
    tokens_in: int  # prompt + completion tokens through the model in one pass over the batches
    rows: int = 0  # completions (trained or not): Dr. GRPO's constant normaliser counts them


def step_batches(groups: list[SampleGroup], *, micro_batch_size: int, micro_batch_tokens: int,
                 estimator: Estimator = "grpo", overlong: str = "none", overlong_penalty: float = 0.0,
                 objective: str = "grpo", parts: int = 1, device: torch.device | None = None,
                 share_prompts: bool = False, hidden_size: int = 0) -> list[StepBatches]:
    """`groups` as `parts` mini-batches of micro-batches (trainer/batch.py), each padded with empty
    micro-batches to the most any rank has, their tensors on `device` (None: where collate made
    them, the CPU); with `share_prompts`, packed (each prompt through the model once)."""
    out = []
    for batches, tokens, seqs in mini_batches(groups, parts=parts, micro_batch_size=micro_batch_size,
                                              micro_batch_tokens=micro_batch_tokens, estimator=estimator,
                                              overlong=overlong, overlong_penalty=overlong_penalty,
                                              objective=objective, share_prompts=share_prompts,
                                              hidden_size=hidden_size):
        tokens_in = sum(int(mb.attention_mask.sum()) if mb.packed is None else int((mb.packed.segments >= 0).sum())
                        for mb in batches)
        rows = sum(mb.input_ids.shape[0] for mb in batches)
        tokens, seqs, tokens_in, rows = (int(x) for x in all_sum([tokens, seqs, tokens_in, rows]))
        empty = with_mask(batches[-1], torch.zeros_like(batches[-1].mask))
        batches += [empty] * (all_max(len(batches)) - len(batches))
        if device is not None:
            batches = [to_device(mb, device) for mb in batches]
        out.append(StepBatches(batches=batches, tokens=tokens, seqs=seqs, tokens_in=tokens_in, rows=rows))
    return out


def clip_and_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, max_grad_norm: float,
                  loss_finite: bool = True) -> float:
    """Clip the accumulated gradients to `max_grad_norm` and take the optimizer step; return the
    gradient norm before clipping (of the whole model: under FSDP every rank gets the same).

    A non-finite gradient norm, or `loss_finite` false on any rank, skips the step: the gradients
    are dropped, the weights and the optimizer state stay as they were, and NaN is returned
    (on every rank) for the caller to count the skip."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    norm = float(grad_norm)
    if any_rank(not (loss_finite and math.isfinite(norm))):
        optimizer.zero_grad(set_to_none=True)
        return math.nan
    optimizer.step()
    return norm


def sum_over_ranks(stats: dict[str, float]) -> dict[str, float]:
    """`stats` summed over the ranks (each rank's are shares of global counts), keys in sorted order."""
    names = sorted(stats)
    return dict(zip(names, all_sum([stats[k] for k in names]), strict=True))


EMPTY_GRPO_STATS = {**LossStats().named(), "loss/policy": 0.0, "grad_norm": 0.0, "entropy": 0.0,
                    "mismatch/abs_log_ratio_mean": 0.0, "mismatch/abs_log_ratio_max": 0.0, "mismatch/masked": 0.0,
                    "steps_skipped": 0.0}


def by_staleness(stats: dict[str, float]) -> dict[str, float]:
    """`stats` with the per-staleness sums (grpo.mismatch_stats) turned into means,
    "mismatch/abs_log_ratio_mean/staleness_{s}" for each staleness with a trained token."""
    out = {k: v for k, v in stats.items() if not k.startswith("staleness/")}
    for key in stats:
        if key.startswith("staleness/") and key.endswith("/tokens") and stats[key] > 0:
            s = key.split("/")[1]
            out[f"mismatch/abs_log_ratio_mean/staleness_{s}"] = stats[f"staleness/{s}/gap_sum"] / stats[key]
    return out


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
               loss: LossConfig, ref_model: torch.nn.Module | None, temperature: float,
               estimator: Estimator, overlong: str, overlong_penalty: float, micro_batch_size: int,
               micro_batch_tokens: int, updates: int, max_grad_norm: float, top_k: int = 0, top_p: float = 1.0,
               max_new_tokens: int = 0, step: int = 0, chunk_tokens: int = 1024,
               share_prompts: bool = True) -> dict[str, float]:
    """One trainer step of the GRPO family over `groups`: `updates` PPO mini-batches, one
    optimizer step each, gradients accumulated over each one's micro-batches.

    `loss` chooses the loss (trainer/losses/); its corrections other than behaviour_clip take the
    PPO ratio against the proximal policy: a no-grad pass, dropout off, with the weights at the
    start of the step. Log-probs are those of the sampler's distribution (temperature, `top_k`,
    `top_p`). An update whose loss or gradient norm is not finite is skipped (counted in
    "steps_skipped"). `step` (trainer steps done) gives each group's staleness for the mismatch
    metrics. Stats are shares of the step's trained tokens; the loss and grad norm are means over
    the applied updates. With `share_prompts` each micro-batch runs each of its prompts through
    the model once, however many of its completions share it (the same log-probs, fewer
    positions).
    """
    minis = step_batches(groups, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                         estimator=estimator, overlong=overlong, overlong_penalty=overlong_penalty, parts=updates,
                         device=model_device(model), share_prompts=share_prompts,
                         hidden_size=int(getattr(getattr(model, "config", None), "hidden_size", 0) or 0))
    total_tokens, world = sum(m.tokens for m in minis), world_size()
    base = {"tokens/trained": float(total_tokens), "tokens/forward": 0.0}
    if total_tokens == 0:  # every completion masked (overlong = "mask"): nothing to learn from
        return {**EMPTY_GRPO_STATS, **base}

    forward = partial(sequence_logprobs, temperature=temperature, top_k=top_k, top_p=top_p,
                      chunk_tokens=chunk_tokens)
    loss_fn, correction = loss_function(loss), correction_of(loss)
    model.eval()  # the no-grad passes run with dropout off
    with torch.no_grad():
        prox = [[log_probs(forward, model, mb)[0] for mb in m.batches] if correction.type != "behaviour_clip"
                else [None] * len(m.batches) for m in minis]
        ref = [[log_probs(forward, ref_model, mb)[0] if ref_model is not None else None for mb in m.batches]
               for m in minis]
    model.train()
    oldest = all_max(max([0] + [step - g.version for g in groups]))
    stats: dict[str, float] = {"loss/policy": 0.0, "grad_norm": 0.0, "entropy": 0.0, "steps_skipped": 0.0,
                               **{f"staleness/{s}/{k}": 0.0 for s in range(oldest + 1) for k in ("gap_sum", "tokens")}}
    gap_max, applied = 0.0, 0
    for mini, mini_prox, mini_ref in zip(minis, prox, ref, strict=True):
        if mini.tokens == 0:
            continue
        optimizer.zero_grad(set_to_none=True)
        mini_loss, mini_gap_max = backward_mini(model, mini, mini_prox, mini_ref, stats, loss_fn=loss_fn,
                                                correction=correction, forward=forward, step=step,
                                                total_tokens=total_tokens, max_new_tokens=max_new_tokens)
        gap_max = max(gap_max, mini_gap_max)
        grad_norm = clip_and_step(model, optimizer, max_grad_norm=max_grad_norm,
                                  loss_finite=math.isfinite(mini_loss))
        if math.isfinite(grad_norm):  # the same on every rank
            stats["grad_norm"] += grad_norm / world  # summed over ranks below
            stats["loss/policy"] += mini_loss  # this rank's part; summed over ranks below
            applied += 1
        else:
            stats["steps_skipped"] += 1.0 / world
    out = by_staleness(sum_over_ranks(stats))
    out["loss/policy"] /= max(applied, 1)
    out["grad_norm"] /= max(applied, 1)
    out["mismatch/abs_log_ratio_max"] = max(gather(gap_max))
    return {**out, **base, "tokens/forward": float(sum(m.tokens_in for m in minis))}


def log_probs(forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], model: torch.nn.Module,
              mb: MicroBatch, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model`'s log-probs of `mb`'s targets, and their entropy if asked: (B, T), 0 off the mask."""
    return forward(model, mb.input_ids, mb.attention_mask, mb.targets, entropy=entropy, positions=mb.trained_at,
                   packed=mb.packed)


def backward_mini(model: torch.nn.Module, mini: StepBatches, prox: list[torch.Tensor | None],
                  ref: list[torch.Tensor | None], stats: dict[str, float], *, loss_fn: Loss,
                  correction: CorrectionConfig, forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]],
                  step: int, total_tokens: int, max_new_tokens: int) -> tuple[float, float]:
    """The loss of one mini-batch, backward micro-batch by micro-batch (the gradients accumulate),
    its stats added to `stats` as shares of the step's `total_tokens`. Returns its loss (this
    rank's part) and its largest behaviour/proximal gap."""
    share, mini_loss, gap_max, world = mini.tokens / total_tokens, 0.0, 0.0, world_size()
    for mb, prox_logp, ref_logp in zip(mini.batches, prox, ref, strict=True):
        logp, entropy = log_probs(forward, model, mb, entropy=True)
        out = loss_fn(LossInputs(logp=logp, behaviour_logp=mb.behaviour_logp, advantages=mb.advantages,
                                 mask=mb.mask, total_tokens=mini.tokens, total_seqs=mini.seqs,
                                 norm_tokens=mini.rows * max_new_tokens, prox_logp=prox_logp, ref_logp=ref_logp))
        (out.loss * world).backward()
        mini_loss += out.loss.item()
        mb_stats = {**out.stats.named(), **mismatch(logp.detach() if prox_logp is None else prox_logp, mb,
                                                    correction, step=step, total_tokens=mini.tokens)}
        gap_max = max(gap_max, mb_stats.pop("mismatch/abs_log_ratio_max"))
        for k, v in mb_stats.items():  # shares of the mini-batch's tokens: weighted to the step's
            stats[k] = stats.get(k, 0.0) + (v if k.startswith("staleness/") else v * share)
        stats["entropy"] += (entropy * mb.mask).sum().item() / total_tokens
    return mini_loss, gap_max


def mismatch(measured: torch.Tensor, mb: MicroBatch, correction: CorrectionConfig, *, step: int,
             total_tokens: int) -> dict[str, float]:
    """The behaviour/proximal mismatch of micro-batch `mb` (grpo.mismatch_stats), `measured` the
    policy before this update (the proximal pass, else the trained policy's own log-probs), with
    the tokens `correction` drops and each token's staleness at trainer step `step`."""
    weight = behaviour_weight(measured, mb.behaviour_logp, mb.mask, correction)
    return mismatch_stats(measured, mb.behaviour_logp, mb.mask, weight == 0, (step - mb.versions).clamp(min=0),
                          total_tokens=total_tokens)


def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
             micro_batch_size: int, micro_batch_tokens: int, max_grad_norm: float,
             step: int = 0, chunk_tokens: int = 1024) -> dict[str, float]:
    """One optimizer step of supervised cross-entropy over `groups`' loss-masked completion
    tokens, normalised by the global masked-token count as `train_step`'s token_mean (so any
    world size gives the same update). `step` is unused (sft data is never stale); a non-finite
    loss or gradient norm skips the step (counted in "steps_skipped")."""
    batched = step_batches(groups, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                           objective="sft", device=model_device(model))[0]
    total_tokens, world = batched.tokens, world_size()
    base = {"tokens/trained": float(total_tokens), "tokens/forward": float(batched.tokens_in)}
    if total_tokens == 0:
        return {**base, "loss/sft": 0.0, "grad_norm": 0.0, "entropy": 0.0}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    stats = {"loss/sft": 0.0, "entropy": 0.0}
    for mb in batched.batches:
        logp, entropy = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                          entropy=True, chunk_tokens=chunk_tokens,
                                          positions=mb.trained_at)  # (B, T), (B, T): 0 off the mask
        mb_loss = sft_loss(logp, mb.mask, total_tokens=total_tokens)
        (mb_loss * world).backward()
        stats["loss/sft"] += mb_loss.item()
        stats["entropy"] += (entropy * mb.mask).sum().item() / total_tokens
    grad_norm = clip_and_step(model, optimizer, max_grad_norm=max_grad_norm,
                              loss_finite=math.isfinite(stats["loss/sft"]))
    stats["grad_norm"] = grad_norm / world if math.isfinite(grad_norm) else 0.0  # summed below
    stats["steps_skipped"] = 0.0 if math.isfinite(grad_norm) else 1.0 / world
    return {**sum_over_ranks(stats), **base}
