"""Prompts and sample groups written as the producer and a generator would: a prompt of the
arithmetic task, a group of random tokens carrying a model's own log-probs."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from common.messages import Completion, PromptTask, SampleGroup


def ask(i: int, *, n: int = 3) -> PromptTask:
    """Prompt `i` of the arithmetic task, asking for `n` completions."""
    a, b = i, 2 * i + 1
    return PromptTask(id=f"arithmetic:0:{i}", messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
                      text=None, meta={"answer": a + b}, n=n, admitted_at=0)


def make_group(model, gid: str, *, version: int, rng: random.Random, n: int = 4,
               shape: tuple[int, Sequence[int]] | None = None, partial_mask: bool = False) -> SampleGroup:
    """A group of random tokens. `model`: the model whose own log-probs (temperature 1) the
    completions carry, or a vocabulary size (log-probs then drawn at random in [-6, -0.5]).
    `shape`: (prompt length, each completion's length); None: 4-8 prompt tokens and `n` completions
    of 3-10. `partial_mask`: the second completion trains on only some (about 60%) of its tokens."""
    vocab = model if isinstance(model, int) else model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 8) if shape is None else shape[0])]
    completions = []
    for i in range(n if shape is None else len(shape[1])):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(3, 10) if shape is None else shape[1][i])]
        logprobs = [-rng.uniform(0.5, 6.0) for _ in ids] if isinstance(model, int) else own_logprobs(model, prompt, ids)
        loss_mask = [int(rng.random() < 0.6) for _ in ids] if partial_mask and i == 1 else None
        correct = float(i % 2 == 0 if rng.random() < 0.8 else i == 0)
        completions.append(Completion(ids=ids, logprobs=logprobs, reward=correct, rewards={"correct": correct},
                                      finish="stop", text="", loss_mask=loss_mask))
    return SampleGroup(id=gid, prompt_id=gid, prompt_ids=prompt, version=version, generator="test",
                       engine="hf", completions=completions)


def own_logprobs(model, prompt: list[int], ids: list[int]) -> list[float]:
    """The model's log-prob of each of `ids` after `prompt` and the ids before it (temperature 1)."""
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]  # (len(ids), V)
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0].tolist()
