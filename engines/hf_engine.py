"""The HF transformers engine: sample completions with their behaviour log-probs; reload weights.

Log-probs are computed as the trainer computes them: `log_softmax(logits.float() / temperature)`
at the sampled token, over the top-k/top-p truncated distribution when those are on, and with no
other logits processor, so each behaviour log-prob is that of the distribution actually sampled.

`add`/`step` give the generator's continuous-batching interface: each `step` samples the queued
requests (up to `max_batch` prompts) in one `generate` call; requests added meanwhile go into the
next step.

LoRA adapters (trainer.lora.publish = "adapter") are peft's layers on the base model loaded once:
the default one (`load_adapter` with no name) and any number of named ones, one per training run
sharing the base model, each in its own peft slot. A step samples requests of one adapter only,
that adapter switched on (peft's `set_adapter`); a request whose adapter is not loaded yet samples
with the base model alone (peft's `disable_adapter`).
"""

from __future__ import annotations

import re
import threading
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from common import vision
from common.checkpoints import (
    ADAPTER_CONFIG,
    ADAPTER_FILE,
    CheckpointError,
    check_fits,
    copy_into,
    is_adapter_dir,
    read_tensors,
    shapes_fit,
    tensor_shapes,
)
from common.config import GeneratorConfig
from common.messages import PromptTask
from common.routing import routers, routing_of, top_k_output
from common.vision import is_vision_model, load_processor, model_class
from engines.base import Finished, Row, Sampled, SamplingSettings, chat_prompt_ids, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ADAPTER = "default"  # peft's name of the default adapter (load_adapter with no name)
# Weights `stage` reads ahead at most: a second copy in page-locked host memory (a 4B model in bf16)
STAGE_MAX_BYTES = 8 * 2**30


def _adapter_key(slot: str) -> re.Pattern[str]:
    """Matches the part of an adapted model's state-dict name that names peft's adapter `slot`
    (`.lora_A.<slot>.`, `.lora_B.<slot>.`, ...)."""
    return re.compile(rf"\.(lora_\w+?)\.{re.escape(slot)}(?=\.|$)")


def _peft_name(key: str, slot: str = _ADAPTER) -> str:
    """An adapted model's state-dict name as peft saves it: the adapter's name (`slot`) dropped."""
    return _adapter_key(slot).sub(r".\1", key)


def _adapter_tensors(state: dict[str, torch.Tensor], slot: str) -> dict[str, torch.Tensor]:
    """The tensors of peft's adapter `slot` in an adapted model's state dict, under the names peft
    saves them with (those of the adapter's file)."""
    key = _adapter_key(slot)
    return {_peft_name(k, slot): v for k, v in state.items() if key.search(k)}


@dataclass(frozen=True, slots=True)
class Adapter:
    """A LoRA adapter the engine holds: its peft slot, (rank, alpha, target modules), version."""

    slot: str  # peft's adapter name: "default" for the default adapter, "adapter<i>" for a named one
    shape: tuple
    version: int


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_ids: list[int]
    sampling: SamplingSettings
    rows: list[Row] = field(default_factory=list)  # its n completions once a step started it
    images: tuple[bytes, ...] = ()  # a vision-language prompt's images (common/images.py)
    adapter: str | None = None  # the named LoRA adapter it samples with; None: the default one


def same_batch(q: Request, head: Request) -> bool:
    """Whether `q` is sampled in one step with `head`: both new or both interrupted (continued
    rows), with the same adapter, sampling the same distribution, and new ones asking for as many
    completions; each row has its own token budget, so requests of different max_new_tokens share a step."""
    if bool(q.rows) != bool(head.rows) or len(q.images) != len(head.images):  # images: as many in each row
        return False
    if q.adapter != head.adapter:
        return False
    a, b = q.sampling, head.sampling
    return (a.temperature, a.top_k, a.top_p) == (b.temperature, b.top_k, b.top_p) and (a.n == b.n or bool(head.rows))


class Budget(StoppingCriteria):
    """Ends each row at its own length (prefix + budget), and every row once `yield_when` says so."""

    def __init__(self, ends: torch.Tensor, yield_when: Callable[[], bool] | None) -> None:
        self.ends, self.yield_when = ends, yield_when  # (B,) sequence length at which each row is done

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        if self.yield_when is not None and self.yield_when():
            return torch.ones(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        return input_ids.shape[1] >= self.ends  # (B,)


class HFEngine:
    """A causal LM and its tokenizer, and the weight version they hold."""

    name = "hf"

    @classmethod
    def for_settings(cls, path: str | Path, *, settings: GeneratorConfig, dtype: str, seed: int,
                     max_running: int) -> HFEngine:
        """The engine a generator runs: generator.batch_prompts prompts per generate call."""
        return cls(path, dtype=dtype, seed=seed, max_batch=settings.batch_prompts,
                   routing_replay=settings.routing_replay)

    def __init__(self, path: str | Path, *, dtype: str = "float32", seed: int = 0,
                 max_batch: int = 8, routing_replay: bool = False) -> None:
        assert dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}"
        self.path = Path(path)
        self.max_batch = self.max_running = max_batch  # prompts sampled together in one step
        self._queue: deque[Request] = deque()  # added, not finished: a started one holds its completions so far
        self.tokenizer = load_tokenizer(self.path)
        self.model = model_class(self.path).from_pretrained(self.path, dtype=DTYPES[dtype],
                                                            use_safetensors=True).eval()
        # a vision-language model's processor (its images' tokens and pixel values); None: a text model
        self.processor = load_processor(self.path) if is_vision_model(self.path) else None
        self.model.to("cuda" if torch.cuda.is_available() else "cpu")  # the process's visible GPU (its lease)
        # On a GPU a version's files are read ahead into page-locked host memory beside the sampling
        # (`stage`), for load_weights to copy in one go: (the checkpoint's path, its tensors) or None
        self.stages = self.model.device.type == "cuda"
        self.loaded_staged = False  # the last load_weights copied from what `stage` read ahead
        self._staging = threading.Lock()  # `stage` (a worker thread) against the copy out of its buffers
        self._staged: tuple[str, dict[str, torch.Tensor]] | None = None
        self._stage_buffers: dict[str, torch.Tensor] = {}  # reused from version to version
        if getattr(self.model.config, "output_router_logits", False):
            # an MoE config asking for the router's loss: the trainer's (trainer/moe.py), not the sampler's;
            # transformers' own fails in generate() once the cache holds earlier positions
            self.model.config.output_router_logits = False
        self.version = 0  # weight version loaded: 0 = the initial checkpoint
        self.adapter: tuple | None = None  # (rank, alpha, target modules) of the default LoRA adapter, if any
        self._adapters: dict[str | None, Adapter] = {}  # LoRA adapters loaded, by name (None: the default one)
        self._slots = 0  # peft slots given to named adapters: each its own, never reused
        self._active: str | None = None  # peft's active adapter slot (set_adapter), None: not set by us
        torch.manual_seed(seed)  # generate() samples from torch's global generator
        model_eos = self.model.generation_config.eos_token_id
        model_eos = model_eos if isinstance(model_eos, list) else [model_eos]
        self.eos_ids = sorted({e for e in [self.tokenizer.eos_token_id, *model_eos] if e is not None})
        assert self.eos_ids, f"{self.path}: neither the tokenizer nor the model names an eos token"
        # Longest prompt + completion the model's positions allow.
        self.context_length = int(self.model.config.get_text_config().max_position_embeddings)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]
        # Routing replay: (MoE layers, top_k, experts) of the experts each Sampled carries; None: none recorded.
        self.routing = routing_of(self.model) if routing_replay else None
        if routing_replay and self.routing is None:
            raise ValueError(f"{self.path}: routing replay on a dense model: there are no experts to record")

    def prompt_ids(self, task: PromptTask, *, tools: list[dict] | None = None) -> list[int]:
        if task.images:
            return vision.prompt_ids(self.processor, task, tools=tools)
        return chat_prompt_ids(self.tokenizer, task)

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingSettings, *,
            images: tuple[bytes, ...] = (), adapter: str | None = None) -> None:
        """Queue a request, sampled with the LoRA adapter loaded under the name `adapter` (None:
        the default one), or with the base model alone while none is loaded under that name."""
        assert prompt_ids, f"request {request_id}: empty prompt"
        assert not images or self.processor is not None, f"request {request_id}: images, but a text model"
        self._queue.append(Request(request_id, prompt_ids, sampling, images=tuple(images), adapter=adapter))

    def adapter_version(self, name: str | None) -> int:
        """The version last loaded as the adapter `name` (0 before any); None: `version`, that of
        the default adapter or the full weights."""
        if name is None:
            return self.version
        held = self._adapters.get(name)
        return 0 if held is None else held.version

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def step(self, *, yield_when: Callable[[], bool] | None = None) -> list[Finished]:
        """Sample the oldest queued requests that share its settings, up to `max_batch`, in one
        `generate` call, and return those that finished. Requests a yield interrupted (see
        `Engine.step`) are stepped together, their unfinished completions continued from prompt +
        tokens so far (prefilled again, under the weights loaded now) for the rest of their budgets."""
        if not self._queue:
            return []
        head = self._queue[0]
        batch = [q for q in self._queue if same_batch(q, head)][:self.max_batch]
        for q in batch:
            q.rows = q.rows or [Row() for _ in range(q.sampling.n)]
        rows = [(q, row) for q in batch for row in q.rows if row.finish is None]
        cut = self._generate([q.prompt_ids + row.ids for q, row in rows],
                             budgets=[q.sampling.max_new_tokens - len(row.ids) for q, row in rows],
                             sampling=head.sampling, yield_when=yield_when,
                             images=[q.images for q, _ in rows] if head.images else None, adapter=head.adapter,
                             prompt_lengths=[len(q.prompt_ids) for q, _ in rows])
        version = self.adapter_version(head.adapter)
        for (_, row), (ids, logprobs, finish, experts) in zip(rows, cut, strict=True):
            row.extend(ids, logprobs, version=version, finish=finish, experts=experts)
        done = [q for q in batch if all(row.finish is not None for row in q.rows)]
        gone = {id(q) for q in done}
        self._queue = deque(q for q in self._queue if id(q) not in gone)
        return [Finished(request_id=q.request_id, samples=[row.sampled() for row in q.rows]) for q in done]

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], sampling: SamplingSettings, *,
               images: list[tuple[bytes, ...]] | None = None) -> list[list[Sampled]]:
        """`sampling.n` completions of each prompt, in one batch: result[i][j] is prompt i's j-th.
        `images`: each prompt's (its `prompt_ids` laid out with them; as many in each), or None."""
        assert prompts and all(prompts), "sample() needs non-empty prompts"
        n = sampling.n
        rows = self._generate([p for p in prompts for _ in range(n)],
                              budgets=[sampling.max_new_tokens] * (len(prompts) * n), sampling=sampling,
                              images=None if images is None else [tuple(i) for i in images for _ in range(n)])
        samples = [Sampled(ids=ids, logprobs=lps, finish=finish or "length", versions=[(0, self.version)],
                           experts=experts)
                   for ids, lps, finish, experts in rows]
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    @torch.no_grad()
    def _generate(self, prefixes: list[list[int]], *, budgets: list[int], sampling: SamplingSettings,
                  yield_when: Callable[[], bool] | None = None, images: list[tuple[bytes, ...]] | None = None,
                  adapter: str | None = None, prompt_lengths: list[int] | None = None,
                  ) -> list[tuple[list[int], list[float], str | None, np.ndarray | None]]:
        """One completion of each prefix, at most its budget of new tokens, in one `generate` call
        with the LoRA adapter `adapter` (`_using`), each prefix's `images` shown in its prompt (its
        first `prompt_lengths` ids; None: all of them), the rest (a continued completion's) text:
        per row the new ids, their behaviour log-probs, "stop" (an eos ended it), "length" (its
        budget did) or None (a yield cut it short: to be continued), and with routing replay the
        experts that chose each new id ((ids, layers, top_k) uint16; else None)."""
        input_ids, attention_mask = self._left_pad(prefixes)
        width = input_ids.shape[1]
        stop = Budget(torch.tensor(budgets, device=input_ids.device) + width, yield_when)
        pixels, slots = self._pixels(input_ids, prefixes, images, prompt_lengths)
        with self._using(adapter), self._recording() as record, self._shown_at(slots):
            out = self._sample(input_ids, attention_mask, sampling, budgets, stop, pixels=pixels)
        new = out.sequences[:, width:]  # (B, T)
        experts = self._experts(record, rows=len(prefixes), tokens=new.shape[1])  # (B, T, layers, k) or None
        scores = torch.stack(out.scores, dim=1).float()  # (B, T, V) processed: logits / T, truncated
        # The processors are the same at every position: checking the first is enough (all of
        # them cost a seventh of the engine's time on the default model).
        first, raw = scores[:, 0], out.logits[0].float() / sampling.temperature  # (B, V)
        kept = torch.isfinite(first)  # top-k/top-p set the tokens they cut to -inf
        assert torch.allclose(first[kept], raw[kept]), \
            "generate() applied logits processors beyond temperature: behaviour log-probs would be wrong"
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (B, T)
        is_eos = torch.isin(new, torch.tensor(self.eos_ids, device=new.device))
        rows = []
        for row, budget in enumerate(budgets):
            stops = is_eos[row, :budget].nonzero()
            end = int(stops[0]) + 1 if len(stops) else min(budget, new.shape[1])
            finish = "stop" if len(stops) else "length" if end == budget else None
            rows.append((new[row, :end].tolist(), logprobs[row, :end].tolist(), finish,
                         None if experts is None else experts[row, :end]))
        return rows

    def _sample(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, sampling: SamplingSettings,
                budgets: list[int], stop: Budget, pixels: dict[str, torch.Tensor] | None = None):
        """`generate`, sampling at `sampling`'s temperature, top-k and top-p alone."""
        temperature = sampling.temperature
        return self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask,
            # Temperature, then top-k and top-p when on: every other processor the model's
            # generation_config might switch on is switched off here (HF defaults top_k to 50).
            do_sample=True, temperature=temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            min_p=None,
            typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
            no_repeat_ngram_size=0, min_length=0, min_new_tokens=None, bad_words_ids=None,
            suppress_tokens=None, begin_suppress_tokens=None, forced_eos_token_id=None,
            max_new_tokens=max(budgets), stopping_criteria=StoppingCriteriaList([stop]),
            output_scores=True, output_logits=True, return_dict_in_generate=True,
            pad_token_id=self.pad_id, eos_token_id=self.eos_ids, **(pixels or {}))

    @contextmanager
    def _using(self, name: str | None) -> Iterator[None]:
        """Within it, the model samples with the LoRA adapter loaded as `name` (None: the default
        one), or with the base model alone where none is loaded under that name."""
        held = self._adapters.get(name)
        if held is not None:
            if self._active != held.slot:
                self.model.set_adapter(held.slot, inference_mode=True)
                self._active = held.slot
            yield
        elif self._adapters:  # peft's layers are there, but not this adapter's: all of them off
            with self.model.disable_adapter():
                yield
        else:
            yield

    @contextmanager
    def _recording(self) -> Iterator[list[torch.Tensor]]:
        """Within it (with routing replay), each router's top-k indices of each forward pass are
        appended to the list it yields, pass by pass, layer by layer; nothing without."""
        record: list[torch.Tensor] = []
        if self.routing is None:
            yield record
            return
        hooks = [m.register_forward_hook(
            lambda m, _a, out: record.append(top_k_output(out, type(m).__name__)[2].detach()))
            for m in routers(self.model)]
        try:
            yield record
        finally:
            for h in hooks:
                h.remove()

    def _experts(self, record: list[torch.Tensor], *, rows: int, tokens: int) -> np.ndarray | None:
        """(rows, tokens, layers, k): the experts that chose each new token, those of the pass
        whose logits sampled it (the prefill's last position for the first, then each decode
        step's), from `_recording`'s record; None without routing replay."""
        if self.routing is None:
            return None
        layers, top_k, _ = self.routing
        assert len(record) >= tokens * layers and len(record) % layers == 0, \
            f"{len(record)} router outputs recorded for {tokens} tokens of {layers} MoE layers"
        last = [r.reshape(rows, -1, top_k)[:, -1] for r in record[:tokens * layers]]  # each (rows, k)
        if not last:
            return np.zeros((rows, 0, layers, top_k), dtype=np.uint16)
        stacked = torch.stack(last).reshape(tokens, layers, rows, top_k).permute(2, 0, 1, 3)
        return stacked.to(torch.int32).cpu().numpy().astype(np.uint16)

    def _shown_at(self, slots: torch.Tensor | None) -> AbstractContextManager:
        """A prefill that puts its image features into `slots` alone (common/vision.py
        `features_at`); None (no images): the model as it is."""
        return nullcontext() if slots is None else vision.features_at(self.model, slots)

    def _pixels(self, input_ids: torch.Tensor, prefixes: list[list[int]], images: list[tuple[bytes, ...]] | None,
                prompt_lengths: list[int] | None = None) -> tuple[dict[str, torch.Tensor] | None, torch.Tensor | None]:
        """The pixel inputs of each left-padded prefix's `images` (None: none), and where their
        features go (bool like `input_ids`): the image tokens of each prefix's prompt, its first
        `prompt_lengths` ids (None: all of it). An image token a completion sampled, fed again with
        its prompt to continue it, stays text, as decoding embedded it and as the trainer embeds it
        (trainer/vision.py): Qwen2-VL's 3-D positions (`mm_token_type_ids`) count the prompt's alone."""
        if images is None:
            return None, None
        pixels = vision.pixel_inputs(self.processor, images, device=input_ids.device, dtype=self.model.dtype)
        width = input_ids.shape[1]
        prompt = torch.zeros_like(input_ids, dtype=torch.bool)
        for row, (prefix, length) in enumerate(zip(prefixes, prompt_lengths or map(len, prefixes), strict=True)):
            prompt[row, width - len(prefix):width - len(prefix) + length] = True
        slots = (input_ids == self.model.config.image_token_id) & prompt
        if "image_grid_thw" in pixels:  # Qwen2-VL: its 3-D positions start at the image tokens
            pixels["mm_token_type_ids"] = slots.int()
        return pixels, slots

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        device = self.model.device
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)  # (B, L)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return input_ids, attention_mask

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int,
               images: list[tuple[bytes, ...]] | None = None) -> list[list[int]]:
        """The greedy completion of each prompt (eos included where one was reached). `images`:
        each prompt's (its `prompt_ids` laid out with them; as many in each), or None."""
        assert prompts and all(prompts), "greedy() needs non-empty prompts"
        assert images is None or self.processor is not None, "greedy() with images, but a text model"
        input_ids, attention_mask = self._left_pad(prompts)
        pixels, slots = self._pixels(input_ids, prompts, None if images is None else [tuple(i) for i in images])
        with self._using(None), self._shown_at(slots):
            out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                      top_k=None, top_p=None, temperature=None, max_new_tokens=max_new_tokens,
                                      pad_token_id=self.pad_id, eos_token_id=self.eos_ids, **(pixels or {}))
        completions = []
        for row in out[:, input_ids.shape[1]:].tolist():
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            completions.append(row if stop is None else row[:stop + 1])
        return completions

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def load_weights(self, path: str | Path, *, version: int, adapter: str | None = None) -> None:
        """Load an HF-format safetensors checkpoint in place, or a LoRA adapter in peft's format
        (trainer.lora.publish = "adapter": `load_adapter`, as the adapter named `adapter`); raise
        CheckpointError (model unchanged) when its tensors do not fit the model, or for full
        weights with `adapter` named."""
        self.loaded_staged = False
        if is_adapter_dir(path):
            self.load_adapter(path, version=version, name=adapter)
            return
        if adapter is not None:
            raise CheckpointError(f"checkpoint {path}: full weights for adapter {adapter!r}, but a named adapter "
                                  "takes LoRA adapters only (trainer.lora.publish = \"adapter\")")
        if self._adapters:
            raise CheckpointError(f"checkpoint {path}: full weights, but this engine samples with LoRA adapters "
                                  f"on its base model (trainer.lora.publish = \"adapter\"): restart it to load them")
        own = self.model.state_dict()
        tied = {"lm_head.weight"} if self.model.config.get_text_config().tie_word_embeddings else set()
        try:
            check_fits(path, {k: tuple(v.shape) for k, v in own.items()}, tied=tied)  # headers only
        except CheckpointError:
            if not self._load_converted(path, own, tied):
                raise
            self.version = version
            return
        # Into the model's own tensors, from what `stage` read ahead or else from the files: no second
        # copy of the weights. A tied lm_head shares the embedding's tensor (save_pretrained leaves it out).
        missing = set(own) - tied - self._copy_in(path, own)
        if missing:  # its file gone since the headers were read: nothing was copied from it
            raise CheckpointError(f"checkpoint {path}: {len(missing)} tensors (e.g. {sorted(missing)[0]}) were not "
                                  "there to load: removed or replaced after it was checked")
        self.version = version

    def stage(self, path: str | Path) -> bool:
        """Read the full weights at `path` (a version verified, not loaded yet) into page-locked host
        memory, for load_weights(path) to copy from: called off the engine's thread while it samples
        (generators/weights.py `check`), so that the engine's pause for a version is one copy to the
        GPU, not the files' read and a copy from pageable memory (0.22 s of each version's 0.29 s
        pause for the built-in model on an H200, docs/gpu.md). On a GPU only, for weights up to
        STAGE_MAX_BYTES (one more copy of them in host memory, kept for the next version). True where
        staged; a checkpoint it cannot read is left to load_weights to refuse."""
        if not self.stages or is_adapter_dir(path):
            return False
        try:
            if sum(f.stat().st_size for f in Path(path).glob("*.safetensors")) > STAGE_MAX_BYTES:
                return False
            with self._staging:
                self._staged = None
                self._stage_buffers = read_tensors(path, self._stage_buffers, pin=torch.cuda.is_available())
                self._staged = (str(path), self._stage_buffers)
        except (OSError, CheckpointError, ValueError, KeyError):
            return False
        return True

    def _copy_in(self, path: str | Path, own: dict[str, torch.Tensor]) -> set[str]:
        """copy_into(path, own), or from the tensors `stage` read of `path` where it did: each copied
        without waiting, then waited for together, before `stage` may read into them again."""
        with self._staging:
            staged = self._staged
            if staged is not None and staged[0] == str(path):
                self._staged = None
                try:
                    for name, t in staged[1].items():
                        own[name].copy_(t, non_blocking=True)
                finally:  # the copies read the buffers until they are done
                    if self.model.device.type == "cuda":
                        torch.cuda.synchronize(self.model.device)
                self.loaded_staged = True
                return set(staged[1])
        return copy_into(path, own)

    def _load_converted(self, path: str | Path, own: dict[str, torch.Tensor], tied: set[str]) -> bool:
        """A checkpoint in the hub's layout that transformers converts as it loads (an MoE's experts:
        one tensor each in the files, fused in the model; the trainer writes that layout): if it fits
        the model's own tensors in that layout, load it whole (a second copy of the weights, for a
        moment), copy it in and return True; False if the model converts nothing. A vision-language
        model's is read by its own class (Qwen2-VL's files name `model.layers`, `visual`; its module
        `model.language_model.layers`, `model.visual`)."""
        from transformers.modeling_utils import revert_weight_conversion

        hub = revert_weight_conversion(self.model, dict(own))
        if set(hub) == set(own):
            return False
        check_fits(path, {k: tuple(v.shape) for k, v in hub.items()}, tied=tied)  # CheckpointError if not
        fresh = model_class(path).from_pretrained(path, dtype=self.model.dtype, use_safetensors=True).state_dict()
        if set(fresh) != set(own) or any(fresh[k].shape != v.shape for k, v in own.items()):
            raise CheckpointError(f"checkpoint {path}: converted as transformers loads it, it does not fit the model")
        for name, tensor in own.items():
            tensor.copy_(fresh[name])
        return True

    @torch.no_grad()
    def load_adapter(self, path: str | Path, *, version: int, name: str | None = None) -> None:
        """Sample the requests of adapter `name` (None: the default adapter) from now on with the
        LoRA adapter at `path` (peft's adapter_model.safetensors and adapter_config.json) on the
        base model loaded once: the first adapter wraps the model in peft's LoRA layers (merge-free:
        each adapted layer adds x A^T B^T * alpha / r to the frozen base's output), each new name
        adds a peft adapter slot of its own, and each later version is copied into its name's slot
        in place. Other adapters' tensors are not touched, so their requests (queued or cut short by
        a yield) go on as they were. CheckpointError, the adapters held unchanged, when its config
        or tensors do not fit (a name's rank, alpha and target modules are those of its first version)."""
        from peft import LoraConfig

        try:
            config = LoraConfig.from_pretrained(str(path))
        except (OSError, ValueError, TypeError) as err:
            raise CheckpointError(f"adapter {path}: {ADAPTER_CONFIG} is not a readable peft LoRA config: "
                                  f"{err}") from None
        shape = (config.r, config.lora_alpha, sorted(config.target_modules or []))
        held = self._adapters.get(name)
        if held is not None and shape != held.shape:
            which = "the adapter in use" if name is None else f"adapter {name!r} in use"
            raise CheckpointError(f"adapter {path}: rank, alpha, target_modules {shape} differ from {which} "
                                  f"{held.shape}: restart the engine to change them")
        slot = self._new_slot(path, config, name) if held is None else held.slot
        try:
            own = _adapter_tensors(self.model.state_dict(), slot)
            shapes_fit(tensor_shapes(path), {k: tuple(v.shape) for k, v in own.items()}, tied=set(),
                       what=f"adapter {path}")
            missing = set(own) - copy_into(path, own)
            if missing:
                raise CheckpointError(f"adapter {path}: {len(missing)} tensors (e.g. {sorted(missing)[0]}) were not "
                                      f"there to load from {ADAPTER_FILE}: removed or replaced after it was checked")
        except CheckpointError:
            if held is None:
                self._drop(slot)
            raise
        self._adapters[name] = Adapter(slot, shape, version)
        if name is None:
            self.adapter, self.version = shape, version

    def _new_slot(self, path: str | Path, config, name: str | None) -> str:
        """A peft adapter slot for the adapter `name`'s first version (`config`, from `path`), its
        B zero (the base model's outputs until its tensors are copied in): the model wrapped in
        peft's layers for the first adapter, a slot added beside the others' for each later one."""
        from peft import get_peft_model

        slot = _ADAPTER if name is None else f"adapter{self._slots + 1}"
        config.inference_mode = True
        try:
            if self._adapters:
                self.model.add_adapter(slot, config)
                self._active = None  # whichever peft leaves active: set again before the next use
            else:
                self.model = get_peft_model(self.model, config, adapter_name=slot).eval()
                self._active = slot
        except ValueError as err:  # e.g. no module matches target_modules
            raise CheckpointError(f"adapter {path}: {err}") from None
        if name is not None:
            self._slots += 1
        for module in self.model.modules():
            if hasattr(module, "lora_B") and slot in module.lora_B:
                module.lora_B[slot].weight.zero_()
        return slot

    def _drop(self, slot: str) -> None:
        """Take a new adapter's slot out of the model again (it did not load): the base model
        unwrapped where it was the only one."""
        if self._adapters:
            self.model.delete_adapter(slot)
            self._active = None  # peft picks another active adapter: set again before the next use
        else:
            self.model = self.model.unload()
            self._active = None

    def load_tensors(self, tensors: dict[str, torch.Tensor], *, version: int) -> None:
        """load_weights from tensors in memory under the checkpoint's names (trainer.weight_transfer);
        CheckpointError, model unchanged, when they do not fit it."""
        own = self.model.state_dict()
        tied = {"lm_head.weight"} if self.model.config.get_text_config().tie_word_embeddings else set()
        shapes = {k: tuple(v.shape) for k, v in own.items()}
        try:
            shapes_fit({k: tuple(t.shape) for k, t in tensors.items()}, shapes, tied=tied, what="the weights received")
        except CheckpointError:  # the checkpoint's layout (an MoE's experts one by one, a VLM's names)?
            converted = in_model_layout(self.model, tensors)
            if converted is None:
                raise
            shapes_fit({k: tuple(t.shape) for k, t in converted.items()}, shapes, tied=tied,
                       what="the weights received, converted as transformers loads them")
            tensors = converted
        with torch.no_grad():
            for name, t in tensors.items():
                own[name].copy_(t)
        self.version = version


def in_model_layout(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """`tensors` under a checkpoint's names and layout (what the trainer writes and broadcasts: an
    MoE's experts one tensor each, a VLM's `model.layers`) converted as transformers' from_pretrained
    converts them into `model`'s own (fused experts, `model.language_model.layers`): the inverse of
    the trainer's `revert_weight_conversion`. None where the model converts nothing, or the tensors
    do not convert (what is missing is then named by the fit check on the names as received)."""
    from copy import deepcopy

    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        PrefixChange,
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
    )

    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # built without from_pretrained: transformers' mapping for its class
        conversions = [c for c in get_model_conversion_mapping(model, add_legacy=False)
                       if not isinstance(c, PrefixChange)]
    if not conversions:
        return None
    renamings = [c for c in conversions if isinstance(c, WeightRenaming)]
    converters = [c for c in conversions if isinstance(c, WeightConverter)]
    by_pattern = {p: c for c in converters for p in c.source_patterns}
    pending: dict[str, WeightRenaming | WeightConverter] = {}
    try:
        for name, tensor in sorted(tensors.items(), key=lambda kv: dot_natural_key(kv[0])):
            renamed, pattern = rename_source_key(name, renamings, converters)
            if pattern is None:
                transform = pending.setdefault(renamed, WeightRenaming(name, renamed))
                pattern = name
            else:  # each target its own converter, gathering its sources (every expert's tensor)
                transform = pending.setdefault(renamed, deepcopy(by_pattern[pattern]))
            transform.add_tensor(renamed, name, pattern, tensor)
        out = {}
        for first, transform in pending.items():
            for target, value in transform.convert(first, model=model, config=model.config).items():
                out[target] = value[0] if isinstance(value, list) else value
    except Exception:  # noqa: BLE001 - a layout transformers cannot convert: refused by the caller's fit check
        return None
    return None if set(out) == set(tensors) else out
