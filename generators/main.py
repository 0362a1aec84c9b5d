"""The generator process: take prompts, sample and score groups, publish them; follow the weights.

`run` starts up (Redis, a GPU, the engine in its thread, the reward workers) and cleans up after;
`serve` wires the stages together and runs them as concurrent trio tasks, each a loop over one
`Generator` (what they share and never change: Redis, the engine, the channels between them) and
one `State` (what they hand over and count):
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
  episodes   plays the prompts of sources with an environment: n multi-turn episodes each
             (generators/episodes.py), whose model turns the engine loop samples among all other
             requests and whose environment steps run in worker processes with time limits
             (generators/environments.py); then writes the group as scoring does
  weights    follows the weights stream (generators.weights: XREAD BLOCK in a thread of its
             own), wakes the engine loop at each new version and verifies its files meanwhile
  heartbeat  writes the heartbeat hash (version, engine, tokens/s, prompts in flight)
  signals    stops the intake at the first signal, everything at the second
The first four are the pipeline, which ends when every taken prompt is written; the others run
beside it until then. What is read from and written to Redis for prompts and groups (the
MULTI/EXECs above, dead letters, reclaiming) is in `generators.prompts`.
Blocking calls (Redis, the engine, rewards) run in threads; the engine always in one thread of
its own, the thread it was created in.

Staleness: a newer published version stops new prompts from joining the engine; the ones in flight
finish with the weights they started with (every group is sampled with one version, the one it is
stamped with; an episode's later turns too), then the weights are loaded and the waiting prompts
join. With `inflight_updates` the engine's step yields as soon as newer weights are seen, they are
loaded, and the unfinished completions go on under them (generators/inflight.py: each token's
version is recorded; a group is as stale as its oldest token). Episodes still drain first.
A prompt admitted at a version newer than the loaded one makes the engine read
`weights:latest` before adding it, so a prompt admitted at version v is sampled with weights >= v,
which is what keeps admission control's staleness bound.

The first SIGTERM/SIGINT stops the intake; the prompts already taken are sampled, scored and
written, then the process exits. A second signal exits at once: what it held stays pending and is
reclaimed.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import signal
import socket
import sys
import time
import zlib
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import redis
import trio

from common import streams
from common.checkpoints import CheckpointError
from common.config import Config, GeneratorConfig, LimitsConfig, TrainerConfig
from common.heartbeats import Heartbeat, clear_heartbeat, count_engine_stall, write_heartbeat
from common.keys import GENERATORS_GROUP, Keys
from common.messages import Completion, PromptTask, SampleGroup, WeightVersion
from common.shaping import zero_variance
from engines.base import Engine, Finished, Sampled, SamplingSettings, episode_prompt_ids, turn_ids
from engines.choice import check_inflight, engine_name, open_engine
from envs.base import Spec
from generators import devices
from generators.environments import EnvRunner, environment_specs
from generators.episodes import EpisodeLimits, run_episodes
from generators.inflight import group_versions
from generators.prompts import drop_group, leave_group, own_pending, prepare_prompts, publish, take_prompts, touch_held
from generators.scoring import RewardRunner, conversational_sources, reward_names, trl_formats
from generators.weights import Checked, Watcher, check

RATE_WINDOW_S = 30.0  # tokens/s in the heartbeat is over this window

T = TypeVar("T")


@dataclass
class Held:
    """A prompt this generator took and has not yet written a group for."""

    entry_id: bytes
    task: PromptTask
    prompt_ids: list[int]
    taken_at: float  # perf_counter when it was taken from the stream
    added_at: float = 0.0  # when it joined the engine
    version: int = -1  # weights it is sampled with, set when it joins the engine


class TurnFailed(RuntimeError):
    """The engine failed an episode's turn (a request that never came back): the prompt is let go."""


def turn_failed(err: BaseException) -> bool:
    """Whether `err` is only failed turns (TurnFailed, or a group of them from a nursery)."""
    if isinstance(err, BaseExceptionGroup):
        return err.split(TurnFailed)[1] is None
    return isinstance(err, TurnFailed)


@dataclass(eq=False)
class Turn:
    """An episode's model turn: a request for the engine loop, and its result once sampled."""

    request_id: str
    ids: list[int]  # the episode's ids so far (prompt included)
    sampling: SamplingSettings
    done: trio.Event = field(default_factory=trio.Event)
    result: Sampled | None = None
    error: str | None = None  # why the engine failed the turn; None: it did not


@dataclass
class State:
    """What the generator's tasks share: held prompts, weights to load, counters for the heartbeat."""

    held: dict[str, Held] = field(default_factory=dict)  # request id (prompt entry id) -> prompt
    latest: bytes | None = None  # the newest weights payload announced (or read from weights:latest)
    acted_on: bytes | None = None  # the payload last loaded or refused
    # When the weights loaded were published (their created_at; 0: the initial checkpoint). A
    # version announced later with a number no higher is a trainer restarted from an older state
    # publishing its steps again: loaded all the same, once nothing is in flight (`went_back`).
    published_at: float = 0.0
    went_back: bytes | None = None  # such a payload, waiting for the completions in flight to finish
    checked: Checked | None = None  # the newest payload's check (checksums), begun when it was announced
    seen: tuple[bytes, float] = (b"", 0.0)  # the payload last announced, and time.time() the watcher saw it
    stopping: bool = False
    exit_code: int | None = None  # set by a second signal: exit now with this code
    news: trio.Event = field(default_factory=trio.Event)  # set when the heartbeat should not wait (new weights)
    groups: int = 0
    dropped_zero_variance: int = 0
    reward_errors: int = 0
    weights_refused: int = 0
    last_refusal: str = ""
    produced: deque[tuple[float, int]] = field(default_factory=deque)  # (time, tokens) per group
    episodes: int = 0  # prompts whose episodes are being played (weights are not loaded meanwhile)
    turns: deque[Turn] = field(default_factory=deque)  # episode turns waiting to join the engine
    sampling: dict[str, Turn] = field(default_factory=dict)  # request id -> turn in the engine
    turn_count: int = 0  # turns ever queued (their request ids)
    wake: trio.Event = field(default_factory=trio.Event)  # set when a turn is queued or an episode ends
    env_errors: int = 0  # environment steps that failed (answered with an error message)
    engine_errors: int = 0  # engine requests that failed (never answered, refused); their prompts let go

    def tokens_per_s(self) -> float:
        now = time.monotonic()
        while self.produced and self.produced[0][0] < now - RATE_WINDOW_S:
            self.produced.popleft()
        if not self.produced:
            return 0.0
        span = max(now - self.produced[0][0], 1.0)
        return round(sum(t for _, t in self.produced) / span, 1)


@dataclass(frozen=True)
class Generator:
    """How the generator's tasks are wired together: made once by `serve`, never changed."""

    id: str  # its consumer name in the prompts group, heartbeat key and GPU lease owner
    r: redis.Redis
    keys: Keys
    settings: GeneratorConfig
    trainer: TrainerConfig  # its overlong penalty shapes the rewards dynamic sampling judges
    sampling: SamplingSettings  # every request's, with n replaced by its prompt's
    limits: LimitsConfig  # what a prompt message may hold
    engine: Engine
    engine_thread: concurrent.futures.Executor  # the one thread every engine call runs in
    rewards: RewardRunner
    host: str
    gpu: str | None  # the GPU it leased on this host; None: it runs without one
    arrived_send: trio.MemorySendChannel[Held]  # intake -> engine: prompts taken
    arrived: trio.MemoryReceiveChannel[Held]
    finished_send: trio.MemorySendChannel[tuple[Finished, Held]]  # engine -> scoring: prompts sampled
    finished: trio.MemoryReceiveChannel[tuple[Finished, Held]]
    capacity: trio.Semaphore  # one token per held prompt: at most max_in_flight
    envs: EnvRunner | None  # runs environment steps; None: no source has an environment
    specs: dict[str, Spec]  # source name -> its environment
    episode_limits: dict[str, EpisodeLimits]  # source name -> its episodes' limits
    episodes_send: trio.MemorySendChannel[Held]  # engine -> episodes: prompts to play, version stamped
    episodes_in: trio.MemoryReceiveChannel[Held]
    intake_scope: trio.CancelScope  # cancelled by the first signal
    fetch_dir: Path  # where versions fetched over HTTP land (settings.weights_url)
    weights: Watcher  # the newest version announced on the weights stream

    @property
    def name(self) -> str:
        return f"generator {self.id}"


def run(config: Config, *, generator_id: str) -> None:
    name = f"generator {generator_id}"
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one console line per group batch, not progress bars
    keys = Keys(config.run)
    gen = config.generator

    # ------------------------------------------------------------------ start-up
    names = reward_names(config)  # a reward name that does not load fails before the model does
    specs = environment_specs(config)  # so does an environment's
    r = streams.connect(config.redis_url)
    streams.ensure_group(r, keys.prompts, GENERATORS_GROUP)
    host = socket.gethostname()
    # One GPU leased per generator; a tensor-parallel one uses the GPUs CUDA_VISIBLE_DEVICES gives it.
    gpu = devices.pick_gpu(r, keys, host=host, owner=generator_id, ttl_s=gen.heartbeat_ttl_s) \
        if gen.tensor_parallel_size == 1 else None
    if gen.engine == "openai":
        devices.lease_server(r, keys, url=gen.server_url, owner=generator_id, ttl_s=gen.heartbeat_ttl_s)
    # The engine lives in one thread: created there, every call made there.
    engine_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    engine: Engine = engine_thread.submit(
        open_engine_for, config, seed=gen.seed + zlib.crc32(generator_id.encode())).result()
    check_templates(engine, specs)
    rewards = RewardRunner(names, timeout_s=gen.reward_timeout_s, workers=gen.reward_workers,
                           conversational=conversational_sources(config))
    envs = EnvRunner([s.name for s in specs.values()], workers=gen.env_workers) if specs else None
    state = State()
    print(f"{name}: {engine.name} engine on {engine.path}{f' (GPU {gpu})' if gpu else ''}, "
          f"up to {gen.max_in_flight} prompts in flight", flush=True)
    for line in trl_formats(config):
        print(f"{name}: {line}", flush=True)
    try:
        trio.run(partial(serve, config, state, r=r, keys=keys, engine=engine, engine_thread=engine_thread,
                         rewards=rewards, envs=envs, specs=specs, generator_id=generator_id, host=host,
                         gpu=gpu))
    except BaseExceptionGroup as group:  # a task's error: raise it as itself, for __main__'s handlers
        leaves = leaf_errors(group)
        if len(leaves) == 1:
            if isinstance(leaves[0], EngineStalled):
                count_engine_stall(r, keys)
            raise leaves[0] from None
        raise
    finally:
        clear_heartbeat(r, keys, generator_id)  # a clean exit leaves no heartbeat behind
        leave_group(r, stream=keys.prompts, consumer=generator_id)
        if gpu is not None:
            devices.release_gpu(r, keys, host=host, device=gpu, owner=generator_id)
        if gen.engine == "openai":
            devices.release_server(r, keys, url=gen.server_url, owner=generator_id)
        rewards.close()
        if envs is not None:
            envs.close()
        engine_thread.shutdown(wait=False)
    print(f"{name}: stopped after {state.groups} groups", flush=True)
    if state.exit_code is not None:
        sys.exit(state.exit_code)


def leaf_errors(group: BaseExceptionGroup) -> list[BaseException]:
    out: list[BaseException] = []
    for err in group.exceptions:
        out += leaf_errors(err) if isinstance(err, BaseExceptionGroup) else [err]
    return out


def check_templates(engine: Engine, specs: dict[str, Spec]) -> None:
    """Refuse, at start-up, an environment whose turns the model's chat template cannot append to an
    episode token by token (engines.base.turn_ids), or whose roles it does not render."""
    from jinja2 import TemplateError

    from common.config import ConfigError

    for source, spec in specs.items():
        try:
            turn_ids(engine.tokenizer, [{"role": spec.error_role, "content": "x"}], eos_id=None)
        except (ValueError, TemplateError) as err:
            raise ConfigError(f"source {source!r}: environment {spec.name!r} with the model's chat template: "
                              f"{err}") from None


def open_engine_for(config: Config, *, seed: int) -> Engine:
    from common.models import resolve_model_path

    gen = config.generator
    if gen.threads > 0:
        import torch

        torch.set_num_threads(gen.threads)
    path = resolve_model_path(config.model.path)
    engine = engine_name(gen.engine)
    if gen.inflight_updates:
        check_inflight(engine)
    if engine == "openai":  # the server was started on model.path with the run's dtype and seed
        return open_engine(engine, path, url=gen.server_url, max_running=gen.max_in_flight * config.rollout.group_size,
                           timeout_s=gen.request_timeout_s)
    options: dict[str, Any] = {"max_batch": gen.batch_prompts} if engine == "hf" else {
        "kv_cache_gib": gen.kv_cache_gib, "gpu_memory_utilization": gen.gpu_memory_utilization,
        "max_num_seqs": gen.max_in_flight * config.rollout.group_size, "threads": gen.threads,
        "tensor_parallel_size": gen.tensor_parallel_size, "max_model_len": gen.max_model_len,
        "enforce_eager": gen.enforce_eager}
    return open_engine(engine, path, dtype=config.model.dtype, seed=seed, **options)


async def serve(config: Config, state: State, *, r: redis.Redis, keys: Keys, engine: Engine,
                engine_thread: concurrent.futures.Executor, rewards: RewardRunner, generator_id: str,
                host: str, gpu: str | None, envs: EnvRunner | None = None,
                specs: dict[str, Spec] | None = None) -> None:
    """Wire the stages together and run them: the pipeline until every taken prompt is written."""
    gen, rollout = config.generator, config.rollout
    arrived_send, arrived = trio.open_memory_channel[Held](math.inf)
    finished_send, finished = trio.open_memory_channel[tuple[Finished, Held]](math.inf)
    episodes_send, episodes_in = trio.open_memory_channel[Held](math.inf)
    specs = specs or {}
    limits = {s.name: EpisodeLimits(max_turns=s.max_turns, max_tokens=s.max_episode_tokens,
                                    max_new_tokens=rollout.max_new_tokens, turn_timeout_s=s.turn_timeout_s,
                                    episode_timeout_s=s.episode_timeout_s)
              for s in config.sources if s.name in specs}
    g = Generator(
        id=generator_id, r=r, keys=keys, settings=gen, trainer=config.trainer, limits=config.limits,
        sampling=SamplingSettings(n=1, max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                                  top_p=rollout.top_p, top_k=rollout.top_k),
        engine=engine, engine_thread=engine_thread, rewards=rewards, host=host, gpu=gpu,
        arrived_send=arrived_send, arrived=arrived, finished_send=finished_send, finished=finished,
        capacity=trio.Semaphore(gen.max_in_flight), intake_scope=trio.CancelScope(),
        fetch_dir=Path(config.output_dir) / "fetched", envs=envs, specs=specs, episode_limits=limits,
        episodes_send=episodes_send, episodes_in=episodes_in,
        weights=Watcher(r, keys))
    # A late starter loads the newest weights (weights:latest, read as the watcher starts) first.
    await trio.to_thread.run_sync(g.weights.start)
    if g.weights.latest is not None:
        state.latest = g.weights.latest.blob
    try:
        with trio.CancelScope() as everything:
            async with trio.open_nursery() as background:
                background.start_soon(watch_weights, g, state)
                background.start_soon(heartbeats, g, state)
                background.start_soon(signals, g, state, everything)
                async with trio.open_nursery() as pipeline:  # ends when every taken prompt is written
                    pipeline.start_soon(intake, g, state)
                    pipeline.start_soon(engine_loop, g, state)
                    pipeline.start_soon(scoring, g, state)
                    pipeline.start_soon(episodes, g, state)
                background.cancel_scope.cancel()
    finally:
        g.weights.stop()


# ---------------------------------------------------------------------- intake


async def intake(g: Generator, state: State) -> None:
    """Take prompts while there is capacity, own pending ones first, and send them to the engine
    loop; until the first signal."""
    backlog = await trio.to_thread.run_sync(lambda: own_pending(g.r, stream=g.keys.prompts, consumer=g.id))
    if backlog:
        print(f"{g.name}: {len(backlog)} pending prompts of its own", flush=True)
    with g.intake_scope:
        while True:
            await g.capacity.acquire()  # where a stop signal finds it waiting
            count = 1
            while count < g.settings.batch_prompts:
                try:
                    g.capacity.acquire_nowait()
                except trio.WouldBlock:
                    break
                count += 1
            with trio.CancelScope(shield=True):  # what is taken from the stream is held
                entries, backlog = backlog[:count], backlog[count:]
                if len(entries) < count:
                    entries += await trio.to_thread.run_sync(partial(
                        take_prompts, g.r, stream=g.keys.prompts, consumer=g.id, count=count - len(entries),
                        claim_idle_ms=int(g.settings.claim_idle_s * 1000), wait=not entries))
                # A prompt it holds comes back when it went claim_idle_s without a touch (a heartbeat
                # that fell behind on a loaded machine) and this generator reclaimed it from itself:
                # it is in the engine already, and sampling it twice would write two groups.
                entries = [e for e in entries if e[0].decode() not in state.held]
                work = await trio.to_thread.run_sync(partial(
                    prepare_prompts, g.r, g.engine, entries, keys=g.keys, name=g.name,
                    max_new_tokens=g.sampling.max_new_tokens, limits=g.limits))
                now = time.perf_counter()
                for entry_id, task, ids in work:
                    held = Held(entry_id=entry_id, task=task, prompt_ids=ids, taken_at=now)
                    state.held[entry_id.decode()] = held
                    g.arrived_send.send_nowait(held)
                for _ in range(count - len(work)):
                    g.capacity.release()
    await g.arrived_send.aclose()


# ---------------------------------------------------------------------- engine


async def engine_loop(g: Generator, state: State) -> None:
    """Add arrived prompts to the engine and step it; load newer weights when nothing is in flight.
    Ends when the intake has ended and every prompt it took has been sampled."""
    waiting: deque[Held] = deque()  # arrived, not yet added to the engine
    running = 0  # added to the engine, not finished; at most engine.max_running, so that
    # the rest wait here, where newer weights can still reach them before they start
    asked = -1  # the newest admitted_at weights:latest was read for
    intake_done = False
    while True:
        state.wake = trio.Event()  # what is queued from here on wakes the idle wait below
        if take_arrived(g.arrived, waiting):
            intake_done = True
        # A prompt admitted at a newer version than ours: read the latest weights now, once
        # per version asked for (later ones come with the watcher's polls).
        wanted = max((h.task.admitted_at for h in waiting), default=-1)
        if wanted > max(g.engine.version, asked):
            asked = wanted
            state.latest = await trio.to_thread.run_sync(g.r.get, g.keys.weights_latest)
        newer = state.latest is not None and state.latest != state.acted_on or state.went_back is not None
        if newer and (g.settings.inflight_updates or not g.engine.has_unfinished()) and not state.episodes:
            await load_weights(state, g.engine, g.engine_thread, name=g.name, weights_url=g.settings.weights_url,
                               fetch_dir=g.fetch_dir)
            newer = state.went_back is not None  # an older version waits for the engine to drain
        if state.turns and running < g.engine.max_running:  # episodes in flight go on, newer weights or not
            running += await add_turns(g, state, room=g.engine.max_running - running)
        if waiting and not newer and running < g.engine.max_running:
            # join the running batch; with newer weights pending, drain first
            running += await add_waiting(g, state, waiting, room=g.engine.max_running - running)
        if g.engine.has_unfinished():
            running -= await step_engine(g, state)
            continue
        if intake_done and not waiting and not state.episodes:
            break
        # idle: wait for a prompt to arrive, an episode's turn, or newer weights to show up
        intake_done = await wait_for_work(g, state, waiting, intake_done=intake_done)
    await g.finished_send.aclose()
    await g.episodes_send.aclose()


async def wait_for_work(g: Generator, state: State, waiting: deque[Held], *, intake_done: bool) -> bool:
    """Wait up to `weights_poll_s` for a prompt to arrive (into `waiting`) or an episode to queue a
    turn or end (`state.wake`); whether the intake has ended."""
    async with trio.open_nursery() as race:
        race.cancel_scope.deadline = trio.current_time() + g.settings.weights_poll_s

        async def prompt() -> None:
            nonlocal intake_done
            try:
                waiting.append(await g.arrived.receive())
            except trio.EndOfChannel:
                intake_done = True
            race.cancel_scope.cancel()

        async def woken() -> None:
            await state.wake.wait()
            race.cancel_scope.cancel()

        if not intake_done:
            race.start_soon(prompt)
        race.start_soon(woken)
    return intake_done


def take_arrived(arrived: trio.MemoryReceiveChannel[Held], waiting: deque[Held]) -> bool:
    """Move every prompt that has arrived to `waiting`, without waiting; whether the intake has ended."""
    while True:
        try:
            waiting.append(arrived.receive_nowait())
        except trio.WouldBlock:
            return False
        except trio.EndOfChannel:
            return True


async def add_waiting(g: Generator, state: State, waiting: deque[Held], *, room: int) -> int:
    """Add up to `room` waiting prompts to the engine, stamped with its weight version; how many.
    A prompt of a source with an environment goes to the episodes stage instead (its turns come
    back as requests)."""
    version, now = g.engine.version, time.perf_counter()
    batch = [waiting.popleft() for _ in range(min(len(waiting), room))]
    for h in batch:
        h.version, h.added_at = version, now
    played = [h for h in batch if h.task.meta.get("source") in g.specs]
    for h in played:
        state.episodes += 1
        g.episodes_send.send_nowait(h)
    batch = [h for h in batch if h.task.meta.get("source") not in g.specs]
    requests = [(h.entry_id.decode(), h.prompt_ids, dataclasses.replace(g.sampling, n=h.task.n)) for h in batch]
    if requests:
        await run_on_engine(g.engine_thread, add_all, g.engine, requests, timeout_s=g.settings.engine_timeout_s)
    return len(batch)


async def add_turns(g: Generator, state: State, *, room: int) -> int:
    """Add up to `room` queued episode turns to the engine; how many."""
    batch = [state.turns.popleft() for _ in range(min(len(state.turns), room))]
    for turn in batch:
        state.sampling[turn.request_id] = turn
    await run_on_engine(g.engine_thread, add_all, g.engine, [(t.request_id, t.ids, t.sampling) for t in batch],
                        timeout_s=g.settings.engine_timeout_s)
    return len(batch)


def add_all(engine: Engine, requests: list[tuple[str, list[int], SamplingSettings]]) -> None:
    for request_id, ids, sampling in requests:
        engine.add(request_id, ids, sampling)


async def step_engine(g: Generator, state: State) -> int:
    """One engine step; each prompt it finished goes on to scoring. How many finished."""
    pending = partial(weights_pending, state) if g.settings.inflight_updates else None
    finished = await run_on_engine(g.engine_thread, partial(g.engine.step, yield_when=pending),
                                   timeout_s=g.settings.engine_timeout_s)
    for done in finished:
        if done.error is not None:
            state.engine_errors += 1
            print(f"{g.name}: engine request {done.request_id} failed: {done.error}", file=sys.stderr, flush=True)
        turn = state.sampling.pop(done.request_id, None)
        if turn is not None:  # an episode's turn: back to its episode
            turn.result, turn.error = (done.samples[0], None) if done.error is None else (None, done.error)
            turn.done.set()
        elif done.error is not None:
            let_go(g, state, state.held[done.request_id])
        else:
            g.finished_send.send_nowait((done, state.held[done.request_id]))
    return len(finished)


def let_go(g: Generator, state: State, held: Held) -> None:
    """Stop holding a prompt whose sampling failed (an engine request that never came back): it stays
    pending, untouched, and is reclaimed after claim_idle_s, by this generator or another, and
    sampled again. Its place in `capacity` goes back to the intake."""
    del state.held[held.entry_id.decode()]
    g.capacity.release()
    print(f"{g.name}: let prompt {held.task.id} go, to be reclaimed after {g.settings.claim_idle_s:g} s",
          file=sys.stderr, flush=True)


def weights_pending(state: State) -> bool:
    """Whether newer weights wait to be loaded (in-flight updates: the engine yields to them). Called
    on the engine's thread once per sampled token: a read of two fields."""
    return state.latest is not None and state.latest != state.acted_on and not state.episodes


async def run_on_engine(thread: concurrent.futures.Executor, fn: Callable[..., T], *args: Any,
                        timeout_s: float = math.inf) -> T:
    """`fn(*args)` in the engine's own thread (trio's worker threads are any of several); raise
    EngineStalled when it has not returned within `timeout_s` (it goes on in its thread)."""
    token, done = trio.lowlevel.current_trio_token(), trio.Event()
    future = thread.submit(fn, *args)
    future.add_done_callback(lambda _: token.run_sync_soon(done.set))
    with trio.move_on_after(timeout_s):
        await done.wait()
        return future.result()
    raise EngineStalled(f"the engine's {getattr(fn, '__name__', 'call')} did not return within {timeout_s:g} s "
                        "(generator.engine_timeout_s); exiting: its prompts are reclaimed after claim_idle_s")


class EngineStalled(RuntimeError):
    """An engine call overran generator.engine_timeout_s: the engine's thread is stuck in it."""


async def load_weights(state: State, engine: Engine, engine_thread: concurrent.futures.Executor, *,
                       name: str, weights_url: str = "", fetch_dir: Path | None = None) -> None:
    """Load the WeightVersion in `state.latest` if it is newer than the engine's, once its files
    are verified (the check begun when it was announced, else one begun now); a refusal (the
    payload does not decode, the files fail their checksums or do not fit the model) is counted
    and reported, and the engine keeps its weights.

    A version no newer than the engine's but published after its weights (a trainer restarted
    from an older state announces its steps again, with other weights) is loaded too, once the
    engine has nothing in flight: until then it waits in `state.went_back`, so that no completion
    spans versions that descend. One published before them (weights:latest read while the
    watcher had already seen newer) is passed over."""
    blob = state.acted_on = state.latest
    assert blob is not None
    waiting, state.went_back = state.went_back, None
    t0, loading_at = time.perf_counter(), time.time()
    checked = state.checked
    if checked is None or checked.blob != blob:
        checked = state.checked = await check(Checked(blob), weights_url=weights_url, fetch_dir=fetch_dir)
    await checked.done.wait()
    t1 = time.perf_counter()
    wv = checked.wv
    try:
        if checked.error:
            raise CheckpointError(checked.error)
        assert wv is not None
        back = wv.version <= engine.version
        if back and wv.created_at <= state.published_at:
            return
        if back and engine.has_unfinished():
            if waiting is None:
                print(f"{name}: weights version {wv.version} {anew(wv.version, engine.version)}: loading it once the "
                      "completions in flight are done", flush=True)
            state.went_back = blob
            return
        before = engine.version
        try:
            await run_on_engine(engine_thread, lambda: engine.load_weights(checked.path, version=wv.version))
        except OSError as err:  # a file gone between the check and the load: nothing was copied yet
            raise CheckpointError(f"checkpoint {checked.path} could not be read ({err}): removed or replaced "
                                  "after it was checked") from None
    except CheckpointError as err:
        state.weights_refused += 1
        state.last_refusal = str(err)
        state.news.set()
        print(f"{name}: refused weights: {err}", file=sys.stderr, flush=True)
        return
    state.news.set()
    state.published_at = wv.created_at
    announced, drained = timeline(state, wv, loading_at=loading_at)
    if back:
        print(f"{name}: weights version {wv.version} {anew(wv.version, before)}", flush=True)
    print(f"{name}: loaded weights version {wv.version} (verify {checked.seconds:.2f} s, reload "
          f"{time.perf_counter() - t1:.2f} s; announced {announced:.2f} s after publishing, drained {drained:.2f} s, "
          f"waited {t1 - t0:.2f} s for the checksums)", flush=True)


def anew(version: int, loaded: int) -> str:
    """Why a version not numbered above the engine's `loaded` one is loaded all the same."""
    if version < loaded:
        return f"announced after version {loaded}: the trainer went back to an older state"
    return "published again (other files; a trainer restarted from an older state, or its checkpoint was lost)"


# ---------------------------------------------------------------------- scoring and writing


async def scoring(g: Generator, state: State) -> None:
    """Score and write the group of each prompt the engine finished, `reward_workers` at once."""
    async with trio.open_nursery() as writers:
        limit = trio.Semaphore(max(g.settings.reward_workers, 1))  # groups being scored at once
        async for done, held in g.finished:
            await limit.acquire()
            writers.start_soon(score_and_publish, g, state, done, held, limit)


async def score_and_publish(g: Generator, state: State, done: Finished, held: Held, limit: trio.Semaphore) -> None:
    """Score one finished prompt and write its group (or drop it: dynamic sampling); its place in
    `capacity` goes back to the intake."""
    try:
        group, errors = await trio.to_thread.run_sync(partial(
            make_group, g.engine, g.rewards, held, done, generator_id=g.id))
        drop = g.settings.drop_zero_variance and zero_variance(
            group, overlong=g.trainer.overlong, overlong_penalty=g.trainer.overlong_penalty)
        await trio.to_thread.run_sync(partial(
            drop_group if drop else publish, g.r, keys=g.keys, entry_id=held.entry_id, group=group))
    finally:
        limit.release()
    written(g, state, held, group, errors, drop=drop)


def written(g: Generator, state: State, held: Held, group: SampleGroup, errors: list[str], *, drop: bool) -> None:
    """Count a prompt's group written (or dropped: dynamic sampling) and give its place in
    `capacity` back to the intake."""
    del state.held[held.entry_id.decode()]
    g.capacity.release()
    tokens = sum(len(c.ids) if c.loss_mask is None else sum(c.loss_mask) for c in group.completions)
    state.produced.append((time.monotonic(), tokens))
    state.reward_errors += len(errors)
    if drop:
        state.dropped_zero_variance += 1
    else:
        state.groups += 1
    for err in errors[:1]:
        print(f"{g.name}: reward error ({len(errors)} in group {group.id}): {err}", file=sys.stderr, flush=True)
    if state.groups % 8 == 0 or drop:
        print(f"{g.name} v{group.version}: {state.groups} groups written"
              f"{f', {state.dropped_zero_variance} dropped (zero reward variance)' if drop else ''}, "
              f"{state.tokens_per_s():.0f} tok/s, {len(state.held)} in flight", flush=True)


def make_group(engine: Engine, rewards: RewardRunner, held: Held, done: Finished, *,
               generator_id: str) -> tuple[SampleGroup, list[str]]:
    """The scored SampleGroup of one finished prompt, and its reward errors."""
    task = held.task
    t0 = time.perf_counter()
    texts = [engine.decode(s.ids) for s in done.samples]
    source = task.meta.get("source")
    version, spans = group_versions(done.samples, added_at=held.version)
    scored = rewards.score(source if isinstance(source, str) else None, prompt=prompt_text(task),
                           completions=[(text, s.ids) for text, s in zip(texts, done.samples, strict=True)],
                           meta=task.meta, messages=task.messages, version=version)
    completions = [Completion(ids=s.ids, logprobs=s.logprobs, reward=sc.reward, rewards=sc.rewards,
                              finish=s.finish, text=text, reward_error=sc.error, versions=span)
                   for s, text, sc, span in zip(done.samples, texts, scored, spans, strict=True)]
    group = SampleGroup(
        id=task.id, prompt_id=task.id, prompt_ids=held.prompt_ids, version=version,
        generator=generator_id, engine=engine.name, completions=completions,
        timings={"queue": held.added_at - held.taken_at, "generate": t0 - held.added_at,
                 "reward": time.perf_counter() - t0})
    return group, [f"prompt {task.id}: {sc.error}" for sc in scored if sc.error is not None]


# ---------------------------------------------------------------------- episodes


async def episodes(g: Generator, state: State) -> None:
    """Play each prompt the engine loop sends (a source with an environment), all concurrently."""
    async with trio.open_nursery() as playing:
        async for held in g.episodes_in:
            playing.start_soon(play_and_publish, g, state, held)


async def play_and_publish(g: Generator, state: State, held: Held) -> None:
    """Play a prompt's n episodes, then write its group (or drop it: dynamic sampling)."""
    assert g.envs is not None, "a prompt to play, but no environment runner"
    task = held.task
    source = task.meta["source"]
    spec, limits = g.specs[source], g.episode_limits[source]
    try:
        prompt_ids = episode_prompt_ids(g.engine.tokenizer, task, system=spec.system, tools=spec.tools)
        room = g.engine.context_length - len(prompt_ids)  # the episode must fit the model's positions
        assert room > 0, f"prompt {task.id}: {len(prompt_ids)} tokens fill the model's context"
        limits = dataclasses.replace(limits, max_tokens=min(limits.max_tokens, room))
        played = await run_episodes(task.n, sample=partial(sample_turn, g, state), envs=g.envs, spec=spec,
                                    tokenizer=g.engine.tokenizer, prompt_ids=prompt_ids, meta=task.meta,
                                    limits=limits)
        t0 = time.perf_counter()
        completions = [ep.completion(g.engine.decode(ep.ids)) for ep in played]
        group = SampleGroup(
            id=task.id, prompt_id=task.id, prompt_ids=prompt_ids, version=held.version, generator=g.id,
            engine=g.engine.name, completions=completions,
            timings={"queue": held.added_at - held.taken_at, "generate": t0 - held.added_at, "reward": 0.0})
        drop = g.settings.drop_zero_variance and len({c.reward for c in group.completions}) == 1
        await trio.to_thread.run_sync(partial(
            drop_group if drop else publish, g.r, keys=g.keys, entry_id=held.entry_id, group=group))
    except BaseException as err:  # a failed turn (counted and said where it failed), alone or from the
        if not turn_failed(err):    # episodes' nursery: the other episodes' turns end unheard
            raise
        let_go(g, state, held)
        return
    finally:
        state.episodes -= 1
        state.wake.set()
    step_errors = [e for ep in played for e in ep.errors]
    state.env_errors += len(step_errors)
    for err in step_errors[:1]:
        print(f"{g.name}: environment error ({len(step_errors)} in group {group.id}): {err}",
              file=sys.stderr, flush=True)
    written(g, state, held, group, [f"prompt {task.id}: {c.reward_error}" for c in completions
                                    if c.reward_error is not None], drop=drop)


async def sample_turn(g: Generator, state: State, ids: list[int], max_new_tokens: int) -> Sampled:
    """One model turn of an episode: queued for the engine loop, which samples it among the rest."""
    state.turn_count += 1
    turn = Turn(request_id=f"turn-{state.turn_count}", ids=ids,
                sampling=dataclasses.replace(g.sampling, n=1, max_new_tokens=max_new_tokens))
    state.turns.append(turn)
    state.wake.set()
    await turn.done.wait()
    if turn.error is not None:
        raise TurnFailed(turn.error)
    assert turn.result is not None
    return turn.result


def prompt_text(task: PromptTask) -> str:
    """What the reward sees as the prompt: the last user message, or the raw text."""
    if task.messages is None:
        assert task.text is not None, f"prompt {task.id}: neither messages nor text"
        return task.text
    users = [m["content"] for m in task.messages if m["role"] == "user"]
    return users[-1] if users else task.messages[-1]["content"]


# ---------------------------------------------------------------------- weights, heartbeat, signals


async def watch_weights(g: Generator, state: State) -> None:
    """Hand each version the watcher sees announced to the engine loop (waking it), and check
    its files at once, while the engine finishes what is in flight; it loads at a safe point."""
    seen = 0
    while True:
        got = await trio.to_thread.run_sync(g.weights.wait, seen, 1.0, abandon_on_cancel=True)
        if got is None:
            if g.weights.error is not None:
                raise RuntimeError(f"{g.name}: the weights watcher stopped") from g.weights.error
            continue
        seen = got.seq
        state.latest, state.seen = got.blob, (got.blob, got.seen_at)
        state.wake.set()  # an idle engine loop loads it now
        if state.checked is None or state.checked.blob != got.blob:
            state.checked = Checked(got.blob)
            await check(state.checked, weights_url=g.settings.weights_url, fetch_dir=g.fetch_dir)


def timeline(state: State, wv: WeightVersion, *, loading_at: float) -> tuple[float, float]:
    """Seconds from the trainer publishing `wv` (its created_at) until the watcher saw it, and
    from then until the engine, done with what was in flight, began loading it (NaN: not seen
    by the watcher but read from weights:latest)."""
    blob, seen_at = state.seen
    if blob != state.acted_on:
        return math.nan, math.nan
    return max(seen_at - wv.created_at, 0.0), max(loading_at - seen_at, 0.0)


async def heartbeats(g: Generator, state: State) -> None:
    """Write the heartbeat hash and renew the GPU lease every few seconds (at once on news), and
    keep the held prompts from looking idle to the other generators."""
    touched = time.monotonic()
    while True:
        if time.monotonic() - touched > g.settings.claim_idle_s / 3:
            touched = time.monotonic()
            await trio.to_thread.run_sync(lambda held=list(state.held): touch_held(
                g.r, stream=g.keys.prompts, consumer=g.id, held=held))
        beat = heartbeat(state, g.engine)
        await trio.to_thread.run_sync(lambda b=beat: write_heartbeat(
            g.r, g.keys, g.id, b, ttl_s=g.settings.heartbeat_ttl_s))
        if g.settings.engine == "openai":
            await trio.to_thread.run_sync(lambda: devices.renew_server(
                g.r, g.keys, url=g.settings.server_url, owner=g.id, ttl_s=g.settings.heartbeat_ttl_s))
        if g.gpu is not None:
            await trio.to_thread.run_sync(lambda: devices.renew_gpu(
                g.r, g.keys, host=g.host, device=g.gpu, owner=g.id, ttl_s=g.settings.heartbeat_ttl_s))
        with trio.move_on_after(min(5.0, g.settings.heartbeat_ttl_s / 3, g.settings.claim_idle_s / 3)):
            await state.news.wait()
        state.news = trio.Event()


def heartbeat(state: State, engine: Engine) -> Heartbeat:
    """What the heartbeat says of this generator now (`rollouts status` shows it)."""
    return Heartbeat(engine=engine.name, version=engine.version, tokens_per_s=state.tokens_per_s(),
                     in_flight=len(state.held), groups=state.groups, reward_errors=state.reward_errors,
                     dropped_zero_variance=state.dropped_zero_variance, weights_refused=state.weights_refused,
                     last_refusal=state.last_refusal, env_errors=state.env_errors, engine_errors=state.engine_errors)


async def signals(g: Generator, state: State, everything: trio.CancelScope) -> None:
    """The first SIGTERM/SIGINT stops the intake (what is held is finished); the second cancels
    `everything` and sets the exit code."""
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as received:
        async for signum in received:
            if state.stopping:
                print(f"{g.name}: second signal, exiting now", file=sys.stderr, flush=True)
                state.exit_code = 128 + signum
                everything.cancel()
                return
            state.stopping = True
            g.intake_scope.cancel()
            print(f"{g.name}: finishing the {len(state.held)} prompts it holds (signal again to exit now)",
                  file=sys.stderr, flush=True)
