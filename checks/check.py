"""The check, top to bottom: prompts drawn as the producer draws them, groups sampled and scored
as a generator makes them, every sampled token's log-prob recomputed as the trainer computes it,
and one verdict with the figures behind it.

Sources with an environment (multi-turn episodes) are left out, and said so: their turns are
sampled by the episodes stage, not checked here.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from common.config import Config
from common.messages import PromptTask, SampleGroup
from common.mismatch import BOUNDS
from common.models import resolve_model_path
from common.process import Stop
from common.shaping import zero_variance
from engines.base import Engine, Finished, SamplingSettings
from generators.groups import make_group
from generators.main import open_engine_for
from generators.scoring import RewardRunner, conversational_sources, reward_names
from generators.state import Held
from producers.data import Skipped, choose
from producers.main import sources_at
from trainer.checkpoints import load_model, place
from trainer.devices import placement
from trainer.logprobs import sequence_logprobs
from trainer.step import log_probs, step_batches

POSITION_BUCKETS = ((0, 15), (16, 63), (64, None))  # completion token positions, inclusive


@dataclass(frozen=True, slots=True)
class Sampled:
    """What the generator side made: the groups, and the seconds it took."""

    groups: list[SampleGroup]
    sample_s: float  # sampling every group, all at once
    score_s: float  # scoring them
    engine: str
    temperature: float


@dataclass(frozen=True, slots=True)
class Mismatch:
    """Trainer against behaviour over every sampled token (also those the loss would leave out)."""

    log_ratio: torch.Tensor  # (N,) float64: logp_trainer - logp_behaviour
    position: torch.Tensor  # (N,) int64: the token's place in its completion
    forward_s: float  # the trainer's forward passes over the groups

    def by_bucket(self) -> list[tuple[str, float | None, int]]:
        out = []
        for low, high in POSITION_BUCKETS:
            inside = (self.position >= low) & (self.position <= (high if high is not None else math.inf))
            n = int(inside.sum())
            out.append((f"{low}-{high}" if high is not None else f"{low}+",
                        float(self.log_ratio[inside].abs().mean()) if n else None, n))
        return out


# ---------------------------------------------------------------------- the generator's side


def draw_prompts(config: Config, *, count: int) -> tuple[list[PromptTask], list[str]]:
    """The first `count` prompts the producer would admit from the run's sources (the mixture's
    draws, each source's order, held-out problems passed over), and the sources left out."""
    played = [s.name for s in config.sources if s.environment]
    if len(played) == len(config.sources):
        raise Stop(f"every source ({', '.join(played)}) plays multi-turn episodes; the check samples "
                   "single-turn groups only")
    kept = [s for s in sources_at(config, {}) if s.name not in played]
    weights = [s.config.weight for s in kept]
    tasks = []
    for index in range(count):
        source = kept[choose(seed=config.task.seed, index=index, weights=weights)]
        for _ in range(1000):
            made = source.take()
            if not isinstance(made, Skipped):
                break
        else:
            raise Stop(f"source {source.name!r}: 1000 rows in a row make no prompt (last: {made.reason})")
        tasks.append(PromptTask(id=made.id, messages=made.messages, text=made.text, meta=made.meta,
                                n=config.rollout.group_size, admitted_at=0, source=source.name))
    return tasks, played


def sample_groups(config: Config, engine: Engine, tasks: list[PromptTask], *, temperature: float) -> Sampled:
    """Each task's group, sampled by `engine` and scored in the run's reward workers
    (generators.groups.make_group: what a generator writes)."""
    ro, gen = config.rollout, config.generator
    sampling = SamplingSettings(n=ro.group_size, max_new_tokens=ro.max_new_tokens, temperature=temperature,
                                top_p=ro.top_p, top_k=ro.top_k)
    prompt_ids = [engine.prompt_ids(t) for t in tasks]
    t0 = time.perf_counter()
    done = engine.sample(prompt_ids, sampling)
    sample_s = time.perf_counter() - t0
    with RewardRunner(reward_names(config), timeout_s=gen.reward_timeout_s, workers=gen.reward_workers,
                      conversational=conversational_sources(config)) as rewards:
        t1 = time.perf_counter()  # the workers started: scoring from here
        groups = [make_group(engine, rewards, Held(entry_id=task.id.encode(), task=task, prompt_ids=ids,
                                                   taken_at=t0, added_at=t0, version=0),
                             Finished(request_id=task.id, samples=samples), generator_id="check")[0]
                  for task, ids, samples in zip(tasks, prompt_ids, done, strict=True)]
        score_s = time.perf_counter() - t1
    return Sampled(groups=groups, sample_s=sample_s, score_s=score_s, engine=engine.name, temperature=temperature)


# ---------------------------------------------------------------------- the trainer's side


def open_trainer_model(config: Config) -> torch.nn.Module:
    """model.path as the trainer loads and places it (model.dtype, master weights), for no-grad passes."""
    cfg = config.trainer
    where = placement(dtype=config.model.dtype, master_fp32=cfg.master_fp32, activation_checkpointing=False)
    return place(load_model(resolve_model_path(config.model.path), where.weights_dtype), where).eval()


def every_token(group: SampleGroup) -> SampleGroup:
    """`group` with no reward error: the trainer's batches then hold every sampled token (a failed
    reward only keeps a completion out of the loss; its log-probs are the same)."""
    return dataclasses.replace(group, completions=[dataclasses.replace(c, reward_error=None)
                                                   for c in group.completions])


def trainer_mismatch(config: Config, model: torch.nn.Module, groups: list[SampleGroup], *,
                     temperature: float) -> Mismatch:
    """Every sampled token's log-prob as the trainer's step computes it (its micro-batches, packing,
    chunked head, truncation at rollout.top_k/top_p), at `temperature`, against the behaviour's."""
    cfg, ro = config.trainer, config.rollout
    device = next(model.parameters()).device
    forward = partial(sequence_logprobs, temperature=temperature, top_k=ro.top_k, top_p=ro.top_p,
                      chunk_tokens=cfg.logits_chunk_tokens)
    t0 = time.perf_counter()
    minis = step_batches([every_token(g) for g in groups], micro_batch_size=cfg.micro_batch_size,
                         micro_batch_tokens=cfg.micro_batch_tokens, estimator=cfg.advantage, parts=1,
                         device=device, share_prompts=cfg.share_prompts,
                         hidden_size=int(getattr(model.config, "hidden_size", 0) or 0))
    ratios, positions = [], []
    with torch.no_grad():
        for mb in minis[0].batches:
            logp, _ = log_probs(forward, model, mb)  # (B, T), 0 off the mask
            mask = mb.mask.bool()
            ratios.append((logp.double() - mb.behaviour_logp.double())[mask].cpu())
            positions.append((mask.long().cumsum(dim=1) - 1)[mask].cpu())
    return Mismatch(log_ratio=torch.cat(ratios), position=torch.cat(positions), forward_s=time.perf_counter() - t0)


def fitted_temperature(config: Config, model: torch.nn.Module, groups: list[SampleGroup]) -> tuple[float, float]:
    """(temperature, mean |log-ratio| there): the trainer's temperature that best explains the
    behaviour log-probs, searched from a quarter to four times rollout.temperature (golden section
    on its log)."""
    def gap(log_t: float) -> float:
        m = trainer_mismatch(config, model, groups, temperature=math.exp(log_t))
        return float(m.log_ratio.abs().mean())

    base = math.log(config.rollout.temperature)
    lo, hi = base - math.log(4), base + math.log(4)
    golden = (math.sqrt(5) - 1) / 2
    a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
    fa, fb = gap(a), gap(b)
    for _ in range(14):
        if fa < fb:
            hi, b, fb = b, a, fa
            a = hi - golden * (hi - lo)
            fa = gap(a)
        else:
            lo, a, fa = a, b, fb
            b = lo + golden * (hi - lo)
            fb = gap(b)
    best = (a + b) / 2
    return math.exp(best), gap(best)


# ---------------------------------------------------------------------- the verdict


def mismatch_problems(mismatch: Mismatch, *, fitted: tuple[float, float] | None, temperature: float,
                      dtype: str) -> list[str]:
    """What is wrong with the log-probs (one line each), against the bounds of model.dtype `dtype`;
    `fitted`: fitted_temperature's answer, asked for when the mean is out of bounds."""
    if mismatch.log_ratio.numel() == 0:
        return ["mismatch: no sampled token to compare"]
    mean, ratio_max = float(mismatch.log_ratio.abs().mean()), float(mismatch.log_ratio.exp().max())
    bound, max_ratio = BOUNDS[dtype]
    problems = []
    if mean > bound:
        why = "the engine's sampling does not match the trainer's (weights? model.dtype? the engine's own settings?)"
        if fitted is not None and fitted[1] <= bound:
            why = (f"the engine samples at temperature {fitted[0]:.2f} (the trainer's log-probs agree there, "
                   f"mean {fitted[1]:.1e}), the trainer computes them at rollout.temperature = {temperature}")
        elif fitted is not None:
            why = (f"no temperature explains it (best fit {fitted[0]:.2f}, still {fitted[1]:.2f}): the engine "
                   "samples from other weights than the trainer's model.path (or another model.dtype)")
        problems.append(f"mismatch: mean |log-ratio| {mean:.3g} above {bound}: {why}")
    if ratio_max > max_ratio:
        problems.append(f"ratio: max importance ratio {ratio_max:.3g} above {max_ratio}: some tokens are far "
                        "likelier under the trainer than under the engine that sampled them")
    return problems


def reward_problems(groups: list[SampleGroup]) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the rewards: any failed reward is a problem; every reward the same is
    a warning (a weak model at the start can score 0 everywhere and still learn)."""
    completions = [c for g in groups for c in g.completions]
    errors = [c.reward_error for c in completions if c.reward_error is not None]
    problems, warnings = [], []
    if errors and len(errors) == len(completions):
        problems.append(f"rewards: every completion's reward raised: {errors[0]}")
    elif errors:
        problems.append(f"rewards: {len(errors)} of {len(completions)} completions' rewards failed: {errors[0]}")
    scored = {c.reward for c in completions if c.reward_error is None}
    if len(scored) == 1:
        warnings.append(f"rewards: every completion scored {scored.pop():g}: no group teaches anything yet")
    return problems, warnings


def figure_lines(config: Config, sampled: Sampled, mismatch: Mismatch) -> list[str]:
    """The figures behind the verdict."""
    lr, groups = mismatch.log_ratio, sampled.groups
    completions = [c for g in groups for c in g.completions]
    zero = sum(zero_variance(g, overlong=config.trainer.overlong, overlong_penalty=config.trainer.overlong_penalty)
               for g in groups)
    errors = sum(c.reward_error is not None for c in completions)
    scored = {c.reward for c in completions if c.reward_error is None}
    constant = "-" if not scored else "yes" if len(scored) == 1 else "no"  # -: none scored
    n, steps = len(groups), config.rollout.prompts_per_step
    bound, max_ratio = BOUNDS[config.model.dtype]
    per_sample, per_forward = sampled.sample_s / n, mismatch.forward_s / n
    buckets = "  ".join(f"{name} {'-' if v is None else f'{v:.2e}'} ({k})" for name, v, k in mismatch.by_bucket())
    lines = [f"mismatch   mean |log-ratio| {lr.abs().mean():.2e}  max {lr.abs().max():.2e}  "
             f"KL (k3) {(lr.exp() - 1 - lr).mean():.2e}  over {lr.numel()} tokens (trainer minus behaviour)",
             f"           by position  {buckets}",
             f"ratio      exp(logp_trainer - logp_behaviour) mean {lr.exp().mean():.4f}  max {lr.exp().max():.4f}  "
             f"(bounds: mean |log-ratio| <= {bound}, ratio <= {max_ratio})"] if lr.numel() else ["mismatch   no tokens"]
    lines += [f"rewards    {len(completions)} completions, {errors} errors, constant {constant}, "
              f"zero-variance groups {zero}/{n} ({zero / n:.0%})",
              f"time       sampling {per_sample:.3g} s/group, scoring {sampled.score_s / n:.3g} s/group, "
              f"trainer forward {per_forward:.3g} s/group",
              f"estimate   at prompts_per_step {steps}: sampling {per_sample * steps:.3g} s per step on one "
              f"generator, trainer forward {per_forward * steps:.3g} s (a step's forward and backward: about 3x)"]
    return lines


def run(config: Config, *, prompts: int, engine_model: str | None = None,
        engine_temperature: float | None = None) -> int:
    """The check; prints its lines and returns the exit status (0: ok, 1: a problem)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the check's lines, not loading bars
    if prompts < 1:
        raise Stop("--prompts must be at least 1", code=2)
    if config.trainer.objective != "grpo":
        raise Stop(f"trainer.objective = {config.trainer.objective!r}: nothing is sampled to check", code=2)
    tasks, played = draw_prompts(config, count=prompts)
    if engine_model is not None:  # the engine on other weights; the trainer's side stays on model.path
        config_for_engine = config.model_copy(update={"model": config.model.model_copy(update={"path": engine_model})})
    else:
        config_for_engine = config
    temperature = config.rollout.temperature if engine_temperature is None else engine_temperature
    engine = open_engine_for(config_for_engine, seed=config.generator.seed)
    sampled = sample_groups(config, engine, tasks, temperature=temperature)
    del engine
    model = open_trainer_model(config)
    mismatch = trainer_mismatch(config, model, sampled.groups, temperature=config.rollout.temperature)
    fitted = None
    bound, max_ratio = BOUNDS[config.model.dtype]
    if mismatch.log_ratio.numel() and float(mismatch.log_ratio.abs().mean()) > bound:
        fitted = fitted_temperature(config, model, sampled.groups)
    sources = sorted({t.source for t in tasks if t.source})
    print(f"check: {len(tasks)} prompts from {', '.join(sources)}, {config.rollout.group_size} completions each, "
          f"{sampled.engine} engine at temperature {temperature:g}"
          f"{f' on {Path(engine_model)}' if engine_model else ''}; trainer {config.model.dtype} on "
          f"{next(model.parameters()).device.type} at rollout.temperature {config.rollout.temperature:g}", flush=True)
    if played:
        print(f"check: left out: {', '.join(played)} (multi-turn episodes are not checked)")
    for line in figure_lines(config, sampled, mismatch):
        print(line)
    problems = mismatch_problems(mismatch, fitted=fitted, temperature=config.rollout.temperature,
                                 dtype=config.model.dtype)
    reward_issues, warnings = reward_problems(sampled.groups)
    for line in warnings:
        print(f"check: warning: {line}")
    for line in problems + reward_issues:
        print(f"check: FAILED: {line}")
    if problems or reward_issues:
        return 1
    lr = mismatch.log_ratio
    print(f"check: ok (mean |log-ratio| {lr.abs().mean():.1e} <= {bound}, "
          f"ratio max {lr.exp().max():.3f} <= {max_ratio}, rewards scored without errors)")
    return 0
