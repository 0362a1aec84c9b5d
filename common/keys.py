"""Every Redis key and consumer group of a run, declared once.

All keys of one run share the prefix `rollouts:{run}:` so several runs can share a server.
"""

from __future__ import annotations

from dataclasses import dataclass

# Consumer groups.
GENERATORS_GROUP = "generators"  # on the prompts stream, one consumer per generator
TRAINER_GROUP = "trainer"  # on the samples stream, one consumer per trainer rank

# The single field under which every stream entry carries its MessagePack payload.
PAYLOAD = b"m"

METRICS_MAXLEN = 10_000  # the metrics stream is capped to about this many entries
WEIGHTS_MAXLEN = 1_000  # the weights stream too (checkpoints on disk are pruned to keep_checkpoints)


@dataclass(frozen=True)
class Keys:
    run: str

    def _k(self, name: str) -> str:
        return f"rollouts:{self.run}:{name}"

    @property
    def prompts(self) -> str:
        """Stream of PromptTask; group `generators`."""
        return self._k("prompts")

    @property
    def prompts_dead(self) -> str:
        """Prompt entries that failed to decode, with the reason."""
        return self._k("prompts:dead")

    @property
    def outstanding(self) -> str:
        """Set: ids of the prompts the producer admitted that are neither trained nor dropped yet
        (bounded by the admission limit). Only an id taken out of it counts as dropped."""
        return self._k("prompts:outstanding")

    @property
    def prompts_dropped(self) -> str:
        """Counter: admitted prompts that will never fill a trainer step (dropped too stale, by
        dynamic sampling, or dead-lettered), counted once each by id; the producer admits as many
        more. Entries nobody admitted (foreign, forged, duplicates) never count."""
        return self._k("prompts:dropped")

    @property
    def samples(self) -> str:
        """Stream of SampleGroup; group `trainer`."""
        return self._k("samples")

    @property
    def samples_dead(self) -> str:
        """Sample entries that failed to decode or validate, with the reason."""
        return self._k("samples:dead")

    @property
    def weights(self) -> str:
        """Stream of WeightVersion, one entry per published checkpoint."""
        return self._k("weights")

    @property
    def weights_latest(self) -> str:
        """String: the newest WeightVersion's payload."""
        return self._k("weights:latest")

    @property
    def transfer_members(self) -> str:
        """Hash: generator id -> unix time its receiver last said it listens for weights over the
        trainer's collective (trainer.weight_transfer; common/transfer.py)."""
        return self._k("transfer:members")

    @property
    def transfer_offers(self) -> str:
        """Stream of transfer Offers (common/transfer.py), one per broadcast version."""
        return self._k("transfer:offers")

    @property
    def producer(self) -> str:
        """Hash: `seed`, `admitted` (prompts, the mixture's draw index), each source's position
        `{source}:epoch` and `{source}:offset`, and bad rows: `rows_skipped`,
        `{source}:rows_skipped`, `last_skipped` (the row's id and why)."""
        return self._k("producer")

    @property
    def trainer(self) -> str:
        """Hash: `step`, `version` (published), counters of trained and dropped groups."""
        return self._k("trainer")

    @property
    def gone_back(self) -> str:
        """List: every time the trainer resumed below a version it had published, oldest first
        (common/progress.py:GoneBack, JSON), so that groups sampled with the weights it abandoned
        are told from those sampled with the weights it published again under the same numbers."""
        return self._k("trainer:gone_back")

    @property
    def quarantine(self) -> str:
        """Hash: generator id -> its Quarantine (common/quarantine.py), written by the trainer; a
        generator removes its own at start-up."""
        return self._k("quarantine")

    @property
    def trainer_status(self) -> str:
        """Hash: the last step's `last_step_s`, `last_wait_s`, `staleness_mean`, `staleness_max`,
        `tokens_per_s` and `updated_at` (what `rollouts status` shows of the trainer)."""
        return self._k("trainer:status")

    @property
    def trained(self) -> str:
        """Sorted set: group id -> the trainer step whose saved state holds its update (never
        trained twice). Ids older than `trainer.dedup_window` steps are pruned (bounded memory)."""
        return self._k("trainer:trained")

    @property
    def metrics(self) -> str:
        """Capped stream of per-step metrics."""
        return self._k("metrics")

    @property
    def eval_queue(self) -> str:
        """Name of the RQ queue of checkpoint evaluations (RQ adds its own `rq:` keys)."""
        return self._k("eval")

    @property
    def evals(self) -> str:
        """Hash: published version -> JSON of its evaluation result."""
        return self._k("evals")

    def generator(self, generator_id: str) -> str:
        """Heartbeat hash of one generator, with a TTL."""
        return self._k(f"generator:{generator_id}")

    @property
    def generator_pattern(self) -> str:
        return self._k("generator:*")

    @property
    def generators(self) -> str:
        """Hash: counters of all generators together: `groups_dropped_zero_variance` (groups
        dropped by dynamic sampling, their prompts acknowledged with no group written)."""
        return self._k("generators")

    def server_lease(self, url: str) -> str:
        """String with a TTL: the id of the generator driving the inference server at `url`
        (engine "openai"; one generator per server)."""
        import hashlib

        return self._k(f"server:{hashlib.sha256(url.rstrip('/').encode()).hexdigest()[:16]}")

    def gpu_lease(self, host: str, device: str) -> str:
        """String with a TTL: the id of the generator using GPU `device` of `host`."""
        return self._k(f"gpu:{host}:{device}")
