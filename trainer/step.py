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
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields, is_dataclass, replace
from functools import partial
from typing import Any, TypeVar

import numpy as np
import torch
from torch import Tensor

from common.config import CorrectionConfig, LossConfig, RolloutConfig, TrainerConfig
from common.messages import SampleGroup
from trainer.batch import PACK, SHARE_PROMPTS, MicroBatch, mini_batches, with_mask
from trainer.devices import model_device, to_device
from trainer.grpo import Estimator, mismatch_stats, token_advantages
from trainer.logprobs import PACKED_ATTENTION, packed_attention, sequence_logprobs
from trainer.losses import (
    Loss,
    LossInputs,
    LossStats,
    correction_of,
    loss_function,
    takes_proximal,
    zero_advantage_adds_nothing,
)
from trainer.losses.corrections import behaviour_weight
from trainer.losses.sft import sft_loss
from trainer.moe import RouterAux, caught_router_logits, load_balancing_loss, replayed_routing, router_aux_of
from trainer.parallel import all_max, all_sum, any_rank, gather, world_size
from trainer.stats import Mismatch, StepStats
from trainer.varlen import VARLEN
from trainer.vision import pixel_values_of

# The config's defaults, where a caller leaves these out (written once: common/config.py).
CHUNK_TOKENS: int = TrainerConfig.model_fields["logits_chunk_tokens"].default
SKIP_ZERO_ADVANTAGE: bool = TrainerConfig.model_fields["skip_zero_advantage"].default
ROLLOUT = RolloutConfig.model_fields
T = TypeVar("T")


@dataclass(frozen=True)
class StepBatches:
    """This rank's micro-batches of one (mini-)batch, padded to every rank's count, and its counts
    summed over the ranks."""

    batches: list[MicroBatch]
    tokens: int  # trained (loss-masked) completion tokens
    seqs: int  # sequences with a trained token
    tokens_in: int  # prompt + completion tokens through the model in one pass over the batches
    # trained tokens in `batches`, fewer than `tokens` where rows of advantage 0 were left out: the
    # statistics of the pass (entropy, ratios, mismatch) are shares of these
    computed: int
    rows: int = 0  # completions (trained or not): Dr. GRPO's constant normaliser counts them
    # no-gradient passes measuring the groups left out (batch.Part.probes), padded like `batches`
    probes: list[MicroBatch] = field(default_factory=list)


def step_batches(groups: list[SampleGroup], *, micro_batch_size: int, micro_batch_tokens: int,
                 estimator: Estimator = "grpo", overlong: str = "none", overlong_penalty: float = 0.0,
                 objective: str = "grpo", parts: int = 1, device: torch.device | None = None,
                 share_prompts: bool = SHARE_PROMPTS, pack: bool = PACK, hidden_size: int = 0,
                 skip_zero: bool = False, model: torch.nn.Module | None = None) -> list[StepBatches]:
    """`groups` as `parts` mini-batches of micro-batches (trainer/batch.py), each padded with empty
    micro-batches to the most any rank has, their tensors on `device` (None: where collate made
    them, the CPU); with `pack`, packed end to end, each rank filling as many micro-batches as the
    rank that needs the most, balanced by tokens; with `share_prompts` as well, each prompt through
    the model once; with `skip_zero`, without the rows of advantage 0 (`mini_batches`). With
    a vision-language `model`, each packed micro-batch with images carries their pixel
    inputs (`MicroBatch.pixels`, on `device`), made once for all the passes of the step; `tokens_in`
    counts the positions its body runs: the packed ones only where its attention takes a packed
    mask (`packed_attention`), else the right-padded rows' tokens. `hidden_size` (0: `model`'s text
    decoder's) prices attention's pairs for the packing: where shared prompts are cut, and, where
    `model`'s attention takes a dense packed mask, how many packed rows a micro-batch takes."""
    # sequence_logprobs' choice: packed rows where the attention takes a packed mask (no model: as packed)
    impl = packed_attention(model) if model is not None else None
    packed_body = model is None or impl is not None
    hidden_size = hidden_size or (text_hidden_size(model) if model is not None else 0)
    # an attention computing every pair of a packed row (SDPA's and eager's dense mask): the
    # documents go in a few rows where that is cheaper (trainer/batch.py `packed_rows`)
    dense_rows = PACKED_ATTENTION.get(impl or "") in ("bool", "float")
    out = []
    for part in mini_batches(groups, parts=parts, micro_batch_size=micro_batch_size,
                             micro_batch_tokens=micro_batch_tokens, estimator=estimator, overlong=overlong,
                             overlong_penalty=overlong_penalty, objective=objective, share_prompts=share_prompts,
                             pack=pack, hidden_size=hidden_size, skip_zero=skip_zero, agree=all_max,
                             dense_rows=dense_rows):
        if model is not None:  # before the padding below, which copies the last micro-batch (its pixels too)
            part = part._replace(batches=[with_pixels(mb, model, device) for mb in part.batches],
                                 probes=[with_pixels(mb, model, device) for mb in part.probes])
        if impl == VARLEN:  # the varlen layout made here on the host, not on the device in each pass
            part = part._replace(batches=[with_varlen(mb) for mb in part.batches],
                                 probes=[with_varlen(mb) for mb in part.probes])
        batches = part.batches
        tokens_in = sum(int((mb.packed.segments >= 0).sum()) if mb.packed is not None and packed_body
                        else int(mb.attention_mask.sum()) for mb in batches)  # the positions the body runs
        computed = sum(int(mb.mask.sum()) for mb in batches)
        tokens, seqs, tokens_in, rows, computed = (int(x) for x in all_sum(
            [part.tokens, part.seqs, tokens_in, part.rows, computed]))
        empty = with_mask(batches[-1], torch.zeros_like(batches[-1].mask))
        batches += [empty] * (all_max(len(batches)) - len(batches))
        probes = list(part.probes)
        probes += [with_mask(probes[-1], torch.zeros_like(probes[-1].mask)) if probes else empty] * (
            all_max(len(probes)) - len(probes))
        if device is not None:
            batches, probes = [to_device(mb, device) for mb in batches], [to_device(mb, device) for mb in probes]
        out.append(StepBatches(batches=batches, tokens=tokens, seqs=seqs, tokens_in=tokens_in, rows=rows,
                               computed=computed, probes=probes))
    return out


def with_varlen(mb: MicroBatch) -> MicroBatch:
    """`mb` with its packed rows' varlen layout (trainer/varlen.py), or as it is where not packed."""
    return mb if mb.packed is None else replace(mb, packed=mb.packed.with_varlen())


def text_hidden_size(model: torch.nn.Module) -> int:
    """The hidden size of `model`'s text decoder (a vision-language model's config keeps it in its
    text config), the packing's cost model's; 0 where the config names none."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(getattr(text, "hidden_size", 0) or 0)


def with_pixels(mb: MicroBatch, model: torch.nn.Module, device: torch.device | None) -> MicroBatch:
    """`mb` with the pixel inputs of its packed layout's images (trainer/vision.py `pixel_values_of`)
    on `device`; `mb` itself where it has none (or is not packed: the pass refuses its images)."""
    if mb.packed is None or not mb.packed.images:
        return mb
    return replace(mb, pixels=pixel_values_of(model, mb.packed.images, device=device or torch.device("cpu")))


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


ZERO_LOSS_STATS = LossStats(**{f.name: 0.0 for f in fields(LossStats)})


@dataclass(frozen=True, slots=True)
class Pending:
    """Some of one micro-batch's figures as its passes left them (0-dim tensors on the model's
    device, or floats), for `Sums` to add in once they are read back with the step's others."""

    share: float = 0.0  # its mini-batch's share of the step's trained tokens: weights stats, mismatch, router_aux
    stats: LossStats | None = None  # the loss's
    mismatch: Mismatch | None = None  # the behaviour/proximal mismatch's
    entropy: Tensor | float | None = None  # summed over its trained tokens; divided by `total_tokens`
    total_tokens: int = 1
    teacher_kl: Tensor | float | None = None  # summed over the trained tokens a teacher scored, and their count
    teacher_tokens: Tensor | float | None = None
    router_aux: Tensor | float | None = None  # the router's load-balancing loss, its share of the mini-batch's
    group_gap: Tensor | None = None  # (B,) |log pi_measured - log pi_behav| summed over each row's trained tokens
    group_tokens: Tensor | None = None  # (B,) ... and their count, added to `Sums.by_group` by `group_of` (-1: none)
    group_of: np.ndarray | None = None


@dataclass
class Sums:
    """One step's statistics as they add up over micro-batches and updates: this rank's shares of
    the step's trained tokens (summed over the ranks at the end, `summed`). A micro-batch's figures
    wait in `pending` as its passes left them and are added in, in the order they came, once read
    back to the host all at once (`settle`, at the step's end): on a GPU a read waits for every
    kernel queued before it, so reading them once a micro-batch would leave the GPU idle while the
    host reads and then queues the next pass."""

    loss_stats: LossStats = ZERO_LOSS_STATS  # the loss's, weighted by each mini-batch's share
    mismatch: Mismatch = field(default_factory=Mismatch)  # ... the behaviour/proximal mismatch's
    entropy: float = 0.0
    loss: float = 0.0  # this rank's part of the applied updates' losses
    grad_norm: float = 0.0  # the applied updates' norms, each divided by the world size
    skipped: float = 0.0  # updates skipped, each 1 / world size
    teacher_kl: float = 0.0  # k = log pi_behav - log pi_teacher summed over the trained tokens a teacher scored
    teacher_tokens: float = 0.0  # ... and their count (plain sums, divided at the end)
    router_aux: float = 0.0  # the router's load-balancing loss (trainer/moe.py), shares of the trained tokens
    # (groups, 2): |log pi_prox - log pi_behav| summed over each of this rank's groups' trained
    # tokens, and their count (rank-local: never summed over ranks)
    by_group: np.ndarray = field(default_factory=lambda: np.zeros((0, 2)))
    pending: list[Pending] = field(default_factory=list)  # figures not read back yet, in the order they came

    def add(self, stats: LossStats, mismatch: Mismatch, *, share: float) -> None:
        """A micro-batch's loss and mismatch stats, shares of its mini-batch's tokens, weighted by
        the mini-batch's `share` of the step's (added in by `settle`)."""
        detached = partial(_mapped, fn=Tensor.detach)  # a custom loss's stats may carry its graph: not kept
        self.pending.append(Pending(share=share, stats=detached(stats), mismatch=detached(mismatch)))

    def settle(self) -> None:
        """Read every pending figure back to the host in one transfer (`read_back`) and add them in,
        in the order they came."""
        for p in read_back(self.pending):
            if p.stats is not None:
                self.loss_stats = LossStats(**{f.name: getattr(self.loss_stats, f.name)
                                               + getattr(p.stats, f.name) * p.share for f in fields(LossStats)})
            if p.mismatch is not None:
                self.mismatch = self.mismatch.plus(p.mismatch, share=p.share)
            if p.entropy is not None:
                self.entropy += p.entropy / p.total_tokens
            if p.teacher_kl is not None and p.teacher_tokens is not None:
                self.teacher_kl += p.teacher_kl
                self.teacher_tokens += p.teacher_tokens
            if p.router_aux is not None:
                self.router_aux += p.router_aux * p.share
            if p.group_of is not None and p.group_gap is not None and p.group_tokens is not None:
                rows = p.group_of >= 0  # rows of no group (-1: padding) add nothing
                np.add.at(self.by_group, (p.group_of[rows], 0), p.group_gap[rows])
                np.add.at(self.by_group, (p.group_of[rows], 1), p.group_tokens[rows])
        self.pending = []

    def summed(self, *, oldest: int) -> Sums:
        """Every rank's sums together (the same on every rank); `oldest`: the largest staleness of
        any rank's groups, so that every rank sums the same values."""
        self.settle()
        stale = [self.mismatch.by_staleness.get(s, (0.0, 0.0)) for s in range(oldest + 1)]
        mine = [getattr(self.loss_stats, f.name) for f in fields(LossStats)] + [
            self.mismatch.gap, self.mismatch.masked, *(x for pair in stale for x in pair),
            self.entropy, self.loss, self.grad_norm, self.skipped, self.teacher_kl, self.teacher_tokens,
            self.router_aux]
        total = all_sum(mine)
        n = len(fields(LossStats))
        gap, masked, rest = total[n], total[n + 1], total[n + 2:]
        by_staleness = {s: (rest[2 * s], rest[2 * s + 1]) for s in range(oldest + 1)}
        entropy, loss, grad_norm, skipped, teacher_kl, teacher_tokens, router_aux = rest[2 * (oldest + 1):]
        return Sums(loss_stats=LossStats(*total[:n]), entropy=entropy, loss=loss, grad_norm=grad_norm,
                    skipped=skipped, by_group=self.by_group, teacher_kl=teacher_kl, teacher_tokens=teacher_tokens,
                    router_aux=router_aux,
                    mismatch=Mismatch(gap=gap, gap_max=max(gather(self.mismatch.gap_max)), masked=masked,
                                      by_staleness=by_staleness))


@dataclass(frozen=True, slots=True)
class GrpoOptions:
    """How a GRPO-family step updates: the loss and the batching ([trainer]), and the sampler's
    distribution ([rollout]), whose log-probs the step computes."""

    loss: LossConfig  # the policy loss (trainer/losses/) and its off-policy correction
    estimator: Estimator  # the group-relative advantage (trainer.advantage)
    overlong: str  # what a completion cut at max_new_tokens gets: "none", "mask" or "penalty"
    overlong_penalty: float  # ... the reward it loses with "penalty"
    micro_batch_size: int  # completions per forward/backward pass
    micro_batch_tokens: int  # ... or at most this many tokens per pass (0: no cap)
    updates: int  # PPO mini-batches of the step, one optimizer step each
    max_grad_norm: float  # gradients clipped to this global norm
    temperature: float = ROLLOUT["temperature"].default  # the sampler's temperature
    top_k: int = ROLLOUT["top_k"].default  # ... its top-k truncation (0: none)
    top_p: float = ROLLOUT["top_p"].default  # ... its top-p truncation (1: none)
    max_new_tokens: int = ROLLOUT["max_new_tokens"].default  # the sampler's; Dr. GRPO's normaliser: completions x it
    chunk_tokens: int = CHUNK_TOKENS  # logits computed this many positions at a time (trainer/logprobs.py)
    share_prompts: bool = SHARE_PROMPTS  # each prompt through the model once per micro-batch, however many completions
    pack: bool = PACK  # micro-batches packed end to end, no padding (trainer.pack_sequences)
    skip_zero_advantage: bool = SKIP_ZERO_ADVANTAGE  # rows of advantage 0 left out of the passes where they add nothing
    # On-policy distillation ([teacher] distill_weight; 0: none): each token's advantage less this
    # times its reverse KL to the teacher (grpo.token_advantages)
    distill_weight: float = 0.0

    @classmethod
    def of(cls, cfg: TrainerConfig, rollout: RolloutConfig, *, distill_weight: float = 0.0) -> GrpoOptions:
        """The options a run's config gives (`distill_weight`: its [teacher]'s, 0 without one)."""
        return cls(loss=cfg.loss, estimator=cfg.advantage, overlong=cfg.overlong, overlong_penalty=cfg.overlong_penalty,
                   micro_batch_size=cfg.micro_batch_size, micro_batch_tokens=cfg.micro_batch_tokens,
                   updates=cfg.updates_per_batch, skip_zero_advantage=cfg.skip_zero_advantage,
                   max_grad_norm=cfg.max_grad_norm, temperature=rollout.temperature,
                   top_k=rollout.top_k, top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens,
                   chunk_tokens=cfg.logits_chunk_tokens, share_prompts=cfg.share_prompts, pack=cfg.pack_sequences,
                   distill_weight=distill_weight)


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
               how: GrpoOptions, ref_model: torch.nn.Module | None = None, step: int = 0) -> StepStats:
    """One trainer step of the GRPO family over `groups`: `how.updates` PPO mini-batches, one
    optimizer step each, gradients accumulated over each one's micro-batches.

    `how.loss` chooses the loss (trainer/losses/); a correction that takes a proximal pass
    (losses.takes_proximal: behaviour_clip takes none) takes the PPO ratio against the proximal
    policy: a no-grad pass, dropout off, with the weights at the start of the step; a KL term's
    reference is `ref_model`. Log-probs are those of the sampler's distribution (temperature,
    top_k, top_p). An update whose loss or gradient norm is not finite is skipped (counted in
    `skipped`). `step` (trainer steps done) gives each group's staleness for
    the mismatch metrics. Stats are shares of the step's trained tokens; the loss and grad norm are
    means over the applied updates. With `how.share_prompts` each micro-batch runs each of its
    prompts through the model once, however many of its completions share it (the same log-probs,
    fewer positions).
    """
    minis = step_batches(groups, micro_batch_size=how.micro_batch_size, micro_batch_tokens=how.micro_batch_tokens,
                         estimator=how.estimator, overlong=how.overlong, overlong_penalty=how.overlong_penalty,
                         parts=how.updates, device=model_device(model), share_prompts=how.share_prompts, pack=how.pack,
                         skip_zero=how.skip_zero_advantage and zero_advantage_adds_nothing(how.loss)
                         and how.distill_weight == 0,  # a token's KL to the teacher teaches at advantage 0
                         model=model)
    total_tokens, world = sum(m.tokens for m in minis), world_size()
    if total_tokens == 0:  # every completion masked (overlong = "mask"): nothing to learn from
        return StepStats(policy=LossStats())

    forward = partial(sequence_logprobs, temperature=how.temperature, top_k=how.top_k, top_p=how.top_p,
                      chunk_tokens=how.chunk_tokens)
    loss_fn, correction = loss_function(how.loss), correction_of(how.loss)
    # The first update's proximal policy is the policy it trains (the weights at the step's start):
    # where the model's training forward computes what its no-grad one does (no dropout), its
    # log-probs are that forward's own, detached, and the proximal pass over that mini-batch (a
    # forward over the whole batch at one update) is not run, as verl's actor takes them on policy.
    first = next((i for i, m in enumerate(minis) if m.tokens), None)
    own = first if takes_proximal(how.loss) and trains_as_it_infers(model) else None
    model.eval()  # the no-grad passes run with dropout off
    with torch.no_grad():
        prox = [[log_probs(forward, model, mb)[0] for mb in m.batches] if takes_proximal(how.loss) and i != own
                else [None] * len(m.batches) for i, m in enumerate(minis)]
        ref = [[log_probs(forward, ref_model, mb)[0] if ref_model is not None else None for mb in m.batches]
               for m in minis]
        sums, applied = Sums(by_group=np.zeros((len(groups), 2))), 0
        for mb in (mb for m in minis for mb in m.probes):  # the groups left out: their mismatch only
            add_by_group(sums, log_probs(forward, model, mb)[0], mb)
    model.train()
    oldest = all_max(max([0] + [step - g.version for g in groups]))
    aux = router_aux_of(model)
    for i, (mini, mini_prox, mini_ref) in enumerate(zip(minis, prox, ref, strict=True)):
        if mini.tokens == 0:
            continue
        optimizer.zero_grad(set_to_none=True)
        mini_loss = backward_mini(model, mini, mini_prox, mini_ref, sums, loss_fn=loss_fn, correction=correction,
                                  forward=forward, step=step, total_tokens=sum(m.computed for m in minis),
                                  max_new_tokens=how.max_new_tokens, distill_weight=how.distill_weight,
                                  aux=aux, own_prox=i == own)
        grad_norm = clip_and_step(model, optimizer, max_grad_norm=how.max_grad_norm,
                                  loss_finite=math.isfinite(mini_loss))
        if math.isfinite(grad_norm):  # the same on every rank
            sums.grad_norm += grad_norm / world  # summed over ranks below
            sums.loss += mini_loss  # this rank's part; summed over ranks below
            applied += 1
        else:
            sums.skipped += 1.0 / world
    out = sums.summed(oldest=oldest)
    return StepStats(loss=out.loss / max(applied, 1), grad_norm=out.grad_norm / max(applied, 1), entropy=out.entropy,
                     skipped=round(out.skipped), tokens_trained=total_tokens,
                     tokens_forward=sum(m.tokens_in for m in minis), policy=out.loss_stats,
                     mismatch_mean=out.mismatch.gap, mismatch_max=out.mismatch.gap_max, masked=out.mismatch.masked,
                     mismatch_by_staleness={s: gap / tokens for s, (gap, tokens) in out.mismatch.by_staleness.items()
                                            if tokens > 0},
                     teacher_kl=out.teacher_kl / out.teacher_tokens if out.teacher_tokens > 0 else 0.0,
                     router_aux_loss=None if aux is None else out.router_aux,
                     group_mismatch=tuple(float(gap / tokens) if tokens > 0 else math.nan
                                          for gap, tokens in out.by_group))


def log_probs(forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], model: torch.nn.Module,
              mb: MicroBatch, entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`model`'s log-probs of `mb`'s targets, and their entropy if asked: (B, T), 0 off the mask; where
    its completions carry their experts (routing replay), with those experts at their positions."""
    with routed(model, mb):
        return forward(model, mb.input_ids, mb.attention_mask, mb.targets, entropy=entropy, positions=mb.trained_at,
                       packed=mb.packed, images=mb.images, pixels=mb.pixels)


def backward_mini(model: torch.nn.Module, mini: StepBatches, prox: list[torch.Tensor | None],
                  ref: list[torch.Tensor | None], sums: Sums, *, loss_fn: Loss, correction: CorrectionConfig,
                  forward: Callable[..., tuple[torch.Tensor, torch.Tensor | None]], step: int, total_tokens: int,
                  max_new_tokens: int, distill_weight: float = 0.0, aux: RouterAux | None = None,
                  own_prox: bool = False) -> float:
    """The loss of one mini-batch, backward micro-batch by micro-batch (the gradients accumulate),
    its stats added to `sums` as shares of `total_tokens`, the step's trained tokens through the
    model (`StepBatches.computed`). With a teacher's log-probs the advantages are per token, less
    `distill_weight` times each token's KL to the teacher (grpo.token_advantages). With `aux` (an
    MoE config asking for it: trainer/moe.py) each micro-batch's loss adds coef x the router's
    load-balancing loss, weighted by its share of the trained tokens. With `own_prox` (the step's
    first update, whose weights are the proximal policy) each micro-batch's proximal log-probs are
    its own forward's, detached. Returns its loss (this rank's part)."""
    # the loss's stats are shares of the mini-batch's trained tokens (its normaliser), all of which
    # went through the model unless rows of advantage 0 were left out (`computed` < `tokens`)
    share, mini_loss, world = mini.tokens / total_tokens, 0.0, world_size()
    losses: list[Tensor] = []  # each micro-batch's loss, read back after the last one's backward
    for mb, prox_logp, ref_logp in zip(mini.batches, prox, ref, strict=True):
        with routed(model, mb):  # held through the backward: a checkpointed block recomputes with the same experts
            with caught_router_logits(model, aux) as routers:
                logp, entropy = log_probs(forward, model, mb, entropy=True)
            prox_logp = logp.detach() if own_prox else prox_logp
            advantages = token_advantages(mb.advantages, mb.teacher_kl, distill_weight)
            out = loss_fn(LossInputs(logp=logp, behaviour_logp=mb.behaviour_logp, advantages=advantages,
                                     mask=mb.mask, total_tokens=mini.tokens, total_seqs=mini.seqs,
                                     norm_tokens=mini.rows * max_new_tokens, prox_logp=prox_logp, ref_logp=ref_logp))
            loss = out.loss
            if aux is not None:
                balance = load_balancing_loss(routers, aux.top_k, router_aux_rows(model, mb)) * (
                    len(mb.trained_at) / mini.tokens)  # this micro-batch's share of the mini-batch's mean
                loss = loss + aux.coef * balance
                sums.pending.append(Pending(share=share, router_aux=balance.detach()))
            (loss * world).backward()
        losses.append(out.loss.detach())
        measured = logp.detach() if prox_logp is None else prox_logp
        sums.add(out.stats, mismatch(measured, mb, correction, step=step, total_tokens=mini.tokens), share=share)
        add_by_group(sums, measured, mb)
        sums.pending.append(Pending(entropy=(entropy * mb.mask).sum(), total_tokens=total_tokens))
        if mb.teacher_kl is not None and mb.teacher_at is not None:
            taught = mb.teacher_at * mb.mask  # trained tokens a teacher scored (an empty pad: none)
            sums.pending.append(Pending(teacher_kl=(mb.teacher_kl * taught).sum(), teacher_tokens=taught.sum()))
    for value in read_back(losses):  # one read a mini-batch: its update needs to know the loss is finite
        mini_loss += value
    return mini_loss


def trains_as_it_infers(model: torch.nn.Module) -> bool:
    """Whether `model`'s forward in training mode computes what its forward in eval mode does: no
    dropout module (peft's LoRA dropout among them) with p > 0, and no dropout or router jitter
    above 0 in any of its configs (transformers applies attention dropout and an MoE router's
    jitter by `self.training`, without a module)."""
    if any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0 for m in model.modules()):
        return False
    configs = {id(c): c for m in model.modules() if hasattr(c := getattr(m, "config", None), "to_dict")}
    return not any(_stochastic(c.to_dict()) for c in configs.values())


def _stochastic(settings: dict) -> bool:
    """Whether a config's settings (sub-configs as nested dicts) set a dropout or jitter above 0."""
    for key, value in settings.items():
        if isinstance(value, dict):
            if _stochastic(value):
                return True
        elif (isinstance(key, str) and ("dropout" in key or "jitter" in key) and isinstance(value, int | float)
              and not isinstance(value, bool) and value > 0):
            return True
    return False


@contextmanager
def routed(model: torch.nn.Module, mb: MicroBatch) -> Iterator[None]:
    """Within it, `model` routes `mb`'s completion positions to the experts they carry (routing
    replay: trainer/moe.py `replayed_routing`); nothing where they carry none. Re-entrant: held
    around a forward and its backward, the forward's own (in `log_probs`) adds nothing."""
    rows = None if mb.experts_at is None else router_aux_rows(model, mb, mb.experts_at)
    with replayed_routing(model, rows, mb.experts):
        yield


def router_aux_rows(model: torch.nn.Module, mb: MicroBatch, at: torch.Tensor | None = None) -> torch.Tensor:
    """The flat positions of the model body's input (the packed rows where `sequence_logprobs` ran
    the body on them, else the right-padded rows) whose hidden states predict `mb`'s trained
    tokens (or those at `at`, flat positions of the right-padded rows): where the router's
    load-balancing loss is taken and replayed experts are forced (trainer/moe.py)."""
    at = mb.trained_at if at is None else at
    if mb.packed is not None and packed_attention(model) is not None:
        return mb.packed.at[at]
    return at


def add_by_group(sums: Sums, measured: torch.Tensor, mb: MicroBatch) -> None:
    """Add micro-batch `mb`'s |log pi_measured - log pi_behav| over each row's trained tokens, and
    their count, to its group's row of `sums.by_group` (once read back: `Sums.settle`)."""
    if mb.group_of is None or not len(sums.by_group):
        return
    gap = ((measured.float() - mb.behaviour_logp.float()).abs() * mb.mask).sum(1)  # (B,)
    sums.pending.append(Pending(group_gap=gap, group_tokens=mb.mask.sum(1), group_of=mb.group_of))


def read_back(tree: T) -> T:
    """`tree` (dataclasses, lists, tuples and dicts holding tensors) with each tensor read back to
    the host, all of them in one transfer: a 0-dim tensor becomes a float, any other a float64
    numpy array, each value exactly the tensor's. Everything else is left as it is."""
    found: list[Tensor] = []
    _mapped(tree, lambda t: found.append(t) or t)
    if not found:
        return tree
    flat = torch.cat([t.detach().reshape(-1).to(device=found[0].device, dtype=torch.float64) for t in found])
    values = iter(flat.tolist())

    def host(t: Tensor) -> float | np.ndarray:
        if t.dim() == 0:
            return next(values)
        return np.array([next(values) for _ in range(t.numel())], dtype=np.float64).reshape(tuple(t.shape))

    return _mapped(tree, host)


def _mapped(x: Any, fn: Callable[[Tensor], Any]) -> Any:
    """`x` with `fn` applied to each tensor in it (dataclass fields, list, tuple and dict items), in
    one fixed order."""
    if isinstance(x, torch.Tensor):
        return fn(x)
    if is_dataclass(x) and not isinstance(x, type):
        return replace(x, **{f.name: _mapped(getattr(x, f.name), fn) for f in fields(x) if f.init})
    if isinstance(x, dict):
        return {k: _mapped(v, fn) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return type(x)(_mapped(v, fn) for v in x)
    return x


def mismatch(measured: torch.Tensor, mb: MicroBatch, correction: CorrectionConfig, *, step: int,
             total_tokens: int) -> Mismatch:
    """The behaviour/proximal mismatch of micro-batch `mb` (grpo.mismatch_stats), `measured` the
    policy before this update (the proximal pass, else the trained policy's own log-probs), with
    the tokens `correction` drops and each token's staleness at trainer step `step`."""
    weight = behaviour_weight(measured, mb.behaviour_logp, mb.mask, correction)
    return mismatch_stats(measured, mb.behaviour_logp, mb.mask, weight == 0, (step - mb.versions).clamp(min=0),
                          stale={max(step - v, 0) for v in mb.trained_versions}, total_tokens=total_tokens)


def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
             micro_batch_size: int, micro_batch_tokens: int, max_grad_norm: float,
             step: int = 0, chunk_tokens: int = CHUNK_TOKENS, pack: bool = PACK) -> StepStats:
    """One optimizer step of supervised cross-entropy over `groups`' loss-masked completion
    tokens, normalised by the global masked-token count as `train_step`'s token_mean (so any
    world size gives the same update). `step` is unused (sft data is never stale); a non-finite
    loss or gradient norm skips the step (counted in `skipped`). With `pack` the sequences go
    packed end to end (trainer.pack_sequences)."""
    batched = step_batches(groups, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                           objective="sft", device=model_device(model), pack=pack, model=model)[0]
    total_tokens, world = batched.tokens, world_size()
    if total_tokens == 0:
        return StepStats(tokens_forward=batched.tokens_in)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    loss, entropy_sum, parts = 0.0, 0.0, []
    for mb in batched.batches:
        logp, entropy = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                          entropy=True, chunk_tokens=chunk_tokens,
                                          positions=mb.trained_at, packed=mb.packed,
                                          pixels=mb.pixels)  # (B, T): 0 off the mask
        mb_loss = sft_loss(logp, mb.mask, total_tokens=total_tokens)
        (mb_loss * world).backward()
        parts.append((mb_loss.detach(), (entropy * mb.mask).sum()))
    for mb_loss, mb_entropy in read_back(parts):  # one read back, after the last backward
        loss += mb_loss
        entropy_sum += mb_entropy / total_tokens
    grad_norm = clip_and_step(model, optimizer, max_grad_norm=max_grad_norm, loss_finite=math.isfinite(loss))
    applied = math.isfinite(grad_norm)
    entropy_sum, grad_norm, loss, skipped = all_sum([entropy_sum, grad_norm / world if applied else 0.0, loss,
                                                     0.0 if applied else 1.0 / world])
    return StepStats(loss=loss, grad_norm=grad_norm, entropy=entropy_sum, skipped=round(skipped),
                     tokens_trained=total_tokens, tokens_forward=batched.tokens_in)
