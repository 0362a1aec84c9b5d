"""Reading one step's sample groups from the samples stream, and turning away what cannot be trained on.

Each rank is its own consumer (`rank{N}`) in the `trainer` group and reads its share of groups. A
restarted trainer first re-reads its own pending entries in stream order (read by an earlier
incarnation, never acknowledged), then new ones. Entries it will never train on are acknowledged
at once and counted in the trainer hash: undecodable or untrainable ones are dead-lettered with
the reason (`groups_dead`), a group whose id is already trained or waiting to be published is a
duplicate (`groups_duplicate`), and one staler than `max_staleness` is dropped
(`groups_dropped_stale`). So is one sampled with weights the trainer abandoned: a trainer restarted
from a state older than its last publish (`state_every` above `sync_every`, a crash between the two)
publishes those step numbers again with other weights. A group says when the weights of its newest
version were published (`published_at`), and each such start is recorded with the time after
which the trainer published anew (common/progress.py:GoneBack): a group of a version above the
step it went back to, up to the highest it had published, and published before then, was sampled
with the old weights, even once the trainer has passed that version again. Versions above that
highest one were never published in this run (a replayed recording): they are trained.

The `trained` sorted set (group id -> step, written by trainer/checkpoints.py's `publish`) guards
against a second group made from the same prompt (two generators racing on a reclaimed prompt); it
keeps the ids of the last `dedup_window` steps only: a copy arriving later than that was sampled so
long ago that the staleness limit drops it anyway, unless a generator sat on a claimed prompt for
that many steps before sampling it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import redis

from common.config import LimitsConfig
from common.deadletters import DeadLetter, dead_letter
from common.keys import PAYLOAD, TRAINER_GROUP, Keys
from common.messages import MessageError, SampleGroup, peek_id
from common.progress import GoneBack, Refused, count_refused, settle
from common.quarantine import Quarantine
from trainer.parallel import gather
from trainer.shutdown import Shutdown

if TYPE_CHECKING:
    from trainer.run import Run

BLOCK_MS = 1000  # longest wait on the samples stream before checking for a stop request


@dataclass
class Collected:
    """The sample groups of one step, and what was turned away while collecting them."""

    groups: list[SampleGroup] = field(default_factory=list)
    entry_ids: list[bytes] = field(default_factory=list)  # stream entries of `groups`, to ack on publish
    dead: int = 0
    duplicate: int = 0
    stale: int = 0
    wait_s: float = 0.0  # seconds blocked on the stream with nothing to read


def read_entries(r: redis.Redis, keys: Keys, *, consumer: str, cursor: bytes | None, count: int
                 ) -> tuple[list[tuple[bytes, dict]], bytes | None]:
    """Up to `count` entries, and the cursor to read from next.

    `cursor` walks this consumer's own pending entries (read but never acknowledged by an
    earlier incarnation) from "0"; once they are exhausted it becomes None and reads are of new
    entries (">"), blocking up to BLOCK_MS.
    """
    if cursor is not None:
        reply = r.xreadgroup(TRAINER_GROUP, consumer, {keys.samples: cursor}, count=count)
        entries = reply[0][1] if reply else []
        if entries:
            return [(eid, fields or {}) for eid, fields in entries], entries[-1][0]
    reply = r.xreadgroup(TRAINER_GROUP, consumer, {keys.samples: ">"}, count=count, block=BLOCK_MS)
    return [(eid, fields or {}) for eid, fields in (reply[0][1] if reply else [])], None


def validate(fields: dict, *, vocab_size: int, objective: str = "grpo", limits: LimitsConfig | None = None,
             routing: tuple[int, int, int] | None = None) -> SampleGroup:
    """The entry's group, or MessageError saying why it cannot be trained on (None: default limits).
    `routing`: the model's (MoE layers, top_k, experts), None for a dense model: a group whose
    completions carry experts (routing replay) for another is refused."""
    limits = limits or LimitsConfig()
    blob = fields.get(PAYLOAD)
    if blob is None:
        raise MessageError(f"entry has no payload field {PAYLOAD!r} (fields: {sorted(fields)})")
    group = limits.decode_group(blob, vocab_size=vocab_size)
    if objective == "grpo" and len(group.completions) < 2:
        raise MessageError(f"group {group.id}: {len(group.completions)} completion(s); "
                           "a group-relative advantage needs at least 2")
    if group.routing is not None and group.routing != routing:
        raise MessageError(f"group {group.id}: experts recorded as (MoE layers, top_k, experts) {group.routing}, "
                           "but the trained model's are " + ("none (a dense model, or routers it cannot read)"
                                                            if routing is None else str(routing))
                           + ": its routing cannot be replayed")
    if not any(c.loss_mask is None or c.loss_mask.any() for c in group.completions):  # decoded: bool arrays
        raise MessageError(f"group {group.id}: loss_mask is 0 everywhere; nothing to train on")
    return group


def reject(r: redis.Redis, keys: Keys, entry_id: bytes, *, why: Refused, group_id: str | None = None,
           fields: dict | None = None, reason: str = "") -> None:
    """Acknowledge an entry that will never be trained on and count it (dead-letter it if
    `fields`); with a `group_id` its prompt settles as dropped, if the producer admitted it and
    nothing settled it yet (a prompt admitted again after Redis lost writes, whose group was
    trained before, is such a one)."""
    pipe = r.pipeline(transaction=True)
    if fields is not None:
        dead_letter(pipe, keys.samples_dead, DeadLetter.of(source=keys.samples, entry_id=entry_id, entry=fields,
                                                           reason=reason))
    pipe.xack(keys.samples, TRAINER_GROUP, entry_id)
    count_refused(pipe, keys, why)
    if group_id is not None:
        settle(pipe, keys, [group_id], dropped=True)
    pipe.execute()


def collect(r: redis.Redis, keys: Keys, *, want: int, step: int, max_staleness: int | None, vocab_size: int,
            unpublished: set[str], consumer: str, cursor: bytes | None, shutdown: Shutdown,
            objective: str = "grpo", limits: LimitsConfig | None = None, trained: dict[str, int] | None = None,
            skip: set[bytes] | None = None, between: Callable[[], None] | None = None,
            gone_back: Sequence[GoneBack] = (), quarantined: dict[str, Quarantine] | None = None,
            routing: tuple[int, int, int] | None = None) -> tuple[Collected | None, bytes | None]:
    """`want` trainable groups (None if a stop was requested first), and the next read cursor.
    `max_staleness` None: no group is too stale (sft). A group is a duplicate if its id is
    `unpublished` (trained since the last saved state), in `trained` (the trainer's own record of
    the ids it trained) or in Redis's `trained` set; entries in `skip` (trained, acknowledged with
    the next saved state) are passed over when this rank's pending entries are read again.
    `between` runs before every read (rank-local: no collectives), for what must not wait for
    the step's groups to arrive. `gone_back`: the trainer's starts below a version it had published
    (a group sampled with weights one of them abandoned is dropped as stale). `quarantined`: the
    generators in quarantine (common/quarantine.py), whose groups are dead-lettered with the
    figures, unless sampled with weights published since (on probation). `routing`: the model's
    (`validate`)."""
    trained = trained or {}
    skip = skip or set()
    got = Collected()
    seen = set(unpublished)
    while len(got.groups) < want:
        if shutdown.requested:
            return None, cursor
        if between is not None:
            between()
        t0 = time.monotonic()
        entries, cursor = read_entries(r, keys, consumer=consumer, cursor=cursor, count=want - len(got.groups))
        if not entries:
            got.wait_s += time.monotonic() - t0
        for entry_id, fields in entries:
            if entry_id in skip:
                continue
            try:
                group = validate(fields, vocab_size=vocab_size, objective=objective, limits=limits, routing=routing)
            except MessageError as err:
                reject(r, keys, entry_id, why=Refused.DEAD, group_id=peek_id(fields.get(PAYLOAD, b"")),
                       fields=fields, reason=str(err))
                print(f"trainer: dead-lettered sample entry {entry_id.decode()}: {err}",
                      file=sys.stderr, flush=True)
                got.dead += 1
                continue
            if group.id in seen:  # its twin's prompt settles when the twin is published
                reject(r, keys, entry_id, why=Refused.DUPLICATE)
                got.duplicate += 1
                continue
            if group.id in trained or r.zscore(keys.trained, group.id) is not None:
                reject(r, keys, entry_id, why=Refused.DUPLICATE, group_id=group.id)
                got.duplicate += 1
                continue
            if max_staleness is not None and (  # sft: no sampling, no weights to be stale
                    step - group.version > max_staleness
                    or any(g.abandoned(group.newest_version, group.published_at) for g in gone_back)):
                reject(r, keys, entry_id, why=Refused.STALE, group_id=group.id)
                got.stale += 1
                continue
            held = (quarantined or {}).get(group.generator)
            if held is not None and held.turns_away(group.published_at):
                reason = f"generator {group.generator} {held.line()}"
                reject(r, keys, entry_id, why=Refused.DEAD, group_id=group.id, fields=fields, reason=reason)
                print(f"trainer: dead-lettered group {group.id}: {reason}", file=sys.stderr, flush=True)
                got.dead += 1
                continue
            seen.add(group.id)
            got.groups.append(group)
            got.entry_ids.append(entry_id)
    return got, cursor


def gather_groups(run: Run, got: Collected) -> tuple[list[Collected], list[SampleGroup]]:
    """Every rank's collected groups (for the acknowledgement and the metrics), a group two ranks
    read kept once and counted as a duplicate; and the groups this rank trains on."""
    gathered = gather(got)
    everyone, mine = cross_rank_duplicates(gathered, run.rank)
    if run.rank == 0:
        for _ in range(sum(c.duplicate for c in everyone) - sum(c.duplicate for c in gathered)):
            count_refused(run.r, run.keys, Refused.DUPLICATE)
    return everyone, mine


def cross_rank_duplicates(everyone: list[Collected], rank: int) -> tuple[list[Collected], list[SampleGroup]]:
    """Two copies of one group (two generators raced on a reclaimed prompt) read by two ranks in
    the same step: `everyone` with each group id kept at its first rank only (each dropped copy
    counts as a duplicate; its entry stays, to be acknowledged), and the groups rank `rank` trains
    on: every rank's groups dealt again by tokens (`balanced`), a dropped copy kept with nothing to
    train on (every loss mask 0), so that every rank keeps as many groups as it read."""
    seen: set[str] = set()
    out, trained = [], []
    for got in everyone:
        keep = [g for g in got.groups if g.id not in seen]
        seen.update(g.id for g in keep)
        out.append(replace(got, groups=keep, duplicate=got.duplicate + len(got.groups) - len(keep)))
        kept = {id(g) for g in keep}
        trained.append([g if id(g) in kept else replace(g, completions=[
            replace(c, loss_mask=[0] * len(c.ids)) for c in g.completions]) for g in got.groups])
    return out, balanced(trained)[rank]


def group_tokens(group: SampleGroup) -> int:
    """Positions `group` puts through the model: its prompt once, then its completions."""
    return len(group.prompt_ids) + sum(len(c.ids) for c in group.completions)


def balanced(read: list[list[SampleGroup]]) -> list[list[SampleGroup]]:
    """The step's groups dealt to the ranks by tokens: each rank as many groups as it read (so that
    every rank's mini-batches and passes line up), the longest group first to the rank with the
    fewest tokens so far that still has room. The loss is normalised by the global token count, so
    which rank trains a group does not change the update; what it changes is how long the slowest
    rank takes. Every rank computes the same deal from the same gathered lists, in their order."""
    if len(read) == 1:
        return read
    pool = sorted((g for groups in read for g in groups), key=group_tokens, reverse=True)  # stable: read order
    room, tokens = [len(groups) for groups in read], [0] * len(read)
    out: list[list[SampleGroup]] = [[] for _ in read]
    for g in pool:
        n = min((n for n in range(len(read)) if room[n]), key=lambda n: (tokens[n], n))
        out[n].append(g)
        room[n] -= 1
        tokens[n] += group_tokens(g)
    return out
