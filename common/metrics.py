"""The trainer's per-step metrics entry: one typed record, its names as TRL users know them.

Written by the trainer (the metrics stream, `metrics.jsonl`, TensorBoard, W&B), read by `rollouts
plot`, `rollouts status` and the tests. Each field's wire name is declared here once (`NAMES`); an
entry is a flat dict of those names: TRL's GRPOTrainer's names where TRL logs the same thing
("reward", "reward_std", "loss", "learning_rate", "completions/clipped_ratio", "clip_ratio/low_mean",
"rewards/<function>/mean", ...), ours beside them for what TRL has no name for ("staleness/mean").
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, field, fields
from pathlib import Path
from typing import Any

import msgpack
import redis

from common.keys import METRICS_MAXLEN, PAYLOAD, Keys


@dataclass(frozen=True, slots=True)
class PolicyStats:
    """What a GRPO-family update reports (absent from sft steps); shares of the trained tokens."""

    loss: float  # the policy loss, averaged over the step's updates
    kl: float  # mean KL to the reference model (0 without one)
    clip_low: float  # share of tokens whose ratio is clipped below 1 - clip_low (advantage < 0)
    clip_high: float  # share clipped above 1 + clip_high (advantage > 0)
    clip_region: float  # clip_low + clip_high
    ratio: float  # mean importance ratio to the policy that started the step
    tis: float  # mean behaviour weight of the correction (decoupled: min(pi_prox / pi_behav, cap)); 1: none
    # Since the off-policy corrections: absent from older entries, read as their defaults.
    clip_dual: float = 0.0  # share of tokens the dual clip bounded (0 when off)
    mismatch_mean: float = 0.0  # mean |log pi_prox - log pi_behav| over trained tokens (behaviour vs proximal policy)
    mismatch_max: float = 0.0  # ... its largest
    masked: float = 0.0  # share of trained tokens the correction's weight dropped (token_mask, sequence_mask)
    # staleness -> mean |log pi_prox - log pi_behav| of the tokens sampled that many steps ago
    mismatch_by_staleness: dict[str, float] = field(default_factory=dict)
    # mean per-token reverse KL to the teacher, log pi_behav - log pi_teacher, over the trained tokens a
    # teacher scored (on-policy distillation; 0 without a teacher)
    teacher_kl: float = 0.0


@dataclass(frozen=True, slots=True)
class StepMetrics:
    """One trainer step."""

    step: int  # trainer steps done, this one included
    version: int  # the newest published weight version after this step
    reward_mean: float | None  # mean reward of the step's completions; None for sft
    reward_std: float | None  # mean of per-group reward stds (TRL's reward_std); None without groups of 2+
    accuracy: float | None  # mean of the "correct" reward component where there is one
    frac_reward_zero_std: float | None  # share of groups that teach nothing: common.shaping.zero_variance
    reward_errors: int | None  # completions whose reward raised, timed out or returned garbage (scored 0)
    mean_length: float  # completion tokens, mean
    max_length: int  # completion tokens, longest
    clipped_ratio: float  # share of completions cut at max_new_tokens (finish "length")
    staleness_mean: float  # versions between a group's sampling weights and the trainer, mean
    staleness_max: int  # ... the largest
    policy: PolicyStats | None  # GRPO family; None for sft
    sft_loss: float | None  # cross-entropy on the loss-masked tokens; None for GRPO
    entropy: float  # mean per-token entropy of the policy that started the step
    grad_norm: float  # global gradient norm before clipping (mean over updates)
    lr: float  # the learning rate this step's updates used
    dropped_stale: int  # groups dropped while collecting this step: too stale
    dead: int  # ... dead-lettered
    duplicate: int  # ... already trained
    tokens_trained: float  # tokens the loss covers (every rank)
    tokens_per_s: float  # prompt and completion tokens through the model per second of training
    time_step: float  # seconds of the whole step
    time_wait_data: float  # of which waiting for groups (the slowest rank)
    time_train: float  # of which in the update
    # of which checkpointing and publishing (a version written beside the next step: its copy to the
    # host, and the wait for the one before, its trainer state's included)
    time_publish: float
    generators_alive: float  # generators with a live heartbeat
    generators_tokens_per_s: float  # their tokens/s, summed
    steps_skipped: int = 0  # optimizer updates of this step skipped: non-finite loss or gradient norm
    # prompt and completion positions through the model in one pass: fewer than the step's tokens
    # where prompts are shared (trainer.share_prompts) or completions of advantage 0 left out
    # (trainer.skip_zero_advantage)
    tokens_forward: float = 0.0
    group_ids: list[str] = field(default_factory=list)  # the groups trained, every rank's
    # (mean, std) over the step's completions of each reward component (a TRL function's value, or a
    # per-completion function's named part), over the completions that have it; {} for sft
    reward_components: dict[str, tuple[float, float]] = field(default_factory=dict)
    # Since in-flight weight updates: staleness_mean/max are of each group's oldest token; these
    # see each token's version (absent from older entries, read as their defaults).
    staleness_token_mean: float = 0.0  # versions between the weights that sampled a completion token and the trainer
    mixed_versions: float = 0.0  # share of completions whose tokens span two or more weight versions
    # Since the quarantine (common/quarantine.py): each generator's mean |log pi_prox - log pi_behav|
    # over its groups trained this step, and the generators quarantined when the step ended.
    mismatch_by_generator: dict[str, float] = field(default_factory=dict)
    generators_quarantined: float = 0.0
    # Since MoE models: the router's load-balancing loss (trainer/moe.py), unweighted by its
    # coefficient, where the model config asks for it (output_router_logits); else None, not written.
    router_aux_loss: float | None = None

    def entry(self) -> dict[str, Any]:
        """The flat dict the sinks write: TRL's names, policy fields only for GRPO, the sft loss only for sft."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name == "policy":
                if value is not None:
                    out.update({POLICY_NAMES[p.name]: getattr(value, p.name) for p in fields(PolicyStats)})
            elif f.name == "reward_components":
                for name, (mean, std) in value.items():
                    out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = mean, std
            elif f.name not in ("sft_loss", "router_aux_loss") or value is not None:
                out[NAMES[f.name]] = value
        return out

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> StepMetrics:
        """The record an entry holds; KeyError naming the first metric it lacks."""
        policy = None
        if POLICY_NAMES["clip_low"] in entry:
            policy = PolicyStats(**{name: entry[wire] for name, wire in POLICY_NAMES.items()
                                    if wire in entry or name not in _DEFAULTED})
        values = {name: entry.get(wire) if name == "sft_loss" else entry[wire]
                  for name, wire in NAMES.items()
                  if name not in ("policy", "reward_components") and (wire in entry or name not in _DEFAULTED)}
        if policy is not None:
            values["sft_loss"] = None  # "loss" is the policy's
        parts = {key[len("rewards/"):-len("/mean")] for key in entry
                 if key.startswith("rewards/") and key.endswith("/mean")}
        components = {n: (entry[f"rewards/{n}/mean"], entry[f"rewards/{n}/std"]) for n in sorted(parts)}
        return cls(policy=policy, reward_components=components, **values)


NAMES = {  # StepMetrics field -> the name it is written under (TRL's where TRL logs it)
    "step": "step", "version": "version", "reward_mean": "reward", "reward_std": "reward_std",
    "accuracy": "accuracy", "frac_reward_zero_std": "frac_reward_zero_std", "reward_errors": "reward_errors",
    "mean_length": "completions/mean_length", "max_length": "completions/max_length",
    "clipped_ratio": "completions/clipped_ratio",
    "staleness_mean": "staleness/mean", "staleness_max": "staleness/max", "policy": "",
    "sft_loss": "loss", "entropy": "entropy", "grad_norm": "grad_norm", "lr": "learning_rate",
    "dropped_stale": "groups/dropped_stale", "dead": "groups/dead", "duplicate": "groups/duplicate",
    "steps_skipped": "steps_skipped",
    "tokens_trained": "tokens/trained", "tokens_forward": "tokens/forward", "tokens_per_s": "tokens_per_s",
    "time_step": "time/step", "time_wait_data": "time/wait_data", "time_train": "time/train",
    "time_publish": "time/publish",
    "generators_alive": "generators/alive", "generators_tokens_per_s": "generators/tokens_per_s",
    "group_ids": "group_ids", "staleness_token_mean": "staleness/token_mean",
    "mixed_versions": "completions/mixed_versions", "mismatch_by_generator": "mismatch/by_generator",
    "generators_quarantined": "generators/quarantined",
    "router_aux_loss": "router_aux_loss",
    "reward_components": "rewards/<component>/mean, rewards/<component>/std",
}
POLICY_NAMES = {  # PolicyStats field -> the name it is written under
    "loss": "loss", "kl": "kl", "clip_low": "clip_ratio/low_mean", "clip_high": "clip_ratio/high_mean",
    "clip_region": "clip_ratio/region_mean", "ratio": "ratio/mean", "tis": "tis/mean",
    "clip_dual": "clip_ratio/dual_mean", "mismatch_mean": "mismatch/abs_log_ratio_mean",
    "mismatch_max": "mismatch/abs_log_ratio_max", "masked": "mismatch/masked",
    "mismatch_by_staleness": "mismatch/by_staleness", "teacher_kl": "teacher_kl",
}
_DEFAULTED = {f.name for cls in (PolicyStats, StepMetrics) for f in fields(cls)  # may be absent from an entry
              if f.name not in ("group_ids",) and (f.default is not MISSING or f.default_factory is not MISSING)}
assert set(NAMES) == {f.name for f in fields(StepMetrics)}, "every StepMetrics field needs its name"
assert set(POLICY_NAMES) == {f.name for f in fields(PolicyStats)}, "every PolicyStats field needs its name"


def write_metrics(pipe: redis.client.Pipeline, keys: Keys, entry: dict[str, Any]) -> None:
    """Append an entry to the run's capped metrics stream, on the caller's pipeline."""
    pipe.xadd(keys.metrics, {PAYLOAD: msgpack.packb(entry, use_bin_type=True)}, maxlen=METRICS_MAXLEN,
              approximate=True)


def read_metrics_stream(r: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    """Every entry still in the run's metrics stream (trainer steps and evaluations), oldest first."""
    return [msgpack.unpackb(f[PAYLOAD], raw=False) for _, f in r.xrange(keys.metrics)]


def latest_step(r: redis.Redis, keys: Keys, *, look_back: int = 50) -> StepMetrics | None:
    """The newest trainer step in the run's metrics stream (evaluations are skipped), or None."""
    for _, f in r.xrevrange(keys.metrics, count=look_back):
        try:
            return StepMetrics.from_entry(msgpack.unpackb(f[PAYLOAD], raw=False))
        except (KeyError, TypeError):  # an evaluation's entry
            continue
    return None


STATUS_NAMES = ["reward", "reward_std", "frac_reward_zero_std", "loss", "kl", "entropy", "completions/mean_length",
                "completions/clipped_ratio", "learning_rate"]  # what `rollouts status` shows of the last step


def status_line(m: StepMetrics) -> str:
    """The last step's headline metrics, under their logged names, for `rollouts status`."""
    entry = m.entry()
    shown = [(name, entry.get(name)) for name in STATUS_NAMES] + \
        [(f"rewards/{n}/mean", mean) for n, (mean, _) in m.reward_components.items()]
    return f"metrics    step {m.step}  " + "  ".join(f"{name} {v:.4g}" for name, v in shown if v is not None)


def read_metrics(path: str | Path) -> list[StepMetrics]:
    """The run's steps from the trainer's JSONL file; ValueError if it holds none or a line is not a step."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.strip():
            try:
                rows.append(StepMetrics.from_entry(json.loads(line)))
            except (KeyError, TypeError, json.JSONDecodeError) as err:
                raise ValueError(f"{path}:{n}: not a step's metrics ({type(err).__name__}: {err})") from None
    if not rows:
        raise ValueError(f"{path}: no metrics yet (the trainer writes one line per step)")
    return rows
