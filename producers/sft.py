"""SFT data: a chat conversation (a `messages` column's row) as a SampleGroup for the trainer's
SFT objective, trained on its assistant turns only.

The producer writes them straight onto the samples stream for a run of `kind = "sft"` sources
(no generator, no reward); the trainer trains on them with `trainer.objective = "sft"`.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from types import SimpleNamespace
from typing import Any

from common.images import image_messages
from common.messages import Completion, MessageError, SampleGroup
from common.vision import prompt_ids as image_prompt_ids

ENGINE = "sft"  # SampleGroup.engine of a conversation from data, not from sampling


def _ids(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool,
         images: int = 0, processor: Any = None) -> list[int]:
    # Rendered to text then encoded, as the generators do for prompts (hf_engine.prompt_ids). With
    # `images`, by the processor's chat template with that many images before the first user
    # message's text, each image one `<image>` token (common/vision.py `placeholder_ids`).
    if images:
        text = processor.apply_chat_template(image_messages(messages, images), tokenize=False,
                                             add_generation_prompt=generation_prompt)
        return processor.tokenizer.encode(text, add_special_tokens=False)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def conversation_group(tokenizer: Any, messages: list[dict[str, str]], *, group_id: str,
                       version: int = 0, images: tuple[bytes, ...] = (), processor: Any = None) -> SampleGroup:
    """The conversation as one group of one completion.

    `prompt_ids` are the turns before the first assistant turn, chat template and generation
    prompt applied; the completion is everything after, with `loss_mask` 1 on the assistant
    turns' tokens (end-of-turn included) and 0 on the user or system turns between them.
    Trailing turns after the last assistant turn are dropped. Log-probs are 0 (not sampled).

    `images` (a vision-language model's, with its `processor`): shown before the text of the first
    user message, as a prompt's are to the generator; the prompt's image tokens laid out as the
    processor lays them (common/vision.py `prompt_ids`, what the trainer fills with their features),
    and the group carries the images. MessageError when the model takes none (`processor` None) or
    an image cannot be read.
    """
    if images and processor is None:
        raise MessageError(f"{group_id}: {len(images)} images, but the model takes no images "
                           "(not a vision-language model)")
    roles = [m["role"] for m in messages]
    assert "assistant" in roles, f"{group_id}: a conversation for SFT needs an assistant turn"
    first = roles.index("assistant")
    assert first > 0, f"{group_id}: the conversation starts with the assistant; nothing prompts it"
    assert not images or "user" in roles[:first], \
        f"{group_id}: images are shown in the first user message, and none comes before the first assistant turn"
    last = len(roles) - 1 - roles[::-1].index("assistant")
    _ids_of = partial(_ids, images=len(images), processor=processor)
    prompt_ids = _ids_of(tokenizer, messages[:first], generation_prompt=True)
    done, ids, mask = prompt_ids, [], []
    for k in range(first, last + 1):
        assistant = roles[k] == "assistant"
        # a non-assistant turn takes the next assistant turn's header with it (not trained on)
        full = _ids_of(tokenizer, messages[:k + 1], generation_prompt=not assistant)
        assert full[:len(done)] == done, \
            f"{group_id}: the chat template does not render turn {k} as an extension of the turns before"
        ids += full[len(done):]
        mask += [int(assistant)] * (len(full) - len(done))
        done = full
    completion = Completion(ids=ids, logprobs=[0.0] * len(ids), reward=0.0, rewards={}, finish="stop",
                            text=tokenizer.decode(ids), loss_mask=mask)
    if images:  # the prompt as the processor lays out its image tokens; the completion is text
        prompt_ids = image_prompt_ids(processor, SimpleNamespace(id=group_id, messages=messages[:first],
                                                                 images=tuple(images)))
    return SampleGroup(id=group_id, prompt_id=group_id, prompt_ids=prompt_ids, version=version,
                       generator=ENGINE, engine=ENGINE, completions=[completion], images=tuple(images))


def truncate(group: SampleGroup, *, max_length: int) -> tuple[SampleGroup | None, int]:
    """The group cut to `max_length` tokens (prompt + completion), and how many tokens were cut.

    None when nothing trainable is left (the prompt alone fills `max_length`, or no assistant
    token survives the cut).
    """
    (c,) = group.completions
    keep = max_length - len(group.prompt_ids)
    cut = max(0, len(c.ids) - max(keep, 0))
    if keep <= 0 or not any(c.loss_mask[:keep]):
        return None, cut
    if cut == 0:
        return group, 0
    short = replace(c, ids=c.ids[:keep], logprobs=c.logprobs[:keep], loss_mask=c.loss_mask[:keep],
                    finish="length")
    return replace(group, completions=[short]), cut
