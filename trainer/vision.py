"""A vision-language model's images in the trainer: the images a micro-batch carries (its groups'
`images`, common/images.py) through the processor saved beside the model, as the generator's HF
engine turns them into pixel values (common/vision.py `pixel_inputs`), so that both compute
log-probs over the same inputs.

Each image's features go into its prompt's `<image>` tokens only. A completion may sample the
`<image>` token itself (a random model does); the engine embeds such a token as text (its pixel
values fill the prompt's image tokens at prefill, and decoding takes none), so the trainer does
too: it fills the image tokens of prompt positions (`prompt_at`) and leaves the others as text.
Idefics3 and SmolVLM merge the features in `inputs_merger`, which `showing` takes over for the
pass. Only packed micro-batches carry where the prompts are; right-padded ones with images are
refused."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import Tensor

from common.models import ModelError
from common.vision import is_vision_config, load_processor, pixel_inputs


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


@contextmanager
def showing(model: torch.nn.Module, ids: Tensor, images: tuple[bytes, ...],
            prompt_at: Tensor | None, pixels: dict[str, Tensor] | None = None) -> Iterator[dict[str, Tensor]]:
    """Within it, a forward pass of `model` over `ids` given the keyword arguments it yields (the
    pixel inputs of `images`: `pixels` where the caller made them once for all its passes,
    `pixel_values_of` here otherwise) puts each image's features into the `<image>` tokens of prompt
    positions (`prompt_at`, bool like `ids`), in order, and embeds any other `<image>` token as
    text. ModelError where the counts do not match, or where `prompt_at` is None (right-padded
    rows, which say not where their prompts end)."""
    if prompt_at is None:
        raise ModelError("a vision-language model trains on packed micro-batches only (trainer.pack_sequences = "
                         "true, with an attention that takes a packed mask): right-padded rows with images")
    merger = next((m for m in model.modules() if hasattr(type(m), "inputs_merger")), None)
    token = getattr(getattr(model, "config", None), "image_token_id", None)
    if merger is None or token is None:
        raise ModelError(f"{type(model).__name__}: not a vision-language model whose image features this trainer "
                         "places (Idefics3, SmolVLM)")
    slots = (ids == token) & prompt_at  # (B, L)

    def merge(input_ids: Tensor | None, inputs_embeds: Tensor, image_hidden_states: Tensor) -> Tensor:
        features = image_hidden_states.reshape(-1, inputs_embeds.shape[-1])
        if features.shape[0] != int(slots.sum()):
            raise ModelError(f"{len(images)} images make {features.shape[0]} image features, but the prompts hold "
                             f"{int(slots.sum())} image tokens")
        return inputs_embeds.masked_scatter(slots.unsqueeze(-1), features.to(inputs_embeds.dtype))

    merger.inputs_merger = merge  # the instance's, over its class's, for this pass
    try:
        yield pixels if pixels is not None else pixel_values_of(model, images, device=ids.device)
    finally:
        del merger.inputs_merger
