"""Sample groups to training rows, and rows to right-padded micro-batches."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from common.messages import SampleGroup
from trainer.grpo import group_advantages


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


def group_rows(group: SampleGroup) -> list[Row]:
    """A group's completions as rows; advantages from the group's scalar rewards."""
    assert len(group.completions) >= 2, f"group {group.id}: {len(group.completions)} completions, need >= 2"
    rewards = torch.tensor([[c.reward for c in group.completions]], dtype=torch.float32)  # (1, n)
    advantages = group_advantages(rewards)[0].tolist()
    prompt = group.prompt_ids
    rows = []
    for c, adv in zip(group.completions, advantages, strict=True):
        full = prompt + c.ids
        n_prompt, n_done = len(prompt), len(c.ids)
        # Completion token i is predicted at input position n_prompt - 1 + i.
        done_mask = [1] * n_done if c.loss_mask is None else list(c.loss_mask)
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


def micro_batches(groups: list[SampleGroup], *, micro_batch_size: int) -> tuple[list[MicroBatch], int]:
    """The step's micro-batches of at most `micro_batch_size` rows, and its trained-token count."""
    assert micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}"
    rows = [row for group in groups for row in group_rows(group)]
    total_tokens = sum(sum(row.mask) for row in rows)
    batches = [collate(rows[i : i + micro_batch_size]) for i in range(0, len(rows), micro_batch_size)]
    return batches, total_tokens
