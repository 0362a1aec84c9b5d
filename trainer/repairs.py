"""What the trainer puts right before a step and while it waits for groups: entries delivered to it
whose reply was lost, a Redis that lost the trainer's writes (trainer/record.py), a published
checkpoint deleted from under the generators (trainer/publishing.py); and what it says when it
resumed below the versions it had published."""

from __future__ import annotations

from common.keys import TRAINER_GROUP
from common.progress import read_trainer
from trainer.parallel import any_rank, is_main, say
from trainer.publishing import republish_if_gone, settle_writing
from trainer.record import forgotten, put_right
from trainer.run import Run


def check_redis(run: Run) -> None:
    """Before a step: read this rank's pending entries again when it holds entries it never saw,
    and put Redis right first if it lost writes the trainer made (trainer/record.py).

    A read whose reply was lost (a socket timeout on a loaded machine, retried by the client) left
    entries delivered to this rank that it never received: pending under its name, never trained,
    never acknowledged, holding back the trimming of the stream for good. Re-reading the pending
    entries from the start finds them; those already trained and awaiting the next saved state
    are passed over (collect's `skip`), and any it trained before come round as duplicates."""
    if stranded(run):
        say(f"trainer: {run.consumer} holds pending entries it never received (a lost reply); reading them again")
        run.cursor = b"0"
    if any_rank(put_right_if_lost(run)):
        run.cursor = b"0"


def stranded(run: Run) -> bool:
    """Whether this rank's consumer has entries pending that the trainer does not hold (every
    entry it holds between steps awaits the next saved state, in `run.unacked_entries`)."""
    held = set(run.unacked_entries)
    pending = run.r.xpending_range(run.keys.samples, TRAINER_GROUP, "-", "+", len(held) + 1,
                                   consumername=run.consumer)
    return any(p["message_id"] not in held for p in pending)


def put_right_if_lost(run: Run) -> bool:
    """Rank 0: if Redis has lost writes the trainer made, write its record back (no collectives:
    also called between reads while a step waits for groups, for the generators, stuck on weights
    Redis forgot, sample only groups too stale to train until it is put right)."""
    if not (is_main() and forgotten(read_trainer(run.r, run.keys), run.record)):
        return False
    settle_writing(run)  # a version being written is announced first, and the record written back holds it
    had, record = put_right(run.r, run.keys, run.record), run.record
    say(f"trainer: Redis had lost writes (it said step {had.step}, saved state {had.state_step}, "
        f"{had.groups_trained} groups trained; the trainer is at step {record.step}, saved state "
        f"{record.state_step}, {record.groups_trained} groups trained): written back")
    return True


def between_reads(run: Run) -> None:
    """While a step waits for groups: what cannot wait for the next step (see the two callees)."""
    put_right_if_lost(run)
    if run.world == 1:
        republish_if_gone(run, agree=False)


def note_going_back(run: Run) -> None:
    """Say so when the trainer resumed from a state older than its last publish (a stop between a
    publish and the next saved state): it publishes those step numbers again, with other weights;
    `resume` kept the highest version published before in Redis, and groups sampled with the
    abandoned versions are dropped as stale (trainer/samples.py)."""
    if run.record.version_max <= run.step:
        return
    low, high = run.step + 1, run.record.version_max
    versions = f"version {high}" if low == high else f"versions {low}-{high}"
    say(f"trainer: resuming at step {run.step}, below version {high} it had published: groups sampled with "
        f"{versions} before this start used weights it abandoned, and are dropped as stale")
