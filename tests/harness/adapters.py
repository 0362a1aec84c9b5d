"""LoRA adapters on the tiny model as a trainer holds them, and the log-probs it computes with them:
what an engine sampling with a published adapter must match."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

TARGETS = ["q_proj", "v_proj"]


def adapted(model_dir, *, seed: int, rank: int = 4) -> torch.nn.Module:
    """The tiny model with adapters of `rank` on q and v, B random (a trained adapter, not a zero one)."""
    from trainer.lora import apply_lora

    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), rank=rank, alpha=8.0,
                       dropout=0.0, target_modules=TARGETS)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


@torch.no_grad()
def logprobs_of(model: torch.nn.Module, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """log p(ids[t] | prompt + ids[:t]) under `model` at temperature 1, as the trainer computes them."""
    logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
