"""Quarantined generators: one whose behaviour log-probs depart from the trainer's recompute.

The trainer measures, for every group it trains, the mean |log pi_trainer - log pi_behaviour| of
its tokens, and judges each generator by its groups (trainer/quarantine.py). A generator whose
groups depart beyond the bound several in a row (wrong weights, a wrong sampling setting, a broken
engine, a host that should not be trusted) is quarantined: a `Quarantine` in the hash
`rollouts:{run}:quarantine` under its id. Its groups are then dead-lettered with the figures (their
prompts are replaced by the producer, as any dropped prompt is) until it samples with weights
published after the quarantine: those groups are on probation, trained and judged again. If they
agree it is readmitted (the record is removed); if they depart again the second quarantine is
final: the generator stops sampling (it stays up, so its launcher does not end the run, and says
why), its held prompts go to the others. A generator removes its own record when it starts: a
generator started again (its config fixed) is judged afresh.

The trainer's rank 0 writes the records; every rank reads them (each dead-letters its own reads),
and so do the generators and `rollouts status`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

import redis

from common.keys import Keys


@dataclass(frozen=True, slots=True)
class Quarantine:
    generator: str  # the generator's id
    at: float  # when (the trainer's clock): weights published after it end the quarantine's first strike
    step: int  # the trainer step that judged it
    strikes: int  # 1: until it samples with weights published after `at`; 2: final, it stops sampling
    gap: float  # mean |log-ratio| of its groups that were judged to depart
    bound: float  # the bound they were judged against
    groups: int  # how many groups in a row departed
    reason: str  # one line: the figures and what they point to

    @property
    def final(self) -> bool:
        return self.strikes >= 2

    def turns_away(self, published_at: float) -> bool:
        """Whether a group of this generator, sampled with weights published at `published_at`,
        is dead-lettered (else it is on probation: trained and judged)."""
        return self.final or published_at <= self.at

    def line(self) -> str:
        state = "stopped sampling" if self.final else "groups dead-lettered until it loads newer weights"
        return f"quarantined at step {self.step} (strike {self.strikes}, {state}): {self.reason}"


def write_quarantine(r: redis.Redis, keys: Keys, q: Quarantine) -> None:
    r.hset(keys.quarantine, q.generator, json.dumps(asdict(q)))


def read_quarantines(r: redis.Redis, keys: Keys) -> dict[str, Quarantine]:
    """Every quarantined generator's record, by generator id."""
    return {(k.decode() if isinstance(k, bytes) else k): Quarantine(**json.loads(v))
            for k, v in r.hgetall(keys.quarantine).items()}


def read_quarantine(r: redis.Redis, keys: Keys, generator: str) -> Quarantine | None:
    raw = r.hget(keys.quarantine, generator)
    return None if raw is None else Quarantine(**json.loads(raw))


def lift_quarantine(r: redis.Redis, keys: Keys, generator: str) -> None:
    """Readmit `generator` (the trainer, once its groups agree again; the generator, at its start)."""
    r.hdel(keys.quarantine, generator)
