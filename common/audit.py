"""Where every admitted prompt of a run is, read from Redis, and which groups the trainer trained in
which step, read from its metrics.jsonl: the audit of "nothing lost, nothing twice" that the fault
tests and `ops/chaos` check after a run."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import redis

from common.deadletters import count_dead_letters
from common.heartbeats import read_counters
from common.keys import GENERATORS_GROUP, PAYLOAD, TRAINER_GROUP, Keys
from common.messages import peek_id
from common.progress import count_outstanding, read_dropped, read_producer, read_trainer
from common.streams import entry_key, group_backlog


def _added(r: redis.Redis, stream: str) -> int:
    return r.xinfo_stream(stream)["entries-added"] if r.exists(stream) else 0


def _unread_copies(r: redis.Redis, keys: Keys) -> int:
    """Group entries the trainer has not acknowledged (waiting, or read and not yet turned away)
    whose id is already trained, or is an earlier unacknowledged entry's: copies it refuses as
    duplicates once it reads them. A generator cut off past `claim_idle_s` writes such a copy of a
    prompt another generator took over; written after the trainer stopped, it waits in the stream."""
    if not r.exists(keys.samples):
        return 0
    info = {g["name"].decode(): g for g in r.xinfo_groups(keys.samples)}.get(TRAINER_GROUP)
    delivered, unacked = b"0-0", set()
    if info is not None:
        delivered = info["last-delivered-id"]
        delivered = delivered if isinstance(delivered, bytes) else delivered.encode()
        if info["pending"]:
            unacked = {p["message_id"] for p in r.xpending_range(
                keys.samples, TRAINER_GROUP, min="-", max="+", count=info["pending"])}
    start, copies, unread = (min(unacked, key=entry_key) if unacked else b"(" + delivered), 0, set()
    while entries := r.xrange(keys.samples, min=start, count=1000):
        gids = [gid for entry_id, fields in entries
                if not (entry_key(entry_id) <= entry_key(delivered) and entry_id not in unacked)  # acknowledged
                and (gid := peek_id(fields.get(PAYLOAD, b""))) is not None]
        ids = list(dict.fromkeys(gids))
        trained = {gid for gid, score in zip(ids, r.zmscore(keys.trained, ids) if ids else [], strict=True)
                   if score is not None}  # one round trip a thousand entries
        for gid in gids:
            copies += gid in unread or gid in trained
            unread.add(gid)
        start = b"(" + entries[-1][0]
    return copies


def accounting(r: redis.Redis, keys: Keys) -> dict[str, int]:
    """Where every admitted prompt of a run is (streams may have been trimmed).

    `admitted` should equal `trained + dropped + pending`: groups trained (acknowledged with a
    saved trainer state), groups or prompts given up for a counted reason (too stale, dead
    letters), and prompts or groups still in a stream (waiting, or delivered and unacknowledged).
    `duplicate` counts extra groups made from a prompt already trained: refused by the trainer
    (`duplicate_refused`) or still in the samples stream (`duplicate_unread`, not pending: their
    prompt is trained and the trainer will refuse them); `prompt_entries` and
    `sample_entries` are every entry ever added to the two streams; `outstanding` the admitted
    prompts neither trained nor dropped, by id, and `prompts_dropped` those dropped, by id.

    Read it once no process of the run writes: its reads come one after another, and an admission
    or a group written between two of them shows as a prompt admitted twice or lost.
    """
    t = read_trainer(r, keys)
    prompts_pending, prompts_waiting = group_backlog(r, keys.prompts, GENERATORS_GROUP)
    samples_pending, samples_waiting = group_backlog(r, keys.samples, TRAINER_GROUP)
    acc = {
        "admitted": read_producer(r, keys).admitted,
        "trained": t.groups_trained,
        "dropped_stale": t.groups_dropped_stale,
        "dead_groups": t.groups_dead,
        "dead_prompts": count_dead_letters(r, keys.prompts_dead),
        "dropped_zero_variance": read_counters(r, keys).groups_dropped_zero_variance,
        "duplicate_refused": t.groups_duplicate, "duplicate_unread": _unread_copies(r, keys),
        "prompts_waiting": prompts_waiting, "prompts_pending": prompts_pending,
        "samples_waiting": samples_waiting, "samples_pending": samples_pending,
        "prompt_entries": _added(r, keys.prompts), "sample_entries": _added(r, keys.samples),
        "outstanding": count_outstanding(r, keys), "prompts_dropped": read_dropped(r, keys),
    }
    acc["dropped"] = (acc["dropped_stale"] + acc["dead_groups"] + acc["dead_prompts"]
                      + acc["dropped_zero_variance"])
    acc["duplicate"] = acc["duplicate_refused"] + acc["duplicate_unread"]
    acc["pending"] = (prompts_waiting + prompts_pending + samples_waiting + samples_pending
                      - acc["duplicate_unread"])
    return acc


def unaccounted(acc: dict[str, int]) -> list[str]:
    """What `accounting` shows wrong with a run that only its own producer and generators fed:
    each line a broken promise (empty: every admitted prompt is trained, dropped for a counted
    reason, or pending, exactly once)."""
    wrong = []
    if acc["admitted"] != acc["prompt_entries"]:
        wrong.append(f"prompts admitted twice or lost: admitted {acc['admitted']}, "
                     f"prompt entries {acc['prompt_entries']}")
    if acc["admitted"] != acc["trained"] + acc["dropped"] + acc["pending"]:
        wrong.append(f"unaccounted prompts: admitted {acc['admitted']} != trained {acc['trained']} + "
                     f"dropped {acc['dropped']} + pending {acc['pending']}")
    if acc["admitted"] != acc["trained"] + acc["prompts_dropped"] + acc["outstanding"]:
        wrong.append(f"admitted ids unsettled: admitted {acc['admitted']} != trained {acc['trained']} + "
                     f"dropped by id {acc['prompts_dropped']} + outstanding {acc['outstanding']}")
    groups = (acc["trained"] + acc["dropped_stale"] + acc["dead_groups"] + acc["duplicate_refused"]
              + acc["samples_waiting"] + acc["samples_pending"])
    if acc["sample_entries"] != groups:  # every group entry is one prompt's, or a refused duplicate
        wrong.append(f"group entries {acc['sample_entries']} != groups accounted for {groups}")
    if acc["duplicate"]:
        wrong.append(f"{acc['duplicate']} group(s) made twice from one prompt")
    return wrong


def read_steps(path: Path) -> list[dict]:
    """Each line of a trainer's metrics.jsonl as written, oldest first; [] before the first step."""
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def last_trained(path: Path) -> dict[int, list[str]]:
    """{step: the group ids it trained}, as last trained: a step trained again after a restart is
    written again, and its last record is the one that counts."""
    return {m["step"]: m["group_ids"] for m in read_steps(path)}


def trained_twice(path: Path) -> list[str]:
    """Group ids trained in more than one step."""
    seen = Counter(g for ids in last_trained(path).values() for g in ids)
    return sorted(g for g, n in seen.items() if n > 1)
