"""The check, top to bottom: prompts drawn as the producer draws them, groups sampled and scored
as a generator makes them (a source with an environment: its episodes played, checks/episodes.py),
every sampled token's log-prob recomputed as the trainer computes it, each episode's tokens
against the chat template applied to its whole conversation, one micro-batch's forward and
backward measured for the trainer's memory (checks/memory.py), the settings the trainer resolves
at start-up on this host's device (trainer/memory.py: activation checkpointing), and one verdict
with the figures behind it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from checks import routing as routing_check
from checks.episodes import Template, departures, play_groups, template_line, template_problems
from checks.memory import Memory, memory_line, trainer_memory
from common.config import Config, ConfigError
from common.messages import PromptTask, SampleGroup
from common.mismatch import BOUNDS
from common.models import resolve_model_path
from common.process import Stop
from common.shaping import zero_variance
from engines.base import Engine, Finished, SamplingSettings
from envs.base import Spec
from generators.environments import environment_specs
from generators.groups import make_group
from generators.main import check_templates, open_engine_for
from generators.scoring import RewardRunner, conversational_sources, reward_names
from generators.state import Held
from producers.data import Skipped, choose
from producers.main import sources_at
from trainer.batch import MicroBatch
from trainer.checkpoints import adapted_model, placed_model
from trainer.devices import DTYPES, placement, resolve_attention, trainer_device
from trainer.logprobs import sequence_logprobs
from trainer.memory import Choice, Estimate
from trainer.memory import choose as choose_checkpointing
from trainer.step import log_probs, step_batches

POSITION_BUCKETS = ((0, 15), (16, 63), (64, None))  # completion token positions, inclusive


@dataclass(frozen=True, slots=True)
class Sampled:
    """What the generator side made: the groups, and the seconds it took."""

    groups: list[SampleGroup]
    sample_s: float  # sampling every group, all at once (then playing the episodes, all at once)
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


def draw_prompts(config: Config, *, count: int) -> list[PromptTask]:
    """The first `count` prompts the producer would admit from the run's sources (the mixture's
    draws, each source's order, held-out problems passed over), then the next of each source the
    draws passed over: every source is checked."""
    sources = sources_at(config, {})
    weights = [s.config.weight for s in sources]
    drawn = [sources[choose(seed=config.task.seed, index=index, weights=weights)] for index in range(count)]
    drawn += [s for s in sources if s.name not in {d.name for d in drawn}]
    tasks = []
    for source in drawn:
        for _ in range(1000):
            made = source.take()
            if not isinstance(made, Skipped):
                break
        else:
            raise Stop(f"source {source.name!r}: 1000 rows in a row make no prompt (last: {made.reason})")
        tasks.append(PromptTask(id=made.id, messages=made.messages, text=made.text, meta=made.meta,
                                n=config.rollout.group_size, admitted_at=0, source=source.name))
    return tasks


def sample_groups(config: Config, engine: Engine, engine_thread: concurrent.futures.Executor,
                  tasks: list[PromptTask], *, temperature: float) -> Sampled:
    """Each task's group, sampled by `engine` (in its own thread, as a generator runs it) and scored
    in the run's reward workers (generators.groups.make_group: what a generator writes)."""
    ro, gen = config.rollout, config.generator
    if not tasks:
        return Sampled(groups=[], sample_s=0.0, score_s=0.0, engine=engine.name, temperature=temperature)
    sampling = SamplingSettings(n=ro.group_size, max_new_tokens=ro.max_new_tokens, temperature=temperature,
                                top_p=ro.top_p, top_k=ro.top_k)
    prompt_ids = [engine.prompt_ids(t) for t in tasks]
    t0 = time.perf_counter()
    done = engine_thread.submit(engine.sample, prompt_ids, sampling).result()
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


def open_trainer_model(config: Config, *, checkpointing: bool) -> torch.nn.Module:
    """model.path as the trainer opens it (trainer/main.py `start`, trainer/checkpoints.py `resume`):
    model.dtype, master weights, trainer.attention and trainer.compile, LoRA's adapters and activation
    checkpointing as resolved (`checkpointing`), through the trainer's own placed_model /
    adapted_model, in eval mode."""
    cfg = config.trainer
    where = placement(dtype=config.model.dtype, master_fp32=cfg.master_fp32, activation_checkpointing=checkpointing,
                      attention=cfg.attention, compile=cfg.compile)
    path = resolve_model_path(config.model.path)
    model = adapted_model(path, where, cfg.lora) if cfg.lora.rank else placed_model(path, where)
    return model.eval()


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
    forward = partial(sequence_logprobs, temperature=temperature, top_k=ro.top_k, top_p=ro.top_p,
                      chunk_tokens=cfg.logits_chunk_tokens)
    t0 = time.perf_counter()
    ratios, positions = [], []
    with torch.no_grad():
        for mb in micro_batches(config, model, groups):
            logp, _ = log_probs(forward, model, mb)  # (B, T), 0 off the mask
            mask = mb.mask.bool()
            ratios.append((logp.double() - mb.behaviour_logp.double())[mask].cpu())
            positions.append((mask.long().cumsum(dim=1) - 1)[mask].cpu())
    return Mismatch(log_ratio=torch.cat(ratios), position=torch.cat(positions), forward_s=time.perf_counter() - t0)


def micro_batches(config: Config, model: torch.nn.Module, groups: list[SampleGroup]) -> list[MicroBatch]:
    """`groups` as the trainer's step batches them (trainer.step.step_batches), every token in."""
    cfg = config.trainer
    minis = step_batches([every_token(g) for g in groups], micro_batch_size=cfg.micro_batch_size,
                         micro_batch_tokens=cfg.micro_batch_tokens, estimator=cfg.advantage, parts=1,
                         device=next(model.parameters()).device, share_prompts=cfg.share_prompts,
                         hidden_size=int(getattr(model.config, "hidden_size", 0) or 0))
    return minis[0].batches


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


def measure_memory(config: Config, model: torch.nn.Module, groups: list[SampleGroup]) -> Memory:
    """The trainer's memory per rank (checks/memory.py) at the longest row the config allows: the
    longest prompt sampled, then max_new_tokens (a source with an environment: its
    max_episode_tokens)."""
    ro = config.rollout
    longest = max(s.max_episode_tokens if s.environment else ro.max_new_tokens for s in config.sources)
    return trainer_memory(config, model, micro_batches(config, model, groups),
                          prompt_tokens=max(len(g.prompt_ids) for g in groups), completion_tokens=longest)


def defaults_line(config: Config, choice: Choice, peak: Estimate | None) -> str:
    """The "trainer" line: the settings the trainer resolves at start-up on this host's device
    (trainer/memory.py), with why."""
    cfg = config.trainer
    tokens = f"micro_batch_tokens {cfg.micro_batch_tokens}" if cfg.micro_batch_tokens else \
        f"micro_batch_tokens 0 (no limit: micro_batch_size {cfg.micro_batch_size} rows)"
    planned = f" (estimated at micro-batches of {peak.positions} positions)" if peak is not None else ""
    return (f"trainer    {choice.line()}, {tokens}{planned}, attention {attention_line(config)}, "
            f"{'packed' if cfg.pack_sequences else 'padded'} micro-batches, compile {'on' if cfg.compile else 'off'}")


def attention_line(config: Config) -> str:
    """trainer.attention as the trainer resolves it on this host (trainer/devices.py), "auto"'s choice named."""
    device, dtype = trainer_device(), DTYPES[config.model.dtype]
    chosen = resolve_attention(device, config.trainer.attention, dtype)
    if chosen == "varlen" and device.type == "cuda":
        from trainer.varlen import varlen_kernel

        chosen = f"varlen, kernel {varlen_kernel(device, dtype).line()}"
    return f"{chosen} (auto)" if config.trainer.attention == "auto" else chosen


def figure_lines(config: Config, sampled: Sampled, mismatch: Mismatch, *, template: Template | None,
                 memory: Memory | None, ranks: int, defaults: str) -> list[str]:
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
    lines.append(f"rewards    {len(completions)} completions, {errors} errors, constant {constant}, "
                 f"zero-variance groups {zero}/{n} ({zero / n:.0%})")
    if template is not None:
        lines.append(template_line(template))
    lines += [f"time       sampling {per_sample:.3g} s/group, scoring {sampled.score_s / n:.3g} s/group, "
              f"trainer forward {per_forward:.3g} s/group",
              f"estimate   at prompts_per_step {steps}: sampling {per_sample * steps:.3g} s per step on one "
              f"generator, trainer forward {per_forward * steps:.3g} s (a step's forward and backward: about 3x)",
              memory_line(memory, ranks=ranks) if memory is not None else "memory     not measured: no group to pass",
              defaults]
    return lines


def generate(config: Config, engine: Engine, engine_thread: concurrent.futures.Executor, tasks: list[PromptTask],
             *, specs: dict[str, Spec], temperature: float) -> tuple[Sampled, Template | None]:
    """The groups a generator would write for `tasks`, in their order: sampled and scored, or, for a
    source with an environment (`specs`), played; and what the episodes show of the chat template
    (None: no source has an environment). A template the generator refuses at start-up
    (generators.main.check_templates) leaves those prompts unplayed."""
    single = sample_groups(config, engine, engine_thread, [t for t in tasks if t.source not in specs],
                           temperature=temperature)
    episodic = [t for t in tasks if t.source in specs]
    if not episodic:
        return single, None
    try:
        check_templates(engine, specs)
    except ConfigError as err:
        return single, Template(refused=str(err), departures=[], turns=0)
    t0 = time.perf_counter()
    played, refused = play_groups(config, engine, engine_thread, episodic, specs=specs, temperature=temperature)
    play_s = time.perf_counter() - t0
    found = [d for p in played for d in departures(engine.tokenizer, p, spec=specs[p.task.source],
                                                   eos_ids=engine.eos_ids)]
    by_id = {g.id: g for g in single.groups} | {p.group.id: p.group for p in played}
    sampled = dataclasses.replace(single, groups=[by_id[t.id] for t in tasks if t.id in by_id],
                                  sample_s=single.sample_s + play_s)
    return sampled, Template(refused=refused[0] if refused else None, departures=found,
                             turns=sum(e.turns for p in played for e in p.episodes))


def sample_for_check(config: Config, config_for_engine: Config, tasks: list[PromptTask], *,
                     specs: dict[str, Spec], temperature: float) -> tuple[Sampled, Template | None, list[SampleGroup]]:
    """The check's groups as the run's generators write them (`generate`), what they show of the
    chat template, and the same groups with the experts of an MoE, recorded whether or not the run
    replays them (checks/routing.py)."""
    # The engine lives in one thread, as in a generator: created there, every call made there.
    engine_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    try:
        engine = engine_thread.submit(open_engine_for, routing_check.recording(config_for_engine),
                                      seed=config.generator.seed).result()
        sampled, template = generate(config, engine, engine_thread, tasks, specs=specs, temperature=temperature)
        del engine
    finally:
        engine_thread.shutdown()
    return (dataclasses.replace(sampled, groups=routing_check.as_run(config, sampled.groups)), template,
            sampled.groups)


def run(config: Config, *, prompts: int, engine_model: str | None = None, engine_temperature: float | None = None,
        ranks: int = 1) -> int:
    """The check; prints its lines and returns the exit status (0: ok, 1: a problem). `ranks`: the
    trainer's, over which FSDP2 shards its weights and optimizer state."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # the check's lines, not loading bars
    if prompts < 1 or ranks < 1:
        raise Stop("--prompts and --trainer-ranks must be at least 1", code=2)
    if config.trainer.objective != "grpo":
        raise Stop(f"trainer.objective = {config.trainer.objective!r}: nothing is sampled to check", code=2)
    tasks = draw_prompts(config, count=prompts)
    specs = environment_specs(config)
    if engine_model is not None:  # the engine on other weights; the trainer's side stays on model.path
        config_for_engine = config.model_copy(update={"model": config.model.model_copy(update={"path": engine_model})})
    else:
        config_for_engine = config
    temperature = config.rollout.temperature if engine_temperature is None else engine_temperature
    sampled, template, recorded = sample_for_check(config, config_for_engine, tasks, specs=specs,
                                                   temperature=temperature)
    if not sampled.groups:  # every prompt's episodes stopped by the template: nothing for the trainer
        for line in template_problems(template)[0]:
            print(f"check: FAILED: {line}")
        return 1
    choice, peak = choose_checkpointing(config, source_dir=resolve_model_path(config.model.path),
                                        device=trainer_device(), ranks=ranks, local_ranks=ranks)
    model = open_trainer_model(config, checkpointing=choice.on)
    mismatch = trainer_mismatch(config, model, sampled.groups, temperature=config.rollout.temperature)
    fitted = None
    bound, max_ratio = BOUNDS[config.model.dtype]
    if mismatch.log_ratio.numel() and float(mismatch.log_ratio.abs().mean()) > bound:
        fitted = fitted_temperature(config, model, sampled.groups)
    memory = measure_memory(config, model, sampled.groups) if sampled.groups else None
    replay = routing_check.measure(config, model, recorded, lambda m, gs: trainer_mismatch(
        config, m, gs, temperature=config.rollout.temperature).log_ratio)
    del model  # the teacher's forward, if any, loads its own
    from checks import teacher as teacher_check  # imports this module's trainer_mismatch

    agreed = teacher_check.agreement(
        config, sampled.groups,
        mismatch=lambda c, m, gs: trainer_mismatch(c, m, gs, temperature=config.rollout.temperature).log_ratio,
        open_model=lambda c: open_trainer_model(c, checkpointing=choice.on))
    sources = sorted({t.source for t in tasks if t.source})
    print(f"check: {len(tasks)} prompts from {', '.join(sources)}, {config.rollout.group_size} completions each, "
          f"{sampled.engine} engine at temperature {temperature:g}"
          f"{f' on {Path(engine_model)}' if engine_model else ''}; trainer {config.model.dtype} on "
          f"{trainer_device().type} at rollout.temperature {config.rollout.temperature:g}", flush=True)
    for line in figure_lines(config, sampled, mismatch, template=template, memory=memory, ranks=ranks,
                             defaults=defaults_line(config, choice, peak)) + routing_check.lines(replay):
        print(line)
    if agreed is not None:
        print(teacher_check.line(agreed))
    problems = mismatch_problems(mismatch, fitted=fitted, temperature=config.rollout.temperature,
                                 dtype=config.model.dtype)
    problems += teacher_check.problems(agreed, dtype=config.model.dtype) if agreed is not None else []
    reward_issues, warnings = reward_problems(sampled.groups)
    template_issues, template_warnings = template_problems(template)
    for line in warnings + template_warnings:
        print(f"check: warning: {line}")
    for line in problems + reward_issues + template_issues:
        print(f"check: FAILED: {line}")
    if problems or reward_issues or template_issues:
        return 1
    lr = mismatch.log_ratio
    print(f"check: ok (mean |log-ratio| {lr.abs().mean():.1e} <= {bound}, "
          f"ratio max {lr.exp().max():.3f} <= {max_ratio}, rewards scored without errors"
          f"{', episodes as the chat template renders them' if template is not None else ''})")
    return 0
