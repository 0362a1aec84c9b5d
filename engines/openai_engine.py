"""The server engine: sample from an OpenAI-compatible server (`vllm serve`), reload its weights.

The generator points it at a server (`generator.server_url`) serving the run's model, and keeps
the model's directory for the tokenizer (prompts are tokenized here and sent as token ids; the
completion comes back as token ids, never as text to tokenize again). Each request is one POST
/v1/completions, run in a thread of its own, so requests added between steps are in flight on the
server together and its continuous batching interleaves them; `step` returns those that came back.

The server must give the log-probs the trainer computes, and nothing else may change sampling:
start it with `--logprobs-mode processed_logprobs --generation-config vllm` (log-probs after
temperature and top-k/top-p; the model's generation_config not applied). Requests ask for
`logprobs: 0` (the sampled token's) and `return_tokens_as_token_ids` (tokens as "token_id:N").

New weights: POST /collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}},
then POST /reset_prefix_cache (vLLM's development endpoints: the server runs with
`VLLM_SERVER_DEV_MODE=1`), after the same checksum and shape checks as the in-process engines.
The server's weights are one for everyone it serves: one generator per server (a second one's
reload would change the weights under the first one's requests; nothing here coordinates them).

A model with tied embeddings (SmolLM2, Qwen2.5-0.5B/1.5B-Instruct) needs the server started with
`--worker-extension-cls engines.vllm_worker.WorkerExtension` (this checkout on its PYTHONPATH): on
a CPU vLLM's in-place reload leaves the tied lm_head's packed weight from the old embedding, and
after each reload POST /collective_rpc {"method": "refresh_tied_lm_head"} repacks it (see
engines/vllm_worker.py). The engine calls it once at start-up too, so a server started without
the extension is refused there, with the flag named, and not at the first reload.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.checkpoints import check_fits, tensor_shapes
from common.config import GeneratorConfig
from common.messages import PromptTask
from engines.base import Finished, Sampled, SamplingSettings, chat_prompt_ids, load_tokenizer, stop_ids
from engines.vllm_worker import EXTENSION

POLL_S = 0.02  # longest a step waits for a request to come back


class ServerError(RuntimeError):
    """The server refused a request or answered what cannot be read; the text says which."""


class OpenAIEngine:
    """A model served over HTTP, its local tokenizer, and the weight version the server holds."""

    name = "openai"

    @classmethod
    def for_settings(cls, path: str | Path, *, settings: GeneratorConfig, dtype: str, seed: int,
                     max_running: int) -> OpenAIEngine:
        """The server at generator.server_url; it was started on model.path with the run's dtype and seed."""
        return cls(settings.server_url, path, max_running=max_running, timeout_s=settings.request_timeout_s)

    def __init__(self, url: str, path: str | Path, *, max_running: int = 64, timeout_s: float = 600.0) -> None:
        self.url = url.rstrip("/")
        self.path = Path(path)
        self.tokenizer = load_tokenizer(self.path)
        self.eos_ids = stop_ids(self.tokenizer, self.path)
        self.version = 0  # weight version loaded: 0 = what the server started with
        self._timeout_s = timeout_s
        self._shapes = tensor_shapes(self.path)
        config = json.loads((self.path / "config.json").read_text())
        # an lm_head that shares the embedding: save_pretrained leaves it out of a checkpoint
        self._tied = {"lm_head.weight"} if config.get("tie_word_embeddings", False) else set()
        self.model, self.context_length = self._connect(config)
        self.max_running = max_running
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max_running, thread_name_prefix="request")
        self._in_flight: dict[str, concurrent.futures.Future[list[Sampled]]] = {}
        self._next = 0

    def _connect(self, config: dict[str, Any]) -> tuple[str, int]:
        """Check that the server can serve this engine (`config`: the model's config.json); the
        model's name on it and its context length."""
        models = self._get("/v1/models")["data"]
        assert models, f"{self.url} serves no model"
        if self._tied:  # repacks the head from the weights loaded: harmless, and proves the server can
            try:
                self._post("/collective_rpc", {"method": "refresh_tied_lm_head"})
            except ServerError as err:
                raise ServerError(f"{self.url} cannot refresh the tied lm_head of {self.path} after a reload: start "
                                  f"it with --worker-extension-cls {EXTENSION} (this checkout on its PYTHONPATH) "
                                  f"and VLLM_SERVER_DEV_MODE=1 ({err})") from None
        return models[0]["id"], int(models[0].get("max_model_len") or config["max_position_embeddings"])

    # ------------------------------------------------------------------ the Engine interface

    def prompt_ids(self, task: PromptTask) -> list[int]:
        return chat_prompt_ids(self.tokenizer, task)

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingSettings) -> None:
        assert prompt_ids, f"request {request_id}: empty prompt"
        assert request_id not in self._in_flight, f"request {request_id} is already in flight"
        self._in_flight[request_id] = self._pool.submit(self._complete, list(prompt_ids), sampling)

    def has_unfinished(self) -> bool:
        return bool(self._in_flight)

    def step(self, *, yield_when: Callable[[], bool] | None = None) -> list[Finished]:
        """The requests that came back (waiting up to POLL_S for one); one the server refused,
        answered with what cannot be read, or left unanswered for `timeout_s` comes back failed.
        No in-flight weight updates: `yield_when` must be None (generator.inflight_updates is
        refused at start-up)."""
        assert yield_when is None, "in-flight weight updates need the hf engine (common.config.ENGINES, inflight)"
        if not self._in_flight:
            return []
        concurrent.futures.wait(self._in_flight.values(), timeout=POLL_S,
                                return_when=concurrent.futures.FIRST_COMPLETED)
        done = [rid for rid, f in self._in_flight.items() if f.done()]
        return [_finished(rid, self._in_flight.pop(rid)) for rid in done]

    def sample(self, prompts: list[list[int]], sampling: SamplingSettings) -> list[list[Sampled]]:
        assert prompts and all(prompts), "sample() needs non-empty prompts"
        futures = [self._pool.submit(self._complete, p, sampling) for p in prompts]
        return [f.result() for f in futures]

    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int) -> list[list[int]]:
        assert prompts and all(prompts), "greedy() needs non-empty prompts"
        futures = [self._pool.submit(self._post, "/v1/completions", {
            "model": self.model, "prompt": p, "max_tokens": max_new_tokens, "temperature": 0.0,
            "stop_token_ids": self.eos_ids, "logprobs": 0, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False}) for p in prompts]
        return [_token_ids(f.result()["choices"][0]) for f in futures]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def load_weights(self, path: str | Path, *, version: int) -> None:
        """Reload the server's weights from an HF-format safetensors checkpoint it can read; raise
        CheckpointError (weights unchanged) when the tensors do not fit the model."""
        assert not self._in_flight, "reload weights only between requests, with none in flight"
        check_fits(path, self._shapes, tied=self._tied)
        self._post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(path)}})
        if self._tied:  # else its logits come from the old embedding (engines/vllm_worker.py)
            self._post("/collective_rpc", {"method": "refresh_tied_lm_head"})
        self._post("/reset_prefix_cache", None)  # cached KV was computed with the old weights
        self.version = version

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ HTTP

    def _complete(self, prompt_ids: list[int], sampling: SamplingSettings) -> list[Sampled]:
        out = self._post("/v1/completions", {
            "model": self.model, "prompt": prompt_ids, "n": sampling.n, "max_tokens": sampling.max_new_tokens,
            "temperature": sampling.temperature, "top_p": sampling.top_p, "top_k": sampling.top_k or -1,
            "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0,
            "stop_token_ids": self.eos_ids, "logprobs": 0, "return_tokens_as_token_ids": True,
            "skip_special_tokens": False})
        choices = sorted(out["choices"], key=lambda c: c["index"])
        if len(choices) != sampling.n:
            raise ServerError(f"asked for {sampling.n} completions, got {len(choices)}")
        return [self._sampled(c) for c in choices]

    def _sampled(self, choice: dict[str, Any]) -> Sampled:
        ids = _token_ids(choice)
        logprobs = [float(x) for x in choice["logprobs"]["token_logprobs"]]
        if len(logprobs) != len(ids) or not ids:
            raise ServerError(f"{len(ids)} token ids but {len(logprobs)} log-probs")
        stopped = choice.get("finish_reason") == "stop" and ids[-1] in self.eos_ids
        return Sampled(ids=ids, logprobs=logprobs, finish="stop" if stopped else "length")

    def _get(self, route: str) -> dict[str, Any]:
        return self._call(urllib.request.Request(self.url + route))

    def _post(self, route: str, body: dict[str, Any] | None) -> dict[str, Any]:
        data = b"" if body is None else json.dumps(body).encode()
        return self._call(urllib.request.Request(self.url + route, data=data, method="POST",
                                                 headers={"Content-Type": "application/json"}))

    def _call(self, request: urllib.request.Request) -> dict[str, Any]:
        try:
            with urllib.request.urlopen(request, timeout=self._timeout_s) as response:
                raw = response.read()
        except urllib.error.HTTPError as err:
            raise ServerError(f"{request.get_method()} {request.full_url}: HTTP {err.code}: "
                              f"{err.read()[:500].decode(errors='replace')}") from None
        except TimeoutError:
            raise ServerError(f"{request.get_method()} {request.full_url}: no answer within "
                              f"{self._timeout_s:g} s") from None
        except (OSError, http.client.HTTPException) as err:  # refused, reset, a broken answer
            raise ServerError(f"{request.get_method()} {request.full_url}: {err!r}") from None
        try:
            return json.loads(raw) if raw else {}
        except ValueError as err:
            raise ServerError(f"{request.get_method()} {request.full_url}: an answer that is not JSON: {err}") from None


def _finished(request_id: str, future: concurrent.futures.Future[list[Sampled]]) -> Finished:
    try:
        return Finished(request_id=request_id, samples=future.result())
    except ServerError as err:
        return Finished(request_id=request_id, samples=[], error=str(err))


def _token_ids(choice: dict[str, Any]) -> list[int]:
    """The completion's token ids from `return_tokens_as_token_ids`' "token_id:N" tokens."""
    tokens = choice["logprobs"]["tokens"]
    if not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        raise ServerError(f"tokens are not token ids (is return_tokens_as_token_ids supported?): {tokens[:3]}")
    return [int(t.removeprefix("token_id:")) for t in tokens]
