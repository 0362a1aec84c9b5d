"""Checkpoints the tests and the benchmarks make (a model's weights plus noise, the tiny model with
tied embeddings, LoRA adapters with random weights) and the trainer's log-probs under one."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch


def reference_logprobs(model_dir: Path) -> Callable[[list[int], list[int], float], torch.Tensor]:
    """The trainer's log-probs under the checkpoint at `model_dir`, loaded once: of `ids` after
    `prompt` at `temperature`, float32, one sequence, `trainer.grpo.token_logprobs` -> (T,)."""
    from transformers import AutoModelForCausalLM

    from trainer.grpo import token_logprobs

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs(prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
        prompt, ids = [int(x) for x in prompt], [int(x) for x in ids]  # a decoded group holds arrays
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[:, len(prompt) - 1:-1]  # (1, T, V)
        return token_logprobs(logits, torch.tensor([ids]), temperature)[0]  # (T,)

    return logprobs


def perturbed_copy(src: Path, dst: Path, *, seed: int, scale: float = 0.5) -> Path:
    """An HF checkpoint like the trainer publishes: `src`'s weights plus noise, via save_pretrained.
    Noise of `scale` 0.5 makes the tiny model's activations large, and every engine's log-probs
    drift from the trainer's by up to 1e-4 and more; at 0.05 they agree as on its own weights
    (docs/benchmarks.md 9.3), and the greedy tokens still change."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, dst / f.name)
    return dst


def tied_variant(tiny_model: Path, dst: Path) -> Path:
    """The tiny model's shape with tied embeddings (as SmolLM2 and Qwen2.5-0.5B/1.5B have), random
    weights (seed 0), its tokenizer; save_pretrained leaves the lm_head out, as theirs do."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model)
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(dst, safe_serialization=True)
    for f in tiny_model.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, dst / f.name)
    return dst


ADAPTED = ["q_proj", "v_proj"]  # the modules `adapted` puts adapters on


def adapted(model_dir, *, seed: int, rank: int = 4) -> torch.nn.Module:
    """The model with adapters of `rank` on q and v, B random (a trained adapter, not a zero one)."""
    from transformers import AutoModelForCausalLM

    from trainer.lora import apply_lora

    model = apply_lora(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), rank=rank, alpha=8.0,
                       dropout=0.0, target_modules=ADAPTED)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()
