"""Checkpoints the tests and the benchmarks make (a model's weights plus noise, the tiny model with
tied embeddings, LoRA adapters with random weights, tiny mixture-of-experts and vision-language
models) and the trainer's log-probs under one."""

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


def tiny_moe(tiny_model: Path, dst: Path, *, seed: int = 0, router_std: float = 0.5, **fields: object) -> Path:
    """A tiny random Qwen3-MoE beside the tiny dense model: its tokenizer and chat template, two
    layers of hidden size 64, each a sparse block of 4 experts (intermediate size 32) routing each
    token to 2; `fields` set the rest of its Qwen3MoeConfig (output_router_logits,
    router_aux_loss_coef, ...). Router weights of std `router_std`: at 0.5 their logits are far
    apart (a clear choice of experts), at transformers' init (0.02) near ties. Saved as the trainer
    saves a checkpoint (safetensors)."""
    from transformers import AutoConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

    from common.routing import routers

    dense = AutoConfig.from_pretrained(tiny_model)
    cfg = Qwen3MoeConfig(**{"vocab_size": dense.vocab_size, "hidden_size": 64, "intermediate_size": 128,
                            "moe_intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2,
                            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
                            "head_dim": 32, "max_position_embeddings": 512, "eos_token_id": dense.eos_token_id,
                            "pad_token_id": dense.pad_token_id, "bos_token_id": None,
                            "tie_word_embeddings": False, **fields})
    torch.manual_seed(seed)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():
        for router in routers(model):  # the MoE layers' (`mlp_only_layers` keeps some dense)
            router.weight.normal_(0.0, router_std)
    model.save_pretrained(dst, safe_serialization=True)
    for f in Path(tiny_model).iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, dst / f.name)
    return dst


ADAPTED = ["q_proj", "v_proj"]  # the modules `adapted` puts adapters on


def adapted(model_dir, *, seed: int, rank: int = 4) -> torch.nn.Module:
    """The model with adapters of `rank` on q and v (a vision-language model's: its text model's), B
    random (a trained adapter, not a zero one)."""
    from common.vision import model_class
    from trainer.lora import apply_lora

    model = apply_lora(model_class(model_dir).from_pretrained(model_dir, dtype=torch.float32), rank=rank, alpha=8.0,
                       dropout=0.0, target_modules=ADAPTED)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model.eval()


VLM_CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}<image>{% else %}{{ c['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vlm(tiny_model: Path, dst: Path, *, seed: int = 0, image_size: int = 32, patch_size: int = 8) -> Path:
    """A tiny random Idefics3 (SmolVLM's architecture) over the tiny dense model's tokenizer, with the
    processor that feeds it: a one-layer SigLIP-shaped vision tower (hidden size 32) over
    `image_size` pixels in patches of `patch_size`, its features shuffled by 2 into the two-layer
    Llama text model (hidden size 64): each image is resized to `image_size` (no splitting into
    tiles) and shown as (image_size / patch_size / 2)^2 `<image>` tokens (4 by default) between
    `<fake_token_around_image><global-img>` and `<fake_token_around_image>`, at 1-D positions like
    text. Saved as the trainer saves a checkpoint (safetensors), with the processor, tokenizer and
    chat template (VLM_CHAT_TEMPLATE)."""
    from transformers import (
        AutoTokenizer,
        Idefics3Config,
        Idefics3ForConditionalGeneration,
        Idefics3ImageProcessorPil,
        Idefics3Processor,
    )

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_special_tokens({"additional_special_tokens": [
        "<fake_token_around_image>", "<image>", "<end_of_utterance>", "<global-img>"]})
    tok.chat_template = VLM_CHAT_TEMPLATE
    images = Idefics3ImageProcessorPil(do_image_splitting=False, size={"longest_edge": image_size},
                                       max_image_size={"longest_edge": image_size})
    seq_len = (image_size // patch_size // 2) ** 2
    processor = Idefics3Processor(image_processor=images, tokenizer=tok, image_seq_len=seq_len,
                                  chat_template=VLM_CHAT_TEMPLATE)
    text = {"model_type": "llama", "vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128,
            "num_hidden_layers": 2, "num_attention_heads": 2, "num_key_value_heads": 1,
            "max_position_embeddings": 512, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id,
            "bos_token_id": None, "tie_word_embeddings": False}
    vision = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
              "image_size": image_size, "patch_size": patch_size}
    cfg = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2, pad_token_id=tok.pad_token_id,
                         image_token_id=tok.convert_tokens_to_ids("<image>"), tie_word_embeddings=False)
    torch.manual_seed(seed)
    Idefics3ForConditionalGeneration(cfg).save_pretrained(dst, safe_serialization=True)
    processor.save_pretrained(dst)
    return dst


QWEN2_VL_CHAT_TEMPLATE = VLM_CHAT_TEMPLATE.replace("<image>", "<|vision_start|><|image_pad|><|vision_end|>")


def tiny_qwen2_vl(tiny_model: Path, dst: Path, *, seed: int = 0, image_size: int = 32, patch_size: int = 8,
                  kind: str = "qwen2_vl") -> Path:
    """A tiny random Qwen2-VL (`kind` "qwen2_5_vl": Qwen2.5-VL, its vision tower two layers, the first
    attending within windows of 2 x 2 patches) over the tiny dense model's tokenizer (Qwen2-VL's
    special tokens added), with the processor that feeds it: a one-layer vision tower (width 32) over patches of
    `patch_size` pixels, merged 2 x 2 into the two-layer Qwen2 text model (hidden size 64, M-RoPE
    sections 4/6/6 of its 16 frequencies); the image processor resizes a picture to at most
    `image_size`^2 pixels (a 48-pixel square to 32: a 4 x 4 patch grid), each image shown as
    (image_size / patch_size / 2)^2 `<|image_pad|>` tokens (4 by default) between `<|vision_start|>`
    and `<|vision_end|>`, at 3-D (temporal, height, width) positions (transformers' `get_rope_index`).
    Saved as the trainer saves a checkpoint (safetensors), with the processor, tokenizer and chat
    template (QWEN2_VL_CHAT_TEMPLATE)."""
    import json

    import transformers
    from transformers import AutoTokenizer, Qwen2VLImageProcessorPil

    assert kind in ("qwen2_vl", "qwen2_5_vl"), f"kind must be qwen2_vl or qwen2_5_vl, got {kind!r}"
    name = "Qwen2VL" if kind == "qwen2_vl" else "Qwen2_5_VL"

    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.add_special_tokens({"additional_special_tokens": [
        "<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]})
    tok.chat_template = QWEN2_VL_CHAT_TEMPLATE
    factor = patch_size * 2
    images = Qwen2VLImageProcessorPil(patch_size=patch_size, merge_size=2, temporal_patch_size=2,
                                      size={"shortest_edge": factor * factor, "longest_edge": image_size * image_size})
    ids = {name: tok.convert_tokens_to_ids(f"<|{name}|>") for name in ("vision_start", "vision_end", "image_pad",
                                                                       "video_pad")}
    text = {"vocab_size": len(tok), "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "max_position_embeddings": 512,
            "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 6, 6]},
            "sliding_window": None, "use_sliding_window": False, "eos_token_id": tok.eos_token_id,
            "pad_token_id": tok.pad_token_id, "bos_token_id": None, "tie_word_embeddings": False}
    vision = {"depth": 1, "embed_dim": 32, "hidden_size": 64, "mlp_ratio": 2, "num_heads": 2,
              "patch_size": patch_size, "spatial_merge_size": 2, "temporal_patch_size": 2}
    if kind == "qwen2_5_vl":
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 64, "out_hidden_size": 64, "num_heads": 2,
                  "patch_size": patch_size, "spatial_merge_size": 2, "temporal_patch_size": 2,
                  "window_size": factor, "fullatt_block_indexes": [1]}
    cfg = getattr(transformers, f"{name}Config")(
        text_config=text, vision_config=vision, image_token_id=ids["image_pad"], video_token_id=ids["video_pad"],
        vision_start_token_id=ids["vision_start"], vision_end_token_id=ids["vision_end"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    getattr(transformers, f"{name}ForConditionalGeneration")(cfg).save_pretrained(dst, safe_serialization=True)
    # the processor's files as Qwen2VLProcessor saves them (it is built only with torchvision, for its
    # video processor; common/vision.py `load_processor` reads them without)
    tok.save_pretrained(dst)
    images.save_pretrained(dst)
    (dst / "processor_config.json").write_text(json.dumps({"processor_class": f"{name}Processor"}))
    return dst
