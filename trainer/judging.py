"""Each step's judgement of the generators (trainer/quarantine.py's Judge, kept by rank 0): every
rank's figures gathered, a generator quarantined or readmitted written to Redis and said."""

from __future__ import annotations

import math
import sys
import time

from common.messages import SampleGroup
from common.quarantine import lift_quarantine, read_quarantines, write_quarantine
from trainer.parallel import gather
from trainer.quarantine import Figure
from trainer.run import Run
from trainer.stats import StepStats


def quarantining(run: Run) -> bool:
    """Whether generators are judged by their groups' mismatch (known alike on every rank)."""
    return bool(run.config.trainer.quarantine.after) and not run.sft


def judge_generators(run: Run, groups: list[SampleGroup], stats: StepStats, *, step: int
                     ) -> tuple[dict[str, float], int]:
    """Each generator's mean mismatch over the step's groups (every rank's), and how many are in
    quarantine once rank 0 has judged them (trainer/quarantine.py): a generator quarantined, or
    readmitted, is written to Redis and said on the console. Every rank takes part."""
    if not quarantining(run):
        return {}, 0
    gaps = stats.group_mismatch or (math.nan,) * len(groups)  # none: a step with no token to train on
    mine = [Figure(generator=g.generator, engine=g.engine, staleness=step - g.version, gap=gap)
            for g, gap in zip(groups, gaps, strict=True)]
    figures = [f for rank in gather(mine) for f in rank]
    if run.judge is None:
        return {}, 0
    by_generator = {}
    for name in sorted({f.generator for f in figures}):
        gaps = [f.gap for f in figures if f.generator == name and not math.isnan(f.gap)]
        if gaps:
            by_generator[name] = sum(gaps) / len(gaps)
    held = read_quarantines(run.r, run.keys)
    new, readmitted = run.judge.observe(figures, step=run.step, now=time.time(), quarantined=held)
    for q in new:
        write_quarantine(run.r, run.keys, q)
        held[q.generator] = q
        print(f"trainer: generator {q.generator} {q.line()}", file=sys.stderr, flush=True)
    for name in readmitted:
        lift_quarantine(run.r, run.keys, name)
        held.pop(name, None)
        print(f"trainer: generator {name} readmitted: its last {run.judge.cfg.after} groups agree with the "
              "trainer again", flush=True)
    return by_generator, len(held)
