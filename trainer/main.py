"""The trainer's loop: read scored sample groups, take GRPO steps, publish weights, acknowledge.

Each step collects this rank's share of groups (trainer/samples.py), updates the policy on them
(trainer/step.py), publishes the weights every `sync_every` steps, saving the trainer state and
acknowledging the groups trained since every `state_every` (trainer/checkpoints.py), and records
the step's metrics (trainer/metrics.py, written out by trainer/tracking.py). A restart resumes
where the newest saved state left off (`resume` in trainer/checkpoints.py).

With `trainer.objective = "sft"` the steps are supervised instead: cross-entropy on the loss-masked
completion tokens of groups of any size (the producer's sft sources), no advantages, and no
staleness limit (such groups carry version 0 and are never stale).

Versions. `step` counts trainer steps done (each is `updates_per_batch` optimizer steps on one
batch of groups, one per PPO mini-batch; the lr schedule also counts trainer steps; a step whose
every update was skipped for a non-finite loss is not counted); the published weight `version` is
the step that wrote them, so with sync_every = 1 the two are equal after every step. A sample's staleness is
`step - sample.version`: how many optimizer steps the policy has moved since the weights that
sampled it (this is the DESIGN's "trainer version − sample version", counting unpublished steps
too, which is what the importance ratio has to bridge). The trainer hash holds both `step`
(written every step) and `version` (written only when a checkpoint is published); producers
admit against `version`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path

import redis
import torch
from transformers.utils import logging as hf_logging

from common.config import Config, RolloutConfig, TrainerConfig
from common.evals import enqueue_eval
from common.keys import TRAINER_GROUP, Keys
from common.messages import SampleGroup, WeightVersion
from common.models import resolve_model_path
from common.progress import Fault, Refused, count_fault, count_refused, count_skipped, read_trainer, write_step
from common.streams import connect, ensure_group, latest_weights
from trainer.checkpoints import hold_for_eval, load_model, place, publish, remove_unfinished, resume
from trainer.devices import DTYPES, Placement, placement
from trainer.losses import kl_coef_of
from trainer.metrics import step_record, summary_line
from trainer.parallel import any_rank, finish, gather, init_distributed, is_main, say
from trainer.record import Record, forgotten, put_right
from trainer.samples import Collected, collect
from trainer.shutdown import Shutdown, stop_grace_s
from trainer.state import prune_states, state_dir
from trainer.step import sft_step, train_step
from trainer.tracking import Tracker

# One trainer step's update of (model, optimizer, this rank's groups; step = trainer steps done),
# returning its stats.
Update = Callable[..., dict[str, float]]


@dataclass
class State:
    """What the loop carries from step to step, on every rank."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    step: int  # trainer steps done
    version: int  # the step of the newest published weights (the initial ones are version 0)
    cursor: bytes | None = b"0"  # where this rank reads next: first its own pending entries
    # Every rank's entries and groups trained since the last saved state: acknowledged with the next.
    unacked_entries: list[bytes] = field(default_factory=list)
    unacked_ids: list[str] = field(default_factory=list)
    record: Record = field(default_factory=lambda: Record(step=0, version=0, state_step=0, groups_trained=0))
    updates: int = 1  # optimizer updates per trainer step (trainer.updates_per_batch; 1 for sft)


def objective(cfg: TrainerConfig, rollout: RolloutConfig, *, source_dir: Path, where: Placement) -> Update:
    """The update of `cfg.objective` with its options bound; for grpo with a KL term, the frozen
    reference (the initial model) is loaded here, in the model's dtype (no master weights: it is
    never trained), placed and sharded like the policy. The GRPO family's log-probs are those of
    the generators' sampling distribution (`rollout`'s temperature, top_k, top_p)."""
    if cfg.objective == "sft":
        return partial(sft_step, micro_batch_size=cfg.micro_batch_size, micro_batch_tokens=cfg.micro_batch_tokens,
                       max_grad_norm=cfg.max_grad_norm, chunk_tokens=cfg.logits_chunk_tokens)
    ref_model = None
    if kl_coef_of(cfg.loss) > 0:  # the frozen reference: the initial model
        frozen = replace(where, master_fp32=False, activation_checkpointing=False)
        ref_model = place(load_model(source_dir, frozen.weights_dtype), frozen).eval().requires_grad_(False)
    return partial(train_step, loss=cfg.loss, ref_model=ref_model, temperature=rollout.temperature,
                   top_k=rollout.top_k, top_p=rollout.top_p, max_new_tokens=rollout.max_new_tokens,
                   estimator=cfg.advantage, overlong=cfg.overlong, overlong_penalty=cfg.overlong_penalty,
                   micro_batch_size=cfg.micro_batch_size, micro_batch_tokens=cfg.micro_batch_tokens,
                   updates=cfg.updates_per_batch, max_grad_norm=cfg.max_grad_norm,
                   chunk_tokens=cfg.logits_chunk_tokens, share_prompts=cfg.share_prompts)


def train(state: State, update: Update, groups: list[SampleGroup], *, r: redis.Redis,
          keys: Keys) -> tuple[dict[str, float], float]:
    """One trainer step on this rank's `groups`: the update, then the lr schedule's step. Returns
    the update's stats and the lr it used. A step whose every optimizer update was skipped (a
    non-finite loss or gradient norm) left the weights as they were: it is not counted (the step,
    the schedule and the published version stay), its groups are spent all the same."""
    lr = state.optimizer.param_groups[0]["lr"]
    stats = update(state.model, state.optimizer, groups, step=state.step)
    skipped = int(stats.get("steps_skipped", 0))
    if skipped:
        if is_main():
            count_skipped(r, keys, skipped)
        say(f"trainer: {skipped} update(s) of step {state.step + 1} skipped: non-finite loss or gradient norm")
    if skipped < state.updates:
        state.scheduler.step()
        state.step += 1
    return stats, lr


def gather_groups(r: redis.Redis, keys: Keys, got: Collected, rank: int) -> tuple[list[Collected], list[SampleGroup]]:
    """Every rank's collected groups (for the acknowledgement and the metrics), a group two ranks
    read kept once and counted as a duplicate; and the groups this rank trains on."""
    gathered = gather(got)
    everyone, mine = cross_rank_duplicates(gathered, rank)
    if rank == 0:
        for _ in range(sum(c.duplicate for c in everyone) - sum(c.duplicate for c in gathered)):
            count_refused(r, keys, Refused.DUPLICATE)
    return everyone, mine


def cross_rank_duplicates(everyone: list[Collected], rank: int) -> tuple[list[Collected], list[SampleGroup]]:
    """Two copies of one group (two generators raced on a reclaimed prompt) read by two ranks in
    the same step: `everyone` with each group id kept at its first rank only (each dropped copy
    counts as a duplicate; its entry stays, to be acknowledged), and the groups rank `rank` trains
    on, where a dropped copy stays with nothing to train on (every loss mask 0), so that every rank
    keeps its rows for the step's collectives."""
    seen: set[str] = set()
    out, mine = [], []
    for n, got in enumerate(everyone):
        keep = [g for g in got.groups if g.id not in seen]
        seen.update(g.id for g in keep)
        out.append(replace(got, groups=keep, duplicate=got.duplicate + len(got.groups) - len(keep)))
        if n == rank:
            kept = {id(g) for g in keep}
            mine = [g if id(g) in kept else replace(g, completions=[
                replace(c, loss_mask=[0] * len(c.ids)) for c in g.completions]) for g in got.groups]
    return out, mine


def checkpoint(r: redis.Redis, keys: Keys, state: State, *, save: bool, config: Config, source_dir: Path,
               state_root: Path) -> WeightVersion | None:
    """Publish the weights of `state.step` (every rank takes part); with `save`, the trainer state
    too, and acknowledge every group trained since the last. Rank 0 alone gets the WeightVersion."""
    cfg = config.trainer
    newest = state_dir(state_root, state.record.state_step)
    if any_rank(state.record.state_step > 0 and not newest.is_dir()):
        save = True  # a restart would have nothing to resume from: save one now
        if is_main():
            count_fault(r, keys, Fault.STATE_LOST)
        say(f"trainer: its newest saved state {newest} is gone (the output directory deleted?); "
            f"saving the trainer state of step {state.step} now")
    try:
        wv = publish(r, keys, state.model, state.optimizer, state.scheduler, step=state.step,
                     checkpoint_dir=config.checkpoint_dir, state_root=state_root, source_dir=source_dir,
                     keep=cfg.keep_checkpoints, save_state_now=save,
                     entry_ids=state.unacked_entries if save else [], group_ids=state.unacked_ids if save else [],
                     dedup_window=cfg.dedup_window, dtype=DTYPES[config.model.dtype])
    except OSError as err:  # a full disk, most often: nothing was announced
        raise publish_failed(r, keys, state, err, checkpoint_dir=config.checkpoint_dir, state_root=state_root,
                             keep=cfg.keep_checkpoints) from err
    state.record.published(wv, step=state.step, saved=save, group_ids=state.unacked_ids if save else [],
                           dedup_window=cfg.dedup_window)
    if save:
        state.unacked_entries, state.unacked_ids = [], []
    return wv


class PublishFailed(RuntimeError):
    """A checkpoint or trainer state could not be written (a full disk): nothing was announced, and
    the trainer stops; the text says where a restart resumes."""


def publish_failed(r: redis.Redis, keys: Keys, state: State, err: OSError, *, checkpoint_dir: Path,
                   state_root: Path, keep: int) -> PublishFailed:
    """Count a publish whose files could not be written, remove what it half wrote (space a full
    disk needs back), and say what stands: the weights generators have, the state a restart resumes
    from. Every group trained since that state is still pending, to be trained again."""
    remove_unfinished(checkpoint_dir)
    prune_states(state_root, keep=keep)  # its half-written state
    if is_main():
        count_fault(r, keys, Fault.PUBLISH_FAILED)
    return PublishFailed(
        f"publishing step {state.step} failed: {err}. Nothing was announced: generators keep version "
        f"{state.record.version}, and the groups trained since the saved state of step {state.record.state_step} "
        f"stay pending. Stopping; free the space and start the trainer again: it resumes from that state")


def publish_if_due(r: redis.Redis, keys: Keys, state: State, *, last: bool, config: Config, source_dir: Path,
                   state_root: Path) -> None:
    """After a step: publish every `sync_every` steps and at the `last`, saving the trainer state
    every `state_every` (and at the last), and queue the evaluation of every `eval.every`-th
    version; between publishes rank 0 records the step alone."""
    cfg = config.trainer
    if state.step % cfg.sync_every == 0 or last:
        state.version = state.step
        save = state.step % (cfg.state_every or cfg.sync_every) == 0 or last
        wv = checkpoint(r, keys, state, save=save, config=config, source_dir=source_dir, state_root=state_root)
        if wv is not None and config.eval.every and wv.version % config.eval.every == 0:
            enqueue_eval(r, config, hold_for_eval(wv))  # the evaluator process scores it on held-out problems
    elif is_main():
        write_step(r, keys, step=state.step)
        state.record.step = state.step


def note_going_back(state: State) -> None:
    """Say so when the trainer resumed from a state older than its last publish (a stop between a
    publish and the next saved state): it publishes those step numbers again, with other weights;
    `resume` kept the highest version published before in Redis, and groups sampled with the
    abandoned versions are dropped as stale (trainer/samples.py)."""
    if state.record.version_max <= state.step:
        return
    low, high = state.step + 1, state.record.version_max
    versions = f"version {high}" if low == high else f"versions {low}-{high}"
    say(f"trainer: resuming at step {state.step}, below version {high} it had published: groups sampled with "
        f"{versions} before this start used weights it abandoned, and are dropped as stale")


def check_redis(r: redis.Redis, keys: Keys, state: State, *, consumer: str) -> None:
    """Before a step: read this rank's pending entries again when it holds entries it never saw,
    and put Redis right first if it lost writes the trainer made (trainer/record.py).

    A read whose reply was lost (a socket timeout on a loaded machine, retried by the client) left
    entries delivered to this rank that it never received: pending under its name, never trained,
    never acknowledged, holding back the trimming of the stream for good. Re-reading the pending
    entries from the start finds them; those already trained and awaiting the next saved state
    are passed over (collect's `skip`), and any it trained before come round as duplicates."""
    if stranded(r, keys, state, consumer=consumer):
        say(f"trainer: {consumer} holds pending entries it never received (a lost reply); reading them again")
        state.cursor = b"0"
    if any_rank(put_right_if_lost(r, keys, state)):
        state.cursor = b"0"


def republish_if_gone(r: redis.Redis, keys: Keys, state: State, *, agree: bool, config: Config, source_dir: Path,
                      state_root: Path) -> None:
    """Publish the weights of `state.step` again when the newest published checkpoint's directory
    is gone (deleted, the output directory with it): generators cannot load it and go on sampling
    with older weights, whose groups soon all grow too stale to train, so that no step would ever
    end. `agree`: every rank decides together (a collective); else rank 0 decides alone, which
    only a trainer of world size 1 may (between reads, while a step waits for groups)."""
    latest = latest_weights(r, keys) if is_main() else None
    gone = latest is not None and not Path(latest.path).is_dir()
    if agree:
        gone = any_rank(gone)
    if not gone:
        return
    if latest is not None:
        count_fault(r, keys, Fault.WEIGHTS_LOST)
        say(f"trainer: the published checkpoint {latest.path} (version {latest.version}) is gone and generators "
            f"cannot load it; publishing the weights of step {state.step} again")
    state.version = state.step
    checkpoint(r, keys, state, save=True, config=config, source_dir=source_dir, state_root=state_root)


def put_right_if_lost(r: redis.Redis, keys: Keys, state: State) -> bool:
    """Rank 0: if Redis has lost writes the trainer made, write its record back (no collectives:
    also called between reads while a step waits for groups, for the generators, stuck on weights
    Redis forgot, sample only groups too stale to train until it is put right)."""
    if not (is_main() and forgotten(read_trainer(r, keys), state.record)):
        return False
    had = put_right(r, keys, state.record)
    say(f"trainer: Redis had lost writes (it said step {had.step}, saved state {had.state_step}, "
        f"{had.groups_trained} groups trained; the trainer is at step {state.record.step}, saved state "
        f"{state.record.state_step}, {state.record.groups_trained} groups trained): written back")
    return True


def between_reads(r: redis.Redis, keys: Keys, state: State, *, world: int, config: Config, source_dir: Path,
                  state_root: Path) -> None:
    """While a step waits for groups: what cannot wait for the next step (see the two callees)."""
    put_right_if_lost(r, keys, state)
    if world == 1:
        republish_if_gone(r, keys, state, agree=False, config=config, source_dir=source_dir, state_root=state_root)


def stranded(r: redis.Redis, keys: Keys, state: State, *, consumer: str) -> bool:
    """Whether `consumer` has entries pending that the trainer does not hold (every entry it
    holds between steps awaits the next saved state, in `state.unacked_entries`)."""
    held = set(state.unacked_entries)
    pending = r.xpending_range(keys.samples, TRAINER_GROUP, "-", "+", len(held) + 1, consumername=consumer)
    return any(p["message_id"] not in held for p in pending)


def wind_up(r: redis.Redis, keys: Keys, state: State, tracker: Tracker | None, *, config: Config,
            source_dir: Path, state_root: Path) -> None:
    """After the last step: publish what was trained since the last checkpoint (a stop while
    waiting for data), close the tracker, leave the process group."""
    if state.unacked_ids:
        checkpoint(r, keys, state, save=True, config=config, source_dir=source_dir, state_root=state_root)
    if tracker is not None:
        tracker.close()
    say(f"trainer: stopped at step {state.step}")
    finish()


def run(config: Config) -> None:
    cfg, rollout = config.trainer, config.rollout
    hf_logging.disable_progress_bar()  # one console line per step, not progress bars
    rank, world = init_distributed()
    assert rollout.prompts_per_step % world == 0, (
        f"rollout.prompts_per_step = {rollout.prompts_per_step} must be a multiple of the world size {world}")
    keys = Keys(config.run)
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads or torch.get_num_threads())  # 0: torch's default
    source_dir = resolve_model_path(config.model.path)
    state_root = Path(config.output_dir) / "trainer_state"  # DCP trainer state beside each checkpoint
    if rank == 0:
        remove_unfinished(config.checkpoint_dir)
    shutdown = Shutdown(grace_s=stop_grace_s())

    # ---- connect, and resume from the newest published checkpoint if this run has one
    r = connect(config.redis_url)
    ensure_group(r, keys.samples, TRAINER_GROUP)
    where = placement(dtype=config.model.dtype, master_fp32=cfg.master_fp32,
                      activation_checkpointing=cfg.activation_checkpointing)
    model, optimizer, scheduler, step = resume(
        r, keys, where=where, source_dir=source_dir, state_root=state_root, lr=cfg.lr, weight_decay=cfg.weight_decay,
        lr_schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps, total_steps=cfg.total_steps or cfg.max_steps,
        lora=cfg.lora)
    state = State(model, optimizer, scheduler, step=step, version=step, record=Record.of(read_trainer(r, keys)),
                  updates=1 if cfg.objective == "sft" else cfg.updates_per_batch)
    note_going_back(state)
    sft = cfg.objective == "sft"
    update = objective(cfg, rollout, source_dir=source_dir, where=where)
    tracker = Tracker(r, config) if rank == 0 else None
    say(f"trainer: run {config.run!r}, model {source_dir}, step {state.step}, "
        f"{rollout.prompts_per_step} groups per step, {world} rank(s) on {where.device.type}, "
        f"{config.model.dtype}{' (float32 master weights)' if where.weights_dtype != where.dtype else ''}")

    # ---- steps: collect groups, update, publish every sync_every steps
    # Every decision that leads to a collective (stop, train, publish) is agreed by all ranks.
    while not (cfg.max_steps and state.step >= cfg.max_steps) and not any_rank(shutdown.requested):
        t_step = time.monotonic()
        check_redis(r, keys, state, consumer=f"rank{rank}")
        republish_if_gone(r, keys, state, agree=True, config=config, source_dir=source_dir, state_root=state_root)
        got, state.cursor = collect(r, keys, want=rollout.prompts_per_step // world, step=state.step,
                                    max_staleness=None if sft else rollout.max_staleness,
                                    vocab_size=model.config.vocab_size,
                                    unpublished=set(state.unacked_ids), consumer=f"rank{rank}",
                                    cursor=state.cursor, shutdown=shutdown, objective=cfg.objective,
                                    limits=config.limits, trained=state.record.trained,
                                    skip=set(state.unacked_entries),
                                    between=partial(between_reads, r, keys, state, world=world, config=config,
                                                    source_dir=source_dir, state_root=state_root),
                                    abandoned_upto=state.record.version_max)
        if any_rank(got is None):  # a stop while waiting: what this rank read stays pending
            break
        everyone, mine = gather_groups(r, keys, got, rank)
        all_groups = [g for c in everyone for g in c.groups]
        staleness = [0 if sft else state.step - g.version for g in all_groups]  # sft data is never stale

        t_train = time.monotonic()
        shutdown.step_started(state.step + 1)
        stats, lr = train(state, update, mine, r=r, keys=keys)
        train_s = time.monotonic() - t_train
        state.unacked_entries += [e for c in everyone for e in c.entry_ids]
        state.unacked_ids += [g.id for g in all_groups]
        if stats.get("steps_skipped", 0) >= state.updates:  # nothing applied: nothing to publish or record
            continue

        t_publish = time.monotonic()
        last = any_rank(shutdown.requested) or (cfg.max_steps > 0 and state.step >= cfg.max_steps)
        publish_if_due(r, keys, state, last=last, config=config, source_dir=source_dir, state_root=state_root)
        publish_s = time.monotonic() - t_publish
        shutdown.step_ended()
        if rank == 0:
            metrics = step_record(r, keys, everyone, stats, step=state.step, version=state.version, lr=lr,
                                  staleness=staleness, sft=sft, t_step=t_step, train_s=train_s,
                                  publish_s=publish_s)
            tracker.log(metrics)
            print(summary_line(metrics), flush=True)

    wind_up(r, keys, state, tracker, config=config, source_dir=source_dir, state_root=state_root)
