"""The generator's state: what its stages share (`Generator`: wired once, never changed) and what
they hand over and count (`State`), the prompts it holds, episode turns, and the engine's thread."""

from __future__ import annotations

import concurrent.futures
import math
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import redis
import trio

from common.config import GeneratorConfig, LimitsConfig, TrainerConfig
from common.keys import Keys
from common.messages import PromptTask
from common.quarantine import Quarantine
from common.teacher import Teacher
from engines.base import Engine, Finished, Sampled, SamplingSettings
from envs.base import Spec
from generators.environments import EnvRunner
from generators.episodes import EpisodeLimits
from generators.scoring import RewardRunner
from generators.transfer import Receiver
from generators.weights import Checked, Watcher

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
    published_at: float = 0.0  # when its newest version's weights were published, set when it finishes


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
    images: tuple[bytes, ...] = ()  # the prompt's (common/images.py), laid out in `ids`
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
    # ... and of every version loaded since the engine last went back: the group of a prompt says
    # when the weights of its newest version were published (SampleGroup.published_at).
    published: dict[int, float] = field(default_factory=dict)
    went_back: bytes | None = None  # such a payload, waiting for the completions in flight to finish
    checked: Checked | None = None  # the newest payload's check (checksums), begun when it was announced
    seen: tuple[bytes, float] = (b"", 0.0)  # the payload last announced, and time.time() the watcher saw it
    stopping: bool = False
    exit_code: int | None = None  # set by a second signal: exit now with this code
    news: trio.Event = field(default_factory=trio.Event)  # set when the heartbeat should not wait (new weights)
    groups: int = 0
    dropped_zero_variance: int = 0
    reward_errors: int = 0
    teacher_errors: int = 0  # groups written without teacher log-probs: the teacher failed or overran
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
    # The trainer's quarantine of this generator (common/quarantine.py), as the heartbeat last read it:
    # the intake takes no prompt while its groups would be turned away.
    quarantine: Quarantine | None = None

    def benched(self) -> bool:
        """Whether the trainer would turn away what it samples now: quarantined, and not yet on
        weights published since (or for good)."""
        return self.quarantine is not None and self.quarantine.turns_away(self.published_at)

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
    received: Receiver | None = None  # the trainer's weights broadcast, when it has one (trainer.weight_transfer)
    teacher: Teacher | None = None  # on-policy distillation's teacher ([teacher]); None: none
    distill_weight: float = 0.0  # [teacher]'s: above 0 a group with teacher log-probs is never dropped as zero-variance

    pooled: bool = False  # one of several runs this generator serves (generators/pool.py)

    @property
    def name(self) -> str:
        """How its console lines begin: the generator, and the run where it serves several."""
        return f"generator {self.id} (run {self.keys.run})" if self.pooled else f"generator {self.id}"


def let_go(g: Generator, state: State, held: Held) -> None:
    """Stop holding a prompt whose sampling failed (an engine request that never came back): it stays
    pending, untouched, and is reclaimed after claim_idle_s, by this generator or another, and
    sampled again. Its place in `capacity` goes back to the intake."""
    del state.held[held.entry_id.decode()]
    g.capacity.release()
    print(f"{g.name}: let prompt {held.task.id} go, to be reclaimed after {g.settings.claim_idle_s:g} s",
          file=sys.stderr, flush=True)


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
