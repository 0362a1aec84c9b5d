"""The producer: admits prompts of its sources onto the prompts stream, as fast as staleness allows.

With `kind = "sft"` sources it admits conversations instead: each becomes a SampleGroup of one
completion (producers/sft.py), written straight to the samples stream for the trainer's sft
objective, under the same positions and admission control.
"""

from __future__ import annotations

import signal
import sys
import time
from typing import Any

import redis

from common.config import Config, SftSource
from common.keys import GENERATORS_GROUP, PAYLOAD, TRAINER_GROUP, Keys
from common.messages import MessageError, PromptTask, SampleGroup, encode
from common.models import resolve_model_path
from common.progress import (
    SourcePosition,
    add_outstanding,
    read_dropped,
    read_producer,
    read_trainer,
    start_producer,
    write_admission,
)
from common.streams import connect, ensure_group
from common.trim import trim_acknowledged
from producers.admission import admission_limit
from producers.data import DataError, Prompt, Skipped, Source, choose
from producers.sft import conversation_group, truncate

POLL_S = 0.2
TRIM_EVERY_S = 1.0  # the prompts stream is trimmed of acknowledged prompts about this often
MAX_PER_TRANSACTION = 64


class ProducerError(RuntimeError):
    """The run's stored position does not fit this producer's configuration."""


def load_positions(r: redis.Redis, keys: Keys, *, seed: int,
                   names: list[str]) -> tuple[dict[str, tuple[int, int]], int]:
    """({source: (epoch, offset)}, admitted) of this run, checking the stored seed is the
    configured one. A fresh run starts every source at (0, 0)."""
    stored = read_producer(r, keys)
    if stored.seed is None:
        start_producer(r, keys, seed=seed)
        return {name: (0, 0) for name in names}, 0
    if stored.seed != seed:
        raise ProducerError(f"task.seed: run {keys.run!r} was started with seed {stored.seed}, "
                            f"not {seed}; use a new run name to change the seed")
    at = {name: stored.sources.get(name, SourcePosition()) for name in names}
    return {name: (p.epoch, p.offset) for name, p in at.items()}, stored.admitted


def open_sources(r: redis.Redis, keys: Keys, config: Config) -> tuple[list[Source], int]:
    """The run's sources at their stored positions, and the prompts admitted so far."""
    positions, admitted = load_positions(r, keys, seed=config.task.seed, names=[s.name for s in config.sources])
    return sources_at(config, positions), admitted


def sources_at(config: Config, positions: dict[str, tuple[int, int]]) -> list[Source]:
    """The run's sources, each at its (epoch, offset) in `positions` (absent: the start)."""
    return [Source(s, seed=config.task.seed, field=f"data.sources.{i}" if config.data.sources else "task",
                   epoch=positions.get(s.name, (0, 0))[0], offset=positions.get(s.name, (0, 0))[1],
                   holdout=config.holdout, max_images=config.limits.max_images,
                   max_image_bytes=config.limits.max_image_bytes)
            for i, s in enumerate(config.sources)]


def sft_group(source: Source, made: Prompt, tokenizer, processor=None) -> tuple[SampleGroup | Skipped, int]:
    """(the conversation's SampleGroup cut to the source's max_length, tokens cut), or
    (Skipped, 0) when it has nothing to train on. `processor`: a vision-language model's, which
    lays out a conversation's images (None: a text model, which skips a conversation with any)."""
    try:
        group = conversation_group(tokenizer, made.messages, group_id=made.id, images=made.images,
                                   processor=processor)
    except (AssertionError, MessageError) as err:  # no assistant turn, one the template cannot render,
        return Skipped(id=made.id, reason=str(err)), 0  # or images the model cannot see
    group, cut = truncate(group, max_length=source.config.max_length)
    if group is None:
        return Skipped(id=made.id, reason=f"no assistant token within max_length "
                                          f"{source.config.max_length}"), 0
    return group, cut


def admit(r: redis.Redis, keys: Keys, *, sources: list[Source], weights: list[float], seed: int,
          admitted: int, count: int, n: int, version: int, tokenizer=None,
          processor=None) -> list[tuple[Source, Skipped]]:
    """Push `count` prompts, the `admitted`-th onwards, each from the source the mixture picks;
    every source's position moves forward in the same transaction. Returns the rows skipped.

    With a `tokenizer` (sft sources) each is a conversation's SampleGroup on the samples stream,
    its images laid out by `processor` (a vision-language model's; `sft_group`)."""
    pipe = r.pipeline(transaction=True)
    skipped = []
    ids = []
    truncated = tokens_cut = 0
    for index in range(admitted, admitted + count):
        source = sources[choose(seed=seed, index=index, weights=weights)]
        misses = 0
        while True:
            made, cut = source.take(), 0
            if tokenizer is not None and not isinstance(made, Skipped):
                made, cut = sft_group(source, made, tokenizer, processor)
            if not isinstance(made, Skipped):
                break
            skipped.append((source, made))
            misses += 1
            if source.size is not None and misses > source.size:  # a whole epoch of nothing
                raise DataError(f"source {source.name!r}: no row makes a trainable conversation "
                                f"(last: {made.reason})")
        ids.append(made.id)
        if tokenizer is not None:
            truncated, tokens_cut = truncated + (cut > 0), tokens_cut + cut
            pipe.xadd(keys.samples, {PAYLOAD: encode(made)})
            continue
        msg = PromptTask(id=made.id, messages=made.messages, text=made.text, meta=made.meta,
                         n=n, admitted_at=version, source=source.name, images=made.images)
        pipe.xadd(keys.prompts, {PAYLOAD: encode(msg)})
    add_outstanding(pipe, keys, ids)
    write_admission(pipe, keys, positions={s.name: (s.epoch, s.offset) for s in sources}, admitted=count,
                    skipped=[(source.name, f"{row.id}: {row.reason}") for source, row in skipped],
                    truncated=truncated, tokens_cut=tokens_cut)
    pipe.execute()
    return skipped


def sft_tokenizers(config: Config) -> tuple[Any, Any]:
    """The model's tokenizer, and its processor where it is a vision-language model (None otherwise),
    which turn conversations into SFT groups (`sft_group`)."""
    from transformers import AutoTokenizer

    from common.vision import is_vision_model, load_processor

    path = resolve_model_path(config.model.path)
    return AutoTokenizer.from_pretrained(path), load_processor(path) if is_vision_model(path) else None


def run(config: Config) -> None:
    keys = Keys(config.run)
    stop = False

    def on_signal(signum, frame):  # first signal: stop after this transaction; second: now
        nonlocal stop
        if stop:  # an admission cut short is one MULTI/EXEC: in Redis whole or not at all
            print("producer: second signal, exiting now", file=sys.stderr, flush=True)
            raise SystemExit(130)
        stop = True
        print(f"producer: {signal.Signals(signum).name}: stopping after the admission in hand "
              "(again to exit at once)", file=sys.stderr, flush=True)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    r = connect(config.redis_url, process="producer")
    sft = any(isinstance(s, SftSource) for s in config.sources)  # then all are (DataConfig checks)
    tokenizer = processor = None
    if sft:
        tokenizer, processor = sft_tokenizers(config)
        ensure_group(r, keys.samples, TRAINER_GROUP)
    else:
        ensure_group(r, keys.prompts, GENERATORS_GROUP)
    seed = config.task.seed
    sources, admitted = open_sources(r, keys, config)
    weights = [s.weight for s in config.sources]
    where = ", ".join(f"{s.name} epoch {s.epoch} offset {s.offset}" for s in sources)
    print(f"producer: run {config.run!r}, resuming after {admitted} prompts at {where}", flush=True)

    trimmed_at = 0.0
    while not stop:
        if not sft and time.monotonic() - trimmed_at > TRIM_EVERY_S:  # the trainer trims samples
            trim_acknowledged(r, keys.prompts)
            trimmed_at = time.monotonic()
        # ---- how many prompts the trainer's version allows. SFT data never goes stale
        # (config.max_staleness None) and waits for no weights, so it is admitted against the
        # trainer's step: with sync_every > 1 the published version would hold it back at
        # (max_staleness + 1) steps, short of a publish.
        if (stored := read_producer(r, keys).admitted) != admitted:
            # Redis lost writes (power loss within appendfsync's second): admit again from where it
            # says, so the prompts it forgot are admitted again rather than skipped
            print(f"producer: Redis says {stored} prompts admitted, this producer admitted {admitted}: "
                  "Redis lost writes; admitting again from its positions", file=sys.stderr, flush=True)
            sources, admitted = open_sources(r, keys, config)
        trainer = read_trainer(r, keys)
        version = trainer.version if config.max_staleness is not None else trainer.step
        limit = admission_limit(version=version, max_staleness=config.rollout.max_staleness,
                                prompts_per_step=config.rollout.prompts_per_step,
                                dropped=read_dropped(r, keys))
        count = min(limit - admitted, MAX_PER_TRANSACTION)
        if count <= 0:
            time.sleep(POLL_S)
            continue
        # ---- admit them; the position moves forward in the same transaction
        skipped = admit(r, keys, sources=sources, weights=weights, seed=seed, admitted=admitted,
                        count=count, n=config.rollout.group_size, version=version, tokenizer=tokenizer,
                        processor=processor)
        for source, row in skipped:
            where = getattr(source.config, "path", "") or source.name
            print(f"producer: skipped row {row.id} of {where}: {row.reason}",
                  file=sys.stderr, flush=True)
        admitted += count
        what = "conversations" if sft else "prompts"
        print(f"producer: admitted {admitted} {what} (limit {limit} at version {version})", flush=True)
        if sft and (progress := read_producer(r, keys)).sft_truncated:
            print(f"producer: {progress.sft_truncated} conversations truncated to max_length so far, "
                  f"{progress.sft_tokens_cut} tokens cut", flush=True)
    print("producer: stopped", flush=True)
