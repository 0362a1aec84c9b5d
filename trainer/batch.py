"""Sample groups to training rows, and rows to right-padded micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.messages import SampleGroup
from trainer.grpo import Estimator, group_advantages


@dataclass(frozen=True, slots=True)
class Row:
    """One completion as a next-token training sequence (prompt + completion, shifted by one)."""

    inputs: list[int]  # (prompt + completion)[:-1]
    targets: list[int]  # (prompt + completion)[1:]
    mask: list[int]  # 1 where targets[t] is a trained completion token
    behaviour_logp: list[float]  # generator's log-prob of targets[t] on completion positions, else 0
    advantage: float  # group-relative advantage of the completion


@dataclass(frozen=True, slots=True)
class MicroBatch:
    input_ids: Tensor  # (B, T) int64, right-padded with 0
    attention_mask: Tensor  # (B, T) int64, 0 on padding
    targets: Tensor  # (B, T) int64
    mask: Tensor  # (B, T) float32, 1 on trained completion tokens
    behaviour_logp: Tensor  # (B, T) float32
    advantages: Tensor  # (B,) float32


def group_rows(group: SampleGroup, *, estimator: Estimator = "grpo", overlong: str = "none",
               overlong_penalty: float = 0.0, objective: str = "grpo") -> list[Row]:
    """A group's completions as rows; advantages from the group's scalar rewards (0 for the sft
    objective, which has none and takes groups of any size).

    Overlong completions (finish == "length"): "mask" keeps them in the advantage baseline but
    trains on none of their tokens; "penalty" subtracts `overlong_penalty` from their reward
    before the advantages are computed.
    """
    assert objective == "sft" or len(group.completions) >= 2, \
        f"group {group.id}: {len(group.completions)} completions, need >= 2"
    assert overlong in ("none", "mask", "penalty"), f"overlong must be none, mask or penalty, got {overlong!r}"
    penalty = overlong_penalty if overlong == "penalty" else 0.0
    rewards = torch.tensor([[c.reward - (penalty if c.finish == "length" else 0.0) for c in group.completions]],
                           dtype=torch.float32)  # (1, n)
    advantages = [0.0] * len(group.completions) if objective == "sft" \
        else group_advantages(rewards, estimator)[0].tolist()
    prompt = group.prompt_ids
    rows = []
    for c, adv in zip(group.completions, advantages, strict=True):
        full = prompt + c.ids
        n_prompt, n_done = len(prompt), len(c.ids)
        # Completion token i is predicted at input position n_prompt - 1 + i.
        done_mask = [1] * n_done if c.loss_mask is None else list(c.loss_mask)
        if overlong == "mask" and c.finish == "length":
            done_mask = [0] * n_done
        rows.append(Row(inputs=full[:-1], targets=full[1:],
                        mask=[0] * (n_prompt - 1) + done_mask,
                        behaviour_logp=[0.0] * (n_prompt - 1) + list(c.logprobs),
                        advantage=float(adv)))
    return rows


def collate(rows: list[Row]) -> MicroBatch:
    """Right-pad `rows` to their longest into one micro-batch."""
    assert rows, "collate needs at least one row"
    width = max(len(row.inputs) for row in rows)

    def pad(xs: list, value) -> list:
        return xs + [value] * (width - len(xs))

    return MicroBatch(
        input_ids=torch.tensor([pad(row.inputs, 0) for row in rows], dtype=torch.long),
        attention_mask=torch.tensor([pad([1] * len(row.inputs), 0) for row in rows], dtype=torch.long),
        targets=torch.tensor([pad(row.targets, 0) for row in rows], dtype=torch.long),
        mask=torch.tensor([pad(row.mask, 0) for row in rows], dtype=torch.float32),
        behaviour_logp=torch.tensor([pad(row.behaviour_logp, 0.0) for row in rows], dtype=torch.float32),
        advantages=torch.tensor([row.advantage for row in rows], dtype=torch.float32),
    )


def split_rows(rows: list[Row], *, micro_batch_size: int, micro_batch_tokens: int = 0) -> list[list[Row]]:
    """Consecutive runs of `rows`, each at most `micro_batch_size` rows and, where
    `micro_batch_tokens` > 0, at most that many padded tokens (rows x longest row); a row longer
    than the budget goes alone. Order is kept, so the step's update does not depend on the split.
    """
    assert micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}"
    assert micro_batch_tokens >= 0, f"micro_batch_tokens must be >= 0, got {micro_batch_tokens}"
    out: list[list[Row]] = []
    current: list[Row] = []
    width = 0
    for row in rows:
        w = max(width, len(row.inputs))
        too_many = len(current) >= micro_batch_size
        too_big = micro_batch_tokens > 0 and (len(current) + 1) * w > micro_batch_tokens
        if current and (too_many or too_big):
            out.append(current)
            current, w = [], len(row.inputs)
        current.append(row)
        width = w
    if current:
        out.append(current)
    return out


def micro_batches(groups: list[SampleGroup], *, micro_batch_size: int, micro_batch_tokens: int = 0,
                  estimator: Estimator = "grpo", overlong: str = "none", overlong_penalty: float = 0.0,
                  objective: str = "grpo") -> tuple[list[MicroBatch], int, int]:
    """The step's micro-batches, its trained-token count and its count of trained sequences."""
    rows = [row for group in groups for row in group_rows(group, estimator=estimator, overlong=overlong,
                                                           overlong_penalty=overlong_penalty,
                                                           objective=objective)]
    total_tokens = sum(sum(row.mask) for row in rows)
    total_seqs = sum(1 for row in rows if any(row.mask))
    batches = [collate(part) for part in split_rows(rows, micro_batch_size=micro_batch_size,
                                                    micro_batch_tokens=micro_batch_tokens)]
    return batches, total_tokens, total_seqs
