"""LoRA adapters on the tiny model as a trainer holds them, and the log-probs it computes with them:
what an engine sampling with a published adapter must match."""

from __future__ import annotations

import torch

from ops.lib.models import ADAPTED, adapted  # noqa: F401 (the harness's)

TARGETS = ADAPTED


@torch.no_grad()
def logprobs_of(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | prompt + ids[:t]) under `model` at temperature 1, as the trainer computes them."""
    logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
