"""Weights a test makes of the tiny model (moved as a trainer step would, perturbed and saved as a
checkpoint: ops/lib/models.py, which the benchmarks use too), published as the trainer does, and how
close an engine's log-probs must be to the trainer's."""

from __future__ import annotations

from pathlib import Path

import torch

from common.keys import PAYLOAD, Keys
from common.messages import WeightVersion, encode
from ops.lib.models import perturbed_copy, reference_logprobs, tied_variant, tiny_qwen2_vl, tiny_vlm  # noqa: F401

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


def tiny_moe(tiny_model: Path, dst: Path, *, seed: int = 0, **fields: object) -> Path:
    """A tiny random Qwen3-MoE beside the tiny dense model: its tokenizer and chat template, two
    layers of hidden size 64, each a sparse block of 4 experts (intermediate size 32) routing each
    token to 2; `fields` set the rest of its Qwen3MoeConfig (output_router_logits,
    router_aux_loss_coef, ...). Saved as the trainer saves a checkpoint (safetensors)."""
    import shutil

    from transformers import AutoConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    dense = AutoConfig.from_pretrained(tiny_model)
    cfg = Qwen3MoeConfig(**{"vocab_size": dense.vocab_size, "hidden_size": 64, "intermediate_size": 128,
                            "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "head_dim": 32, "max_position_embeddings": 512, "eos_token_id": dense.eos_token_id,
                            "pad_token_id": dense.pad_token_id, "bos_token_id": None,
                            "tie_word_embeddings": False, **fields})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():  # router logits far apart (init std 0.02 nearly ties them): a clear choice of experts
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0.0, 0.5)
    model.save_pretrained(dst, safe_serialization=True)
    for f in Path(tiny_model).iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, dst / f.name)
    return dst


# The tiny VLM's chat template: a message's content is its text, or a list of parts ({"type": "image"}
# for an image, {"type": "text", "text": ...}) as processors render a vision-language chat.
