"""Judging generators by their groups' mismatch, and quarantining those that depart (common/quarantine.py).

Every trained group's mean |log pi_trainer - log pi_behaviour| (trainer/step.py: `group_mismatch`,
measured with the weights that started the step) is a `Figure`. Honest groups depart from the
trainer only by numerical noise while they were sampled with the weights the trainer holds
(staleness 0), and by more as the trainer moves on. So a group departs when its figure is above
the bound (`trainer.quarantine.max_mismatch`, else the one measured for model.dtype:
common/mismatch.py) and, if it is stale, also above `peer_factor` times the median figure of the
other generators' groups at the same staleness in the step; a stale group with no such peer is
not judged. `after` departing groups in a row quarantine their generator; on probation (after a
first quarantine), as many agreeing ones in a row readmit it, and departing ones make the
quarantine final.

Rank 0 judges (it alone keeps a `Judge`, and writes the records); every rank turns away the groups
of quarantined generators as it reads them (trainer/samples.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

from common.config import QuarantineConfig
from common.mismatch import BOUNDS
from common.quarantine import Quarantine


@dataclass(frozen=True, slots=True)
class Figure:
    """One trained group's mismatch."""

    generator: str
    engine: str
    staleness: int  # trainer step minus the version of its oldest token
    gap: float  # mean |log pi_trainer - log pi_behaviour| over its trained tokens (nan: none)


def bound_of(cfg: QuarantineConfig, dtype: str) -> float:
    return cfg.max_mismatch or BOUNDS[dtype][0]


def departs(figure: Figure, step_figures: list[Figure], *, bound: float, peer_factor: float) -> bool | None:
    """Whether `figure`'s group departs from the trainer (None: it cannot be judged)."""
    if math.isnan(figure.gap):
        return None
    if figure.gap <= bound:
        return False
    if figure.staleness <= 0:
        return True
    peers = [f.gap for f in step_figures if f.generator != figure.generator and f.staleness == figure.staleness
             and not math.isnan(f.gap)]
    if not peers:
        return None
    return figure.gap > peer_factor * statistics.median(peers)


@dataclass
class Judge:
    """Rank 0's running judgement: each generator's departing groups in a row, and its agreeing
    ones in a row while on probation."""

    cfg: QuarantineConfig
    bound: float
    departing: dict[str, list[Figure]] = field(default_factory=dict)
    agreeing: dict[str, int] = field(default_factory=dict)

    def observe(self, figures: list[Figure], *, step: int, now: float, quarantined: dict[str, Quarantine]
                ) -> tuple[list[Quarantine], list[str]]:
        """The step's figures judged in order: new quarantines (strike 2 for one on probation), and
        the generators on probation readmitted."""
        new: dict[str, Quarantine] = {}
        readmitted: list[str] = []
        for f in figures:
            verdict = departs(f, figures, bound=self.bound, peer_factor=self.cfg.peer_factor)
            if verdict is None or f.generator in new:
                continue
            held = quarantined.get(f.generator)
            if verdict:
                self.agreeing.pop(f.generator, None)
                run = self.departing.setdefault(f.generator, [])
                run.append(f)
                if len(run) >= self.cfg.after and (held is None or not held.final):
                    new[f.generator] = self.verdict(run, step=step, now=now, strikes=1 if held is None else 2)
                    self.departing.pop(f.generator)
            else:
                self.departing.pop(f.generator, None)
                if held is not None and not held.final:
                    self.agreeing[f.generator] = self.agreeing.get(f.generator, 0) + 1
                    if self.agreeing[f.generator] >= self.cfg.after:
                        readmitted.append(f.generator)
                        self.agreeing.pop(f.generator)
        return list(new.values()), readmitted

    def verdict(self, run: list[Figure], *, step: int, now: float, strikes: int) -> Quarantine:
        gap = sum(f.gap for f in run) / len(run)
        stale = sorted({f.staleness for f in run})
        reason = (f"mean |log pi_trainer - log pi_behaviour| {gap:.3g} over its last {len(run)} groups "
                  f"({run[-1].engine} engine, staleness {'/'.join(map(str, stale))}), above {self.bound:g}"
                  f"{f' and {self.cfg.peer_factor:g}x the other generators at that staleness' if stale[-1] else ''}:"
                  " it samples with other weights or other settings (temperature, top_p, top_k) than the "
                  "trainer's, or its engine is broken")
        return Quarantine(generator=run[-1].generator, at=now, step=step, strikes=strikes, gap=gap, bound=self.bound,
                          groups=len(run), reason=reason)
