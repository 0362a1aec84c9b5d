"""The trainer: reads scored sample groups, takes GRPO steps, publishes weights, acknowledges.

Versions. `step` counts optimizer steps done; the published weight `version` is the step that
wrote them, so with sync_every = 1 the two are equal after every step. A sample's staleness is
`step - sample.version`: how many optimizer steps the policy has moved since the weights that
sampled it (this is the DESIGN's "trainer version − sample version", counting unpublished steps
too, which is what the importance ratio has to bridge). The trainer hash holds both `step`
(written every step) and `version` (written only when a checkpoint is published); producers
admit against `version`.

Delivery. Groups are acknowledged, and added to the `trained` set, in the same transaction that
publishes the checkpoint holding their update. A restarted trainer loads the newest published
checkpoint, continues from its step, and first re-reads its own pending entries, so it trains on
what an uninterrupted run would have. Entries it will never train on (undecodable, duplicate,
too stale) are acknowledged at once and counted.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import redis
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as hf_logging

from common.checkpoints import checksum_dir, verify_dir
from common.config import Config
from common.keys import METRICS_MAXLEN, PAYLOAD, TRAINER_GROUP, Keys
from common.messages import MessageError, SampleGroup, WeightVersion, decode_group, encode
from common.models import resolve_model_path
from common.streams import connect, dead_letter, ensure_group, latest_weights
from trainer.batch import micro_batches
from trainer.grpo import grpo_loss, token_logprobs

CONSUMER = "rank0"  # one consumer per trainer rank; world size 1 for now
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


def read_entries(r: redis.Redis, keys: Keys, *, cursor: bytes | None, count: int
                 ) -> tuple[list[tuple[bytes, dict]], bytes | None]:
    """Up to `count` entries, and the cursor to read from next.

    `cursor` walks this consumer's own pending entries (read but never acknowledged by an
    earlier incarnation) from "0"; once they are exhausted it becomes None and reads are of new
    entries (">"), blocking up to BLOCK_MS.
    """
    if cursor is not None:
        reply = r.xreadgroup(TRAINER_GROUP, CONSUMER, {keys.samples: cursor}, count=count)
        entries = reply[0][1] if reply else []
        if entries:
            return [(eid, fields or {}) for eid, fields in entries], entries[-1][0]
    reply = r.xreadgroup(TRAINER_GROUP, CONSUMER, {keys.samples: ">"}, count=count, block=BLOCK_MS)
    return [(eid, fields or {}) for eid, fields in (reply[0][1] if reply else [])], None


def validate(fields: dict, *, vocab_size: int) -> SampleGroup:
    """The entry's group, or MessageError saying why it cannot be trained on."""
    blob = fields.get(PAYLOAD)
    if blob is None:
        raise MessageError(f"entry has no payload field {PAYLOAD!r} (fields: {sorted(fields)})")
    group = decode_group(blob, vocab_size=vocab_size)
    if len(group.completions) < 2:
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


def collect(r: redis.Redis, keys: Keys, *, want: int, step: int, max_staleness: int, vocab_size: int,
            unpublished: set[str], cursor: bytes | None, shutdown: Shutdown
            ) -> tuple[Collected | None, bytes | None]:
    """`want` trainable groups (None if a stop was requested first), and the next read cursor."""
    got = Collected()
    seen = set(unpublished)
    while len(got.groups) < want:
        if shutdown.requested:
            return None, cursor
        t0 = time.monotonic()
        entries, cursor = read_entries(r, keys, cursor=cursor, count=want - len(got.groups))
        if not entries:
            got.wait_s += time.monotonic() - t0
        for entry_id, fields in entries:
            try:
                group = validate(fields, vocab_size=vocab_size)
            except MessageError as err:
                reject(r, keys, entry_id, counter="groups_dead", fields=fields, reason=str(err))
                print(f"trainer: dead-lettered sample entry {entry_id.decode()}: {err}",
                      file=sys.stderr, flush=True)
                got.dead += 1
                continue
            if group.id in seen or r.sismember(keys.trained, group.id):
                reject(r, keys, entry_id, counter="groups_duplicate")
                got.duplicate += 1
                continue
            if step - group.version > max_staleness:
                reject(r, keys, entry_id, counter="groups_dropped_stale")
                got.stale += 1
                continue
            seen.add(group.id)
            got.groups.append(group)
            got.entry_ids.append(entry_id)
    return got, cursor


# --------------------------------------------------------------------------- the update


def train_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, groups: list[SampleGroup], *,
               micro_batch_size: int, temperature: float, clip_low: float, clip_high: float,
               max_grad_norm: float) -> dict[str, float]:
    """One optimizer step of GRPO over `groups`, gradients accumulated over micro-batches."""
    batches, total_tokens = micro_batches(groups, micro_batch_size=micro_batch_size)
    model.train()
    optimizer.zero_grad(set_to_none=True)
    stats: dict[str, float] = {"loss/policy": 0.0}
    tokens_in = 0
    for mb in batches:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
        logp = token_logprobs(logits, mb.targets, temperature)  # (B, T)
        loss, mb_stats = grpo_loss(logp, mb.behaviour_logp, mb.advantages, mb.mask, clip_low=clip_low,
                                   clip_high=clip_high, total_tokens=total_tokens)
        loss.backward()
        stats["loss/policy"] += loss.item()
        for k, v in mb_stats.items():  # each is a share of total_tokens: they add up
            stats[k] = stats.get(k, 0.0) + v
        tokens_in += int(mb.attention_mask.sum())
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return {**stats, "grad_norm": float(grad_norm), "tokens/trained": float(total_tokens),
            "tokens/forward": float(tokens_in)}


# --------------------------------------------------------------------------- publishing


def copy_tokenizer_files(source: Path, dest: Path) -> None:
    """Copy what `dest` lacks from `source` (tokenizer, chat template), weights excepted."""
    for f in source.iterdir():
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(WEIGHT_SUFFIXES) \
                and not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)


def save_checkpoint(model: torch.nn.Module, *, checkpoint_dir: Path, step: int, source_dir: Path) -> Path:
    """Write `checkpoint_dir/step_{step}` as a complete HF directory: temporary name, then rename."""
    tmp = checkpoint_dir / f".step_{step}.tmp"
    final = checkpoint_dir / f"step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.parent.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(tmp, safe_serialization=True)
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


def publish(r: redis.Redis, keys: Keys, model: torch.nn.Module, *, step: int, checkpoint_dir: Path,
            source_dir: Path, keep: int, entry_ids: list[bytes], group_ids: list[str]) -> WeightVersion:
    """Checkpoint on disk, then in one transaction: announce it and acknowledge the groups it holds."""
    path = save_checkpoint(model, checkpoint_dir=checkpoint_dir, step=step, source_dir=source_dir)
    wv = WeightVersion(version=step, step=step, path=str(path), format="safetensors",
                       checksums=checksum_dir(path), created_at=time.time())
    blob = encode(wv)
    pipe = r.pipeline(transaction=True)
    pipe.xadd(keys.weights, {PAYLOAD: blob})
    pipe.set(keys.weights_latest, blob)
    pipe.hset(keys.trainer, mapping={"step": step, "version": step})
    if entry_ids:
        pipe.xack(keys.samples, TRAINER_GROUP, *entry_ids)
        pipe.sadd(keys.trained, *group_ids)
    pipe.hincrby(keys.trainer, "groups_trained", len(group_ids))
    pipe.execute()
    prune_checkpoints(checkpoint_dir, keep=keep)
    return wv


# --------------------------------------------------------------------------- metrics


def step_metrics(groups: list[SampleGroup], *, step: int, staleness: list[int]) -> dict:
    """Reward, accuracy, length and staleness metrics of one step's groups (TRL's names)."""
    completions = [c for g in groups for c in g.completions]
    rewards = torch.tensor([c.reward for c in completions], dtype=torch.float64)
    group_std = [torch.tensor([c.reward for c in g.completions], dtype=torch.float64).std().item()
                 for g in groups]
    correct = [c.rewards["correct"] for c in completions if "correct" in c.rewards]
    lengths = [len(c.ids) for c in completions]
    return {
        "reward/mean": rewards.mean().item(),
        "reward/std": sum(group_std) / len(group_std),  # mean of per-group stds, as TRL's reward_std
        "accuracy": sum(correct) / len(correct) if correct else None,
        "frac_reward_zero_std": sum(s < 1e-8 for s in group_std) / len(group_std),
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/max_length": max(lengths),
        "staleness/mean": sum(staleness) / len(staleness),
        "staleness/max": max(staleness),
    }


def record(r: redis.Redis, keys: Keys, metrics: dict, *, path: Path) -> None:
    """Append the step's metrics to the JSONL file and the capped metrics stream."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(metrics) + "\n")
    r.xadd(keys.metrics, {PAYLOAD: msgpack.packb(metrics, use_bin_type=True)},
           maxlen=METRICS_MAXLEN, approximate=True)


def summary_line(m: dict) -> str:
    acc = "  -  " if m["accuracy"] is None else f"{m['accuracy']:.3f}"
    return (f"step {m['step']:4d} | reward {m['reward/mean']:.3f} | acc {acc} | "
            f"len {m['completions/mean_length']:5.1f} | stale {m['staleness/mean']:.1f}/{m['staleness/max']} | "
            f"loss {m['loss/policy']:+.4f} | {m['time/step']:.2f}s")


# --------------------------------------------------------------------------- the run


def load_model(path: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def run(config: Config) -> None:
    cfg, rollout = config.trainer, config.rollout
    hf_logging.disable_progress_bar()  # one console line per step, not progress bars
    keys = Keys(config.run)
    torch.manual_seed(cfg.seed)
    if cfg.threads > 0:
        torch.set_num_threads(cfg.threads)
    source_dir = resolve_model_path(config.model.path)
    checkpoint_dir = config.checkpoint_dir
    for tmp in checkpoint_dir.glob(".step_*.tmp"):  # half-written by a trainer that was killed
        shutil.rmtree(tmp, ignore_errors=True)
    shutdown = Shutdown()

    # ---- connect, and resume from the newest published checkpoint if this run has one
    r = connect(config.redis_url)
    ensure_group(r, keys.samples, TRAINER_GROUP)
    step = int(r.hget(keys.trainer, "step") or 0)
    latest = latest_weights(r, keys) if step > 0 else None
    if latest is not None:
        verify_dir(latest.path, latest.checksums)
        model = load_model(Path(latest.path))
        step = latest.step
        print(f"trainer: resuming at step {step} from {latest.path} "
              "(optimizer state is not restored yet: AdamW starts fresh)", flush=True)
    else:
        if step > 0:
            print(f"trainer: run {config.run!r} reached step {step} but published no weights; "
                  "starting again from the initial model", flush=True)
            step = 0
        model = load_model(source_dir)
    version = step  # the newest published weights (the initial ones are version 0)
    r.hset(keys.trainer, mapping={"step": step, "version": version})
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    vocab_size = model.config.vocab_size
    print(f"trainer: run {config.run!r}, model {source_dir}, step {step}, "
          f"{rollout.prompts_per_step} groups per step", flush=True)

    # ---- steps: collect groups, update, publish every sync_every steps
    cursor: bytes | None = b"0"  # first re-read our own pending entries
    unpublished_entries: list[bytes] = []
    unpublished_ids: list[str] = []
    while not (cfg.max_steps and step >= cfg.max_steps) and not shutdown.requested:
        t_step = time.monotonic()
        got, cursor = collect(r, keys, want=rollout.prompts_per_step, step=step,
                              max_staleness=rollout.max_staleness, vocab_size=vocab_size,
                              unpublished=set(unpublished_ids), cursor=cursor, shutdown=shutdown)
        if got is None:
            break
        staleness = [step - g.version for g in got.groups]

        t_train = time.monotonic()
        stats = train_step(model, optimizer, got.groups, micro_batch_size=cfg.micro_batch_size,
                           temperature=rollout.temperature, clip_low=cfg.clip_low,
                           clip_high=cfg.clip_high, max_grad_norm=cfg.max_grad_norm)
        train_s = time.monotonic() - t_train
        step += 1
        unpublished_entries += got.entry_ids
        unpublished_ids += [g.id for g in got.groups]

        t_publish = time.monotonic()
        last = shutdown.requested or (cfg.max_steps > 0 and step >= cfg.max_steps)
        if step % cfg.sync_every == 0 or last:
            version = step
            publish(r, keys, model, step=step, checkpoint_dir=checkpoint_dir, source_dir=source_dir,
                    keep=cfg.keep_checkpoints, entry_ids=unpublished_entries, group_ids=unpublished_ids)
            unpublished_entries, unpublished_ids = [], []
        else:
            r.hset(keys.trainer, "step", step)
        publish_s = time.monotonic() - t_publish

        metrics = {
            "step": step,
            **step_metrics(got.groups, step=step, staleness=staleness),
            "clip_ratio": stats["clip_ratio/region_mean"],
            **{k: v for k, v in stats.items() if k.startswith(("clip_ratio/", "ratio/"))},
            "loss/policy": stats["loss/policy"],
            "grad_norm": stats["grad_norm"],
            "lr": optimizer.param_groups[0]["lr"],
            "groups/dropped_stale": got.stale,
            "groups/dead": got.dead,
            "groups/duplicate": got.duplicate,
            "tokens/trained": stats["tokens/trained"],
            "tokens_per_s": stats["tokens/forward"] / train_s,  # prompt + completion tokens through the model
            "time/step": time.monotonic() - t_step,
            "time/wait_data": got.wait_s,
            "time/train": train_s,
            "time/publish": publish_s,
            "version": version,
            "group_ids": [g.id for g in got.groups],
        }
        record(r, keys, metrics, path=config.metrics_path)
        print(summary_line(metrics), flush=True)

    # ---- a stop while waiting for data: publish what was trained since the last checkpoint
    if unpublished_ids:
        publish(r, keys, model, step=step, checkpoint_dir=checkpoint_dir, source_dir=source_dir,
                keep=cfg.keep_checkpoints, entry_ids=unpublished_entries, group_ids=unpublished_ids)
    print(f"trainer: stopped at step {step}", flush=True)
