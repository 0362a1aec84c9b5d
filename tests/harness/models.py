"""Weights a test makes of the tiny model (moved as a trainer step would, perturbed and saved as a
checkpoint: ops/lib/models.py, which the benchmarks use too), published as the trainer does, and how
close an engine's log-probs must be to the trainer's."""

from __future__ import annotations

from pathlib import Path

import torch

from common.keys import PAYLOAD, Keys
from common.messages import WeightVersion, encode
from ops.lib.models import (  # noqa: F401
    perturbed_copy,
    reference_logprobs,
    tied_variant,
    tiny_moe,
    tiny_qwen2_vl,
    tiny_vlm,
)

# fp32, one sequence: the engine's log-prob of each sampled token against the trainer's
# log_softmax(logits / T) over a plain forward pass. Measured in tests/test_engines.py (2026-11-23):
# at most 9.5e-7 (HF) and 4.8e-7 (vLLM), one or two float32 steps at these magnitudes; the README
# states this bound.
LOGPROB_TOL = 5e-6


def one_layer_llama(tokenizer, **fields: object):
    """The config of a one-layer Llama (hidden size 32, two heads) over `tokenizer`'s vocabulary, its
    eos the tokenizer's, no bos: a tiny model a test builds to score with (a reward model, a judge),
    whose behaviour it sets; `fields` set the rest."""
    from transformers import LlamaConfig

    return LlamaConfig(**{"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                          "bos_token_id": None, "eos_token_id": tokenizer.eos_token_id, **fields})


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


# The tiny VLM's chat template: a message's content is its text, or a list of parts ({"type": "image"}
# for an image, {"type": "text", "text": ...}) as processors render a vision-language chat.
