"""The generator process: take prompts, sample and score groups, publish them; follow the weights.

Each pass of the loop, top to bottom:
  1. take prompts: this consumer's own pending ones (a restart under the same id), ones idle in a
     dead generator's pending list (XAUTOCLAIM), then new ones (XREADGROUP)
  2. decode and tokenize them; dead-letter (and acknowledge) what does not decode
  3. weights: at this safe point before sampling, load a newer published version (checksums first)
  4. sample n completions of every prompt in one engine call, score each with the reward
  5. per prompt, one MULTI/EXEC: XADD its group to the samples stream + XACK the prompt
  6. heartbeat (also while waiting for prompts)
The first SIGTERM/SIGINT lets the current batch finish and be written; a second exits at once.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
import zlib
from typing import Any

import redis
import torch
from jinja2 import TemplateError
from transformers.utils import logging as hf_logging

from common import streams
from common.checkpoints import CheckpointError, verify_dir
from common.config import Config, ConfigError, LimitsConfig
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import (
    Completion,
    MessageError,
    PromptTask,
    SampleGroup,
    decode_prompt,
    decode_weights,
    encode,
)
from common.models import resolve_model_path
from generators import rewards as reward_fns
from generators.engines import Sampled, SamplingSettings
from generators.hf_engine import HFEngine
from generators.rewards import RewardFn, score

ENGINE = "hf"
BLOCK_MS = 1000  # longest wait for new prompts before the loop comes round (heartbeat, weights)

Entry = tuple[bytes, dict[bytes, bytes]]  # (stream entry id, fields)


def run(config: Config, *, generator_id: str) -> None:
    name = f"generator {generator_id}"
    hf_logging.disable_progress_bar()  # one console line per step, not progress bars
    keys = Keys(config.run)
    gen = config.generator

    # ------------------------------------------------------------------ start-up
    rewards = load_rewards(config)  # each source's reward; a bad name fails before the model loads
    if gen.threads > 0:
        torch.set_num_threads(gen.threads)
    r = streams.connect(config.redis_url)
    streams.ensure_group(r, keys.prompts, GENERATORS_GROUP)
    engine = HFEngine(resolve_model_path(config.model.path), dtype=config.model.dtype,
                      seed=gen.seed + zlib.crc32(generator_id.encode()))
    stop = install_shutdown(name)
    status: dict[str, Any] = {"engine": ENGINE, "tokens_per_s": 0.0, "in_flight": 0, "groups": 0,
                              "reward_errors": 0, "weights_refused": 0, "last_refusal": ""}
    seen_weights: bytes | None = None  # the weights:latest payload last acted on
    backlog = own_pending(r, stream=keys.prompts, consumer=generator_id)
    print(f"{name}: {ENGINE} engine on {engine.path}, {len(backlog)} pending prompts of its own",
          flush=True)

    while not stop.is_set():
        # -------------------------------------------------------------- 1. take prompts
        entries, backlog = backlog[:gen.batch_prompts], backlog[gen.batch_prompts:]
        if len(entries) < gen.batch_prompts:
            entries += take_prompts(r, stream=keys.prompts, consumer=generator_id,
                                    count=gen.batch_prompts - len(entries),
                                    claim_idle_ms=int(gen.claim_idle_s * 1000), wait=not entries)

        # -------------------------------------------------------------- 2. decode, dead-letter
        work = prepare_prompts(r, engine, entries, keys=keys, name=name,
                               max_new_tokens=config.rollout.max_new_tokens, limits=config.limits)
        # -------------------------------------------------------------- 3. weights
        # Checked after the prompts are in hand and right before sampling: a prompt admitted at
        # version v is then sampled with weights >= v, which is what keeps admission control's
        # staleness bound. A late starter loads the newest weights here, before its first prompt.
        blob = r.get(keys.weights_latest)
        if blob is not None and blob != seen_weights:
            seen_weights = blob
            refusal = load_newer_weights(engine, blob=blob, name=name)
            if refusal is not None:
                status["weights_refused"] += 1
                status["last_refusal"] = refusal
                print(f"{name}: refused weights: {refusal}", file=sys.stderr, flush=True)

        heartbeat(r, key=keys.generator(generator_id), ttl_s=gen.heartbeat_ttl_s,
                  fields={**status, "version": engine.version, "in_flight": len(work)})
        if not work:
            continue

        # -------------------------------------------------------------- 4. sample, score
        t0 = time.perf_counter()
        groups, reward_errors = make_groups(
            engine, [(task, ids) for _, task, ids in work], generator_id=generator_id,
            max_new_tokens=config.rollout.max_new_tokens,
            temperature=config.rollout.temperature, rewards=rewards)
        for err in reward_errors[:1]:
            print(f"{name}: reward error ({len(reward_errors)} in this batch): {err}",
                  file=sys.stderr, flush=True)

        # -------------------------------------------------------------- 5. publish + ack
        for (entry_id, _, _), group in zip(work, groups, strict=True):
            publish(r, keys=keys, entry_id=entry_id, group=group)
        seconds = time.perf_counter() - t0
        tokens = sum(len(c.ids) for g in groups for c in g.completions)
        status["groups"] += len(groups)
        status["reward_errors"] += len(reward_errors)
        status["tokens_per_s"] = round(tokens / max(groups[0].timings["generate"], 1e-9), 1)

        # -------------------------------------------------------------- 6. heartbeat, report
        heartbeat(r, key=keys.generator(generator_id), ttl_s=gen.heartbeat_ttl_s,
                  fields={**status, "version": engine.version, "in_flight": 0})
        print(f"{name} v{groups[0].version}: {len(groups)} groups, {tokens} tokens, "
              f"{tokens / seconds:.0f} tok/s", flush=True)

    r.delete(keys.generator(generator_id))  # a clean exit leaves no heartbeat behind
    print(f"{name}: stopped after {status['groups']} groups", flush=True)


# ---------------------------------------------------------------------- weights


def load_newer_weights(engine: HFEngine, *, blob: bytes, name: str) -> str | None:
    """Load the WeightVersion in `blob` if it is newer than the engine's; the reason if refused
    (the payload does not decode, the files fail their checksums or do not fit the model)."""
    try:
        wv = decode_weights(blob)
        if wv.version <= engine.version:
            return None
        verify_dir(wv.path, wv.checksums)
        t0 = time.perf_counter()
        engine.load_weights(wv.path, version=wv.version)
    except (MessageError, CheckpointError) as err:
        return str(err)
    print(f"{name}: loaded weights version {wv.version} ({time.perf_counter() - t0:.2f} s)",
          flush=True)
    return None


# ---------------------------------------------------------------------- prompts in


def own_pending(r: redis.Redis, *, stream: str, consumer: str) -> list[Entry]:
    """Prompts delivered to this consumer name and never acknowledged (it restarted)."""
    got = r.xreadgroup(GENERATORS_GROUP, consumer, {stream: "0"})
    return [e for _, es in got or [] for e in es]


def take_prompts(r: redis.Redis, *, stream: str, consumer: str, count: int, claim_idle_ms: int,
                 wait: bool) -> list[Entry]:
    """Up to `count` prompt entries: first those idle longer than `claim_idle_ms` in another
    (dead) generator's pending list, then new ones, waiting up to BLOCK_MS if `wait`."""
    assert count >= 1, f"count must be >= 1, got {count}"
    claimed = r.xautoclaim(stream, GENERATORS_GROUP, consumer, min_idle_time=claim_idle_ms,
                           start_id="0-0", count=count)[1]
    entries = list(claimed)
    if len(entries) < count:
        got = r.xreadgroup(GENERATORS_GROUP, consumer, {stream: ">"}, count=count - len(entries),
                           block=BLOCK_MS if wait and not entries else None)
        entries += [e for _, es in got or [] for e in es]
    return entries


def prepare_prompts(r: redis.Redis, engine: HFEngine, entries: list[Entry], *, keys: Keys,
                    name: str, max_new_tokens: int, limits: LimitsConfig | None = None
                    ) -> list[tuple[bytes, PromptTask, list[int]]]:
    """(entry id, task, prompt token ids) of each entry that decodes and fits the model; the
    others are moved to the dead-letter stream and acknowledged, in one MULTI/EXEC each."""
    limits = limits or LimitsConfig()
    work = []
    for entry_id, fields in entries:
        fields = fields or {}  # an entry deleted from the stream comes back without fields
        try:
            if PAYLOAD not in fields:
                raise MessageError(f"entry has no {PAYLOAD.decode()!r} field")
            task = decode_prompt(fields[PAYLOAD], max_bytes=limits.max_message_bytes, max_n=limits.max_group_size)
            ids = engine.prompt_ids(task)
            if len(ids) + max_new_tokens > engine.context_length:
                raise MessageError(f"prompt {task.id}: {len(ids)} tokens + max_new_tokens "
                                   f"{max_new_tokens} exceed the model's context {engine.context_length}")
        except (MessageError, TemplateError) as err:
            with r.pipeline(transaction=True) as pipe:
                streams.dead_letter(pipe, dead_stream=keys.prompts_dead, source=keys.prompts,
                                    entry_id=entry_id, fields=fields, reason=str(err))
                pipe.xack(keys.prompts, GENERATORS_GROUP, entry_id)
                pipe.execute()
            print(f"{name}: dead-lettered prompt entry {entry_id.decode()}: {err}",
                  file=sys.stderr, flush=True)
            continue
        work.append((entry_id, task, ids))
    return work


# ---------------------------------------------------------------------- sampling and scoring


def prompt_text(task: PromptTask) -> str:
    """What the reward sees as the prompt: the last user message, or the raw text."""
    if task.messages is None:
        assert task.text is not None, f"prompt {task.id}: neither messages nor text"
        return task.text
    users = [m["content"] for m in task.messages if m["role"] == "user"]
    return users[-1] if users else task.messages[-1]["content"]


def load_rewards(config: Config) -> dict[str, RewardFn]:
    """{source name: its reward function}, named in the config only, never by a message."""
    loaded = {}
    for i, source in enumerate(config.sources):
        try:
            loaded[source.name] = reward_fns.load(source.reward_name)
        except ValueError as err:
            raise ConfigError(f"data.sources.{i}.reward: {err}") from None
    return loaded


def reward_for(task: PromptTask, rewards: dict[str, RewardFn]) -> RewardFn:
    """The reward of the task's source (meta["source"]); a prompt without one takes the only
    configured reward. An unknown source scores 0 with a recorded reward error."""
    source = task.meta.get("source")
    if source is None and len(rewards) == 1:
        return next(iter(rewards.values()))
    fn = rewards.get(source) if isinstance(source, str) else None
    if fn is not None:
        return fn

    def unknown(**_: Any) -> dict[str, float]:
        raise LookupError(f"no reward configured for source {source!r} (have {sorted(rewards)})")

    return unknown


def make_groups(engine: HFEngine, prompts: list[tuple[PromptTask, list[int]]], *, generator_id: str,
                max_new_tokens: int, temperature: float,
                rewards: dict[str, RewardFn]) -> tuple[list[SampleGroup], list[str]]:
    """One scored SampleGroup per (task, prompt ids), and the reward errors met on the way."""
    version = engine.version  # the weights these tokens are sampled with
    t0 = time.perf_counter()
    sampled: list[list[Sampled]] = [[] for _ in prompts]
    for n in sorted({task.n for task, _ in prompts}):  # one engine call per group size: usually one
        idx = [i for i, (task, _) in enumerate(prompts) if task.n == n]
        out = engine.sample([prompts[i][1] for i in idx],
                            SamplingSettings(n=n, max_new_tokens=max_new_tokens, temperature=temperature))
        for i, samples in zip(idx, out, strict=True):
            sampled[i] = samples
    generate_s = time.perf_counter() - t0  # the whole batch's: its prompts were sampled together

    groups, errors = [], []
    for (task, ids), samples in zip(prompts, sampled, strict=True):
        t1 = time.perf_counter()
        completions = []
        reward_fn = reward_for(task, rewards)
        for s in samples:
            text = engine.decode(s.ids)
            reward, parts, err = score(reward_fn, prompt=prompt_text(task), completion=text,
                                       completion_ids=s.ids, meta=task.meta)
            if err is not None:
                errors.append(f"prompt {task.id}: {err}")
            completions.append(Completion(ids=s.ids, logprobs=s.logprobs, reward=reward,
                                          rewards=parts, finish=s.finish, text=text))
        groups.append(SampleGroup(
            id=task.id, prompt_id=task.id, prompt_ids=ids, version=version,
            generator=generator_id, engine=ENGINE, completions=completions,
            timings={"generate": generate_s, "reward": time.perf_counter() - t1}))
    return groups, errors


# ---------------------------------------------------------------------- groups out, liveness


def publish(r: redis.Redis, *, keys: Keys, entry_id: bytes, group: SampleGroup) -> None:
    """The group and its prompt's acknowledgement in one MULTI/EXEC: after a crash, a prompt is
    either fully turned into a group or still pending."""
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.samples, {PAYLOAD: encode(group)})
        pipe.xack(keys.prompts, GENERATORS_GROUP, entry_id)
        pipe.execute()


def heartbeat(r: redis.Redis, *, key: str, ttl_s: int, fields: dict[str, Any]) -> None:
    with r.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={**fields, "last_seen": time.time()})
        pipe.expire(key, ttl_s)
        pipe.execute()


def install_shutdown(name: str) -> threading.Event:
    """SIGTERM/SIGINT once: set the returned event (the loop finishes its batch); twice: exit now."""
    stop = threading.Event()

    def handle(signum: int, frame: object) -> None:
        if stop.is_set():
            print(f"{name}: second signal, exiting now", file=sys.stderr, flush=True)
            raise SystemExit(128 + signum)
        stop.set()
        print(f"{name}: finishing the current batch (signal again to exit now)",
              file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    return stop
