"""Several runs, one generator: `python -m generators --runs a.toml,b.toml` serves the run of each
config file on one engine, its base model loaded once.

Each run trains LoRA adapters and publishes them alone (trainer.lora.publish = "adapter"); the
engine holds one adapter per run (its name is the run's name) and samples each request with its
run's. Everything else is the run's own, as if it had a generator of its own: its prompts stream,
weight versions, staleness bound, rewards, environments, heartbeat, quarantine and exactly-once
delivery (generators.main wires one set of stages per run, each with a `RunEngine`: the run's view
of the engine). Fair by construction: each run takes prompts up to its own `max_in_flight`, however
long another run's backlog, and the engine steps its requests in the order they came. A run whose
reward fails or whose adapter is refused counts it in its own heartbeat; the others go on.

Refused at start-up, by name: two configs of one run, runs on different base models, Redis servers,
engines or dtypes, a run that publishes full weights (they would change every run's model), and
in-flight updates or a weights broadcast (an adapter loads only between a run's requests, from
disk).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import Config, ConfigError
from engines.base import Engine, Finished, SamplingSettings


def check_pool(configs: list[Config]) -> None:
    """Refuse a set of runs one engine cannot serve together (ConfigError naming what differs); one
    config passes as it is."""
    from common.models import resolve_model_path

    if len(configs) < 2:
        return
    names = [c.run for c in configs]
    if len(set(names)) < len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ConfigError(f"--runs: run {twice[0]!r} is named by two configs; each run once")
    first = configs[0]
    base = resolve_model_path(first.model.path)
    for c in configs:
        other = resolve_model_path(c.model.path)
        if other.resolve() != base.resolve():
            raise ConfigError(f"--runs: runs {first.run!r} and {c.run!r} have different base models ({base} and "
                              f"{other}); one generator serves runs of one base model")
        for what, a, b in (("redis_url", first.redis_url, c.redis_url),
                           ("model.dtype", first.model.dtype, c.model.dtype),
                           ("generator.engine", first.generator.engine, c.generator.engine)):
            if a != b:
                raise ConfigError(f"--runs: runs {first.run!r} and {c.run!r} differ in {what} ({a!r} and {b!r}); "
                                  "the runs of one generator share it")
        lora = c.trainer.lora
        if lora.rank == 0 or lora.publish != "adapter":
            raise ConfigError(f"--runs: run {c.run!r} publishes full weights, which would change every run's model; "
                              "the runs of one generator train LoRA adapters and publish them alone "
                              "([trainer.lora] rank > 0, publish = \"adapter\")")
        if c.generator.inflight_updates:
            raise ConfigError(f"--runs: run {c.run!r} has generator.inflight_updates on; a generator serving several "
                              "runs loads a run's adapter between its requests: set it to false")
        if c.trainer.weight_transfer != "disk":
            raise ConfigError(f"--runs: run {c.run!r} has trainer.weight_transfer = {c.trainer.weight_transfer!r}; "
                              "a generator serving several runs reads their adapters from disk: set it to \"disk\"")


def run_engines(engine: Engine, runs: list[str]) -> list[Engine]:
    """Each run's engine: the engine itself where there is one run, else a RunEngine each over it."""
    if len(runs) == 1:
        return [engine]
    outboxes: dict[str, list[Finished]] = {run: [] for run in runs}
    return [RunEngine(engine, run, outboxes) for run in runs]  # type: ignore[list-item]


class RunEngine:
    """One run's view of a pool's engine: its requests sampled with its own LoRA adapter (named for
    the run) and its own weight version; what the engine finishes for other runs kept for them.
    Request ids are made the run's own ("run/id": two runs' prompt streams give out the same ids).
    Called only in the engine's thread, as the engine is."""

    def __init__(self, engine: Engine, run: str, outboxes: dict[str, list[Finished]]) -> None:
        self.engine, self.run = engine, run
        self._outboxes = outboxes  # run -> finished requests of that run not yet stepped out
        self._mine: set[str] = set()  # this run's request ids (engine's) not yet stepped out

    @property
    def version(self) -> int:
        """This run's version loaded: 0 = the base model."""
        return self.engine.adapter_version(self.run)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> Any:  # name, path, tokenizer, eos_ids, prompt_ids, decode, ...
        return getattr(self.engine, name)

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingSettings, *,
            images: tuple[bytes, ...] = ()) -> None:
        own = f"{self.run}/{request_id}"
        extra = {"images": images} if images else {}
        self.engine.add(own, prompt_ids, sampling, adapter=self.run, **extra)
        self._mine.add(own)

    def has_unfinished(self) -> bool:
        return bool(self._mine)

    def step(self, *, yield_when: Callable[[], bool] | None = None) -> list[Finished]:
        """What of this run's the engine has finished: kept from another run's step, or else one step
        of the engine (which advances every run's requests)."""
        assert yield_when is None, "a pool loads a run's adapter between its requests (no in-flight updates)"
        if not self._outboxes[self.run] and self._mine:
            for done in self.engine.step():
                run, _, request_id = done.request_id.partition("/")
                self._outboxes[run].append(dataclasses.replace(done, request_id=request_id))
        out, self._outboxes[self.run] = self._outboxes[self.run], []
        self._mine -= {f"{self.run}/{done.request_id}" for done in out}
        return out

    def load_weights(self, path: str | Path, *, version: int) -> None:
        """Load the run's adapter version at `path` under the run's name (CheckpointError: full
        weights, or an adapter that does not fit; the run's adapter in use unchanged)."""
        self.engine.load_weights(path, version=version, adapter=self.run)  # type: ignore[call-arg]
