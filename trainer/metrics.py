"""What the trainer records of each step: the metrics dict (TRL's names where TRL has one) and its
console line. Where they go is trainer/tracking.py."""

from __future__ import annotations

import time
from typing import Any

import redis
import torch

from common.keys import Keys
from common.messages import SampleGroup
from trainer.samples import Collected
from trainer.tracking import generator_metrics


def step_metrics(groups: list[SampleGroup], *, step: int, staleness: list[int], rewarded: bool = True) -> dict:
    """Reward, accuracy, length and staleness metrics of one step's groups (TRL's names).

    Reward fields are None where there are none to report: unrewarded (sft) groups, or no group
    of 2 or more completions for the per-group std."""
    completions = [c for g in groups for c in g.completions]
    rewards = torch.tensor([c.reward for c in completions], dtype=torch.float64)
    group_std = [torch.tensor([c.reward for c in g.completions], dtype=torch.float64).std().item()
                 for g in groups if len(g.completions) >= 2] if rewarded else []
    correct = [c.rewards["correct"] for c in completions if "correct" in c.rewards]
    lengths = [len(c.ids) for c in completions]
    return {
        "reward/mean": rewards.mean().item() if rewarded else None,
        # mean of per-group stds, as TRL's reward_std
        "reward/std": sum(group_std) / len(group_std) if group_std else None,
        "accuracy": sum(correct) / len(correct) if correct else None,
        "frac_reward_zero_std": sum(s < 1e-8 for s in group_std) / len(group_std) if group_std else None,
        # completions whose reward function raised, timed out or returned garbage (scored 0)
        "reward/errors": sum(c.reward_error is not None for c in completions) if rewarded else None,
        "completions/mean_length": sum(lengths) / len(lengths),
        "completions/max_length": max(lengths),
        "staleness/mean": sum(staleness) / len(staleness),
        "staleness/max": max(staleness),
    }


def step_record(r: redis.Redis, keys: Keys, everyone: list[Collected], stats: dict[str, float], *, step: int,
                version: int, lr: float, staleness: list[int], sft: bool, t_step: float, train_s: float,
                publish_s: float) -> dict[str, Any]:
    """The metrics of trainer step `step` (counted once done), as the trackers record them.

    `everyone`: every rank's collected groups; `stats`: the update's (trainer/step.py); `lr`: the
    rate its updates used; `t_step`: the monotonic time the step began; `train_s`, `publish_s`:
    seconds spent updating and publishing. Generators' metrics are read from their heartbeats.
    """
    all_groups = [g for c in everyone for g in c.groups]
    policy = {"clip_ratio": stats["clip_ratio/region_mean"],
              **{k: v for k, v in stats.items() if k.startswith(("clip_ratio/", "ratio/", "tis/"))},
              "loss/policy": stats["loss/policy"], "kl": stats["kl"]} if not sft \
        else {"loss/sft": stats["loss/sft"]}
    return {
        "step": step,
        **step_metrics(all_groups, step=step, staleness=staleness, rewarded=not sft),
        **policy,
        "entropy": stats["entropy"],
        "grad_norm": stats["grad_norm"],
        "lr": lr,  # the rate this step's updates used
        "groups/dropped_stale": sum(c.stale for c in everyone),
        "groups/dead": sum(c.dead for c in everyone),
        "groups/duplicate": sum(c.duplicate for c in everyone),
        "tokens/trained": stats["tokens/trained"],
        "tokens_per_s": stats["tokens/forward"] / train_s,  # prompt + completion tokens through the model
        "time/step": time.monotonic() - t_step,
        "time/wait_data": max(c.wait_s for c in everyone),
        "time/train": train_s,
        "time/publish": publish_s,
        "version": version,
        **generator_metrics(r, keys),
        "group_ids": [g.id for g in all_groups],
    }


def summary_line(m: dict) -> str:
    def num(key: str, spec: str) -> str:
        return "  -  " if m.get(key) is None else format(m[key], spec)

    loss = f"sft {m['loss/sft']:.4f}" if "loss/sft" in m else f"loss {num('loss/policy', '+.4f')}"
    return (f"step {m['step']:4d} | reward {num('reward/mean', '.3f')} | acc {num('accuracy', '.3f')} | "
            f"len {m['completions/mean_length']:5.1f} | stale {m['staleness/mean']:.1f}/{m['staleness/max']} | "
            f"{loss} | ent {m['entropy']:.3f} | lr {m['lr']:.2e} | {m['time/step']:.2f}s")
