"""Vision-language models: which class loads one, its processor, a prompt's token ids with its
images, and the pixel values the model reads for them.

The generator's HF engine and the trainer both call `pixel_inputs` on the same image bytes
(common/images.py) with the same processor (the one saved beside the model), so the pixel values
(and the log-probs) they compute agree. A vision-language model here is one whose config has a
`vision_config` (Idefics3 / SmolVLM, whose image features replace the `<image>` tokens in order,
at 1-D positions like text: what packs end to end as text does).
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from stat import S_ISREG
from typing import Any

from common.images import image_messages, open_image
from common.tokens import MessageError


def is_vision_config(config: Any) -> bool:
    """Whether a model config (transformers' or its config.json dict) is a vision-language model's."""
    return (config.get("vision_config") if isinstance(config, dict) else getattr(config, "vision_config", None)
            ) is not None


def is_vision_model(path: str | Path) -> bool:
    """Whether the model directory `path` holds a vision-language model (its config.json says),
    the file read once however many callers ask (again only once it changes)."""
    config = Path(path).resolve() / "config.json"
    try:
        seen = config.stat()
    except OSError:  # no config.json
        return False
    return S_ISREG(seen.st_mode) and vision_config_at(config, seen.st_mtime_ns, seen.st_size)


@lru_cache(maxsize=64)
def vision_config_at(config: Path, mtime_ns: int, size: int) -> bool:
    """`is_vision_model`'s reading of the config.json at `config` as it is at (`mtime_ns`, `size`)."""
    import json

    return is_vision_config(json.loads(config.read_text()))


def model_class(path: str | Path) -> Any:
    """The transformers auto class that loads the model at `path`: AutoModelForImageTextToText for a
    vision-language model, AutoModelForCausalLM otherwise."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    return AutoModelForImageTextToText if is_vision_model(path) else AutoModelForCausalLM


@lru_cache(maxsize=4)
def load_processor(path: str | Path) -> Any:
    """The processor saved beside a vision-language model (its image processor, tokenizer and chat
    template)."""
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(path))


def prompt_ids(processor: Any, task: Any) -> list[int]:
    """A prompt's token ids with its images: the chat template over its messages with the images
    before the first user message's text (common/images.py `image_messages`), each image's tokens
    laid out as the processor lays them; MessageError when the model has no processor (it takes no
    images) or the prompt is plain text."""
    if processor is None:
        raise MessageError(f"prompt {task.id}: {len(task.images)} images, but the model takes no images "
                           "(not a vision-language model)")
    if task.messages is None:
        raise MessageError(f"prompt {task.id}: images need chat messages to show them in, not plain text")
    try:
        messages = image_messages(task.messages, len(task.images))
    except ValueError as err:
        raise MessageError(f"prompt {task.id}: {err}") from None
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    try:
        pictures = [open_image(img) for img in task.images]
    except ValueError as err:
        raise MessageError(f"prompt {task.id}: {err}") from None
    out = processor(text=[text], images=[pictures], add_special_tokens=False)
    return [int(i) for i in out["input_ids"][0]]


def placeholder_ids(processor: Any, task: Any) -> list[int]:
    """A prompt's token ids with one image token standing for each image, before the processor lays
    out each image's tokens (what vLLM takes with the images, to lay them out itself: the same ids
    as `prompt_ids`)."""
    messages = image_messages(task.messages, len(task.images))
    text = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return processor.tokenizer.encode(text, add_special_tokens=False)


def pixel_inputs(processor: Any, images: list[tuple[bytes, ...]], *, device: Any = None,
                 dtype: Any = None) -> dict[str, Any]:
    """The model's image inputs of a batch, one entry of `images` for each sample (its images in
    order; every sample the same number): pixel_values (and Idefics3's pixel_attention_mask) as
    the image processor makes them, on `device`, pixel values in `dtype` (None: as made)."""
    out = processor.image_processor(images=[[open_image(img) for img in row] for row in images], return_tensors="pt")
    return {k: v.to(device=device, dtype=dtype if k == "pixel_values" else None) for k, v in out.items()}
