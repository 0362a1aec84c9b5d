"""Weights a test makes of the tiny model (moved as a trainer step would, perturbed and saved as a
checkpoint), published as the trainer does, and how close an engine's log-probs must be to the
trainer's."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from common.keys import PAYLOAD, Keys
from common.messages import WeightVersion, encode

# fp32, one sequence: the engine's log-prob of each sampled token against the trainer's
# log_softmax(logits / T) over a plain forward pass. Measured in tests/test_engines.py (2026-11-23):
# at most 9.5e-7 (HF) and 4.8e-7 (vLLM), one or two float32 steps at these magnitudes; the README
# states this bound.
LOGPROB_TOL = 5e-6


def perturbed_copy(src: Path, dst: Path, *, seed: int) -> Path:
    """An HF checkpoint like the trainer publishes: `src`'s weights plus noise, via save_pretrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, dst / f.name)
    return dst


def trained(tiny_model: Path, *, seed: int) -> torch.nn.Module:
    """The tiny model with its weights moved, as a trainer step would."""
    from trainer.checkpoints import load_model

    model = load_model(tiny_model)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=g))
    return model


def publish_weights(r, keys: Keys, wv: WeightVersion) -> None:
    """What the trainer does after renaming its checkpoint into place."""
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.weights, {PAYLOAD: encode(wv)})
        pipe.set(keys.weights_latest, encode(wv))
        pipe.execute()
