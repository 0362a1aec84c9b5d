"""The run's progress hashes: the trainer's (step, version, group counters), its last step's
status, and the producer's position. One owner for every field.

Each hash is a typed record here, with the one function that writes it (called by its process)
and the one that reads it (called by every process that needs it, the `rollouts` command
included). No other module spells these field names: a misspelt one is an AttributeError where
it is written, not a zero read silently elsewhere.

Writers take a client or a MULTI pipeline: the trainer changes its progress in the same
transaction that publishes a checkpoint or acknowledges groups.
"""

from __future__ import annotations

import enum
import json
import time
from dataclasses import asdict, dataclass, field, fields

import redis

from common.keys import Keys

Client = redis.Redis | redis.client.Pipeline


def _ints(raw: dict[bytes, bytes], names: list[str]) -> dict[str, int]:
    return {name: int(raw[name.encode()]) for name in names if name.encode() in raw}


# ---------------------------------------------------------------------- the trainer's progress


@dataclass(frozen=True, slots=True)
class TrainerProgress:
    """`rollouts:{run}:trainer`, written by the trainer only."""

    step: int = 0  # trainer steps done (written every step)
    version: int = 0  # the newest published weight version (0: the initial weights); producers admit against it
    # the highest version published before the trainer last went back to an older saved state (0: it
    # never did): groups sampled with a version above its step, up to this, used weights it abandoned
    version_max: int = 0
    state_step: int = 0  # the step of the newest saved trainer state; 0: none saved yet
    groups_trained: int = 0  # groups acknowledged together with a saved trainer state holding their update
    groups_dead: int = 0  # sample entries dead-lettered (did not decode or validate)
    groups_duplicate: int = 0  # groups refused for an id already trained
    groups_dropped_stale: int = 0  # groups staler than rollout.max_staleness, acknowledged untrained
    steps_skipped: int = 0  # optimizer updates skipped for a non-finite loss or gradient norm (not applied)
    publish_failed: int = 0  # publishes whose files could not be written (a full disk): none announced, trainer stopped
    state_lost: int = 0  # times the newest saved trainer state was found deleted (saved again at once)
    weights_lost: int = 0  # times the newest published checkpoint was found deleted (published again at once)


@dataclass(frozen=True, slots=True)
class GoneBack:
    """One start of the trainer from a saved state older than its last publish: it publishes the
    versions above `step` again, with other weights. Weights of a version in (`step`, `upto`]
    published before `at` (their created_at) are the ones it abandoned; what it publishes from
    then on is created at or after `at`, so the same number never means two things."""

    step: int  # the step it resumed at
    upto: int  # the highest version it had published before
    at: float  # unix seconds, after the created_at of every version it had published
    # versions it has published again with the very weights it had published under them (the same
    # groups trained again in the same order: the update is bit-identical), so nothing of them was abandoned
    same: list[int] = field(default_factory=list)

    def abandoned(self, version: int, published_at: float) -> bool:
        """Whether weights of `version` published at `published_at` (0: not said) are ones it abandoned."""
        return self.step < version <= self.upto and published_at < self.at and version not in self.same


def read_gone_back(r: redis.Redis, keys: Keys) -> list[GoneBack]:
    """The trainer's go-backs over the run, oldest first."""
    return [GoneBack(**json.loads(raw)) for raw in r.lrange(keys.gone_back, 0, -1)]


def add_gone_back(r: Client, keys: Keys, gone: GoneBack) -> None:
    """Record one more go-back of the trainer."""
    r.rpush(keys.gone_back, json.dumps(asdict(gone)))


def note_same(r: Client, keys: Keys, gone: GoneBack) -> None:
    """Replace the newest go-back with `gone`, which says more versions were published again unchanged."""
    r.lset(keys.gone_back, -1, json.dumps(asdict(gone)))


def write_gone_back(r: Client, keys: Keys, gone: list[GoneBack]) -> None:
    """Replace the run's go-backs with `gone` (what the trainer knows, into a Redis that lost writes)."""
    r.delete(keys.gone_back)
    for g in gone:
        add_gone_back(r, keys, g)


class Refused(enum.Enum):
    """Why the trainer acknowledged a group without training on it: the counter it bumps."""

    DEAD = "groups_dead"
    DUPLICATE = "groups_duplicate"
    STALE = "groups_dropped_stale"


def read_trainer(r: redis.Redis, keys: Keys) -> TrainerProgress:
    """The trainer's progress (all zeros before its first step)."""
    raw = r.hgetall(keys.trainer)
    return TrainerProgress(**_ints(raw, [f.name for f in fields(TrainerProgress)]))


def write_step(r: Client, keys: Keys, *, step: int, version: int | None = None,
               state_step: int | None = None, version_max: int | None = None) -> None:
    """Record `step` (and the published `version`, the saved trainer state's step and the highest
    version published before going back, when given)."""
    mapping = {"step": step}
    if version is not None:
        mapping["version"] = version
    if state_step is not None:
        mapping["state_step"] = state_step
    if version_max:
        mapping["version_max"] = version_max
    r.hset(keys.trainer, mapping=mapping)


def write_state_step(r: Client, keys: Keys, state_step: int) -> None:
    """Record the step of the newest saved trainer state alone (its version announced before it)."""
    r.hset(keys.trainer, "state_step", state_step)


def count_trained(r: Client, keys: Keys, groups: int) -> None:
    r.hincrby(keys.trainer, "groups_trained", groups)


def restore_trained(pipe: Client, keys: Keys, *, groups_trained: int, trained: dict[str, int]) -> None:
    """Put back the trainer's own count of trained groups and ids of trained groups (id -> step)
    into a Redis that lost writes (trainer/record.py)."""
    pipe.hset(keys.trainer, "groups_trained", groups_trained)
    if trained:
        pipe.zadd(keys.trained, trained)


def count_skipped(r: Client, keys: Keys, updates: int) -> None:
    r.hincrby(keys.trainer, "steps_skipped", updates)


class Fault(enum.Enum):
    """A fault of the trainer's disk it lived through or stopped at: the counter it bumps."""

    PUBLISH_FAILED = "publish_failed"
    STATE_LOST = "state_lost"
    WEIGHTS_LOST = "weights_lost"


def count_fault(r: Client, keys: Keys, fault: Fault) -> None:
    r.hincrby(keys.trainer, fault.value, 1)


def count_refused(r: Client, keys: Keys, why: Refused) -> None:
    r.hincrby(keys.trainer, why.value, 1)


# ---------------------------------------------------------------------- the trainer's last step


@dataclass(frozen=True, slots=True)
class TrainerStatus:
    """`rollouts:{run}:trainer:status`: what `rollouts status` shows of the trainer's last step."""

    last_step_s: float  # wall-clock seconds of the last step, waiting for data included
    last_wait_s: float  # of which blocked on the samples stream with nothing to read
    staleness_mean: float  # mean staleness (versions behind) of the last step's groups
    staleness_max: float  # the largest
    tokens_per_s: float  # prompt and completion tokens through the model per second of training
    updated_at: float = field(default_factory=time.time)  # Unix time it was written


def write_status(r: Client, keys: Keys, status: TrainerStatus) -> None:
    r.hset(keys.trainer_status, mapping=asdict(status))


def read_status(r: redis.Redis, keys: Keys) -> TrainerStatus | None:
    """The last step's status; None before the trainer's first step."""
    raw = {k.decode(): float(v) for k, v in r.hgetall(keys.trainer_status).items()}
    names = [f.name for f in fields(TrainerStatus)]
    if not all(n in raw for n in names):
        return None
    return TrainerStatus(**{n: raw[n] for n in names})


# ---------------------------------------------------------------------- the producer's position


@dataclass(frozen=True, slots=True)
class SourcePosition:
    epoch: int = 0  # passes over the source begun (0: the first)
    offset: int = 0  # rows of this epoch taken (admitted or skipped)
    rows_skipped: int = 0  # rows of this source that made no prompt, over the run


@dataclass(frozen=True, slots=True)
class ProducerProgress:
    """`rollouts:{run}:producer`, written by the producer only: all it needs to resume exactly."""

    seed: int | None = None  # task.seed the run started with; None: no producer has started it
    admitted: int = 0  # prompts (or sft conversations) admitted: the mixture's next draw index
    rows_skipped: int = 0  # rows of every source that made no prompt
    last_skipped: str = ""  # the last skipped row's id and why
    sft_truncated: int = 0  # sft conversations cut to their source's max_length
    sft_tokens_cut: int = 0  # tokens those cuts removed
    sources: dict[str, SourcePosition] = field(default_factory=dict)  # source name -> its position


_PRODUCER_INTS = ["admitted", "rows_skipped", "sft_truncated", "sft_tokens_cut"]
_SOURCE_FIELDS = ("epoch", "offset", "rows_skipped")


def read_producer(r: redis.Redis, keys: Keys) -> ProducerProgress:
    raw = r.hgetall(keys.producer)
    sources: dict[str, dict[str, int]] = {}
    for k, v in raw.items():
        name, sep, what = k.decode().rpartition(":")
        if sep and what in _SOURCE_FIELDS:
            sources.setdefault(name, {})[what] = int(v)
    seed = raw.get(b"seed")
    return ProducerProgress(seed=None if seed is None else int(seed),
                            last_skipped=raw.get(b"last_skipped", b"").decode(),
                            sources={n: SourcePosition(**p) for n, p in sorted(sources.items())},
                            **_ints(raw, _PRODUCER_INTS))


def start_producer(r: Client, keys: Keys, *, seed: int) -> None:
    """Mark the run as started by a producer with `seed`."""
    r.hset(keys.producer, mapping={"seed": seed, "admitted": 0, "rows_skipped": 0})


def write_admission(pipe: Client, keys: Keys, *, positions: dict[str, tuple[int, int]], admitted: int,
                    skipped: list[tuple[str, str]], truncated: int = 0, tokens_cut: int = 0) -> None:
    """One admission, on the pipeline whose transaction pushes its prompts: every source's
    (epoch, offset), `admitted` more prompts, the rows skipped as (source, "row id: why"), and the
    sft conversations truncated."""
    if truncated:
        pipe.hincrby(keys.producer, "sft_truncated", truncated)
        pipe.hincrby(keys.producer, "sft_tokens_cut", tokens_cut)
    pipe.hset(keys.producer, mapping={f"{name}:{what}": value for name, (epoch, offset) in positions.items()
                                      for what, value in (("epoch", epoch), ("offset", offset))})
    pipe.hincrby(keys.producer, "admitted", admitted)
    for source, why in skipped:
        pipe.hincrby(keys.producer, "rows_skipped", 1)
        pipe.hincrby(keys.producer, f"{source}:rows_skipped", 1)
        pipe.hset(keys.producer, "last_skipped", why[:500])


# ---------------------------------------------------------------------- prompts admitted, until settled

# Take each id out of the outstanding set; count the ones that were in it as dropped when
# ARGV[1] is "1". Atomic, and runs inside the caller's MULTI/EXEC: an id settles once.
_SETTLE = """
local n = 0
for i = 2, #ARGV do
  n = n + redis.call('SREM', KEYS[1], ARGV[i])
end
if ARGV[1] == '1' and n > 0 then redis.call('INCRBY', KEYS[2], n) end
return n
"""


def add_outstanding(pipe: Client, keys: Keys, ids: list[str]) -> None:
    """On the producer's admission transaction: `ids` are admitted and outstanding."""
    if ids:
        pipe.sadd(keys.outstanding, *ids)


def settle(r: Client, keys: Keys, ids: list[str], *, dropped: bool) -> None:
    """`ids` will never be admitted work again: trained (`dropped` False) or given up for good
    (too stale, dead-lettered, dropped by dynamic sampling). Only ids the producer admitted and
    that are still outstanding count towards `read_dropped`, each once: an entry nobody admitted,
    a forged id or a second group of a prompt already settled changes nothing."""
    if ids:
        r.eval(_SETTLE, 2, keys.outstanding, keys.prompts_dropped, "1" if dropped else "0", *ids)


def read_dropped(r: redis.Redis, keys: Keys) -> int:
    """Admitted prompts dropped for good: the producer admits as many more."""
    return int(r.get(keys.prompts_dropped) or 0)


def count_outstanding(r: redis.Redis, keys: Keys) -> int:
    return int(r.scard(keys.outstanding))
