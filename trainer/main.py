"""The trainer's loop: read scored sample groups, take GRPO steps, publish weights, acknowledge.

Every stage is a function over one `Run` (trainer/run.py), built once by `start`, which resumes
where the newest saved state left off (`resume` in trainer/checkpoints.py). Each step collects
this rank's share of groups (trainer/samples.py), updates the policy on them (trainer/step.py),
publishes the weights every `sync_every` steps, saving the trainer state and acknowledging the
groups trained since every `state_every` (trainer/publishing.py, trainer/checkpoints.py), and
records the step's metrics (trainer/metrics.py, written out by trainer/tracking.py); rank 0 keeps
the step's groups in the run's history (common/history.py, written by its own thread). Before a step
and while it waits for groups, the trainer puts right what went wrong around it (trainer/repairs.py).

With `trainer.objective = "sft"` the steps are supervised instead: cross-entropy on the loss-masked
completion tokens of groups of any size (the producer's sft sources), no advantages, and no
staleness limit (such groups carry version 0 and are never stale).

Versions. `step` counts trainer steps done (each is `updates_per_batch` optimizer steps on one
batch of groups, one per PPO mini-batch; the lr schedule also counts trainer steps; a step whose
every update was skipped for a non-finite loss is not counted); the published weight `version` is
the step that wrote them, so with sync_every = 1 the two are equal after every step. A sample's staleness is
`step - sample.version`: how many optimizer steps the policy has moved since the weights that
sampled it ("trainer version − sample version", counting unpublished steps too, which is what the
importance ratio has to bridge). The trainer hash holds both `step`
(written every step) and `version` (written only when a checkpoint is published); producers
admit against `version`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
from transformers.utils import logging as hf_logging

from common.config import Config, ConfigError, RolloutConfig, TrainerConfig
from common.history import HistoryWriter, history_dir
from common.keys import TRAINER_GROUP, Keys
from common.messages import SampleGroup
from common.models import resolve_model_path
from common.process import stop_grace_s
from common.progress import count_skipped, read_gone_back, read_trainer
from common.quarantine import read_quarantines
from common.routing import replayable
from common.shaping import completion_advantages
from common.streams import connect, ensure_group
from trainer.checkpoints import remove_unfinished, resume
from trainer.devices import Placement, placement, trainer_device
from trainer.judging import judge_generators, quarantining
from trainer.loading import placed_model
from trainer.losses import kl_coef_of
from trainer.memory import choose as choose_checkpointing
from trainer.metrics import step_record, summary_line
from trainer.parallel import any_rank, finish, init_distributed, is_main, say, unshared
from trainer.publishing import checkpoint, publish_if_due, republish_if_gone, settle_writing
from trainer.quarantine import Judge, bound_of
from trainer.record import Record
from trainer.repairs import between_reads, check_redis, note_going_back
from trainer.run import Run, Update
from trainer.samples import Collected, collect, gather_groups
from trainer.shutdown import Shutdown
from trainer.stats import StepStats
from trainer.step import GrpoOptions, sft_step, train_step
from trainer.tracking import Tracker
from trainer.transfer import Sender


def run(config: Config) -> None:
    """The trainer: start (resuming), steps until `max_steps` or a stop, then wind up."""
    hf_logging.disable_progress_bar()  # one console line per step, not progress bars
    trainer, shutdown = start(config)
    # Every decision that leads to a collective (stop, train, publish) is agreed by all ranks.
    while not (config.trainer.max_steps and trainer.step >= config.trainer.max_steps) \
            and not any_rank(shutdown.requested):
        if not take_step(trainer, shutdown):  # a stop while waiting: what this rank read stays pending
            break
    wind_up(trainer)


def start(config: Config) -> tuple[Run, Shutdown]:
    """Everything the stages need: the process group, Redis, and the model and optimizer where the
    newest saved state (or published checkpoint) of the run left off (one call: `resume`); and the
    stop handling, installed before the model loads."""
    cfg, rollout = config.trainer, config.rollout
    rank, world = init_distributed()
    assert rollout.prompts_per_step % world == 0, (
        f"rollout.prompts_per_step = {rollout.prompts_per_step} must be a multiple of the world size {world}")
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())  # 0: torch's default
    keys, source_dir = Keys(config.run), resolve_model_path(config.model.path)
    state_root = Path(config.output_dir) / "trainer_state"  # DCP trainer state beside each checkpoint
    refused = unshared([state_root.parent, config.checkpoint_dir])
    if refused:
        raise ConfigError(refused)
    if rank == 0:
        remove_unfinished(config.checkpoint_dir)
    shutdown = Shutdown(grace_s=stop_grace_s())
    r = connect(config.redis_url, process="trainer")
    ensure_group(r, keys.samples, TRAINER_GROUP)
    checkpointing, _ = choose_checkpointing(config, source_dir=source_dir, device=trainer_device(), ranks=world)
    say(f"trainer: {checkpointing.line()}")  # "auto" resolved here, once, from the estimate (trainer/memory.py)
    where = placement(dtype=config.model.dtype, master_fp32=cfg.master_fp32,
                      activation_checkpointing=checkpointing.on, attention=cfg.attention, compile=cfg.compile)
    say(f"trainer: attention {where.attention}"
        + (" (auto: trainer.attention chose it on this device)" if cfg.attention == "auto" else "")
        + (", each transformer block compiled (trainer.compile)" if where.compile else ""))
    if where.attention == "varlen" and where.device.type == "cuda":
        from trainer.varlen import agreed_kernel

        say(f"trainer: varlen attention's kernel {agreed_kernel(where.device, where.dtype, any_rank).line()}")
    model, optimizer, scheduler, step = resume(
        r, keys, where=where, source_dir=source_dir, state_root=state_root, lr=cfg.lr, weight_decay=cfg.weight_decay,
        lr_schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps or cfg.max_steps,
        lora=cfg.lora)
    record = Record.of(read_trainer(r, keys), read_gone_back(r, keys))  # what Redis holds, as `resume` left it
    run = Run(config=config, r=r, keys=keys, model=model, optimizer=optimizer, scheduler=scheduler,
              update=objective(cfg, rollout, source_dir=source_dir, where=where,
                               distill_weight=config.teacher.distill_weight if config.teacher.on else 0.0),
              source_dir=source_dir,
              state_root=state_root, step=step, version=step, rank=rank, world=world,
              updates=1 if cfg.objective == "sft" else cfg.updates_per_batch,
              tracker=Tracker(r, config) if rank == 0 else None, record=record,
              judge=Judge(cfg.quarantine, bound_of(cfg.quarantine, config.model.dtype))
              if rank == 0 and cfg.quarantine.after and cfg.objective != "sft" else None,
              sender=Sender(r, keys, cfg, device=where.device) if rank == 0 and cfg.weight_transfer != "disk" else None,
              history=HistoryWriter(history_dir(config.output_dir), advantages=advantages_of(cfg))
              if rank == 0 else None)
    note_going_back(run)
    say(f"trainer: run {config.run!r}, model {source_dir}, step {run.step}, "
        f"{rollout.prompts_per_step} groups per step, {world} rank(s) on {where.device.type}, "
        f"{config.model.dtype}{' (float32 master weights)' if where.weights_dtype != where.dtype else ''}")
    return run, shutdown


def advantages_of(cfg: TrainerConfig) -> Callable[[SampleGroup], list[float | None]]:
    """Each completion's advantage as the step computes it (trainer/batch.py), for the history;
    sft steps have none."""
    if cfg.objective == "sft":
        return lambda group: [None] * len(group.completions)
    return partial(completion_advantages, estimator=cfg.advantage, overlong=cfg.overlong,
                   overlong_penalty=cfg.overlong_penalty)


def objective(cfg: TrainerConfig, rollout: RolloutConfig, *, source_dir: Path, where: Placement,
              distill_weight: float = 0.0) -> Update:
    """The update of `cfg.objective` with its options bound; for grpo with a KL term, the frozen
    reference (the initial model) is loaded here, in the model's dtype (no master weights: it is
    never trained), placed and sharded like the policy. The GRPO family's log-probs are those of
    the generators' sampling distribution (`rollout`'s temperature, top_k, top_p)."""
    if cfg.objective == "sft":
        return partial(sft_step, micro_batch_size=cfg.micro_batch_size, micro_batch_tokens=cfg.micro_batch_tokens,
                       max_grad_norm=cfg.max_grad_norm, chunk_tokens=cfg.logits_chunk_tokens, pack=cfg.pack_sequences)
    ref_model = None
    if kl_coef_of(cfg.loss) > 0:  # the frozen reference: the initial model
        frozen = replace(where, master_fp32=False, activation_checkpointing=False)
        ref_model = placed_model(source_dir, frozen).eval().requires_grad_(False)
    return partial(train_step, how=GrpoOptions.of(cfg, rollout, distill_weight=distill_weight), ref_model=ref_model)


def take_step(run: Run, shutdown: Shutdown) -> bool:
    """One trainer step: put right what went wrong, collect the groups, update, publish if due,
    record. False if a stop came while waiting for groups."""
    t_step = time.monotonic()
    check_redis(run)
    republish_if_gone(run, agree=True)
    got = collect_groups(run, shutdown)
    if any_rank(got is None):
        return False
    everyone, mine = gather_groups(run, got)
    all_groups = [g for c in everyone for g in c.groups]
    staleness = [run.config.staleness(step=run.step, version=g.version) for g in all_groups]

    t_train = time.monotonic()
    shutdown.step_started(run.step + 1)
    step_before = run.step
    stats, lr = train(run, mine)
    train_s = time.monotonic() - t_train
    by_generator, quarantined = judge_generators(run, mine, stats, step=step_before)
    run.unacked_entries += [e for c in everyone for e in c.entry_ids]
    run.unacked_ids += [g.id for g in all_groups]
    if stats.skipped >= run.updates:  # nothing applied: nothing to publish or record
        return True

    t_publish = time.monotonic()
    max_steps = run.config.trainer.max_steps
    publish_if_due(run, last=any_rank(shutdown.requested) or (max_steps > 0 and run.step >= max_steps))
    publish_s = time.monotonic() - t_publish
    shutdown.step_ended()
    if run.history is not None:  # written by its own thread, off the step's path
        run.history.add(run.step, all_groups)
    if run.tracker is not None:
        metrics = step_record(run.r, run.keys, everyone, stats, step=run.step, version=run.version, lr=lr,
                              staleness=staleness, sft=run.sft, t_step=t_step, train_s=train_s, publish_s=publish_s,
                              by_generator=by_generator, quarantined=quarantined, overlong=run.config.trainer.overlong,
                              overlong_penalty=run.config.trainer.overlong_penalty)
        run.tracker.log(metrics)
        print(summary_line(metrics), flush=True)
    return True


def collect_groups(run: Run, shutdown: Shutdown) -> Collected | None:
    """This rank's share of the step's groups (trainer/samples.py), None if a stop came first."""
    rollout = run.config.rollout
    got, run.cursor = collect(run.r, run.keys, want=rollout.prompts_per_step // run.world, step=run.step,
                              max_staleness=run.config.max_staleness,
                              vocab_size=run.model.config.get_text_config().vocab_size,
                              unpublished=set(run.unacked_ids),
                              consumer=run.consumer, cursor=run.cursor, shutdown=shutdown,
                              objective=run.config.trainer.objective, limits=run.config.limits,
                              trained=run.record.trained, skip=set(run.unacked_entries),
                              between=partial(between_reads, run), gone_back=run.record.gone_back,
                              quarantined=read_quarantines(run.r, run.keys) if quarantining(run) else None,
                              routing=replayable(run.model))
    return got


def train(run: Run, groups: list[SampleGroup]) -> tuple[StepStats, float]:
    """One trainer step on this rank's `groups`: the update, then the lr schedule's step. Returns
    the update's stats and the lr it used. A step whose every optimizer update was skipped (a
    non-finite loss or gradient norm) left the weights as they were: it is not counted (the step,
    the schedule and the published version stay), its groups are spent all the same."""
    lr = run.optimizer.param_groups[0]["lr"]
    stats = run.update(run.model, run.optimizer, groups, step=run.step)
    if stats.skipped:
        if is_main():
            count_skipped(run.r, run.keys, stats.skipped)
        say(f"trainer: {stats.skipped} update(s) of step {run.step + 1} skipped: non-finite loss or gradient norm")
    if stats.skipped < run.updates:
        run.scheduler.step()
        run.step += 1
    return stats, lr


def wind_up(run: Run) -> None:
    """After the last step: publish what was trained since the last checkpoint (a stop while
    waiting for data), close the tracker, leave the process group."""
    settle_writing(run)  # the version written beside the last step
    if run.unacked_ids:
        checkpoint(run, save=True)
    for writer in (run.writer, run.state_writer):
        if writer is not None:
            writer.shutdown()
    if run.tracker is not None:
        run.tracker.close()
    if run.sender is not None:
        run.sender.close()
    if run.history is not None:
        run.history.close()
        if run.history.lost:
            say(f"trainer: the groups of {run.history.lost} step(s) are not kept in {run.history.root}")
    say(f"trainer: stopped at step {run.step}")
    finish()
