"""The trainer's one state object: what every stage of trainer/main.py needs, built once at start-up
(`start` there), on every rank; the stages are functions over it."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import redis
import torch
from torch.utils.hooks import RemovableHandle

from common.config import Config
from common.history import HistoryWriter
from common.keys import Keys
from trainer.quarantine import Judge
from trainer.record import Record
from trainer.stats import StepStats
from trainer.tracking import Tracker
from trainer.transfer import Sender

# One trainer step's update of (model, optimizer, this rank's groups; step = trainer steps done),
# its objective's options bound (trainer/step.py).
Update = Callable[..., StepStats]


@dataclass(frozen=True, slots=True)
class Writing:
    """A version whose checkpoint, or a trainer state, is being written beside the steps after it
    (trainer/publishing.py)."""

    step: int  # the version
    # a version's: rank 0's write and announcement, its WeightVersion (None on the other ranks); a
    # trainer state's: every rank's write of its shards, and rank 0's acknowledgement
    done: Future | None
    hold: RemovableHandle | None = None  # the optimizer's wait for a write reading the parameters themselves
    entries: int = 0  # a trainer state's: how many of run.unacked_entries (the first) it acknowledges
    ids: int = 0  # and of run.unacked_ids


@dataclass
class Run:
    """One trainer process of a run: its connections and paths (fixed at start-up), its model and
    optimizer, and what the loop carries from step to step."""

    config: Config  # the run's config, validated at start-up
    r: redis.Redis  # the run's Redis
    keys: Keys  # ... and its keys
    model: torch.nn.Module  # the policy: placed on its device, sharded under torchrun
    optimizer: torch.optim.Optimizer  # AdamW over the trained parameters (all, or LoRA's adapters)
    scheduler: torch.optim.lr_scheduler.LRScheduler  # the lr schedule; counts trainer steps
    update: Update  # the objective's update of one trainer step
    source_dir: Path  # the initial model: a fresh start's weights, every checkpoint's tokenizer files
    state_root: Path  # where the trainer states are saved, beside the checkpoints (trainer/state.py)
    step: int  # trainer steps done
    version: int  # the step of the newest published weights (the initial ones are version 0)
    rank: int = 0  # this process's rank under torchrun
    world: int = 1  # ... and the number of ranks
    updates: int = 1  # optimizer updates per trainer step (trainer.updates_per_batch; 1 for sft)
    tracker: Tracker | None = None  # where the step metrics go: rank 0's; None on the others
    cursor: bytes | None = b"0"  # where this rank reads next: first its own pending entries
    # Every rank's entries and groups trained since the last saved state: acknowledged with the next.
    unacked_entries: list[bytes] = field(default_factory=list)
    unacked_ids: list[str] = field(default_factory=list)
    record: Record = field(default_factory=lambda: Record(step=0, version=0, state_step=0, groups_trained=0))
    judge: Judge | None = None  # rank 0's judgement of the generators (None: other ranks, or no quarantine)
    sender: Sender | None = None  # rank 0's end of the weights broadcast (trainer.weight_transfer; None: disk)
    history: HistoryWriter | None = None  # rank 0's keeper of every trained group (common/history.py); None: others
    writing: Writing | None = None  # the version being written beside this step, if any
    saving: Writing | None = None  # the trainer state being written beside the steps, if any
    writer: ThreadPoolExecutor | None = None  # the thread writing versions beside the steps (made when first used)
    state_writer: ThreadPoolExecutor | None = None  # ... and the one writing trainer states
    staged: dict | None = None  # the trainer state's copy in host memory, reused by each save beside the steps

    @property
    def sft(self) -> bool:
        """Supervised steps (trainer.objective = "sft"): no advantages, never stale."""
        return self.config.trainer.objective == "sft"

    @property
    def consumer(self) -> str:
        """This rank's consumer name in the samples stream's `trainer` group."""
        return f"rank{self.rank}"
