"""The prompts stream as a generator consumes it, and the groups it writes back.

Reading: this consumer's own pending prompts (a restart under the same id), prompts idle in a
dead generator's pending list (XAUTOCLAIM), new ones (XREADGROUP); decoding and tokenizing them,
with what does not decode dead-lettered and acknowledged. Holding: the idle time of held prompts
is reset so live generators do not reclaim them, and a consumer that stopped holding nothing
leaves the group. Writing: a scored group and its prompt's acknowledgement in one MULTI/EXEC, or,
for a group dropped by dynamic sampling, the drop counted and the prompt acknowledged in one.
"""

from __future__ import annotations

import sys

import redis
from jinja2 import TemplateError

from common.config import LimitsConfig
from common.deadletters import DeadLetter, dead_letter
from common.heartbeats import count_dropped_zero_variance
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import MessageError, PromptTask, SampleGroup, encode, peek_id
from common.progress import settle
from engines.base import Engine

BLOCK_MS = 1000  # longest wait for new prompts before the intake comes round (stop, capacity)

Entry = tuple[bytes, dict[bytes, bytes]]  # (stream entry id, fields)

# Reset the idle time of every prompt still pending for this consumer, so that live generators
# never reclaim a prompt it holds for longer than claim_idle_s (a long queue, a slow engine).
# Atomic: an entry another generator already claimed is not taken back.
_TOUCH_HELD = """
local held = {}
for i = 3, #ARGV do held[ARGV[i]] = true end
local mine = redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1000, ARGV[2])
local args = {'XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0}
for _, e in ipairs(mine) do
  if held[e[1]] then args[#args + 1] = e[1] end
end
if #args == 5 then return 0 end
args[#args + 1] = 'JUSTID'
redis.call(unpack(args))
return #args - 6
"""


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
            task = limits.decode_prompt(fields[PAYLOAD])
            ids = engine.prompt_ids(task)
            if len(ids) + max_new_tokens > engine.context_length:
                raise MessageError(f"prompt {task.id}: {len(ids)} tokens + max_new_tokens "
                                   f"{max_new_tokens} exceed the model's context {engine.context_length}")
        except (MessageError, TemplateError) as err:
            with r.pipeline(transaction=True) as pipe:
                dead_letter(pipe, keys.prompts_dead, DeadLetter.of(source=keys.prompts, entry_id=entry_id,
                                                                   entry=fields, reason=str(err)))
                pipe.xack(keys.prompts, GENERATORS_GROUP, entry_id)
                # an admitted prompt given up for good: the producer admits another in its place
                settle(pipe, keys, [i for i in [peek_id(fields.get(PAYLOAD, b""))] if i], dropped=True)
                pipe.execute()
            print(f"{name}: dead-lettered prompt entry {entry_id.decode()}: {err}",
                  file=sys.stderr, flush=True)
            continue
        work.append((entry_id, task, ids))
    return work


# ---------------------------------------------------------------------- prompts held


def touch_held(r: redis.Redis, *, stream: str, consumer: str, held: list[str]) -> int:
    """Mark the prompts `held` (entry ids) that are pending for `consumer` as just delivered;
    how many there were. Others pending for it (their acknowledgement lost with a second of
    Redis's writes) age, and another generator, or this one, takes them over."""
    if not held:
        return 0
    return int(r.eval(_TOUCH_HELD, 1, stream, GENERATORS_GROUP, consumer, *held))


def leave_group(r: redis.Redis, *, stream: str, consumer: str) -> None:
    """Remove this consumer from the prompts group if it holds nothing, so that `rollouts status`
    does not list a generator that stopped cleanly as dead. One still holding prompts stays, for
    the others to reclaim them (deleting it would drop them)."""
    if not r.xpending_range(stream, GENERATORS_GROUP, "-", "+", 1, consumername=consumer):
        r.xgroup_delconsumer(stream, GENERATORS_GROUP, consumer)


# ---------------------------------------------------------------------- groups out


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
        count_dropped_zero_variance(pipe, keys)
        settle(pipe, keys, [group.id], dropped=True)
        pipe.xack(keys.prompts, GENERATORS_GROUP, entry_id)
        pipe.execute()
