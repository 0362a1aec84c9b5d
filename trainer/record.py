"""What the trainer has told Redis, kept in memory, so that a Redis that lost writes is put right.

Redis writes its append-only file to disk once a second (`appendfsync everysec`, as the Procfile
ships it): a machine that loses power loses up to a second of writes, while the trainer, which
saved its state to its own disk, goes on. Redis then has forgotten acknowledgements, trained group
ids and progress the trainer already acted on: entries it trained come round again. The trainer
refuses them as duplicates because it checks each group against the ids it trained itself (the
last `dedup_window` steps of them, here), not only against Redis's `trained` set; and when it sees
Redis behind its own record (fewer steps or trained groups), it writes the record back, so that
the producer admits against the right version and every process sees what was trained.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import redis

from common.keys import Keys
from common.messages import WeightVersion
from common.progress import GoneBack, TrainerProgress, read_trainer, restore_trained, write_gone_back, write_step
from common.streams import announce_weights


@dataclass
class Record:
    step: int  # trainer steps done, as last written
    version: int  # newest published version
    state_step: int  # newest saved trainer state
    groups_trained: int  # groups acknowledged with a saved state, over the run
    latest: WeightVersion | None = None  # the newest published weights
    trained: dict[str, int] = field(default_factory=dict)  # group id -> step, the last dedup_window steps
    version_max: int = 0  # the highest version ever published in the run (TrainerProgress.version_max)
    gone_back: list[GoneBack] = field(default_factory=list)  # every start below a published version, oldest first

    @classmethod
    def of(cls, progress: TrainerProgress, gone_back: list[GoneBack] | None = None) -> Record:
        return cls(step=progress.step, version=progress.version, state_step=progress.state_step,
                   groups_trained=progress.groups_trained, version_max=max(progress.version_max, progress.version),
                   gone_back=list(gone_back or []))

    def published(self, wv: WeightVersion | None, *, step: int, saved: bool, group_ids: list[str],
                  dedup_window: int) -> None:
        """After `publish`: the version of `step`, and with `saved` the groups it acknowledged."""
        self.step = self.version = step
        self.version_max = max(self.version_max, step)
        self.latest = wv or self.latest
        if saved:
            self.saved(step=step, group_ids=group_ids, dedup_window=dedup_window)

    def saved(self, *, step: int, group_ids: list[str], dedup_window: int) -> None:
        """After the trainer state of `step` was saved: the groups it acknowledged."""
        self.state_step = step
        self.groups_trained += len(group_ids)
        self.trained.update(dict.fromkeys(group_ids, step))
        self.trained = {g: s for g, s in self.trained.items() if s >= step - dedup_window}


def forgotten(progress: TrainerProgress, record: Record) -> bool:
    """Whether Redis's progress is behind what the trainer wrote: it lost writes."""
    return (progress.step < record.step or progress.state_step < record.state_step
            or progress.groups_trained < record.groups_trained)


def put_right(r: redis.Redis, keys: Keys, record: Record) -> TrainerProgress:
    """Write `record` back into Redis in one transaction; returns what Redis had."""
    had = read_trainer(r, keys)
    pipe = r.pipeline(transaction=True)
    write_step(pipe, keys, step=record.step, version=record.version, state_step=record.state_step,
               version_max=record.version_max if record.version_max > record.version else None)
    restore_trained(pipe, keys, groups_trained=record.groups_trained, trained=record.trained)
    if record.gone_back:
        write_gone_back(pipe, keys, record.gone_back)
    if record.latest is not None:
        announce_weights(pipe, keys, record.latest)
    pipe.execute()
    return had
