"""Images of a vision-language prompt, as they travel and as the models see them.

A prompt's images (PromptTask.images) and the group sampled from it (SampleGroup.images) carry the
encoded image files themselves, PNG or JPEG bytes, in order: the generator's engine and the trainer
each turn the same bytes into pixel values with the model's own image processor, so both compute
log-probs over the same inputs. A decoder checks them (`check_images`: count, size, file signature)
and raises MessageError naming what is wrong; PIL reads them only where a model needs their pixels.

In a chat prompt the images come before the text of the first user message (`image_messages`), the
layout the tiny vision-language model's chat template and most processors' expect.

This module imports neither torch nor PIL at import time: the decoders load it.
"""

from __future__ import annotations

import hashlib
from typing import Any

from common.tokens import MessageError

# Defaults of the config's [limits]: a decoder refuses more images, or a larger one, than these.
MAX_IMAGES = 8  # images of one prompt (and of one group)
MAX_IMAGE_BYTES = 4 * 1024 * 1024  # encoded bytes of one image
SIGNATURES = {b"\x89PNG\r\n\x1a\n": "PNG", b"\xff\xd8\xff": "JPEG"}  # the file formats taken


def check_images(raw: Any, what: str, *, max_images: int = MAX_IMAGES,
                 max_image_bytes: int = MAX_IMAGE_BYTES) -> tuple[bytes, ...]:
    """A message's `images` field as a tuple of bytes, checked: a list of at most `max_images`
    PNG or JPEG files of at most `max_image_bytes` each; MessageError naming the first wrong one."""
    if not isinstance(raw, list):
        raise MessageError(f"{what}.images: expected a list of image files, got {type(raw).__name__}")
    if len(raw) > max_images:
        raise MessageError(f"{what}.images: {len(raw)} images exceed the limit of {max_images}")
    for i, img in enumerate(raw):
        if not isinstance(img, bytes):
            raise MessageError(f"{what}.images[{i}]: expected the bytes of a PNG or JPEG file, "
                               f"got {type(img).__name__}")
        if len(img) > max_image_bytes:
            raise MessageError(f"{what}.images[{i}]: {len(img)} bytes exceed the limit of {max_image_bytes}")
        if not any(img.startswith(sig) for sig in SIGNATURES):
            raise MessageError(f"{what}.images[{i}]: not a PNG or JPEG file (starts {img[:8]!r})")
    return tuple(raw)


def image_digest(img: bytes) -> str:
    """An image's content hash (SHA-256, 16 hex digits): names it in logs and the viewer."""
    return hashlib.sha256(img).hexdigest()[:16]


def png_bytes(image: Any) -> bytes:
    """A PIL image as PNG file bytes (what a task puts in a prompt's images)."""
    import io

    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def open_image(img: bytes) -> Any:
    """The PIL image (RGB) of an image file's bytes; ValueError when PIL cannot read it."""
    import io

    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(io.BytesIO(img)) as opened:
            return opened.convert("RGB")
    except (UnidentifiedImageError, OSError) as err:
        raise ValueError(f"an image of {len(img)} bytes that PIL cannot read: {err}") from None


def image_messages(messages: list[dict[str, Any]], count: int) -> list[dict[str, Any]]:
    """Chat `messages` (string contents) with `count` images placed before the text of the first
    user message, as the content parts a processor's chat template reads ({"type": "image"},
    then {"type": "text", ...}); the other messages keep their string contents."""
    out = [dict(m) for m in messages]
    first = next((i for i, m in enumerate(out) if m["role"] == "user"), None)
    if first is None:
        raise ValueError("a prompt with images needs a user message to show them in")
    out[first]["content"] = [*({"type": "image"} for _ in range(count)),
                             {"type": "text", "text": out[first]["content"]}]
    return out
