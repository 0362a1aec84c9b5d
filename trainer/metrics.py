"""What the trainer records of each step: the metrics dict (TRL's names where TRL has one) and its
console line. Where they go is trainer/tracking.py."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import numpy as np
import redis
import torch

from common.heartbeats import read_heartbeats
from common.keys import Keys
from common.messages import SampleGroup, token_versions
from common.metrics import PolicyStats, StepMetrics
from common.shaping import zero_variance
from trainer.samples import Collected
from trainer.stats import StepStats


def step_metrics(groups: list[SampleGroup], *, staleness: list[int], rewarded: bool = True, overlong: str = "none",
                 overlong_penalty: float = 0.0) -> dict[str, Any]:
    """Reward, accuracy, length and staleness metrics of one step's groups, as StepMetrics fields.

    Reward fields are None where there are none to report: unrewarded (sft) groups, or no group
    of 2 or more completions for the per-group std. `frac_reward_zero_std` counts the groups that
    teach nothing by the one rule dynamic sampling drops them by (common.shaping.zero_variance:
    shaped rewards with the trainer's `overlong` settings, failed completions left out)."""
    completions = [c for g in groups for c in g.completions]
    rewards = torch.tensor([c.reward for c in completions], dtype=torch.float64)
    group_std = [torch.tensor([c.reward for c in g.completions], dtype=torch.float64).std().item()
                 for g in groups if len(g.completions) >= 2] if rewarded else []
    correct = [c.rewards["correct"] for c in completions if "correct" in c.rewards]
    # the model's tokens: an episode's environment turns (loss_mask 0) are not its length
    lengths = [len(c.ids) if c.loss_mask is None else int(np.count_nonzero(c.loss_mask)) for c in completions]
    token_staleness = [s - (token_versions(c, group_version=g.version) - g.version)  # a group's staleness is
                       for g, s in zip(groups, staleness, strict=True) for c in g.completions]  # its oldest token's
    parts: dict[str, list[float]] = {}
    for c in completions if rewarded else []:
        for name, value in c.rewards.items():
            parts.setdefault(name, []).append(value)
    return {
        "reward_mean": rewards.mean().item() if rewarded else None,
        "reward_std": sum(group_std) / len(group_std) if group_std else None,  # mean of per-group stds
        "accuracy": sum(correct) / len(correct) if correct else None,
        "frac_reward_zero_std": sum(zero_variance(g, overlong=overlong, overlong_penalty=overlong_penalty)
                                    for g in groups) / len(groups) if rewarded and groups else None,
        "reward_errors": sum(c.reward_error is not None for c in completions) if rewarded else None,
        "mean_length": sum(lengths) / len(lengths),
        "max_length": max(lengths),
        "clipped_ratio": sum(c.finish == "length" for c in completions) / len(completions),
        "reward_components": {name: mean_std(values) for name, values in sorted(parts.items())},
        "staleness_mean": sum(staleness) / len(staleness),
        "staleness_max": max(staleness),
        "staleness_token_mean": float(np.concatenate(token_staleness).mean()) if token_staleness else 0.0,
        "mixed_versions": sum(c.versions is not None and len(c.versions) > 1 for c in completions) / len(completions),
    }


def mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and (sample) standard deviation, as TRL logs each reward function's; std 0 for one value."""
    t = torch.tensor(values, dtype=torch.float64)
    return t.mean().item(), t.std().item() if len(values) > 1 else 0.0


def step_record(r: redis.Redis, keys: Keys, everyone: list[Collected], stats: StepStats, *, step: int,
                version: int, lr: float, staleness: list[int], sft: bool, t_step: float, train_s: float,
                publish_s: float, by_generator: dict[str, float] | None = None,
                quarantined: int = 0, overlong: str = "none", overlong_penalty: float = 0.0) -> StepMetrics:
    """The metrics of trainer step `step` (counted once done), as the trackers record them.

    `everyone`: every rank's collected groups; `stats`: the update's (trainer/step.py); `lr`: the
    rate its updates used; `t_step`: the monotonic time the step began; `train_s`, `publish_s`:
    seconds spent updating and publishing; `by_generator`: each generator's mean mismatch this step,
    `quarantined`: generators in quarantine (trainer/quarantine.py); `overlong`, `overlong_penalty`:
    the trainer's, for the rewards its advantages use. Generators' metrics are read from their heartbeats.
    """
    all_groups = [g for c in everyone for g in c.groups]
    policy = None if sft or stats.policy is None else PolicyStats(
        loss=stats.loss, **asdict(stats.policy), mismatch_mean=stats.mismatch_mean, mismatch_max=stats.mismatch_max,
        masked=stats.masked, mismatch_by_staleness={str(s): v for s, v in stats.mismatch_by_staleness.items()},
        teacher_kl=stats.teacher_kl)
    beats = read_heartbeats(r, keys).values()
    return StepMetrics(
        step=step, version=version, **step_metrics(all_groups, staleness=staleness, rewarded=not sft, overlong=overlong,
                                                         overlong_penalty=overlong_penalty),
        policy=policy, sft_loss=stats.loss if sft else None, entropy=stats.entropy,
        grad_norm=stats.grad_norm, lr=lr,
        dropped_stale=sum(c.stale for c in everyone), dead=sum(c.dead for c in everyone),
        duplicate=sum(c.duplicate for c in everyone), steps_skipped=stats.skipped,
        tokens_trained=float(stats.tokens_trained), tokens_forward=float(stats.tokens_forward),
        tokens_per_s=stats.tokens_forward / train_s,  # prompt + completion tokens through the model
        time_step=time.monotonic() - t_step, time_wait_data=max(c.wait_s for c in everyone),
        time_train=train_s, time_publish=publish_s,
        generators_alive=float(len(beats)), generators_tokens_per_s=sum(b.tokens_per_s for b in beats),
        group_ids=[g.id for g in all_groups], mismatch_by_generator=by_generator or {},
        generators_quarantined=float(quarantined), router_aux_loss=stats.router_aux_loss)


def summary_line(m: StepMetrics) -> str:
    def num(value: float | None, spec: str) -> str:
        return "  -  " if value is None else format(value, spec)

    loss = f"sft {m.sft_loss:.4f}" if m.sft_loss is not None else \
        f"loss {num(m.policy.loss if m.policy else None, '+.4f')}"
    return (f"step {m.step:4d} | reward {num(m.reward_mean, '.3f')} | acc {num(m.accuracy, '.3f')} | "
            f"len {m.mean_length:5.1f} | stale {m.staleness_mean:.1f}/{m.staleness_max} | "
            f"{loss} | ent {m.entropy:.3f} | lr {m.lr:.2e} | {m.time_step:.2f}s")
