"""The trainer: reads scored sample groups, takes GRPO steps, publishes weights, acknowledges.

With `trainer.objective = "sft"` the steps are supervised instead: cross-entropy on the loss-masked
completion tokens of groups of any size (the producer's sft sources), no advantages, and no
staleness limit (such groups carry version 0 and are never stale).

Versions. `step` counts trainer steps done (each is `updates_per_batch` optimizer steps on one
batch of groups; the lr schedule also counts trainer steps); the published weight `version` is
the step that wrote them, so with sync_every = 1 the two are equal after every step. A sample's staleness is
`step - sample.version`: how many optimizer steps the policy has moved since the weights that
sampled it (this is the DESIGN's "trainer version − sample version", counting unpublished steps
too, which is what the importance ratio has to bridge). The trainer hash holds both `step`
(written every step) and `version` (written only when a checkpoint is published); producers
admit against `version`.

Delivery. Groups are acknowledged, and added to the `trained` set, in the same transaction that
publishes the checkpoint holding their update; the samples stream is then trimmed of what every
consumer group (recorders included) has acknowledged (common/trim.py). The `trained` set guards
against a second group made from the same prompt (two generators racing on a reclaimed prompt); it
keeps the ids of the last `dedup_window` steps only: a copy arriving later than that was sampled
so long ago that the staleness limit drops it anyway, unless a generator sat on a claimed prompt
for that many steps before sampling it. A restarted trainer loads the newest published
checkpoint and the trainer state saved beside it (optimizer, scheduler, RNG: trainer/state.py),
continues from its step, and first re-reads its own pending entries in stream order, so it
trains on what an uninterrupted run would have and ends with the same weights. Entries it will
never train on (undecodable, duplicate, too stale) are acknowledged at once and counted.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import redis
import torch
from evaluator.queue import enqueue_eval
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from common.checkpoints import checksum_dir, verify_dir
from common.config import Config, LimitsConfig
from common.keys import PAYLOAD, TRAINER_GROUP, WEIGHTS_MAXLEN, Keys
from common.messages import MessageError, SampleGroup, WeightVersion, decode_group, encode
from common.models import resolve_model_path
from common.streams import connect, dead_letter, ensure_group, latest_weights
from common.trim import trim_acknowledged
from trainer.batch import micro_batches
from trainer.grpo import Estimator, LossOptions, grpo_loss, sft_loss, token_entropy, token_logprobs
from trainer.parallel import (
    all_max,
    all_sum,
    any_rank,
    finish,
    full_state_dict,
    gather,
    init_distributed,
    is_main,
    parallelize,
    world_size,
)
from trainer.schedule import build_scheduler
from trainer.state import load_state, save_state, state_dir
from trainer.tracking import Tracker, generator_metrics

BLOCK_MS = 1000  # longest wait on the samples stream before checking for a stop request
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


class Shutdown:
    """Two-stage shutdown: the first SIGTERM/SIGINT asks the loop to finish its step, the second exits."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            print("trainer: second signal, exiting now", file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = True
        print(f"trainer: {signal.Signals(signum).name}: finishing the current step "
              "(again to exit at once)", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- reading samples


@dataclass
class Collected:
    """The sample groups of one step, and what was turned away while collecting them."""

    groups: list[SampleGroup] = field(default_factory=list)
    entry_ids: list[bytes] = field(default_factory=list)  # stream entries of `groups`, to ack on publish
    dead: int = 0
    duplicate: int = 0
    stale: int = 0
    wait_s: float = 0.0  # seconds blocked on the stream with nothing to read


def read_entries(r: redis.Redis, keys: Keys, *, consumer: str, cursor: bytes | None, count: int
                 ) -> tuple[list[tuple[bytes, dict]], bytes | None]:
    """Up to `count` entries, and the cursor to read from next.

    `cursor` walks this consumer's own pending entries (read but never acknowledged by an
    earlier incarnation) from "0"; once they are exhausted it becomes None and reads are of new
    entries (">"), blocking up to BLOCK_MS.
    """
    if cursor is not None:
        reply = r.xreadgroup(TRAINER_GROUP, consumer, {keys.samples: cursor}, count=count)
        entries = reply[0][1] if reply else []
        if entries:
            return [(eid, fields or {}) for eid, fields in entries], entries[-1][0]
    reply = r.xreadgroup(TRAINER_GROUP, consumer, {keys.samples: ">"}, count=count, block=BLOCK_MS)
    return [(eid, fields or {}) for eid, fields in (reply[0][1] if reply else [])], None


def validate(fields: dict, *, vocab_size: int, objective: str = "grpo", limits: LimitsConfig | None = None
             ) -> SampleGroup:
    """The entry's group, or MessageError saying why it cannot be trained on (None: default limits)."""
    limits = limits or LimitsConfig()
    blob = fields.get(PAYLOAD)
    if blob is None:
        raise MessageError(f"entry has no payload field {PAYLOAD!r} (fields: {sorted(fields)})")
    group = decode_group(blob, vocab_size=vocab_size, max_bytes=limits.max_message_bytes,
                         max_tokens=limits.max_completion_tokens, max_completions=limits.max_group_size)
    if objective == "grpo" and len(group.completions) < 2:
        raise MessageError(f"group {group.id}: {len(group.completions)} completion(s); "
                           "a group-relative advantage needs at least 2")
    if not any(c.loss_mask is None or any(c.loss_mask) for c in group.completions):
        raise MessageError(f"group {group.id}: loss_mask is 0 everywhere; nothing to train on")
    return group


def reject(r: redis.Redis, keys: Keys, entry_id: bytes, *, counter: str,
           fields: dict | None = None, reason: str = "") -> None:
    """Acknowledge an entry that will never be trained on and count it (dead-letter it if `fields`)."""
    pipe = r.pipeline(transaction=True)
    if fields is not None:
        dead_letter(pipe, dead_stream=keys.samples_dead, source=keys.samples, entry_id=entry_id,
                    fields=fields, reason=reason)
    pipe.xack(keys.samples, TRAINER_GROUP, entry_id)
    pipe.hincrby(keys.trainer, counter, 1)
    pipe.execute()


def collect(r: redis.Redis, keys: Keys, *, want: int, step: int, max_staleness: int | None, vocab_size: int,
            unpublished: set[str], consumer: str, cursor: bytes | None, shutdown: Shutdown,
            objective: str = "grpo", limits: LimitsConfig | None = None) -> tuple[Collected | None, bytes | None]:
    """`want` trainable groups (None if a stop was requested first), and the next read cursor.
    `max_staleness` None: no group is too stale (sft)."""
    got = Collected()
    seen = set(unpublished)
    while len(got.groups) < want:
        if shutdown.requested:
            return None, cursor
        t0 = time.monotonic()
        entries, cursor = read_entries(r, keys, consumer=consumer, cursor=cursor, count=want - len(got.groups))
        if not entries:
            got.wait_s += time.monotonic() - t0
        for entry_id, fields in entries:
            try:
                group = validate(fields, vocab_size=vocab_size, objective=objective, limits=limits)
            except MessageError as err:
                reject(r, keys, entry_id, counter="groups_dead", fields=fields, reason=str(err))
                print(f"trainer: dead-lettered sample entry {entry_id.decode()}: {err}",
                      file=sys.stderr, flush=True)
                got.dead += 1
                continue
            if group.id in seen or r.zscore(keys.trained, group.id) is not None:
                reject(r, keys, entry_id, counter="groups_duplicate")
                got.duplicate += 1
                continue
            if max_staleness is not None and step - group.version > max_staleness:
                reject(r, keys, entry_id, counter="groups_dropped_stale")
                got.stale += 1
                continue
            seen.add(group.id)
            got.groups.append(group)
            got.entry_ids.append(entry_id)
    return got, cursor


# --------------------------------------------------------------------------- the update


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
               loss: LossOptions, ref_model: torch.nn.Module | None, temperature: float,
               estimator: Estimator, overlong: str, overlong_penalty: float, micro_batch_size: int,
               micro_batch_tokens: int, updates: int, recompute_old_logp: bool,
               max_grad_norm: float) -> dict[str, float]:
    """`updates` optimizer steps of the GRPO family over `groups`, gradients accumulated over micro-batches.

    The PPO ratio is taken against the policy at the start of the step: a no-grad pass when
    `updates` > 1 or `recompute_old_logp`, else the behaviour log-probs stand in for it. Stats
    are averaged over the updates; entropy is that of the policy that started the step.

    Under torchrun each rank passes its own groups: token and sequence counts are summed over the
    ranks, so the loss is normalised by the global count and any world size gives the same
    update (FSDP averages gradients over ranks: the loss is scaled by the world size to undo it).
    Ranks run the same number of micro-batches (FSDP's collectives pair up); a rank short of
    them repeats its last one with an empty mask, which adds nothing.
    """
    batches, total_tokens, total_seqs = micro_batches(
        groups, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
        estimator=estimator, overlong=overlong, overlong_penalty=overlong_penalty)
    tokens_in = sum(int(mb.attention_mask.sum()) for mb in batches)
    world = world_size()
    total_tokens, total_seqs, tokens_in = (int(x) for x in all_sum([total_tokens, total_seqs, tokens_in]))
    empty = replace(batches[-1], mask=torch.zeros_like(batches[-1].mask))
    batches += [empty] * (all_max(len(batches)) - len(batches))
    base = {"tokens/trained": float(total_tokens), "tokens/forward": 0.0}
    if total_tokens == 0:  # every completion masked (overlong = "mask"): nothing to learn from
        return {**base, "loss/policy": 0.0, "grad_norm": 0.0, "entropy": 0.0, "kl": 0.0,
                "clip_ratio/low_mean": 0.0, "clip_ratio/high_mean": 0.0, "clip_ratio/region_mean": 0.0,
                "ratio/mean": 1.0, "tis/mean": 1.0}

    def forward_logp(m: torch.nn.Module, mb) -> tuple[torch.Tensor, torch.Tensor]:
        logits = m(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        return token_logprobs(logits, mb.targets, temperature), logits  # (B, T), (B, T, V)

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
            logp, logits = forward_logp(model, mb)
            mb_loss, mb_stats = grpo_loss(
                logp, mb.behaviour_logp, mb.advantages, mb.mask, old_logp=old_logp, ref_logp=ref_logp,
                total_tokens=total_tokens, total_seqs=total_seqs, clip_low=loss.clip_low,
                clip_high=loss.clip_high, ratio_level=loss.ratio_level, aggregation=loss.aggregation,
                tis_cap=loss.tis_cap, kl_coef=loss.kl_coef, kl_estimator=loss.kl_estimator)
            (mb_loss * world).backward()
            stats["loss/policy"] += mb_loss.item() / updates
            for k, v in mb_stats.items():  # each is a share of total_tokens: they add up
                stats[k] = stats.get(k, 0.0) + v / updates
            if update == 0:
                stats["entropy"] += (token_entropy(logits, temperature) * mb.mask).sum().item() / total_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
        if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
            grad_norm = grad_norm.full_tensor()
        optimizer.step()
        stats["grad_norm"] += float(grad_norm) / world / updates  # summed over ranks below
    names = sorted(stats)
    stats = dict(zip(names, all_sum([stats[k] for k in names]), strict=True))  # shares of global counts
    return {**stats, **base, "tokens/forward": float(tokens_in * updates)}


def sft_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
             micro_batch_size: int, micro_batch_tokens: int, max_grad_norm: float) -> dict[str, float]:
    """One optimizer step of supervised cross-entropy over `groups`' loss-masked completion
    tokens, normalised by the global masked-token count as `train_step`'s token_mean (so any
    world size gives the same update); the same padding of ranks short of micro-batches."""
    batches, total_tokens, _ = micro_batches(groups, micro_batch_size=micro_batch_size,
                                             micro_batch_tokens=micro_batch_tokens, objective="sft")
    tokens_in = sum(int(mb.attention_mask.sum()) for mb in batches)
    world = world_size()
    total_tokens, tokens_in = (int(x) for x in all_sum([total_tokens, tokens_in]))
    empty = replace(batches[-1], mask=torch.zeros_like(batches[-1].mask))
    batches += [empty] * (all_max(len(batches)) - len(batches))
    base = {"tokens/trained": float(total_tokens), "tokens/forward": float(tokens_in)}
    if total_tokens == 0:
        return {**base, "loss/sft": 0.0, "grad_norm": 0.0, "entropy": 0.0}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    stats = {"loss/sft": 0.0, "entropy": 0.0}
    for mb in batches:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        mb_loss = sft_loss(token_logprobs(logits, mb.targets, 1.0), mb.mask, total_tokens=total_tokens)
        (mb_loss * world).backward()
        stats["loss/sft"] += mb_loss.item()
        stats["entropy"] += (token_entropy(logits, 1.0) * mb.mask).sum().item() / total_tokens
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # a DTensor under FSDP
        grad_norm = grad_norm.full_tensor()
    optimizer.step()
    stats["grad_norm"] = float(grad_norm) / world  # summed over ranks below
    names = sorted(stats)
    stats = dict(zip(names, all_sum([stats[k] for k in names]), strict=True))
    return {**stats, **base}


# --------------------------------------------------------------------------- publishing


def copy_tokenizer_files(source: Path, dest: Path) -> None:
    """Copy what `dest` lacks from `source` (tokenizer, chat template), weights excepted."""
    for f in source.iterdir():
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(WEIGHT_SUFFIXES) \
                and not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)


def save_checkpoint(model: torch.nn.Module, *, checkpoint_dir: Path, step: int, source_dir: Path,
                    state_dict: dict[str, torch.Tensor] | None = None) -> Path:
    """Write `checkpoint_dir/step_{step}` as a complete HF directory: temporary name, then rename.

    `state_dict`: the gathered weights of a sharded model; None saves the model's own.
    """
    tmp = checkpoint_dir / f".step_{step}.tmp"
    final = checkpoint_dir / f"step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, state_dict=state_dict, safe_serialization=True)
    copy_tokenizer_files(source_dir, tmp)
    if final.exists():  # written by a run that crashed before publishing it: never seen by anyone
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final.resolve()


def prune_checkpoints(checkpoint_dir: Path, *, keep: int) -> None:
    """Delete all but the newest `keep` step_N directories."""
    dirs = sorted((p for p in checkpoint_dir.glob("step_*") if p.name[5:].isdigit()),
                  key=lambda p: int(p.name[5:]))
    for old in dirs[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def publish(r: redis.Redis, keys: Keys, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: torch.optim.lr_scheduler.LRScheduler, *, step: int, checkpoint_dir: Path,
            state_root: Path, source_dir: Path, keep: int, save_state_now: bool, entry_ids: list[bytes],
            group_ids: list[str], dedup_window: int) -> WeightVersion | None:
    """Checkpoint and trainer state on disk, then in one transaction: announce it and
    acknowledge the groups it holds (every rank's: `entry_ids` and `group_ids` are global).

    Every rank takes part (gathering the weights, writing its state shards); rank 0 writes the
    checkpoint and talks to Redis, and alone returns the WeightVersion.
    """
    weights = full_state_dict(model)
    path = save_checkpoint(model, checkpoint_dir=checkpoint_dir, step=step, source_dir=source_dir,
                           state_dict=weights) if is_main() else None
    assert save_state_now or not entry_ids, "groups are acknowledged only with a saved trainer state"
    if save_state_now:
        save_state(model, optimizer, scheduler, step=step, state_root=state_root, keep=keep)
    if not is_main():
        return None
    wv = WeightVersion(version=step, step=step, path=str(path), format="safetensors",
                       checksums=checksum_dir(path), created_at=time.time())
    blob = encode(wv)
    pipe = r.pipeline(transaction=True)
    pipe.xadd(keys.weights, {PAYLOAD: blob}, maxlen=WEIGHTS_MAXLEN, approximate=True)
    pipe.set(keys.weights_latest, blob)
    pipe.hset(keys.trainer, mapping={"step": step, "version": step})
    if save_state_now:
        pipe.hset(keys.trainer, "state_step", step)
    if entry_ids:
        pipe.xack(keys.samples, TRAINER_GROUP, *entry_ids)
        pipe.zadd(keys.trained, dict.fromkeys(group_ids, step))
        pipe.zremrangebyscore(keys.trained, "-inf", f"({step - dedup_window}")
    pipe.hincrby(keys.trainer, "groups_trained", len(group_ids))
    pipe.execute()
    trim_acknowledged(r, keys.samples)  # what every group has acknowledged; nothing of ours is pending
    prune_checkpoints(checkpoint_dir, keep=keep)
    return wv


# --------------------------------------------------------------------------- metrics


def step_metrics(groups: list[SampleGroup], *, step: int, staleness: list[int], rewarded: bool = True) -> dict:
    """Reward, accuracy, length and staleness metrics of one step's groups (TRL's names).

    Reward fields are None where there are none to report: unrewarded (sft) groups, or no group
    of 2 or more completions for the per-group std."""
    completions = [c for g in groups for c in g.completions]
    rewards = torch.tensor([c.reward for c in completions], dtype=torch.float64)
    group_std = [torch.tensor([c.reward for c in g.completions], dtype=torch.float64).std().item()
                 for g in groups if len(g.completions) >= 2] if rewarded else []
    correct = [c.rewards["correct"] for c in completions if "correct" in c.rewards]
    lengths = [len(c.ids) for c in completions]
    return {
        "reward/mean": rewards.mean().item() if rewarded else None,
        # mean of per-group stds, as TRL's reward_std
        "reward/std": sum(group_std) / len(group_std) if group_std else None,
        "accuracy": sum(correct) / len(correct) if correct else None,
        "frac_reward_zero_std": sum(s < 1e-8 for s in group_std) / len(group_std) if group_std else None,
        # completions whose reward function raised, timed out or returned garbage (scored 0)
        "reward/errors": sum(c.reward_error is not None for c in completions) if rewarded else None,
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/max_length": max(lengths),
        "staleness/mean": sum(staleness) / len(staleness),
        "staleness/max": max(staleness),
    }


def summary_line(m: dict) -> str:
    def num(key: str, spec: str) -> str:
        return "  -  " if m.get(key) is None else format(m[key], spec)

    loss = f"sft {m['loss/sft']:.4f}" if "loss/sft" in m else f"loss {num('loss/policy', '+.4f')}"
    return (f"step {m['step']:4d} | reward {num('reward/mean', '.3f')} | acc {num('accuracy', '.3f')} | "
            f"len {m['completions/mean_length']:5.1f} | stale {m['staleness/mean']:.1f}/{m['staleness/max']} | "
            f"{loss} | ent {m['entropy']:.3f} | lr {m['lr']:.2e} | {m['time/step']:.2f}s")


# --------------------------------------------------------------------------- the run


def load_model(path: Path) -> torch.nn.Module:
    """The model in checkpoint directory `path`, from its safetensors only: a pickled
    `pytorch_model.bin` can run code when loaded, so a directory without safetensors is refused."""
    from common.models import ModelError

    if not any(Path(path).glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in Path(path).glob("*.bin"))) or "no weights"
        raise ModelError(f"model at {path}: no .safetensors weights ({found}); the trainer loads safetensors "
                         "only, never pickle: save the model with save_pretrained(..., safe_serialization=True)")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, use_safetensors=True)


def run(config: Config) -> None:
    cfg, rollout = config.trainer, config.rollout
    hf_logging.disable_progress_bar()  # one console line per step, not progress bars
    rank, world = init_distributed()
    assert rollout.prompts_per_step % world == 0, (
        f"rollout.prompts_per_step = {rollout.prompts_per_step} must be a multiple of the world size {world}")
    consumer = f"rank{rank}"  # each rank its own consumer in the trainer group

    def say(line: str) -> None:  # the console is rank 0's
        if rank == 0:
            print(line, flush=True)

    keys = Keys(config.run)
    torch.manual_seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    source_dir = resolve_model_path(config.model.path)
    checkpoint_dir = config.checkpoint_dir
    state_root = Path(config.output_dir) / "trainer_state"  # DCP trainer state beside each checkpoint
    if rank == 0:
        for tmp in checkpoint_dir.glob(".step_*.tmp"):  # half-written by a trainer that was killed
            shutil.rmtree(tmp, ignore_errors=True)
    shutdown = Shutdown()

    # ---- connect, and resume from the newest published checkpoint if this run has one
    r = connect(config.redis_url)
    ensure_group(r, keys.samples, TRAINER_GROUP)
    if rank == 0 and r.type(keys.trained) == b"set":  # a run from before the set had steps
        old = list(r.smembers(keys.trained))
        with r.pipeline(transaction=True) as pipe:
            pipe.delete(keys.trained)
            pipe.zadd(keys.trained, dict.fromkeys(old, int(r.hget(keys.trainer, "state_step") or 0)))
            pipe.execute()
    step = int(r.hget(keys.trainer, "step") or 0)
    state_step = int(r.hget(keys.trainer, "state_step") or 0)
    latest = latest_weights(r, keys) if step > 0 else None
    # Published weights hold groups still pending when no state was saved yet (state_every >
    # sync_every): nothing acknowledged, so the initial model is the state to re-train them from.
    acknowledged = state_step > 0 or int(r.hget(keys.trainer, "groups_trained") or 0) > 0
    if state_step > 0 and state_dir(state_root, state_step).is_dir():
        # The newest saved state holds the weights too: every group trained after it is still
        # pending and is re-trained, in order, reproducing the versions published since.
        model = load_model(source_dir)
        step = state_step
    elif latest is not None and acknowledged:
        verify_dir(latest.path, latest.checksums)
        model = load_model(Path(latest.path))
        step = latest.step
    else:
        if step > 0:
            say(f"trainer: run {config.run!r} reached step {step} but saved no trainer state; "
                "re-training its groups from the initial model")
            step = 0
        model = load_model(source_dir)
    version = step  # the newest published weights (the initial ones are version 0)
    if rank == 0:
        r.hset(keys.trainer, mapping={"step": step, "version": version})
    vocab_size = model.config.vocab_size
    model = parallelize(model)  # FSDP2 under torchrun; as it is in a single process
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    scheduler = build_scheduler(optimizer, schedule=cfg.lr_schedule, warmup_steps=cfg.warmup_steps,
                                total_steps=cfg.total_steps or cfg.max_steps)
    if step > 0:
        state = state_dir(state_root, step)
        if state.is_dir():
            load_state(model, optimizer, scheduler, path=state)
            say(f"trainer: resuming at step {step} from its trainer state {state}")
        else:
            say(f"trainer: resuming at step {step} from {latest.path}; no trainer state at {state}, "
                "so AdamW and the lr schedule start fresh")
    sft = cfg.objective == "sft"
    ref_model = None
    if cfg.kl_coef > 0 and not sft:  # the frozen reference: the initial model
        ref_model = load_model(source_dir).eval().requires_grad_(False)
    loss = LossOptions(clip_low=cfg.clip_low, clip_high=cfg.clip_high, ratio_level=cfg.ratio_level,
                       aggregation=cfg.loss_agg, tis_cap=cfg.tis_cap, kl_coef=cfg.kl_coef,
                       kl_estimator=cfg.kl_estimator)
    tracker = Tracker(r, config) if rank == 0 else None
    say(f"trainer: run {config.run!r}, model {source_dir}, step {step}, "
        f"{rollout.prompts_per_step} groups per step, {world} rank(s)")

    # ---- steps: collect groups, update, publish every sync_every steps
    cursor: bytes | None = b"0"  # first re-read our own pending entries
    unacked_entries: list[bytes] = []  # trained since the last saved state: acknowledged with the next
    unacked_ids: list[str] = []
    # Every decision that leads to a collective (stop, train, publish) is agreed by all ranks.
    while not (cfg.max_steps and step >= cfg.max_steps) and not any_rank(shutdown.requested):
        t_step = time.monotonic()
        got, cursor = collect(r, keys, want=rollout.prompts_per_step // world, step=step,
                              max_staleness=None if sft else rollout.max_staleness, vocab_size=vocab_size,
                              unpublished=set(unacked_ids), consumer=consumer, cursor=cursor,
                              shutdown=shutdown, objective=cfg.objective, limits=config.limits)
        if any_rank(got is None):  # a stop while waiting: what this rank read stays pending
            break
        everyone = gather(got)  # every rank's groups, for the acknowledgement and the metrics
        all_groups = [g for c in everyone for g in c.groups]
        staleness = [0 if sft else step - g.version for g in all_groups]  # sft data is never stale

        t_train = time.monotonic()
        lr = optimizer.param_groups[0]["lr"]
        if sft:
            stats = sft_step(model, optimizer, got.groups, micro_batch_size=cfg.micro_batch_size,
                             micro_batch_tokens=cfg.micro_batch_tokens, max_grad_norm=cfg.max_grad_norm)
        else:
            stats = train_step(model, optimizer, got.groups, loss=loss, ref_model=ref_model,
                               temperature=rollout.temperature, estimator=cfg.advantage,
                               overlong=cfg.overlong, overlong_penalty=cfg.overlong_penalty,
                               micro_batch_size=cfg.micro_batch_size,
                               micro_batch_tokens=cfg.micro_batch_tokens, updates=cfg.updates_per_batch,
                               recompute_old_logp=cfg.recompute_old_logp, max_grad_norm=cfg.max_grad_norm)
        scheduler.step()
        train_s = time.monotonic() - t_train
        step += 1
        unacked_entries += [e for c in everyone for e in c.entry_ids]
        unacked_ids += [g.id for g in all_groups]

        t_publish = time.monotonic()
        last = any_rank(shutdown.requested) or (cfg.max_steps > 0 and step >= cfg.max_steps)
        if step % cfg.sync_every == 0 or last:
            version = step
            save = step % (cfg.state_every or cfg.sync_every) == 0 or last
            wv = publish(r, keys, model, optimizer, scheduler, step=step, checkpoint_dir=checkpoint_dir,
                         state_root=state_root, source_dir=source_dir, keep=cfg.keep_checkpoints,
                         save_state_now=save, entry_ids=unacked_entries if save else [],
                         group_ids=unacked_ids if save else [], dedup_window=cfg.dedup_window)
            if save:
                unacked_entries, unacked_ids = [], []
            if wv is not None and config.eval.every and wv.version % config.eval.every == 0:
                enqueue_eval(r, config, wv)  # the evaluator process scores it on held-out problems
        elif rank == 0:
            r.hset(keys.trainer, "step", step)
        publish_s = time.monotonic() - t_publish
        if rank != 0:
            continue

        policy = {"clip_ratio": stats["clip_ratio/region_mean"],
                  **{k: v for k, v in stats.items() if k.startswith(("clip_ratio/", "ratio/", "tis/"))},
                  "loss/policy": stats["loss/policy"], "kl": stats["kl"]} if not sft \
            else {"loss/sft": stats["loss/sft"]}
        metrics = {
            "step": step,
            **step_metrics(all_groups, step=step, staleness=staleness, rewarded=not sft),
            **policy,
            "entropy": stats["entropy"],
            "grad_norm": stats["grad_norm"],
            "lr": lr,  # the rate this step's updates used
            "groups/dropped_stale": sum(c.stale for c in everyone),
            "groups/dead": sum(c.dead for c in everyone),
            "groups/duplicate": sum(c.duplicate for c in everyone),
            "tokens/trained": stats["tokens/trained"],
            "tokens_per_s": stats["tokens/forward"] / train_s,  # prompt + completion tokens through the model
            "time/step": time.monotonic() - t_step,
            "time/wait_data": max(c.wait_s for c in everyone),
            "time/train": train_s,
            "time/publish": publish_s,
            "version": version,
            **generator_metrics(r, keys),
            "group_ids": [g.id for g in all_groups],
        }
        tracker.log(metrics)
        print(summary_line(metrics), flush=True)

    # ---- a stop while waiting for data: publish what was trained since the last checkpoint
    if unacked_ids:
        publish(r, keys, model, optimizer, scheduler, step=step, checkpoint_dir=checkpoint_dir,
                state_root=state_root, source_dir=source_dir, keep=cfg.keep_checkpoints,
                save_state_now=True, entry_ids=unacked_entries, group_ids=unacked_ids,
                dedup_window=cfg.dedup_window)
    if tracker is not None:
        tracker.close()
    say(f"trainer: stopped at step {step}")
    finish()
