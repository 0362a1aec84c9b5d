"""Chat templates that break multi-turn episodes in the ways real ones do, on a copy of a model."""

from __future__ import annotations

import shutil
from pathlib import Path

# A template that keeps the content of the last assistant turn only, as Qwen3's keeps the reasoning
# of the turns after the last user message only: each turn is sampled after the whole history, the
# conversation re-templated at the end has the earlier turns empty. The generator's test of the
# template (engines.base.turn_ids: one assistant turn, then the environment's) lets it through.
DROPS_EARLIER_TURNS = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] != 'assistant' or loop.index0 == ns.last %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


# Qwen3's way with history itself (its template keeps an assistant turn's reasoning only after the
# last user message), taken to the whole turn: an assistant turn before the last user message is
# rendered empty. Followed by a tool's message it keeps its content, so the generator's start-up
# test with the error role "tool" lets it through; an environment that answers as the user ends
# each episode at its first answer (engines.base.turn_ids refuses the turn).
DROPS_TURNS_BEFORE_THE_USER = (
    "{% set ns = namespace(last=-1) %}"
    "{% for m in messages %}{% if m['role'] == 'user' %}{% set ns.last = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] != 'assistant' or loop.index0 > ns.last %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def with_template(model: Path, dest: Path, template: str) -> Path:
    """A copy of `model` whose tokenizer has chat template `template`."""
    from transformers import AutoTokenizer

    shutil.copytree(model, dest)
    tok = AutoTokenizer.from_pretrained(dest)
    tok.chat_template = template
    tok.save_pretrained(dest)
    return dest
