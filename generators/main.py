"""The generator process: take prompts, sample and score groups, publish them; follow the weights.

Concurrent tasks under one trio nursery, each a loop:
  intake     takes prompts while fewer than `max_in_flight` are held: this consumer's own
             pending ones first (a restart under the same id), then ones idle in a dead
             generator's pending list (XAUTOCLAIM), then new ones (XREADGROUP); decodes and
             tokenizes them, dead-lettering (and acknowledging) what does not decode
  engine     adds arrived prompts to the engine and steps it (continuous batching: a prompt joins
             the running batch as soon as it arrives, and a finished one leaves it at once); at a
             safe point, with nothing in flight, loads newer weights (checksums first)
  scoring    scores each finished prompt's completions with its reward (in reward worker
             processes, each with a timeout), then per prompt one MULTI/EXEC: XADD its group to
             the samples stream + XACK the prompt
  weights    reads `weights:latest` every `weights_poll_s`
  heartbeat  writes the heartbeat hash (version, engine, tokens/s, prompts in flight)
Blocking calls (Redis, the engine, rewards) run in threads; the engine always in one thread of
its own, the thread it was created in.

Staleness: a newer published version stops new prompts from joining the engine; the ones in flight
finish with the weights they started with (every group is sampled with one version, the one it is
stamped with), then the weights are loaded and the waiting prompts join. A prompt admitted at a
version newer than the loaded one makes the engine read `weights:latest` before adding it, so a
prompt admitted at version v is sampled with weights >= v, which is what keeps admission control's
staleness bound.

The first SIGTERM/SIGINT stops the intake; the prompts already taken are sampled, scored and
written, then the process exits. A second signal exits at once: what it held stays pending and is
reclaimed.
"""

from __future__ import annotations

import concurrent.futures
import math
import signal
import socket
import sys
import time
import zlib
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import redis
import trio
from jinja2 import TemplateError

from common import streams
from common.checkpoints import CheckpointError, verify_dir
from common.config import Config, LimitsConfig
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
from engines.base import Engine, Finished, SamplingSettings
from engines.choice import engine_name, open_engine
from generators import devices
from generators.scoring import RewardRunner, reward_names

BLOCK_MS = 1000  # longest wait for new prompts before the intake comes round (stop, capacity)
RATE_WINDOW_S = 30.0  # tokens/s in the heartbeat is over this window

Entry = tuple[bytes, dict[bytes, bytes]]  # (stream entry id, fields)

# Reset the idle time of every prompt still pending for this consumer, so that live generators
# never reclaim a prompt it holds for longer than claim_idle_s (a long queue, a slow engine).
# Atomic: an entry another generator already claimed is not taken back.
_TOUCH_HELD = """
local mine = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000, ARGV[2])
if #mine == 0 then return 0 end
local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for _, e in ipairs(mine) do args[#args + 1] = e[1] end
args[#args + 1] = 'JUSTID'
redis.call(unpack(args))
return #mine
"""


@dataclass
class Held:
    """A prompt this generator took and has not yet written a group for."""

    entry_id: bytes
    task: PromptTask
    prompt_ids: list[int]
    taken_at: float  # perf_counter when it was taken from the stream
    added_at: float = 0.0  # when it joined the engine
    version: int = -1  # weights it is sampled with, set when it joins the engine


@dataclass
class State:
    """What the generator's tasks share: held prompts, weights to load, counters for the heartbeat."""

    held: dict[str, Held] = field(default_factory=dict)  # request id (prompt entry id) -> prompt
    latest: bytes | None = None  # weights:latest payload last read
    acted_on: bytes | None = None  # the payload last loaded or refused
    stopping: bool = False
    exit_code: int | None = None  # set by a second signal: exit now with this code
    news: trio.Event = field(default_factory=trio.Event)  # set when the heartbeat should not wait (new weights)
    groups: int = 0
    dropped_zero_variance: int = 0
    reward_errors: int = 0
    weights_refused: int = 0
    last_refusal: str = ""
    produced: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) per group

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        while self.produced and self.produced[0][0] < now - RATE_WINDOW_S:
            self.produced.popleft()
        if not self.produced:
            return 0.0
        span = max(now - self.produced[0][0], 1.0)
        return round(sum(t for _, t in self.produced) / span, 1)


def run(config: Config, *, generator_id: str) -> None:
    name = f"generator {generator_id}"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one console line per group batch, not progress bars
    keys = Keys(config.run)
    gen = config.generator

    # ------------------------------------------------------------------ start-up
    names = reward_names(config)  # a reward name that does not load fails before the model does
    r = streams.connect(config.redis_url)
    streams.ensure_group(r, keys.prompts, GENERATORS_GROUP)
    host = socket.gethostname()
    gpu = devices.pick_gpu(r, keys, host=host, owner=generator_id, ttl_s=gen.heartbeat_ttl_s)
    # The engine lives in one thread: created there, every call made there.
    engine_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    engine: Engine = engine_thread.submit(
        open_engine_for, config, seed=gen.seed + zlib.crc32(generator_id.encode())).result()
    rewards = RewardRunner(names, timeout_s=gen.reward_timeout_s, workers=gen.reward_workers)
    state = State()
    print(f"{name}: {engine.name} engine on {engine.path}{f' (GPU {gpu})' if gpu else ''}, "
          f"up to {gen.max_in_flight} prompts in flight", flush=True)
    try:
        trio.run(serve, r, keys, config, engine, engine_thread, rewards, state, generator_id, gpu)
    except BaseExceptionGroup as group:  # a task's error: raise it as itself, for __main__'s handlers
        leaves = leaf_errors(group)
        if len(leaves) == 1:
            raise leaves[0] from None
        raise
    finally:
        r.delete(keys.generator(generator_id))  # a clean exit leaves no heartbeat behind
        leave_group(r, stream=keys.prompts, consumer=generator_id)
        if gpu is not None:
            devices.release_gpu(r, keys, host=host, device=gpu, owner=generator_id)
        rewards.close()
        engine_thread.shutdown(wait=False)
    print(f"{name}: stopped after {state.groups} groups", flush=True)
    if state.exit_code is not None:
        sys.exit(state.exit_code)


def leaf_errors(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for err in group.exceptions:
        out += leaf_errors(err) if isinstance(err, BaseExceptionGroup) else [err]
    return out


def open_engine_for(config: Config, *, seed: int) -> Engine:
    from common.models import resolve_model_path

    gen = config.generator
    if gen.threads > 0:
        import torch

        torch.set_num_threads(gen.threads)
    path = resolve_model_path(config.model.path)
    engine = engine_name(gen.engine)
    options: dict[str, Any] = {"max_batch": gen.batch_prompts} if engine == "hf" else {
        "kv_cache_gib": gen.kv_cache_gib, "gpu_memory_utilization": gen.gpu_memory_utilization,
        "max_num_seqs": gen.max_in_flight * config.rollout.group_size, "threads": gen.threads}
    return open_engine(engine, path, dtype=config.model.dtype, seed=seed, **options)


async def serve(r: redis.Redis, keys: Keys, config: Config, engine: Engine,
                engine_thread: concurrent.futures.Executor, rewards: RewardRunner, state: State,
                generator_id: str, gpu: str | None) -> None:
    name = f"generator {generator_id}"
    gen, rollout = config.generator, config.rollout
    sampling = dict(max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                    top_p=rollout.top_p, top_k=rollout.top_k)
    arrived_send, arrived = trio.open_memory_channel[Held](math.inf)
    finished_send, finished = trio.open_memory_channel[tuple[Finished, Held]](math.inf)
    capacity = trio.Semaphore(gen.max_in_flight)  # one token per held prompt
    intake_scope = trio.CancelScope()  # cancelled by the first signal
    # A late starter loads the newest weights before its first prompt.
    state.latest = await trio.to_thread.run_sync(r.get, keys.weights_latest)

    async def on_engine(fn, *args):
        token, done = trio.lowlevel.current_trio_token(), trio.Event()
        future = engine_thread.submit(fn, *args)
        future.add_done_callback(lambda _: token.run_sync_soon(done.set))
        await done.wait()
        return future.result()

    # -------------------------------------------------------------- intake
    async def intake() -> None:
        backlog = await trio.to_thread.run_sync(lambda: own_pending(r, stream=keys.prompts, consumer=generator_id))
        if backlog:
            print(f"{name}: {len(backlog)} pending prompts of its own", flush=True)
        with intake_scope:
            while True:
                await capacity.acquire()  # where a stop signal finds it waiting
                count = 1
                while count < gen.batch_prompts:
                    try:
                        capacity.acquire_nowait()
                    except trio.WouldBlock:
                        break
                    count += 1
                with trio.CancelScope(shield=True):  # what is taken from the stream is held
                    entries, backlog = backlog[:count], backlog[count:]
                    if len(entries) < count:
                        entries += await trio.to_thread.run_sync(partial(
                            take_prompts, r, stream=keys.prompts, consumer=generator_id, count=count - len(entries),
                            claim_idle_ms=int(gen.claim_idle_s * 1000), wait=not entries))
                    work = await trio.to_thread.run_sync(lambda es=entries: prepare_prompts(
                        r, engine, es, keys=keys, name=name, max_new_tokens=rollout.max_new_tokens,
                        limits=config.limits))
                    now = time.perf_counter()
                    for entry_id, task, ids in work:
                        held = Held(entry_id=entry_id, task=task, prompt_ids=ids, taken_at=now)
                        state.held[entry_id.decode()] = held
                        arrived_send.send_nowait(held)
                    for _ in range(count - len(work)):
                        capacity.release()
        await arrived_send.aclose()

    # -------------------------------------------------------------- engine
    async def engine_loop() -> None:
        waiting: deque[Held] = deque()  # arrived, not yet added to the engine
        running = 0  # added to the engine, not finished; at most engine.max_running, so that
        # the rest wait here, where newer weights can still reach them before they start
        asked = -1  # the newest admitted_at weights:latest was read for
        intake_done = False
        while True:
            while True:  # everything that arrived, without waiting
                try:
                    waiting.append(arrived.receive_nowait())
                except trio.WouldBlock:
                    break
                except trio.EndOfChannel:
                    intake_done = True
                    break
            # A prompt admitted at a newer version than ours: read the latest weights now, once
            # per version asked for (later ones come with the watcher's polls).
            wanted = max((h.task.admitted_at for h in waiting), default=-1)
            if wanted > max(engine.version, asked):
                asked = wanted
                state.latest = await trio.to_thread.run_sync(r.get, keys.weights_latest)
            newer = state.latest is not None and state.latest != state.acted_on
            if newer and not engine.has_unfinished():
                await load_weights(state, engine, on_engine, name=name)
                newer = False
            if waiting and not newer and running < engine.max_running:
                # join the running batch; with newer weights pending, drain first
                version, now = engine.version, time.perf_counter()
                batch = [waiting.popleft() for _ in range(min(len(waiting), engine.max_running - running))]
                running += len(batch)
                for h in batch:
                    h.version, h.added_at = version, now
                await on_engine(add_all, engine, [(h.entry_id.decode(), h.prompt_ids, SamplingSettings(
                    n=h.task.n, **sampling)) for h in batch])
            if engine.has_unfinished():
                for done in await on_engine(engine.step):
                    running -= 1
                    finished_send.send_nowait((done, state.held[done.request_id]))
                continue
            if intake_done and not waiting:
                break
            # idle: wait for a prompt to arrive or newer weights to show up
            with trio.move_on_after(gen.weights_poll_s):
                try:
                    waiting.append(await arrived.receive())
                except trio.EndOfChannel:
                    intake_done = True
        await finished_send.aclose()

    # -------------------------------------------------------------- scoring and writing
    async def scoring() -> None:
        async with trio.open_nursery() as writers:
            limit = trio.Semaphore(max(gen.reward_workers, 1))  # groups being scored at once
            async for done, held in finished:
                await limit.acquire()
                writers.start_soon(score_and_publish, done, held, limit)

    async def score_and_publish(done: Finished, held: Held, limit: trio.Semaphore) -> None:
        try:
            group, errors = await trio.to_thread.run_sync(lambda: make_group(
                engine, rewards, held, done, generator_id=generator_id))
            drop = gen.drop_zero_variance and len({c.reward for c in group.completions}) == 1
            await trio.to_thread.run_sync(lambda: (drop_group if drop else publish)(
                r, keys=keys, entry_id=held.entry_id, group=group))
        finally:
            limit.release()
        del state.held[done.request_id]
        capacity.release()
        tokens = sum(len(c.ids) for c in group.completions)
        state.produced.append((time.monotonic(), tokens))
        state.reward_errors += len(errors)
        if drop:
            state.dropped_zero_variance += 1
        else:
            state.groups += 1
        for err in errors[:1]:
            print(f"{name}: reward error ({len(errors)} in group {group.id}): {err}", file=sys.stderr, flush=True)
        if state.groups % 8 == 0 or drop:
            print(f"{name} v{group.version}: {state.groups} groups written"
                  f"{f', {state.dropped_zero_variance} dropped (zero reward variance)' if drop else ''}, "
                  f"{state.tokens_per_s():.0f} tok/s, {len(state.held)} in flight", flush=True)

    # -------------------------------------------------------------- weights, heartbeat, signals
    async def watch_weights() -> None:
        while True:
            blob = await trio.to_thread.run_sync(r.get, keys.weights_latest)
            if blob is not None:
                state.latest = blob
            await trio.sleep(gen.weights_poll_s)

    async def heartbeats() -> None:
        host = socket.gethostname()
        touched = time.monotonic()
        while True:
            if time.monotonic() - touched > gen.claim_idle_s / 3:
                touched = time.monotonic()
                await trio.to_thread.run_sync(lambda: touch_held(r, stream=keys.prompts, consumer=generator_id))
            fields = {"engine": engine.name, "version": engine.version, "tokens_per_s": state.tokens_per_s(),
                      "in_flight": len(state.held), "groups": state.groups, "reward_errors": state.reward_errors,
                      "dropped_zero_variance": state.dropped_zero_variance,
                      "weights_refused": state.weights_refused, "last_refusal": state.last_refusal}
            await trio.to_thread.run_sync(lambda f=fields: heartbeat(
                r, key=keys.generator(generator_id), ttl_s=gen.heartbeat_ttl_s, fields=f))
            if gpu is not None:
                await trio.to_thread.run_sync(lambda: devices.renew_gpu(
                    r, keys, host=host, device=gpu, owner=generator_id, ttl_s=gen.heartbeat_ttl_s))
            with trio.move_on_after(min(5.0, gen.heartbeat_ttl_s / 3, gen.claim_idle_s / 3)):
                await state.news.wait()
            state.news = trio.Event()

    async def signals(everything: trio.CancelScope) -> None:
        with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
            async for signum in received:
                if state.stopping:
                    print(f"{name}: second signal, exiting now", file=sys.stderr, flush=True)
                    state.exit_code = 128 + signum
                    everything.cancel()
                    return
                state.stopping = True
                intake_scope.cancel()
                print(f"{name}: finishing the {len(state.held)} prompts it holds (signal again to exit now)",
                      file=sys.stderr, flush=True)

    with trio.CancelScope() as everything:
        async with trio.open_nursery() as background:
            background.start_soon(watch_weights)
            background.start_soon(heartbeats)
            background.start_soon(signals, everything)
            async with trio.open_nursery() as pipeline:  # ends when every taken prompt is written
                pipeline.start_soon(intake)
                pipeline.start_soon(engine_loop)
                pipeline.start_soon(scoring)
            background.cancel_scope.cancel()


def add_all(engine: Engine, requests: list[tuple[str, list[int], SamplingSettings]]) -> None:
    for request_id, ids, sampling in requests:
        engine.add(request_id, ids, sampling)


# ---------------------------------------------------------------------- weights


async def load_weights(state: State, engine: Engine, on_engine, *, name: str) -> None:
    """Load the WeightVersion in `state.latest` if it is newer than the engine's; a refusal (the
    payload does not decode, the files fail their checksums or do not fit the model) is counted
    and reported, and the engine keeps its weights."""
    blob = state.acted_on = state.latest
    assert blob is not None
    try:
        wv = decode_weights(blob)
        if wv.version <= engine.version:
            return
        t0 = time.perf_counter()
        await trio.to_thread.run_sync(verify_dir, wv.path, wv.checksums)
        t1 = time.perf_counter()
        await on_engine(lambda: engine.load_weights(wv.path, version=wv.version))
    except (MessageError, CheckpointError) as err:
        state.weights_refused += 1
        state.last_refusal = str(err)
        state.news.set()
        print(f"{name}: refused weights: {err}", file=sys.stderr, flush=True)
        return
    state.news.set()
    print(f"{name}: loaded weights version {wv.version} (verify {t1 - t0:.2f} s, "
          f"reload {time.perf_counter() - t1:.2f} s)", flush=True)


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


def prepare_prompts(r: redis.Redis, engine: Engine, entries: list[Entry], *, keys: Keys,
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


# ---------------------------------------------------------------------- scoring


def prompt_text(task: PromptTask) -> str:
    """What the reward sees as the prompt: the last user message, or the raw text."""
    if task.messages is None:
        assert task.text is not None, f"prompt {task.id}: neither messages nor text"
        return task.text
    users = [m["content"] for m in task.messages if m["role"] == "user"]
    return users[-1] if users else task.messages[-1]["content"]


def make_group(engine: Engine, rewards: RewardRunner, held: Held, done: Finished, *,
               generator_id: str) -> tuple[SampleGroup, list[str]]:
    """The scored SampleGroup of one finished prompt, and its reward errors."""
    task = held.task
    t0 = time.perf_counter()
    texts = [engine.decode(s.ids) for s in done.samples]
    source = task.meta.get("source")
    scored = rewards.score(source if isinstance(source, str) else None, prompt=prompt_text(task),
                           completions=[(text, s.ids) for text, s in zip(texts, done.samples, strict=True)],
                           meta=task.meta)
    completions = [Completion(ids=s.ids, logprobs=s.logprobs, reward=sc.reward, rewards=sc.rewards,
                              finish=s.finish, text=text, reward_error=sc.error)
                   for s, text, sc in zip(done.samples, texts, scored, strict=True)]
    group = SampleGroup(
        id=task.id, prompt_id=task.id, prompt_ids=held.prompt_ids, version=held.version,
        generator=generator_id, engine=engine.name, completions=completions,
        timings={"queue": held.added_at - held.taken_at, "generate": t0 - held.added_at,
                 "reward": time.perf_counter() - t0})
    return group, [f"prompt {task.id}: {sc.error}" for sc in scored if sc.error is not None]


# ---------------------------------------------------------------------- groups out, liveness


def publish(r: redis.Redis, *, keys: Keys, entry_id: bytes, group: SampleGroup) -> None:
    """The group and its prompt's acknowledgement in one MULTI/EXEC: after a crash, a prompt is
    either fully turned into a group or still pending."""
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.samples, {PAYLOAD: encode(group)})
        pipe.xack(keys.prompts, GENERATORS_GROUP, entry_id)
        pipe.execute()


def drop_group(r: redis.Redis, *, keys: Keys, entry_id: bytes, group: SampleGroup) -> None:
    """Dynamic sampling: acknowledge the prompt and count its group dropped, in one MULTI/EXEC
    (the producer admits one more prompt for each)."""
    with r.pipeline(transaction=True) as pipe:
        pipe.hincrby(keys.generators, "groups_dropped_zero_variance", 1)
        pipe.xack(keys.prompts, GENERATORS_GROUP, entry_id)
        pipe.execute()


def leave_group(r: redis.Redis, *, stream: str, consumer: str) -> None:
    """Remove this consumer from the prompts group if it holds nothing, so that `rollouts status`
    does not list a generator that stopped cleanly as dead. One still holding prompts stays, for
    the others to reclaim them (deleting it would drop them)."""
    if not r.xpending_range(stream, GENERATORS_GROUP, "-", "+", 1, consumername=consumer):
        r.xgroup_delconsumer(stream, GENERATORS_GROUP, consumer)


def touch_held(r: redis.Redis, *, stream: str, consumer: str) -> int:
    """Mark every prompt pending for `consumer` as just delivered; how many there are."""
    return int(r.eval(_TOUCH_HELD, 1, stream, GENERATORS_GROUP, consumer))


def heartbeat(r: redis.Redis, *, key: str, ttl_s: int, fields: dict[str, Any]) -> None:
    with r.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping={**fields, "last_seen": time.time()})
        pipe.expire(key, ttl_s)
        pipe.execute()
