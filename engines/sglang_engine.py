"""The SGLang server engine: sample from an SGLang server's native API, reload its weights from disk.

The server engine of engines/openai_engine.py, on an SGLang server (`python -m sglang.launch_server`)
instead of `vllm serve`: the same local tokenizer, one request per prompt in a thread of its own
(the server's continuous batching interleaves them), the same checks before a reload, and the
same one-generator-per-server lease (common.config.ENGINES: a server engine). What differs is the
API, hence this subclass, which replaces the requests and the reload and inherits the rest:

- Sampling: POST /generate with `input_ids` (n copies of the prompt: one batch, its prefix cached
  once) and `return_logprob`, not /v1/completions: SGLang's OpenAI API returns the completion's
  tokens as text pieces (it has no `return_tokens_as_token_ids`), while /generate returns
  `output_ids` and `meta_info.output_token_logprobs`, [log-prob, token id, text] per sampled
  token. With temperature > 0 SGLang reports log(softmax(logits / T)) before top-k/top-p, the
  trainer's distribution (layers/sampler.py in sglang 0.5.23; not with SGLANG_RETURN_ORIGINAL_LOGPROB
  set, which reports the distribution before temperature); greedy requests report log_softmax(logits).
- New weights: POST /update_weights_from_disk {"model_path": DIR, "weight_version": "N",
  "flush_cache": true}: the server loads the checkpoint in place, empties its prefix cache and
  from then on tags each answer with `meta_info.weight_version` = "N". The engine checks that tag
  on every completion: one sampled under other weights than those it loaded (someone else
  reloaded the server) comes back failed instead of being attributed to the wrong version.

Start the server with `--dtype` the run's dtype and `--sampling-defaults openai` (the model's
generation_config.json not applied to requests; each request sets every sampling field anyway).
Prompts go as ids and completions come back as ids: the server's own tokenizer only decodes text
the engine ignores. Tied embeddings need nothing more: SGLang's models share the lm_head with the
embedding, and a reload of the embedding is a reload of the head.

Not done: SGLang's tensor and process-group updates (`/update_weights_from_tensor`,
`/update_weights_from_distributed`); the first needs the trainer on the server's host handing over
CUDA IPC handles, the second an NCCL group: neither is cheap without a GPU, so trainer.weight_transfer
stays "disk" for this engine (`receives` false). Tested against a real SGLang server only on a
CPU, with its kernel library stubbed (docs/generators.md); not yet on a GPU.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.checkpoints import check_fits
from engines.base import Sampled, SamplingSettings
from engines.openai_engine import OpenAIEngine, ServerError


class SGLangEngine(OpenAIEngine):
    """A model served by SGLang over HTTP, its local tokenizer, and the weight version it holds."""

    name = "sglang"

    def _connect(self, config: dict[str, Any]) -> tuple[str, int]:
        """An SGLang server of a generative model (its /model_info), and the version tag it puts on
        answers from the weights it started with (--weight-version)."""
        info = self._get("/model_info")
        if not info.get("is_generation", False):
            raise ServerError(f"{self.url} serves {info.get('model_path')!r}, not a generative model")
        self._served = str(info.get("weight_version"))
        return str(info.get("model_path", self.path)), int(config["max_position_embeddings"])

    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int) -> list[list[int]]:
        assert prompts and all(prompts), "greedy() needs non-empty prompts"
        settings = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
        futures = [self._pool.submit(self._generate, [p], settings) for p in prompts]
        return [f.result()[0].ids for f in futures]

    def load_weights(self, path: str | Path, *, version: int) -> None:
        """Reload the server's weights from an HF-format safetensors checkpoint it can read; raise
        CheckpointError (weights unchanged) when the tensors do not fit the model, ServerError
        when the server refuses them."""
        assert not self._in_flight, "reload weights only between requests, with none in flight"
        check_fits(path, self._shapes, tied=self._tied)
        out = self._post("/update_weights_from_disk", {"model_path": str(path), "weight_version": str(version),
                                                       "flush_cache": True})
        if not out.get("success"):
            raise ServerError(f"{self.url} did not load {path}: {out.get('message')}")
        self._served = str(version)
        self.version = version

    # ------------------------------------------------------------------ HTTP

    def _complete(self, prompt_ids: list[int], sampling: SamplingSettings) -> list[Sampled]:
        return self._generate([prompt_ids] * sampling.n, {
            "max_new_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k or -1})

    def _generate(self, prompts: list[list[int]], settings: dict[str, Any]) -> list[Sampled]:
        """One completion of each prompt, `settings` over sampling that changes nothing else."""
        out = self._post("/generate", {
            "input_ids": prompts, "return_logprob": True, "sampling_params": {
                "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
                "stop_token_ids": self.eos_ids, "ignore_eos": False, **settings}})
        answers = out if isinstance(out, list) else [out]
        if len(answers) != len(prompts):
            raise ServerError(f"asked for {len(prompts)} completions, got {len(answers)}")
        return [parse_generated(a, eos_ids=self.eos_ids, weight_version=self._served) for a in answers]


def parse_generated(answer: dict[str, Any], *, eos_ids: list[int], weight_version: str) -> Sampled:
    """One completion of SGLang's /generate answer (with return_logprob) as a Sampled: its
    `output_ids`, each one's log-prob from `meta_info.output_token_logprobs` ([log-prob, id, text]
    triples, the ids checked against output_ids), "stop" where an eos ended it. ServerError when
    the answer cannot be read or was sampled under another `weight_version` than the one loaded."""
    try:
        ids = [int(t) for t in answer["output_ids"]]
        meta = answer["meta_info"]
        triples = meta["output_token_logprobs"]
        logprobs = [float(t[0]) for t in triples]
        logprob_ids = [int(t[1]) for t in triples]
        finish = meta["finish_reason"]
    except (KeyError, TypeError, ValueError, IndexError) as err:
        raise ServerError(f"an answer without output_ids and their log-probs ({err!r}): "
                          f"{json.dumps(answer)[:300]}") from None
    if not ids or logprob_ids != ids:
        raise ServerError(f"log-probs of tokens {logprob_ids[:8]} for sampled tokens {ids[:8]}")
    served = str(meta.get("weight_version"))
    if served != weight_version:
        raise ServerError(f"sampled with the server's weights {served!r}, not the version loaded "
                          f"({weight_version!r}): did another client reload the server?")
    stopped = isinstance(finish, dict) and finish.get("type") == "stop" and ids[-1] in eos_ids
    return Sampled(ids=ids, logprobs=logprobs, finish="stop" if stopped else "length")
