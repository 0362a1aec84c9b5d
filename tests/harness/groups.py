"""Prompts and sample groups a test writes itself, as the producer and a generator would, and the
samples stream they travel on."""

from __future__ import annotations

import random

import torch

from common.keys import PAYLOAD, Keys
from common.messages import Completion, PromptTask, SampleGroup, decode_group


def ask(i: int, *, n: int = 3) -> PromptTask:
    """Prompt `i` of the arithmetic task, asking for `n` completions."""
    a, b = i, 2 * i + 1
    return PromptTask(id=f"arithmetic:0:{i}", messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
                      text=None, meta={"answer": a + b}, n=n, admitted_at=0)


def make_group(model, gid: str, *, version: int, rng: random.Random, n: int = 4) -> SampleGroup:
    """A group of random tokens whose behaviour log-probs are the model's own (temperature 1)."""
    vocab = model.config.vocab_size
    prompt = [rng.randrange(vocab) for _ in range(rng.randint(4, 8))]
    completions = []
    for i in range(n):
        ids = [rng.randrange(vocab) for _ in range(rng.randint(3, 10))]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
        correct = float(i % 2 == 0 if rng.random() < 0.8 else i == 0)
        completions.append(Completion(ids=ids, logprobs=logprobs.tolist(), reward=correct,
                                      rewards={"correct": correct}, finish="stop", text=""))
    return SampleGroup(id=gid, prompt_id=gid, prompt_ids=prompt, version=version, generator="test",
                       engine="hf", completions=completions)


def completion(ids: list[int], logprobs: list[float], reward: float, *, loss_mask: list[int] | None = None,
               finish: str = "stop") -> Completion:
    """A completion written out by hand."""
    return Completion(ids=ids, logprobs=logprobs, reward=reward, rewards={}, finish=finish, text="",
                      loss_mask=loss_mask)


def hand_group(completions: list[Completion], *, prompt: tuple[int, ...] = (5, 6, 7)) -> SampleGroup:
    """A group of completions written out by hand, sampled with version 0."""
    return SampleGroup(id="g", prompt_id="p", prompt_ids=list(prompt), version=0, generator="t", engine="hf",
                       completions=completions)


def xadd(r, keys: Keys, blob: bytes) -> None:
    """Write an encoded entry to the run's samples stream, as a generator does."""
    r.xadd(keys.samples, {PAYLOAD: blob})


def read_groups(r, keys: Keys) -> list[SampleGroup]:
    """Every group still in the run's samples stream, oldest first."""
    return [decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)]
