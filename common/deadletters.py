"""Dead letters: stream entries given up for good, each kept with the reason.

A prompt a generator cannot decode or fit in the model's context goes to `…:prompts:dead`; a
sample group the trainer cannot decode or train on goes to `…:samples:dead`. Each is one
`DeadLetter`, written here in the transaction that acknowledges the entry (and settles its
prompt), and read here by `rollouts status` and the audit (common/audit.py). The stream entry's
fields are the record's field names; the payload is kept as it came, for a post-mortem.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields

import redis

from common.keys import PAYLOAD

REASON_CHARS = 2000  # a reason is cut to this many characters (a decoder may quote the input)


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """One entry given up for good."""

    source: str  # the stream the entry was read from (its key: `…:prompts` or `…:samples`)
    entry_id: str  # its id in that stream
    reason: str  # why it was given up: the decoder's or validator's error, at most REASON_CHARS
    payload: bytes  # its payload as it came (b"": it had none, or not as bytes)

    @classmethod
    def of(cls, *, source: str, entry_id: bytes | str, entry: dict, reason: str) -> DeadLetter:
        """The dead letter of the entry `entry_id` of `source`, read with fields `entry`."""
        blob = entry.get(PAYLOAD, b"")
        return cls(source=source, entry_id=entry_id.decode() if isinstance(entry_id, bytes) else entry_id,
                   reason=reason[:REASON_CHARS], payload=blob if isinstance(blob, bytes) else b"")


def dead_letter(pipe: redis.client.Pipeline, dead_stream: str, letter: DeadLetter) -> None:
    """Queue (on the caller's MULTI pipeline) `letter`'s append to `dead_stream`."""
    pipe.xadd(dead_stream, asdict(letter))


def read_dead_letters(r: redis.Redis, dead_stream: str, *, count: int | None = None) -> list[DeadLetter]:
    """The dead letters in `dead_stream`, oldest first (the first `count`; None: all)."""
    out = []
    for _, entry in r.xrange(dead_stream, count=count):
        got = {k.decode(): v for k, v in entry.items()}
        out.append(DeadLetter(**{f.name: got[f.name] if f.type == "bytes" else got[f.name].decode(errors="replace")
                                 for f in fields(DeadLetter)}))
    return out


def count_dead_letters(r: redis.Redis, dead_stream: str) -> int:
    """How many entries were given up into `dead_stream` (it is never trimmed)."""
    return r.xlen(dead_stream)
