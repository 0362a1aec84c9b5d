"""SFT data: a chat conversation (a `messages` column's row) as a SampleGroup for the trainer's
SFT objective, trained on its assistant turns only.

Not yet wired into a process: the trainer's `sft` objective decides how such groups reach it
(most likely straight onto the samples stream, no generator, no reward).
"""

from __future__ import annotations

from typing import Any

from common.messages import Completion, SampleGroup

ENGINE = "sft"  # SampleGroup.engine of a conversation from data, not from sampling


def _ids(tokenizer: Any, messages: list[dict[str, str]], *, generation_prompt: bool) -> list[int]:
    # Rendered to text then encoded, as the generators do for prompts (hf_engine.prompt_ids).
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return tokenizer.encode(text, add_special_tokens=False)


def conversation_group(tokenizer: Any, messages: list[dict[str, str]], *, group_id: str,
                       version: int = 0) -> SampleGroup:
    """The conversation as one group of one completion.

    `prompt_ids` are the turns before the first assistant turn, chat template and generation
    prompt applied; the completion is everything after, with `loss_mask` 1 on the assistant
    turns' tokens (end-of-turn included) and 0 on the user or system turns between them.
    Trailing turns after the last assistant turn are dropped. Log-probs are 0 (not sampled).
    """
    roles = [m["role"] for m in messages]
    assert "assistant" in roles, f"{group_id}: a conversation for SFT needs an assistant turn"
    first = roles.index("assistant")
    assert first > 0, f"{group_id}: the conversation starts with the assistant; nothing prompts it"
    last = len(roles) - 1 - roles[::-1].index("assistant")
    prompt_ids = _ids(tokenizer, messages[:first], generation_prompt=True)
    done, ids, mask = prompt_ids, [], []
    for k in range(first, last + 1):
        assistant = roles[k] == "assistant"
        # a non-assistant turn takes the next assistant turn's header with it (not trained on)
        full = _ids(tokenizer, messages[:k + 1], generation_prompt=not assistant)
        assert full[:len(done)] == done, \
            f"{group_id}: the chat template does not render turn {k} as an extension of the turns before"
        ids += full[len(done):]
        mask += [int(assistant)] * (len(full) - len(done))
        done = full
    completion = Completion(ids=ids, logprobs=[0.0] * len(ids), reward=0.0, rewards={}, finish="stop",
                            text=tokenizer.decode(ids), loss_mask=mask)
    return SampleGroup(id=group_id, prompt_id=group_id, prompt_ids=prompt_ids, version=version,
                       generator=ENGINE, engine=ENGINE, completions=[completion])
