"""The HF transformers engine: sample completions with their behaviour log-probs; reload weights.

Log-probs are computed as the trainer computes them: `log_softmax(logits.float() / temperature)`
at the sampled token, over the top-k/top-p truncated distribution when those are on, and with no
other logits processor, so each behaviour log-prob is that of the distribution actually sampled.

`add`/`step` give the generator's continuous-batching interface: each `step` samples the queued
requests (up to `max_batch` prompts) in one `generate` call; requests added meanwhile go into the
next step.
"""

from __future__ import annotations

from collections import deque
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.checkpoints import check_fits, copy_into
from common.messages import PromptTask
from engines.base import Finished, Sampled, SamplingSettings, chat_prompt_ids, load_tokenizer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFEngine:
    """A causal LM and its tokenizer, and the weight version they hold."""

    name = "hf"

    def __init__(self, path: str | Path, *, dtype: str = "float32", seed: int = 0,
                 max_batch: int = 8) -> None:
        assert dtype in DTYPES, f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}"
        self.path = Path(path)
        self.max_batch = self.max_running = max_batch  # prompts sampled together in one step
        self._queue: deque[tuple[str, list[int], SamplingSettings]] = deque()
        self.tokenizer = load_tokenizer(self.path)
        self.model = AutoModelForCausalLM.from_pretrained(self.path, dtype=DTYPES[dtype], use_safetensors=True).eval()
        self.model.to("cuda" if torch.cuda.is_available() else "cpu")  # the process's visible GPU (its lease)
        self.version = 0  # weight version loaded: 0 = the initial checkpoint
        torch.manual_seed(seed)  # generate() samples from torch's global generator
        model_eos = self.model.generation_config.eos_token_id
        model_eos = model_eos if isinstance(model_eos, list) else [model_eos]
        self.eos_ids = sorted({e for e in [self.tokenizer.eos_token_id, *model_eos] if e is not None})
        assert self.eos_ids, f"{self.path}: neither the tokenizer nor the model names an eos token"
        # Longest prompt + completion the model's positions allow.
        self.context_length = int(self.model.config.get_text_config().max_position_embeddings)
        pad = self.tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]

    def prompt_ids(self, task: PromptTask) -> list[int]:
        return chat_prompt_ids(self.tokenizer, task)

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingSettings) -> None:
        assert prompt_ids, f"request {request_id}: empty prompt"
        self._queue.append((request_id, prompt_ids, sampling))

    def has_unfinished(self) -> bool:
        return bool(self._queue)

    def step(self) -> list[Finished]:
        """Sample the oldest queued requests that share its settings, up to `max_batch`."""
        if not self._queue:
            return []
        sampling = self._queue[0][2]
        batch = [q for q in self._queue if q[2] == sampling][:self.max_batch]
        taken = {id(q) for q in batch}
        self._queue = deque(q for q in self._queue if id(q) not in taken)
        out = self.sample([ids for _, ids, _ in batch], sampling)
        return [Finished(request_id=rid, samples=s) for (rid, _, _), s in zip(batch, out, strict=True)]

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Sampled]]:
        """`sampling.n` completions of each prompt, in one batch: result[i][j] is prompt i's j-th."""
        assert prompts and all(prompts), "sample() needs non-empty prompts"
        n, temperature = sampling.n, sampling.temperature
        input_ids, attention_mask = self._left_pad(prompts)
        width = input_ids.shape[1]
        out = self.model.generate(
            input_ids=input_ids, attention_mask=attention_mask,
            # Temperature, then top-k and top-p when on: every other processor the model's
            # generation_config might switch on is switched off here (HF defaults top_k to 50).
            do_sample=True, temperature=temperature, top_k=sampling.top_k, top_p=sampling.top_p,
            min_p=None,
            typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, repetition_penalty=1.0,
            no_repeat_ngram_size=0, min_length=0, min_new_tokens=None, bad_words_ids=None,
            suppress_tokens=None, begin_suppress_tokens=None, forced_eos_token_id=None,
            num_return_sequences=n, max_new_tokens=sampling.max_new_tokens,
            output_scores=True, output_logits=True, return_dict_in_generate=True,
            pad_token_id=self.pad_id, eos_token_id=self.eos_ids)
        new = out.sequences[:, width:]  # (B*n, T)
        scores = torch.stack(out.scores, dim=1).float()  # (B*n, T, V) processed: logits / T, truncated
        # The processors are the same at every position: checking the first is enough (all of
        # them cost a seventh of the engine's time on the default model).
        first, raw = scores[:, 0], out.logits[0].float() / temperature  # (B*n, V)
        kept = torch.isfinite(first)  # top-k/top-p set the tokens they cut to -inf
        assert torch.allclose(first[kept], raw[kept]), \
            "generate() applied logits processors beyond temperature: behaviour log-probs would be wrong"
        logprobs = torch.log_softmax(scores, dim=-1).gather(-1, new.unsqueeze(-1)).squeeze(-1)  # (B*n, T)
        is_eos = torch.isin(new, torch.tensor(self.eos_ids, device=new.device))
        samples = []
        for row in range(new.shape[0]):
            stops = is_eos[row].nonzero()
            end = int(stops[0]) + 1 if len(stops) else new.shape[1]
            samples.append(Sampled(ids=new[row, :end].tolist(), logprobs=logprobs[row, :end].tolist(),
                                   finish="stop" if len(stops) else "length"))
        return [samples[i * n:(i + 1) * n] for i in range(len(prompts))]

    def _left_pad(self, prompts: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        width = max(len(p) for p in prompts)
        device = self.model.device
        input_ids = torch.tensor([[self.pad_id] * (width - len(p)) + p for p in prompts], device=device)  # (B, L)
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
        return input_ids, attention_mask

    @torch.no_grad()
    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int) -> list[list[int]]:
        """The greedy completion of each prompt (eos included where one was reached)."""
        assert prompts and all(prompts), "greedy() needs non-empty prompts"
        input_ids, attention_mask = self._left_pad(prompts)
        out = self.model.generate(input_ids=input_ids, attention_mask=attention_mask, do_sample=False,
                                  top_k=None, top_p=None, temperature=None, max_new_tokens=max_new_tokens,
                                  pad_token_id=self.pad_id, eos_token_id=self.eos_ids)
        completions = []
        for row in out[:, input_ids.shape[1]:].tolist():
            stop = next((i for i, t in enumerate(row) if t in self.eos_ids), None)
            completions.append(row if stop is None else row[:stop + 1])
        return completions

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @torch.no_grad()
    def load_weights(self, path: str | Path, *, version: int) -> None:
        """Load an HF-format safetensors checkpoint in place; raise CheckpointError (model
        unchanged) when its tensors do not fit the model."""
        own = self.model.state_dict()
        tied = {"lm_head.weight"} if self.model.config.get_text_config().tie_word_embeddings else set()
        check_fits(path, {k: tuple(v.shape) for k, v in own.items()}, tied=tied)  # headers only
        # Into the model's own tensors, from the files' mapped pages: no second copy of the weights.
        # A tied lm_head shares the embedding's tensor (save_pretrained leaves it out).
        copy_into(path, own)
        self.version = version
