"""The trainer step's peak memory per rank, estimated from the model's shape and the trainer's
settings, and `trainer.activation_checkpointing = "auto"` resolved from it at start-up.

The estimate (bytes, per rank) is the sum of
  state        the weights, and for each trained one its gradient and AdamW's two moments, in the
               weights' dtype (float32 under `master_fp32`), divided by the ranks (FSDP2 shards
               them); with LoRA the frozen base at its weights only (the adapters are left out);
  copies       the weights in the compute dtype while a step runs: all of them in one process
               (autocast keeps its casts over the forward), two blocks' at a time under FSDP2;
  activations  per micro-batch position and per layer, what the backward pass keeps of a
               block without checkpointing (`block_bytes`); with checkpointing, each block's
               float32 input and one block's whole; under `attention = "sdpa"` also the packed
               micro-batch's (L, L) mask, once as booleans and, per block, in the compute dtype
               (SDPA turns a boolean mask into an additive one, which its backward keeps);
               a vision-language model's image tokens are positions like text, and its vision
               tower keeps the same per patch and per vision block (`vision_bytes`: a block of
               the tower's width, each image's patches a sequence of their own), `per_token`
               patches for each image token the micro-batch can hold; nothing of it under LoRA
               (the tower is frozen, and nothing before the text model's adapters takes a gradient);
  head         the chunked head's float32 (logits_chunk_tokens x vocabulary) tensors (logits,
               log-softmax and their gradients, `LOGITS_COPIES` of them);
  reference    a KL term's frozen model in the compute dtype, sharded like the policy.
The micro-batch is the largest the config allows (`micro_batch_positions`). A vision-language
model's parameters are all of its parts' (text model, vision tower, connector), and its image
tokens are as many as the micro-batch's positions, at most `limits.max_images` images' worth a row
where an image's tokens are known (`micro_batch_image_tokens`; Idefics3 without splitting images
into tiles, as the tiny VLM does; a split image's tiles count as images). The vision tower's term
has not been measured on a GPU.

Calibrated on one NVIDIA H200 (ops/bench/trainer_gpu.py, commit 99dc686, 2026-11-27, docs/gpu.md):
bf16 autocast over float32 master weights, flex attention, measured peaks
(torch.cuda.max_memory_allocated) of 11.1 GiB (Qwen2.5-0.5B's shape, 512-token GRPO rows,
checkpointing on, micro-batches of 8 rows), 30.0 and 24.1 GiB (the same, checkpointing off, 16,384
and 8,192 micro-batch tokens), 14.4 and 48.6 GiB (Qwen3-0.6B's shape, two 16,384-token sequences,
checkpointing on and off). tests/test_trainer_memory.py holds the estimate to within 35% of each.
The SDPA mask's term has not been measured on a GPU (every row ran flex attention).

The rule for "auto": off where the estimate with checkpointing off fits in `BUDGET` of the
device's memory, less `generator.gpu_memory_utilization` when a vLLM generator shares the GPU
(`vllm_share`); on otherwise. On the CPU "auto" is off: the trainer's memory there is the host's,
which the models a CPU trains do not strain, and checkpointing would only add a recomputed forward
to every step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from common.config import Config, LoraConfig, TrainerConfig

GiB = 2**30
BUDGET = 0.8  # share of the device's memory the step may peak at: the rest for the allocator's slack and CUDA
LOGITS_COPIES = 4  # float32 (chunk x vocabulary) tensors the chunked head holds at once, recomputed in backward
ADAMW_MOMENTS = 2


@dataclass(frozen=True, slots=True)
class VisionShape:
    """What the estimate needs of a vision-language model's vision tower (its `vision_config`)."""

    layers: int
    hidden: int
    intermediate: int
    per_token: int  # patches (positions in the tower) of each image token: scale_factor^2, spatial_merge_size^2
    image_tokens: int  # image tokens of one image (tile) in the text model; 0: they vary (Qwen2-VL)


@dataclass(frozen=True, slots=True)
class ModelShape:
    """What the estimate needs of a causal LM or of a vision-language model's text model (from its
    transformers config), and a vision-language model's vision tower (`vision`)."""

    params: int  # every parameter
    trained: int  # those with a gradient and AdamW state (all; 0 under LoRA: the adapters are left out)
    layers: int
    hidden: int
    q_dim: int  # attention heads x head_dim
    kv_dim: int  # key/value heads x head_dim
    intermediate: int
    vocab: int
    qk_norm: bool  # an RMSNorm on each head's queries and keys (Qwen3)
    context: int  # max_position_embeddings (0: unknown)
    vision: VisionShape | None = None  # a vision-language model's vision tower; None: a text model


def shape_of(hf_config: Any, *, lora: LoraConfig | None = None) -> ModelShape:
    """The shape of the model `hf_config` describes: built on PyTorch's `meta` device (no memory, no
    weights read) to count its parameters and see its modules. A vision-language model (its config
    has a `vision_config`) is built as one (common/vision.py), so its parameters are its text
    model's, vision tower's and connector's, and its blocks are its text model's."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from common.vision import is_vision_config

    vlm = is_vision_config(hf_config)
    with torch.device("meta"):
        model = (AutoModelForImageTextToText if vlm else AutoModelForCausalLM).from_config(hf_config)
    params = sum(p.numel() for p in model.parameters())
    text = hf_config.get_text_config() if vlm else hf_config
    hidden = int(text.hidden_size)
    heads = int(text.num_attention_heads)
    head_dim = int(getattr(text, "head_dim", None) or hidden // heads)
    kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
    return ModelShape(params=params, trained=0 if lora is not None and lora.rank else params,
                      layers=int(text.num_hidden_layers), hidden=hidden, q_dim=heads * head_dim,
                      kv_dim=kv_heads * head_dim,
                      intermediate=int(getattr(text, "intermediate_size", None) or 4 * hidden),
                      vocab=int(text.vocab_size),
                      qk_norm=any(name.endswith("q_norm") for name, _ in model.named_modules()),
                      context=int(getattr(text, "max_position_embeddings", 0) or 0),
                      vision=vision_shape(hf_config) if vlm else None)


def vision_shape(hf_config: Any) -> VisionShape:
    """The vision tower of the vision-language model `hf_config` describes: Idefics3 / SmolVLM (an
    image (tile) of `image_size` pixels in patches of `patch_size`, `scale_factor` x `scale_factor`
    patches shuffled into each image token) or Qwen2-VL (`depth` blocks of `embed_dim`,
    `spatial_merge_size` x `spatial_merge_size` patches merged into each image token, as many
    tokens as the image's size gives)."""
    v = hf_config.vision_config
    if getattr(v, "embed_dim", None):  # Qwen2-VL
        hidden, merge = int(v.embed_dim), int(v.spatial_merge_size)
        return VisionShape(layers=int(v.depth), hidden=hidden, intermediate=int(hidden * float(v.mlp_ratio)),
                           per_token=merge**2, image_tokens=0)
    scale = int(getattr(hf_config, "scale_factor", None) or 1)
    hidden = int(v.hidden_size)
    return VisionShape(layers=int(v.num_hidden_layers), hidden=hidden,
                       intermediate=int(getattr(v, "intermediate_size", None) or 4 * hidden), per_token=scale**2,
                       image_tokens=max((int(v.image_size) // int(v.patch_size)) ** 2 // scale**2, 1))


def block_bytes(shape: ModelShape, *, compute: int, attention: str) -> int:
    """Bytes one block keeps for its backward per position, checkpointing off: its two RMSNorms'
    float32 input and normalised output; in the compute dtype (`compute` bytes) the inputs of the
    q, k, v, gate and up projections (autocast's casts), the MLP's gate, up, activation and product,
    and attention's queries, rotated queries, output and o_proj input with the keys and values:
    repeated to every head for SDPA (it takes a mask only without GQA), once each (and their
    rotated copies) for flex attention; a query/key norm's float32 input and output."""
    h, q, kv = shape.hidden, shape.q_dim, shape.kv_dim
    attn = 7 * q + 2 * kv if attention == "sdpa" else 5 * q + 4 * kv
    return 16 * h + compute * (5 * h + 4 * shape.intermediate + attn) + (8 * (q + kv) if shape.qk_norm else 0)


def vision_bytes(vision: VisionShape, *, compute: int, attention: str) -> int:
    """Bytes one vision block keeps for its backward per patch, checkpointing off: as a text block
    of the tower's width (`block_bytes`, every head its own keys and values; its MLP's gate taken
    for its fc1's output)."""
    like = ModelShape(params=0, trained=0, layers=vision.layers, hidden=vision.hidden, q_dim=vision.hidden,
                      kv_dim=vision.hidden, intermediate=vision.intermediate, vocab=0, qk_norm=False, context=0)
    return block_bytes(like, compute=compute, attention=attention)


@dataclass(frozen=True, slots=True)
class Estimate:
    """The step's peak on one rank, in bytes, by part."""

    state: int
    copies: int
    activations: int
    head: int
    reference: int
    positions: int  # of the micro-batch it is for

    @property
    def total(self) -> int:
        return self.state + self.copies + self.activations + self.head + self.reference


def estimate(shape: ModelShape, *, positions: int, sequence: int, checkpointing: bool, weights: int, compute: int,
             attention: str = "sdpa", chunk_tokens: int = 1024, ranks: int = 1, reference: bool = False,
             image_tokens: int = 0) -> Estimate:
    """The step's peak per rank for micro-batches of `positions` positions whose longest sequence
    (a packed micro-batch: all of it) is `sequence`, weights of `weights` bytes each computed in
    `compute`-byte floats, over `ranks` FSDP2 ranks; `image_tokens` of a vision-language model's
    micro-batch positions are image tokens, each `shape.vision.per_token` patches in its vision
    tower."""
    state = (shape.params * weights + shape.trained * weights * (1 + ADAMW_MOMENTS)) // ranks
    per_layer = shape.params // max(shape.layers, 1)
    copies = 0 if weights <= compute else shape.params * compute if ranks == 1 else 2 * per_layer * (compute + 4)
    block = block_bytes(shape, compute=compute, attention=attention) * positions
    kept = shape.layers * 4 * shape.hidden * positions + block if checkpointing else shape.layers * block
    if attention == "sdpa":  # the mask: (positions / sequence) x (sequence x sequence)
        masks = positions // max(sequence, 1) * sequence * sequence
        kept += masks * (1 + compute * (1 if checkpointing else shape.layers))
    if shape.vision is not None and image_tokens and shape.trained:  # under LoRA the frozen tower keeps nothing
        v = shape.vision
        patches = image_tokens * v.per_token
        block = vision_bytes(v, compute=compute, attention=attention) * patches
        kept += v.layers * 4 * v.hidden * patches + block if checkpointing else v.layers * block
    head = LOGITS_COPIES * 4 * min(chunk_tokens, positions) * shape.vocab
    ref = shape.params * compute // ranks if reference else 0
    return Estimate(state=state, copies=copies, activations=kept, head=head, reference=ref, positions=positions)


def longest_row(config: Config, *, context: int = 0) -> int:
    """The longest sequence (prompt and completion) the trainer plans for: generator.max_model_len
    where set, else twice the longest completion (rollout.max_new_tokens, an environment's
    max_episode_tokens: a prompt taken as at most as long), at most the model's `context`."""
    completion = max([config.rollout.max_new_tokens,
                      *(s.max_episode_tokens for s in config.sources if getattr(s, "environment", ""))])
    row = config.generator.max_model_len or 2 * completion
    return min(row, context) if context else row


def micro_batch_positions(cfg: TrainerConfig, *, row: int) -> tuple[int, int]:
    """(positions, longest sequence) of the largest micro-batch `cfg` allows for rows of at most
    `row` positions: packed, micro_batch_size rows' worth, at most micro_batch_tokens, one
    sequence; padded, that many rows of `row`."""
    if cfg.pack_sequences:
        positions = cfg.micro_batch_size * row
        positions = min(positions, max(cfg.micro_batch_tokens, row)) if cfg.micro_batch_tokens else positions
        return positions, positions
    rows = min(cfg.micro_batch_size, cfg.micro_batch_tokens // row) if cfg.micro_batch_tokens else cfg.micro_batch_size
    return max(rows, 1) * row, row


def micro_batch_image_tokens(shape: ModelShape, cfg: TrainerConfig, *, positions: int, max_images: int) -> int:
    """The image tokens the estimate plans a micro-batch of `positions` positions to hold: the
    whole images (tiles) those positions fit, at most `max_images` (limits.max_images) for each of
    its micro_batch_size rows, where an image's tokens are known; else every position; 0 for a
    text model."""
    if shape.vision is None:
        return 0
    each = shape.vision.image_tokens
    return min(positions // each, cfg.micro_batch_size * max_images) * each if each else positions


@dataclass(frozen=True, slots=True)
class Choice:
    """Activation checkpointing as resolved, and why."""

    on: bool
    why: str  # "auto: about 27.5 GiB of 70 GiB ..." or "trainer.activation_checkpointing = true"

    def line(self) -> str:
        return f"activation checkpointing {'on' if self.on else 'off'} ({self.why})"


def resolve(setting: bool | str, *, device_type: str, peak_off: int | None, total: int | None,
            vllm_share: float = 0.0) -> Choice:
    """trainer.activation_checkpointing resolved: true and false as set; "auto" off on the CPU, and
    on CUDA off where `peak_off` (the estimate with it off, bytes; None: unknown) fits in
    (BUDGET - `vllm_share`) of the device's `total` bytes, else on."""
    if setting is not None and not isinstance(setting, str):
        return Choice(on=bool(setting), why=f"trainer.activation_checkpointing = {str(bool(setting)).lower()}")
    assert setting == "auto", f"trainer.activation_checkpointing must be true, false or 'auto', got {setting!r}"
    about = "" if peak_off is None else f"; about {peak_off / GiB:.3g} GiB without it"
    if device_type != "cuda":
        return Choice(on=False, why=f"auto: off on the {device_type}{about}")
    if peak_off is None or not total:
        return Choice(on=True, why="auto: the model's shape or the device's memory is unknown")
    share = BUDGET - vllm_share
    budget = max(share, 0.0) * total
    sharing = f" less vLLM's {vllm_share:g}" if vllm_share else ""
    fits = peak_off <= budget
    return Choice(on=not fits, why=f"auto: about {peak_off / GiB:.3g} GiB without it, "
                                   f"{'within' if fits else 'over'} {budget / GiB:.3g} GiB "
                                   f"({BUDGET:g}{sharing} of {total / GiB:.3g} GiB)")


def vllm_share(config: Config, device: torch.device, *, local_ranks: int) -> float:
    """generator.gpu_memory_utilization where a vLLM generator shares the trainer's GPU, else 0.
    Taken to share it when the engine is vLLM ("vllm", or "auto" with vLLM installed) and every GPU
    this host shows holds a trainer rank (a generator here then leases one of them: the README's one
    GPU); an HF engine's memory (its model and cache) is left to the rest of the device's memory."""
    from engines.choice import engine_name

    if device.type != "cuda" or engine_name(config.generator.engine) != "vllm":
        return 0.0
    return config.generator.gpu_memory_utilization if torch.cuda.device_count() <= local_ranks else 0.0


def choose(config: Config, *, source_dir: Path, device: torch.device, ranks: int = 1,
           local_ranks: int | None = None) -> tuple[Choice, Estimate | None]:
    """trainer.activation_checkpointing resolved for `config`'s model on `device` with `ranks` FSDP2
    ranks (`local_ranks` of them on this host; default: LOCAL_WORLD_SIZE, else `ranks`), and the
    estimate with it off (None where the model's shape cannot be read)."""
    from transformers import AutoConfig

    from trainer.devices import DTYPES, resolve_attention
    from trainer.losses import kl_coef_of

    cfg = config.trainer
    compute = DTYPES[config.model.dtype].itemsize
    weights = 4 if cfg.master_fp32 else compute
    try:
        shape = shape_of(AutoConfig.from_pretrained(source_dir), lora=cfg.lora)
    except (AttributeError, OSError, ValueError, KeyError):  # not a causal LM transformers describes this way
        shape = None
    peak = None
    if shape is not None:
        positions, sequence = micro_batch_positions(cfg, row=longest_row(config, context=shape.context))
        peak = estimate(shape, positions=positions, sequence=sequence, checkpointing=False, weights=weights,
                        compute=compute, attention=resolve_attention(device, cfg.attention, DTYPES[config.model.dtype]),
                        chunk_tokens=cfg.logits_chunk_tokens, ranks=ranks,
                        reference=kl_coef_of(cfg.loss) > 0,
                        image_tokens=micro_batch_image_tokens(shape, cfg, positions=positions,
                                                              max_images=config.limits.max_images))
    local = local_ranks if local_ranks is not None else int(os.environ.get("LOCAL_WORLD_SIZE", ranks))
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    choice = resolve(cfg.activation_checkpointing, device_type=device.type, peak_off=peak.total if peak else None,
                     total=total, vllm_share=vllm_share(config, device, local_ranks=local))
    return choice, peak
