"""The generators' heartbeats and counters: typed records with one writer (the generator) and one
reader (the trainer's metrics, `rollouts status`, tests). No other module spells these fields.

A heartbeat is a hash with a TTL: a generator that dies stops renewing it and it expires, which
is how the others (and `rollouts status`) tell a live generator from a dead one.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, fields

import redis

from common.keys import Keys

Client = redis.Redis | redis.client.Pipeline


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """`rollouts:{run}:generator:{id}`, renewed by the generator every few seconds."""

    engine: str  # the engine's name: "hf", "vllm" or "openai" (engines/*: `name`)
    version: int  # weight version loaded (0: the initial weights)
    tokens_per_s: float  # completion tokens written per second over the last 30 s
    in_flight: int  # prompts taken from the stream and not yet written as groups
    groups: int  # groups written since it started
    reward_errors: int  # completions whose reward raised, timed out or returned garbage
    dropped_zero_variance: int  # groups dropped by dynamic sampling (every reward equal)
    weights_refused: int  # published checkpoints refused (checksums, shapes, unreadable)
    last_refusal: str = ""  # why the last one was refused ("" none)
    env_errors: int = 0  # environment steps that raised, timed out (the worker killed) or killed their worker
    engine_errors: int = 0  # engine requests that failed (a server that never answered); their prompts let go
    teacher_errors: int = 0  # groups written without teacher log-probs: the teacher failed or overran ([teacher])
    last_seen: float = field(default_factory=time.time)  # Unix time of this beat


_TYPES = {f.name: f.type for f in fields(Heartbeat)}
_PARSE = {"str": bytes.decode, "int": int, "float": float}
assert set(_TYPES.values()) <= set(_PARSE), f"a Heartbeat field type has no parser: {_TYPES}"


def write_heartbeat(r: redis.Redis, keys: Keys, generator_id: str, beat: Heartbeat, *, ttl_s: float) -> None:
    """Write the beat and renew its TTL, in one transaction."""
    key = keys.generator(generator_id)
    with r.pipeline(transaction=True) as pipe:
        pipe.hset(key, mapping=asdict(beat))
        pipe.expire(key, int(ttl_s))
        pipe.execute()


def clear_heartbeat(r: redis.Redis, keys: Keys, generator_id: str) -> None:
    """A generator that stops cleanly leaves no heartbeat behind."""
    r.delete(keys.generator(generator_id))


def parse_heartbeat(raw: dict[bytes, bytes]) -> Heartbeat | None:
    """The record of one heartbeat hash; None if it expired (or is incomplete) as it was read."""
    if not all(name.encode() in raw for name in _TYPES):
        return None
    return Heartbeat(**{name: _PARSE[kind](raw[name.encode()]) for name, kind in _TYPES.items()})


def read_heartbeat(r: redis.Redis, keys: Keys, generator_id: str) -> Heartbeat | None:
    """One generator's heartbeat; None if it has none (never started, stopped, or dead)."""
    return parse_heartbeat(r.hgetall(keys.generator(generator_id)))


SCAN_COUNT = 1000  # keys SCAN looks at per round trip while it finds the heartbeats


def read_heartbeats(r: redis.Redis, keys: Keys) -> dict[str, Heartbeat]:
    """{generator id: heartbeat} of every live generator (an unexpired heartbeat).

    The trainer reads them every step: the hashes come back in one round trip (a pipeline), not
    one per generator, which at 64 generators was already 11 ms of its step on loopback
    (docs/benchmarks.md, "Coordination at scale")."""
    prefix = keys.generator("").encode()
    found = sorted(set(r.scan_iter(match=keys.generator_pattern, count=SCAN_COUNT)))  # SCAN may repeat a key
    with r.pipeline(transaction=False) as pipe:
        for key in found:
            pipe.hgetall(key)
        raws = pipe.execute()
    beats = {}
    for key, raw in zip(found, raws, strict=True):
        beat = parse_heartbeat(raw)
        if beat is not None:
            beats[key.removeprefix(prefix).decode()] = beat
    return beats


# ---------------------------------------------------------------------- counters over all generators


@dataclass(frozen=True, slots=True)
class GeneratorCounters:
    """`rollouts:{run}:generators`: counters summed over every generator the run has had."""

    groups_dropped_zero_variance: int = 0  # groups dropped by dynamic sampling, their prompts acknowledged
    engine_stalls: int = 0  # generators that exited because an engine call overran generator.engine_timeout_s


def count_engine_stall(r: Client, keys: Keys) -> None:
    r.hincrby(keys.generators, "engine_stalls", 1)


def count_dropped_zero_variance(pipe: Client, keys: Keys) -> None:
    """On the pipeline that acknowledges the dropped group's prompt."""
    pipe.hincrby(keys.generators, "groups_dropped_zero_variance", 1)


def read_counters(r: redis.Redis, keys: Keys) -> GeneratorCounters:
    raw = r.hgetall(keys.generators)
    return GeneratorCounters(**{f.name: int(raw[f.name.encode()]) for f in fields(GeneratorCounters)
                                if f.name.encode() in raw})
