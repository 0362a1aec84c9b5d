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

A vision-language model (common/vision.py): a prompt with images is laid out as the in-process
engines lay it (`prompt_ids`: each image's tokens expanded by the processor, the ids the trainer
reads) and sent to vLLM's token-in/token-out endpoint POST /inference/v1/generate (the server
started with `--enable-scale-out`; checked at start-up) with one image token standing for each
image (`vision.placeholder_ids`: the server expands it itself, and would expand an expanded one
again) and the images as data URLs in `content_parts`; completions come back as token ids, each
with its log-prob. Text prompts keep /v1/completions. After a reload the engine also resets the
server's encoder cache (/reset_encoder_cache: vLLM's reload empties the worker's and not the
scheduler's, and the next request with an image seen before would stop the server on an "Encoder
cache miss") and its multimodal cache (/reset_mm_cache).
"""

from __future__ import annotations

import base64
import concurrent.futures
import http.client
import json
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common import vision
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
        # a vision-language model's processor (its images' token layout, as the other engines'); None: a text model
        self._processor = vision.load_processor(self.path) if vision.is_vision_config(config) else None
        self._placeholders = vision.Unexpanded()  # laid-out prompt ids -> what the server takes for them
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
        if self._processor is not None:  # images go through the token-in/token-out endpoint: is it on?
            try:
                self._post("/inference/v1/generate", {})  # refused as incomplete where it is on
            except ServerError as err:
                if "HTTP 403" in str(err) or "HTTP 404" in str(err):
                    raise ServerError(f"{self.url} cannot sample prompts with images of the vision-language model "
                                      f"{self.path}: start it with --enable-scale-out (POST /inference/v1/generate; "
                                      f"{err})") from None
        return models[0]["id"], int(models[0].get("max_model_len") or config["max_position_embeddings"])

    # ------------------------------------------------------------------ the Engine interface

    def prompt_ids(self, task: PromptTask, *, tools: list[dict] | None = None) -> list[int]:
        if task.images:  # the image tokens laid out as the processor lays them (what the trainer reads)
            # MessageError for a text model; the server lays the image tokens out itself from one an image
            return self._placeholders.prompt_ids(self._processor, task, tools=tools)
        return chat_prompt_ids(self.tokenizer, task)

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingSettings, *,
            images: tuple[bytes, ...] = ()) -> None:
        """Queue a request; `images`: a vision-language prompt's (its ids from `prompt_ids`, or
        those followed by an episode's turns so far)."""
        assert prompt_ids, f"request {request_id}: empty prompt"
        assert request_id not in self._in_flight, f"request {request_id} is already in flight"
        self._in_flight[request_id] = self._submit(list(prompt_ids), sampling, tuple(images),
                                                   what=f"request {request_id}")

    def _submit(self, prompt_ids: list[int], sampling: SamplingSettings | dict[str, Any], images: tuple[bytes, ...],
                *, what: str) -> concurrent.futures.Future[list[Sampled]]:
        """A request in flight: text through /v1/completions, a prompt with images through the
        token-in/token-out endpoint (`sampling`: there, vLLM's sampling parameters as they are)."""
        if not images:
            assert isinstance(sampling, SamplingSettings)
            return self._pool.submit(self._complete, prompt_ids, sampling)
        assert self._processor is not None, f"{what}: images, but a text model"
        ids = self._placeholders.of(prompt_ids)
        assert ids is not None, f"{what}: images, but not ids of this engine's prompt_ids"
        params = sampling if isinstance(sampling, dict) else {
            "n": sampling.n, "max_tokens": sampling.max_new_tokens, "temperature": sampling.temperature,
            "top_p": sampling.top_p, "top_k": sampling.top_k or -1}
        return self._pool.submit(self._generate, ids, images, params)

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

    def sample(self, prompts: list[list[int]], sampling: SamplingSettings, *,
               images: list[tuple[bytes, ...]] | None = None) -> list[list[Sampled]]:
        """`images`: each prompt's (its ids from `prompt_ids`), or None."""
        assert prompts and all(prompts), "sample() needs non-empty prompts"
        futures = [self._submit(list(p), sampling, tuple(images[i]) if images else (), what=f"prompt {i}")
                   for i, p in enumerate(prompts)]
        return [f.result() for f in futures]

    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int,
               images: list[tuple[bytes, ...]] | None = None) -> list[list[int]]:
        """`images`: each prompt's (its ids from `prompt_ids`), or None."""
        assert prompts and all(prompts), "greedy() needs non-empty prompts"
        if images:
            params = {"n": 1, "max_tokens": max_new_tokens, "temperature": 0.0}
            futures = [self._submit(list(p), params, tuple(images[i]), what=f"prompt {i}")
                       for i, p in enumerate(prompts)]
            return [f.result()[0].ids for f in futures]
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
        if self._processor is not None:  # a VLM: its images' encoder outputs came from the old vision tower,
            self._post("/reset_encoder_cache", None)  # and the reload left the scheduler's record of them
            self._post("/reset_mm_cache", None)
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

    def _generate(self, ids: list[int], images: tuple[bytes, ...], params: dict[str, Any]) -> list[Sampled]:
        """`params["n"]` completions of the server's input ids `ids` (one image token an image) with
        `images`, through the token-in/token-out endpoint; `params`: n, max_tokens, temperature (and
        top_p, top_k), nothing else changing sampling."""
        out = self._post("/inference/v1/generate", {
            "model": self.model, "token_ids": ids, "output_mode": "tokens",
            "content_parts": [{"type": "image_url", "url": _data_url(img)} for img in images],
            "sampling_params": {"top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                                "presence_penalty": 0.0, "frequency_penalty": 0.0, **params,
                                "stop_token_ids": self.eos_ids, "logprobs": 0, "detokenize": False,
                                "skip_special_tokens": False}})
        choices = sorted(out.get("choices") or [], key=lambda c: c["index"])
        if len(choices) != params["n"]:
            raise ServerError(f"asked for {params['n']} completions, got {len(choices)}")
        return [self._generated(c) for c in choices]

    def _generated(self, choice: dict[str, Any]) -> Sampled:
        """A choice of /inference/v1/generate: its token ids, each one's log-prob (`logprobs.content`)."""
        ids = [int(t) for t in choice.get("token_ids") or []]
        content = (choice.get("logprobs") or {}).get("content") or []
        if [int(c["token_id"]) for c in content] != ids or not ids:
            raise ServerError(f"{len(ids)} token ids but log-probs of {len(content)} tokens, or of others")
        stopped = choice.get("finish_reason") == "stop" and ids[-1] in self.eos_ids
        return Sampled(ids=ids, logprobs=[float(c["logprob"]) for c in content], finish="stop" if stopped else "length")

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


def _data_url(img: bytes) -> str:
    """An image file's bytes (PNG or JPEG: common/images.py) as a data URL the server reads."""
    kind = "jpeg" if img.startswith(b"\xff\xd8\xff") else "png"
    return f"data:image/{kind};base64,{base64.b64encode(img).decode()}"


def _token_ids(choice: dict[str, Any]) -> list[int]:
    """The completion's token ids from `return_tokens_as_token_ids`' "token_id:N" tokens."""
    tokens = choice["logprobs"]["tokens"]
    if not all(isinstance(t, str) and t.startswith("token_id:") for t in tokens):
        raise ServerError(f"tokens are not token ids (is return_tokens_as_token_ids supported?): {tokens[:3]}")
    return [int(t.removeprefix("token_id:")) for t in tokens]
