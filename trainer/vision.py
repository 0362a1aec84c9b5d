"""A vision-language model's images in the trainer: the images a micro-batch carries (its groups'
`images`, common/images.py) through the processor saved beside the model, as the generator's HF
engine turns them into pixel values (common/vision.py `pixel_inputs`), so that both compute
log-probs over the same inputs.

Each image's features go into its prompt's `<image>` tokens only. A completion may sample the
`<image>` token itself (a random model does); the engine embeds such a token as text (its pixel
values fill the prompt's image tokens at prefill, and decoding takes none), so the trainer does
too: it fills the image tokens of prompt positions (`prompt_at`) and leaves the others as text.
Idefics3 and SmolVLM merge the features in `inputs_merger`, which `showing` takes over for the
pass; Qwen2-VL (and Qwen2.5-VL) finds its image tokens in `get_placeholder_mask`, taken over alike
(common/vision.py `features_at`, as the HF engine takes them over for its prefill), and reads 3-D
(M-RoPE) positions, which `mrope_positions` gives each packed sequence as the model gives it alone.
Only packed micro-batches carry where the prompts are; right-padded ones with images are
refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from common.models import ModelError
from common.vision import feature_placers, features_at, is_vision_config, load_processor, pixel_inputs


def model_path(model: torch.nn.Module) -> str:
    """The directory the model was loaded from (its config's `_name_or_path`)."""
    return str(getattr(getattr(model, "config", None), "_name_or_path", "") or "")


def pixel_values_of(model: torch.nn.Module, images: tuple[bytes, ...], *,
                    device: torch.device) -> dict[str, Tensor]:
    """`images` (a micro-batch's, in the order their image tokens come) as the keyword arguments of
    the model's forward pass: pixel_values (1, images, C, H, W) in the model's dtype (and its
    processor's pixel_attention_mask), on `device`. ModelError when the model takes no images or
    has no processor beside it."""
    if not is_vision_config(getattr(model, "config", None)):
        raise ModelError(f"{len(images)} images in a micro-batch, but the model is not a vision-language model")
    path = model_path(model)
    try:
        processor = load_processor(path)
    except (OSError, ValueError) as err:
        raise ModelError(f"model at {path!r}: no processor to make pixel values of its images: {err}") from None
    dtype = next(model.parameters()).dtype
    return pixel_inputs(processor, [tuple(images)], device=device, dtype=dtype)


# vision-language models whose image tokens sit at 3-D positions (transformers' `get_rope_index`)
MROPE_MODELS = ("qwen2_vl", "qwen2_5_vl")


def mrope_positions(core: torch.nn.Module, ids: Tensor, position_ids: Tensor, docs: Tensor, prompt_at: Tensor,
                    grids: Tensor, token: int) -> Tensor:
    """(3, S, L) M-RoPE positions of packed rows `ids` (S, L): each document's (`docs`) as the model
    gives that sequence alone: its prompt's (`prompt_at`) by the model's `get_rope_index` over the
    prompt with its images' `grids` (image_grid_thw, the documents' images in order), each text
    token after the images continuing from the last position as the model continues (the 1-D
    `position_ids` plus the prompt's rope delta), a completion's too; padding at its 1-D position."""
    out = position_ids.unsqueeze(0).repeat(3, 1, 1)  # (3, S, L)
    prompts = [(s, here, (here & prompt_at[s]).nonzero().squeeze(1))
               for s in range(ids.shape[0]) for d in docs[s].unique().tolist() if d >= 0
               for here in [docs[s] == d]]
    width = max((len(at) for _, _, at in prompts), default=0)
    batch = ids.new_zeros(len(prompts), width)  # the prompts alone, right-padded
    mask = torch.zeros_like(batch)
    for i, (s, _, at) in enumerate(prompts):
        batch[i, :len(at)], mask[i, :len(at)] = ids[s, at], 1
    types = ((batch == token) & mask.bool()).int()
    try:
        pos, deltas = core.get_rope_index(batch, mm_token_type_ids=types, image_grid_thw=grids,
                                          attention_mask=mask)  # (3, n, width), (n, 1)
    except StopIteration:  # more runs of image tokens than images
        raise ModelError(f"{len(grids)} images, but the prompts hold more runs of image tokens") from None
    for i, (s, here, at) in enumerate(prompts):
        out[:, s, here] += deltas[i].to(out.device)
        out[:, s, at] = pos[:, i, :len(at)].to(out.device)
    return out


@contextmanager
def showing(model: torch.nn.Module, ids: Tensor, images: tuple[bytes, ...],
            prompt_at: Tensor | None, pixels: dict[str, Tensor] | None = None, *,
            position_ids: Tensor | None = None, docs: Tensor | None = None) -> Iterator[dict[str, Tensor]]:
    """Within it, a forward pass of `model` over `ids` given the keyword arguments it yields (the
    pixel inputs of `images`: `pixels` where the caller made them once for all its passes,
    `pixel_values_of` here otherwise; for Qwen2(.5)-VL the packed rows' 3-D `position_ids` as well,
    `mrope_positions` of their 1-D `position_ids` and documents `docs`) puts each image's features
    into the `<image>` tokens of prompt positions (`prompt_at`, bool like `ids`), in order, and
    embeds any other `<image>` token as text. ModelError where the counts do not match, where
    `prompt_at` is None (right-padded rows, which say not where their prompts end), or where the
    model places its image features otherwise (another architecture: not trained wrongly)."""
    if prompt_at is None:
        raise ModelError("a vision-language model trains on packed micro-batches only (trainer.pack_sequences = "
                         "true, with an attention that takes a packed mask): right-padded rows with images")
    config = getattr(model, "config", None)
    token = getattr(config, "image_token_id", None)
    mrope = getattr(config, "model_type", None) in MROPE_MODELS
    core = next((m for m in model.modules() if hasattr(type(m), "get_rope_index")), None) if mrope else None
    merger = any(name == "inputs_merger" for _, name in feature_placers(model))  # Idefics3, SmolVLM
    if token is None or not (merger or core is not None):  # another's features go elsewhere too (Qwen3-VL)
        raise ModelError(f"{type(model).__name__}: not a vision-language model whose image features this trainer "
                         "places (Idefics3, SmolVLM, Qwen2-VL, Qwen2.5-VL)")
    slots = (ids == token) & prompt_at  # (B, L)
    with features_at(model, slots, error=ModelError):
        shown = pixels if pixels is not None else pixel_values_of(model, images, device=ids.device)
        if core is not None:
            if position_ids is None or docs is None:
                raise ModelError(f"{type(model).__name__} reads 3-D positions: a packed pass must give its "
                                 "position_ids and documents")
            shown = {**shown, "position_ids": mrope_positions(core, ids, position_ids, docs, prompt_at,
                                                              shown["image_grid_thw"], token)}
        yield shown
