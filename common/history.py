"""What a run trained on, kept: every group the trainer trained, in Parquet files under the run's
output directory (`output_dir/history/`), for `rollouts view` once the samples stream has moved on.

The trainer trims the samples stream of what it has trained and saved (common/trim.py); rank 0
hands each step's groups (every rank's, gathered) to a `HistoryWriter`, whose thread turns them into
rows and writes them off the trainer's path. One row per group: the group whole (prompt and
completion token ids, behaviour log-probs, text, rewards and their components, finish, loss mask,
weight versions, generator, engine, the teacher's log-probs, name, version or error) and what
training made of it (the step that trained it, each completion's advantage). A part written before
the teacher's columns were added reads as groups no teacher scored.

Parts. The rows go to `part-{seq}-steps-{first}-{last}.parquet`, a new part every `part_steps`
steps or before the rows held would exceed `part_bytes` (in memory, uncompressed), and at the
trainer's stop; each is written under a temporary name and renamed, so a part is whole or absent.
The rows of the part being filled die with a trainer killed without a clean stop (at most
`part_steps` steps). A trainer that starts again (a restart resumes from its newest saved state, a
go-back from an older one) trains those steps again: a part whose first step is `f` replaces,
for the reader, the rows of every earlier part from step `f` on (`read_history`).

The writer never blocks or fails a step: a step it cannot take (the thread is behind by
`queued` steps) or a part it cannot write (a full disk) is said once on stderr and counted
(`HistoryWriter.lost`, steps), and the trainer goes on.
"""

from __future__ import annotations

import contextlib
import math
import queue
import re
import sys
import threading
import time
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from common.messages import Completion, SampleGroup

HISTORY = "history"  # the folder under output_dir
PART_STEPS = 20  # steps per part at most
PART_BYTES = 64 * 1024 * 1024  # rows held for a part at most (Arrow's in-memory size, uncompressed)
QUEUED = 64  # steps handed over and not yet turned into rows, at most: one more is lost, not waited for
PART = re.compile(r"part-(\d+)-steps-(\d+)-(\d+)\.parquet")

# --------------------------------------------------------------------------- the file layout

COMPLETION = pa.struct([
    ("ids", pa.list_(pa.int32())),  # sampled token ids
    ("logprobs", pa.list_(pa.float32())),  # behaviour log-prob of each
    ("reward", pa.float64()),  # the scalar reward
    ("rewards", pa.map_(pa.string(), pa.float64())),  # its named components
    ("advantage", pa.float64()),  # as the trainer computed it; null: none (its reward failed, sft, < 2 scored)
    ("finish", pa.string()),  # stop, length, abort, turns, timeout
    ("text", pa.string()),  # decoded completion
    ("loss_mask", pa.list_(pa.bool_())),  # true where trained (an episode: the model's turns); null: every token
    ("reward_error", pa.string()),  # why the reward failed; null: it ran
    ("versions", pa.list_(pa.int32())),  # (token index, version) pairs, flat; null: every token the group's version
    ("teacher_logprobs", pa.list_(pa.float32())),  # the teacher's log-prob of each id; null: no teacher scored it
])
SCHEMA = pa.schema([
    ("step", pa.int64()),  # the trainer step that trained the group (metrics.jsonl's step)
    ("trained_at", pa.float64()),  # unix seconds the step ended
    ("id", pa.string()),  # the group's id
    ("prompt_id", pa.string()),  # the prompt it was made from
    ("prompt_ids", pa.list_(pa.int32())),  # prompt token ids, chat template applied
    ("version", pa.int64()),  # weight version that sampled it (its oldest token's)
    ("generator", pa.string()),  # the generator that made it
    ("engine", pa.string()),  # hf, vllm, openai
    ("mean_reward", pa.float64()),  # its completions' mean reward
    ("timings", pa.map_(pa.string(), pa.float64())),  # seconds: generate, reward
    ("published_at", pa.float64()),  # when its newest weights were published; 0: not said
    ("completions", pa.list_(COMPLETION)),
    ("teacher", pa.string()),  # the teacher that scored it ("": none; a part written before: absent)
    ("teacher_error", pa.string()),  # why the teacher did not
    ("teacher_version", pa.string()),  # its weights' fingerprint
])


@dataclass(frozen=True)
class Trained:
    """One group as the history keeps it."""

    step: int  # the trainer step that trained it
    trained_at: float  # unix seconds
    group: SampleGroup
    advantages: list[float | None]  # each completion's, as the trainer computed it


@dataclass(frozen=True)
class Part:
    seq: int  # parts are numbered in the order written
    first: int  # its first step
    last: int  # ... and last
    path: Path


def history_dir(output_dir: str | Path) -> Path:
    return Path(output_dir) / HISTORY


def mean_reward(group: SampleGroup) -> float:
    return sum(c.reward for c in group.completions) / len(group.completions)


def rows(step: int, groups: Iterable[SampleGroup], *, advantages: Callable[[SampleGroup], list[float | None]],
         trained_at: float) -> pa.Table:
    """`groups`, trained in `step`, as rows of SCHEMA."""
    out = []
    for g in groups:
        completions = [{
            "ids": np.asarray(c.ids, dtype=np.int32), "logprobs": np.asarray(c.logprobs, dtype=np.float32),
            "reward": float(c.reward), "rewards": list(c.rewards.items()), "advantage": adv, "finish": c.finish,
            "text": c.text, "loss_mask": None if c.loss_mask is None else np.asarray(c.loss_mask, dtype=bool),
            "reward_error": c.reward_error,
            "versions": None if c.versions is None else [x for pair in c.versions for x in pair],
            "teacher_logprobs": None if c.teacher_logprobs is None else np.asarray(c.teacher_logprobs, np.float32),
        } for c, adv in zip(g.completions, advantages(g), strict=True)]
        out.append({"step": step, "trained_at": trained_at, "id": g.id, "prompt_id": g.prompt_id,
                    "prompt_ids": np.asarray(g.prompt_ids, dtype=np.int32), "version": g.version,
                    "generator": g.generator, "engine": g.engine, "mean_reward": mean_reward(g),
                    "timings": list(g.timings.items()), "published_at": g.published_at, "completions": completions,
                    "teacher": g.teacher, "teacher_error": g.teacher_error, "teacher_version": g.teacher_version})
    return pa.Table.from_pylist(out, schema=SCHEMA)


def trained_of(table: pa.Table) -> list[Trained]:
    """The rows of `table` as groups, in its order."""
    out = []
    for row in table.to_pylist():
        completions, advantages = [], []
        for c in row["completions"]:
            flat = c["versions"]
            completions.append(Completion(
                ids=c["ids"], logprobs=c["logprobs"], reward=c["reward"], rewards=dict(c["rewards"]),
                finish=c["finish"], text=c["text"],
                loss_mask=None if c["loss_mask"] is None else [int(m) for m in c["loss_mask"]],
                reward_error=c["reward_error"],
                versions=None if flat is None else list(zip(flat[::2], flat[1::2], strict=True)),
                teacher_logprobs=None if c.get("teacher_logprobs") is None
                else np.asarray(c["teacher_logprobs"], np.float32)))
            advantages.append(c["advantage"])
        group = SampleGroup(id=row["id"], prompt_id=row["prompt_id"], prompt_ids=row["prompt_ids"],
                            version=row["version"], generator=row["generator"], engine=row["engine"],
                            completions=completions, timings=dict(row["timings"]), published_at=row["published_at"],
                            teacher=row.get("teacher") or "", teacher_error=row.get("teacher_error") or "",
                            teacher_version=row.get("teacher_version") or "")
        out.append(Trained(step=row["step"], trained_at=row["trained_at"], group=group, advantages=advantages))
    return out


# --------------------------------------------------------------------------- reading


def parts(root: Path) -> list[Part]:
    """The parts written under `root`, in the order written (none: no history yet)."""
    found = []
    for path in root.glob("part-*.parquet") if root.is_dir() else ():
        m = PART.fullmatch(path.name)
        if m:
            found.append(Part(seq=int(m[1]), first=int(m[2]), last=int(m[3]), path=path))
    return sorted(found, key=lambda p: p.seq)


def read_history(root: Path, *, min_step: int | None = None, max_step: int | None = None,
                 version: int | None = None, generator: str | None = None, min_reward: float | None = None,
                 max_reward: float | None = None, newest: int | None = None,
                 skip: Collection[str] = ()) -> list[Trained]:
    """The groups kept under `root` that pass every filter set (the step that trained them within
    [min_step, max_step], the version and generator that sampled them, their mean reward within
    [min_reward, max_reward]) and whose id is not in `skip`, oldest first; with `newest`, only the
    newest that many. A step trained again (after a restart) is read from the part written last."""
    found = parts(root)
    out: list[Trained] = []
    for n in range(len(found) - 1, -1, -1):  # newest part first: `newest` may need only the last few
        part = found[n]
        upto = min([p.first for p in found[n + 1:]], default=math.inf) - 1  # its later steps replaced
        hi = min(upto, part.last, math.inf if max_step is None else max_step)
        lo = max(part.first, -math.inf if min_step is None else min_step)
        if lo > hi:
            continue
        where = (pc.field("step") >= lo) & (pc.field("step") <= hi)
        for name, value, op in (("version", version, "eq"), ("generator", generator, "eq"),
                                ("mean_reward", min_reward, "ge"), ("mean_reward", max_reward, "le")):
            if value is not None:
                where &= getattr(pc, {"eq": "equal", "ge": "greater_equal", "le": "less_equal"}[op])(
                    pc.field(name), value)
        table = pq.read_table(part.path, filters=where)
        if skip:
            table = table.filter(pc.invert(pc.is_in(table["id"], value_set=pa.array(list(skip), pa.string()))))
        if newest is not None:
            table = table.slice(max(0, table.num_rows - (newest - len(out))))
        out = trained_of(table) + out
        if newest is not None and len(out) >= newest:
            break
    return out


# --------------------------------------------------------------------------- writing


class HistoryWriter:
    """Rank 0's history: `add` hands a step's groups over (never waits), a thread writes the parts,
    `close` writes what is held and stops it."""

    def __init__(self, root: Path, *, advantages: Callable[[SampleGroup], list[float | None]],
                 part_steps: int = PART_STEPS, part_bytes: int = PART_BYTES, queued: int = QUEUED) -> None:
        assert part_steps >= 1 and part_bytes >= 1, f"part_steps {part_steps}, part_bytes {part_bytes}: expected >= 1"
        self.root, self.advantages, self.part_steps, self.part_bytes = Path(root), advantages, part_steps, part_bytes
        self.lost = 0  # steps whose groups are not kept (said once on stderr)
        self._said, self._lock = False, threading.Lock()
        self._queue: queue.Queue[tuple[int, list[SampleGroup], float] | None] = queue.Queue(maxsize=queued)
        self._held: list[tuple[int, pa.Table]] = []  # the part being filled: (step, its rows)
        self._seq = max((p.seq for p in parts(self.root)), default=0)
        self._thread = threading.Thread(target=self._run, name="history", daemon=True)
        self._thread.start()

    def add(self, step: int, groups: list[SampleGroup]) -> None:
        """Keep the groups trained in `step`; a writer `queued` steps behind loses them instead."""
        try:
            self._queue.put_nowait((step, list(groups), time.time()))
        except queue.Full:
            self._lose([step], f"the writer is {self._queue.maxsize} steps behind")

    def close(self) -> None:
        """Write the part being filled, and stop the thread (waits for it: at the trainer's stop)."""
        while self._thread.is_alive():  # a thread gone (it never should) leaves a full queue unread
            try:
                self._queue.put(None, timeout=1.0)
                break
            except queue.Full:
                continue
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            step, groups, at = item
            try:
                table = rows(step, groups, advantages=self.advantages, trained_at=at)
            except Exception as err:  # noqa: BLE001 - a group it cannot lay out costs its step's history, not the run
                self._lose([step], f"{type(err).__name__}: {err}")
                continue
            if self._held and sum(t.nbytes for _, t in self._held) + table.nbytes > self.part_bytes:
                self._write()
            self._held.append((step, table))
            if len(self._held) >= self.part_steps or sum(t.nbytes for _, t in self._held) >= self.part_bytes:
                self._write()
        if self._held:
            self._write()

    def _write(self) -> None:
        steps = [s for s, _ in self._held]
        name = f"part-{self._seq + 1:06d}-steps-{steps[0]:08d}-{steps[-1]:08d}.parquet"
        tmp = self.root / f".{name}.tmp"
        try:
            self.root.mkdir(parents=True, exist_ok=True)
            pq.write_table(pa.concat_tables([t for _, t in self._held]), tmp)
            tmp.rename(self.root / name)
            self._seq += 1
        except Exception as err:  # noqa: BLE001 - a full disk, a bad path: the history's loss, not the run's
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
            self._lose(steps, f"cannot write {self.root / name}: {type(err).__name__}: {err}")
        self._held = []

    def _lose(self, steps: list[int], why: str) -> None:
        with self._lock:  # the trainer's thread (add) and the writer's
            self.lost += len(steps)
            said, self._said = self._said, True
        if not said:
            which = f"step {steps[0]}" if len(steps) == 1 else f"steps {steps[0]}-{steps[-1]}"
            print(f"trainer: history: the groups of {which} are not kept ({why}); "
                  "training goes on (said once; the trainer's stop counts every step lost)",
                  file=sys.stderr, flush=True)
