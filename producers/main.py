"""The producer: admits prompts of the task onto the prompts stream, as fast as staleness allows."""

from __future__ import annotations

import signal
import time

import redis

from common.config import Config
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import PromptTask, encode
from common.streams import connect, ensure_group, trainer_version
from producers.admission import admission_limit
from producers.arithmetic import problem

POLL_S = 0.2
MAX_PER_TRANSACTION = 64


class ProducerError(RuntimeError):
    """The run's stored position does not fit this producer's configuration."""


def dropped_groups(r: redis.Redis, keys: Keys) -> int:
    """Admitted prompts that will never fill a trainer step: dropped or dead-lettered."""
    stale, dead = r.hmget(keys.trainer, "groups_dropped_stale", "groups_dead")
    return int(stale or 0) + int(dead or 0) + r.xlen(keys.prompts_dead)


def load_position(r: redis.Redis, keys: Keys, *, seed: int) -> tuple[int, int]:
    """(offset, admitted) of this run, checking the stored seed is the configured one."""
    stored_seed, offset, admitted = r.hmget(keys.producer, "seed", "offset", "admitted")
    if stored_seed is None:
        r.hset(keys.producer, mapping={"seed": seed, "epoch": 0, "offset": 0, "admitted": 0})
        return 0, 0
    if int(stored_seed) != seed:
        raise ProducerError(f"task.seed: run {keys.run!r} was started with seed {int(stored_seed)}, "
                            f"not {seed}; use a new run name to change the seed")
    return int(offset or 0), int(admitted or 0)


def admit(r: redis.Redis, keys: Keys, *, config: Config, offset: int, count: int, version: int) -> None:
    """Push `count` prompts starting at `offset`, moving the position in the same transaction."""
    task = config.task
    pipe = r.pipeline(transaction=True)
    for index in range(offset, offset + count):
        p = problem(seed=task.seed, index=index, max_operand=task.max_operand, ops=task.ops)
        msg = PromptTask(id=f"{task.name}:0:{index}", messages=[{"role": "user", "content": p.question}],
                         text=None, meta={"answer": p.answer, "source": task.name},
                         n=config.rollout.group_size, admitted_at=version)
        pipe.xadd(keys.prompts, {PAYLOAD: encode(msg)})
    pipe.hset(keys.producer, mapping={"epoch": 0, "offset": offset + count})
    pipe.hincrby(keys.producer, "admitted", count)
    pipe.execute()


def run(config: Config) -> None:
    keys = Keys(config.run)
    stop = False

    def on_signal(signum, frame):  # first signal: stop after this transaction; second: now
        nonlocal stop
        if stop:
            raise SystemExit(130)
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    r = connect(config.redis_url)
    ensure_group(r, keys.prompts, GENERATORS_GROUP)
    offset, admitted = load_position(r, keys, seed=config.task.seed)
    print(f"producer: run {config.run!r}, task {config.task.name}, resuming at offset {offset}", flush=True)

    while not stop:
        # ---- how many prompts the trainer's version allows
        version = trainer_version(r, keys)
        limit = admission_limit(version=version, max_staleness=config.rollout.max_staleness,
                                prompts_per_step=config.rollout.prompts_per_step,
                                dropped=dropped_groups(r, keys))
        count = min(limit - admitted, MAX_PER_TRANSACTION)
        if count <= 0:
            time.sleep(POLL_S)
            continue
        # ---- admit them; the position moves forward in the same transaction
        admit(r, keys, config=config, offset=offset, count=count, version=version)
        offset, admitted = offset + count, admitted + count
        print(f"producer: admitted {admitted} prompts (limit {limit} at version {version})", flush=True)
    print("producer: stopped", flush=True)
