"""Vision-language models: which class loads one, its processor, a prompt's token ids with its
images, and the pixel values the model reads for them.

The generator's HF engine and the trainer both call `pixel_inputs` on the same image bytes
(common/images.py) with the same processor (the one saved beside the model), so the pixel values
(and the log-probs) they compute agree. A vision-language model here is one whose config has a
`vision_config` (Idefics3 / SmolVLM, whose image features replace the `<image>` tokens in order,
at 1-D positions like text: what packs end to end as text does; Qwen2-VL and Qwen2.5-VL, whose image tokens sit
at 3-D positions, trainer/vision.py `mrope_positions`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
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

    try:
        return AutoProcessor.from_pretrained(str(path))
    except ImportError as err:  # transformers builds Qwen2-VL's video processor only with torchvision
        if "Torchvision" not in str(err) or "VideoProcessor" not in str(err):
            raise
        return ImagesOnly(path)


class ImagesOnly:
    """A Qwen2-VL-style processor without its video processor, which transformers builds only with
    torchvision (absent here): the model's tokenizer (and chat template) and image processor, each
    image's `<|image_pad|>` token laid out as Qwen2VLProcessor lays it (one a merged patch: its
    image_grid_thw's product / merge_size^2), with the `mm_token_type_ids` it returns (1 on image
    tokens)."""

    def __init__(self, path: str | Path) -> None:
        from transformers import AutoImageProcessor, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.image_processor = AutoImageProcessor.from_pretrained(str(path))
        self.image_token = getattr(self.tokenizer, "image_token", None) or "<|image_pad|>"

    def apply_chat_template(self, messages: list[dict], **kwargs: Any) -> str:
        return self.tokenizer.apply_chat_template(messages, **kwargs)

    def __call__(self, *, text: list[str], images: list[list[Any]], add_special_tokens: bool = False) -> dict[str, Any]:
        grids = iter(self.image_processor(images=images)["image_grid_thw"])
        merge = self.image_processor.merge_size ** 2
        ids = []
        for row in text:
            pieces = row.split(self.image_token)
            laid = pieces[0] + "".join(self.image_token * (int(next(grids).prod()) // merge) + rest
                                       for rest in pieces[1:])
            ids.append(self.tokenizer.encode(laid, add_special_tokens=add_special_tokens))
        image = self.tokenizer.convert_tokens_to_ids(self.image_token)
        return {"input_ids": ids, "mm_token_type_ids": [[int(i == image) for i in row] for row in ids]}


def prompt_ids(processor: Any, task: Any, *, tools: list[dict] | None = None) -> list[int]:
    """A prompt's token ids with its images: the chat template over its messages (and `tools`'
    schemas: an episode's) with the images before the first user message's text
    (common/images.py `image_messages`), each image's tokens laid out as the processor lays them;
    MessageError when the model has no processor (it takes no images) or the prompt is plain text."""
    if processor is None:
        raise MessageError(f"prompt {task.id}: {len(task.images)} images, but the model takes no images "
                           "(not a vision-language model)")
    if task.messages is None:
        raise MessageError(f"prompt {task.id}: images need chat messages to show them in, not plain text")
    try:
        messages = image_messages(task.messages, len(task.images))
    except ValueError as err:
        raise MessageError(f"prompt {task.id}: {err}") from None
    text = chat_text(processor, messages, tools)
    try:
        pictures = [open_image(img) for img in task.images]
    except ValueError as err:
        raise MessageError(f"prompt {task.id}: {err}") from None
    out = processor(text=[text], images=[pictures], add_special_tokens=False)
    return [int(i) for i in out["input_ids"][0]]


def placeholder_ids(processor: Any, task: Any, *, tools: list[dict] | None = None) -> list[int]:
    """A prompt's token ids with one image token standing for each image, before the processor lays
    out each image's tokens (what vLLM takes with the images, to lay them out itself: the same ids
    as `prompt_ids`)."""
    text = chat_text(processor, image_messages(task.messages, len(task.images)), tools)
    return processor.tokenizer.encode(text, add_special_tokens=False)


def chat_text(processor: Any, messages: list[dict], tools: list[dict] | None) -> str:
    """The processor's chat template over `messages` (and `tools`' schemas), with the generation prompt."""
    extra = {"tools": tools} if tools else {}
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)


def pixel_inputs(processor: Any, images: list[tuple[bytes, ...]], *, device: Any = None,
                 dtype: Any = None) -> dict[str, Any]:
    """The model's image inputs of a batch, one entry of `images` for each sample (its images in
    order; every sample the same number): pixel_values (and Idefics3's pixel_attention_mask) as
    the image processor makes them, on `device`, pixel values in `dtype` (None: as made)."""
    out = processor.image_processor(images=[[open_image(img) for img in row] for row in images], return_tensors="pt")
    return {k: v.to(device=device, dtype=dtype if k == "pixel_values" else None) for k, v in out.items()}


class Unexpanded:
    """What vLLM takes for the prompts an engine laid out (the `keep` latest): their ids with one
    image token an image (`placeholder_ids`), which vLLM expands itself from its multimodal inputs
    (and would expand again if given `prompt_ids`' expanded ones), by the laid-out ids the trainer
    reads. Both vLLM engines (in process, and a `vllm serve`) keep one."""

    def __init__(self, keep: int = 4096) -> None:
        self.keep = keep
        self._ids: dict[tuple[int, ...], list[int]] = {}  # laid-out prompt ids -> vLLM's input ids

    def prompt_ids(self, processor: Any, task: Any, *, tools: list[dict] | None = None) -> list[int]:
        """`prompt_ids` of the task, its unexpanded ids remembered."""
        ids = prompt_ids(processor, task, tools=tools)
        if len(self._ids) >= self.keep:  # prompts of so many texts: forget the oldest
            del self._ids[next(iter(self._ids))]
        self._ids[tuple(ids)] = placeholder_ids(processor, task, tools=tools)
        return ids

    def of(self, laid_out: list[int]) -> list[int] | None:
        """vLLM's input ids for laid-out ids: those of the prompt they are, or begin with, then what
        follows it as it is (an episode's turns so far); None: no prompt remembered."""
        ids = tuple(laid_out)
        if ids in self._ids:
            return self._ids[ids]
        for n in sorted({len(k) for k in self._ids if len(k) < len(ids)}, reverse=True):
            head = self._ids.get(ids[:n])
            if head is not None:
                return head + list(ids[n:])
        return None


# Where a vision-language model puts its image features: Idefics3 / SmolVLM in `inputs_merger`,
# Qwen2(.5)-VL in `get_placeholder_mask`; each fills every image token of its input_ids.
FEATURE_PLACERS = ("get_placeholder_mask", "inputs_merger")


def feature_placers(model: Any) -> list[tuple[Any, str]]:
    """(module, method name) of each of `model`'s modules whose class places image features."""
    return [(m, name) for m in model.modules() for name in FEATURE_PLACERS if hasattr(type(m), name)]


@contextmanager
def features_at(model: Any, slots: Any, *, error: type[Exception] = ValueError) -> Iterator[None]:
    """Within it, a pass of the vision-language `model` that is given pixel values puts the image
    features into the positions `slots` (bool like its input_ids) alone, in order, and embeds any
    other image token as text (one a completion sampled, fed again): each feature placer
    (`feature_placers`) taken over on its instance for the pass. `error` where the features are not
    as many as the slots, or the pass is not over the slots' positions. The trainer's packed passes
    (trainer/vision.py `showing`) and the HF engine's prefill (engines/hf_engine.py) both place
    them so, which is why their log-probs agree on a completion that sampled an image token."""
    import torch

    def at(inputs_embeds: torch.Tensor, features: torch.Tensor | None) -> torch.Tensor:
        if tuple(slots.shape) != tuple(inputs_embeds.shape[:2]):
            raise error(f"image features placed in a pass over {tuple(inputs_embeds.shape[:2])} positions, but "
                        f"the prompts' image tokens were found in {tuple(slots.shape)}")
        if features is not None:
            made = features.reshape(-1, inputs_embeds.shape[-1]).shape[0]
            if made != int(slots.sum()):
                raise error(f"the images make {made} image features, but the prompts hold {int(slots.sum())} "
                            "image tokens")
        return slots.unsqueeze(-1).to(inputs_embeds.device)  # (B, L, 1)

    def placeholders(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor,
                     image_features: torch.Tensor | None = None,
                     video_features: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        mask = at(inputs_embeds, image_features)
        return mask, torch.zeros_like(mask)  # no video

    def merge(input_ids: torch.Tensor | None, inputs_embeds: torch.Tensor,
              image_hidden_states: torch.Tensor) -> torch.Tensor:
        features = image_hidden_states.reshape(-1, inputs_embeds.shape[-1])
        return inputs_embeds.masked_scatter(at(inputs_embeds, features), features.to(inputs_embeds.dtype))

    hooks = {"get_placeholder_mask": placeholders, "inputs_merger": merge}
    owners = feature_placers(model)
    for owner, name in owners:
        setattr(owner, name, hooks[name])  # the instance's, over its class's, for this pass
    try:
        yield
    finally:
        for owner, name in owners:
            delattr(owner, name)
