"""The teacher on an OpenAI-compatible server (`[teacher] engine = "openai"`, `url`): a vLLM server's
`/v1/completions` reading each completion as a prompt and returning its prompt log-probs.

The group's completions go in one request: `prompt` a list of token-id lists (prompt + completion
ids each), `max_tokens` 1 (the generated token is thrown away), temperature 1 and vLLM's extra
`prompt_logprobs` 0: choice i's `prompt_logprobs` entry k is the log-prob of token k of prompt i
given the tokens before it (entry 0 null; keys are token ids), so completion token j is entry
len(prompt) + j, as with the in-process engine (common/teacher_vllm.py). `path` is the model's
name on the server (`vllm serve PATH` serves it as PATH). As there, prompt log-probs are at
temperature 1 only (they skip the sampler's processors), so a rollout.temperature other than 1 is
refused at start-up. The server must return `prompt_logprobs` (vLLM's OpenAI server does; the
OpenAI API itself has no such field): a choice without them is the group's error, never a guess.

Nothing is loaded and nothing connects at start-up: every group's request is made afresh, so a
server down for a while costs those groups' teacher log-probs (each recorded as its `teacher_error`)
and the run goes on. A request that may pass if tried again (no connection, no answer in time, HTTP
429 and 5xx, as for a served judge: common/served_judges.py) is tried again up to `[teacher] retries`
times, after 0.5 s, 1 s, ..., all within the group's `timeout_s`; any other HTTP status (a model the
server does not serve) is the group's error at once.
"""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from typing import Any

import numpy as np

from common.served_judges import BACKOFF_S, RETRIED


@dataclass(frozen=True, slots=True)
class Server:
    """Where the teacher is served: the server's base URL (up to /v1, excluded) and its model name."""

    url: str
    model: str
    timeout_s: float  # one group's budget, every try of its request included
    retries: int = 2  # tries after the first, of a request that may pass if tried again


def check_url(url: str) -> str:
    """`[teacher] url` without a trailing slash or /v1; ValueError naming it when it is no http(s) URL."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"teacher.url {url!r} is no http(s)://host:port URL of an OpenAI-compatible server")
    base = url.rstrip("/")
    return base[: -len("/v1")] if base.endswith("/v1") else base


def token_logprobs(server: Server, prompt: list[int], completions: list[list[int]]) -> list[np.ndarray]:
    """The served teacher's log-prob (temperature 1) of each completion id after the prompt and the
    completion's earlier ids: one float32 array per completion. Raises (the group's error) on a
    failed request or an answer without them."""
    body = {"model": server.model, "prompt": [prompt + ids for ids in completions], "max_tokens": 1,
            "temperature": 1.0, "prompt_logprobs": 0}
    answer = _answer(server, body)
    choices = sorted(answer.get("choices") or [], key=lambda c: int(c.get("index", 0)))
    if len(choices) != len(completions):
        raise RuntimeError(f"{server.url} returned {len(choices)} choices for {len(completions)} completions")
    p = len(prompt)
    result = []
    for ids, choice in zip(completions, choices, strict=True):
        entries = choice.get("prompt_logprobs")
        if not isinstance(entries, list) or len(entries) != p + len(ids):
            raise RuntimeError(f"{server.url} returned no prompt_logprobs per token (an OpenAI-compatible server "
                               f"that does not, as vLLM's does, cannot be a teacher)")
        # entry p + j: completion token j given the prompt and ids[:j]
        result.append(np.array([float(entries[p + j][str(t)]["logprob"]) for j, t in enumerate(ids)],
                               dtype=np.float32))
    return result


def _answer(server: Server, body: dict[str, Any]) -> dict[str, Any]:
    """The server's JSON answer to `body` on /v1/completions, tried again (`server.retries` times,
    within `server.timeout_s` from now) where it may pass; RuntimeError saying why there is none."""
    where, deadline = server.url + "/v1/completions", time.monotonic() + server.timeout_s
    why = ""
    for attempt in range(server.retries + 1):
        if attempt:
            time.sleep(min(BACKOFF_S * 2 ** (attempt - 1), max(0.0, deadline - time.monotonic())))
        left = deadline - time.monotonic()
        if left <= 0:
            raise RuntimeError(f"{where}: {why} ({attempt} attempts within {server.timeout_s:g} s)")
        request = urllib.request.Request(where, data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"}, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=left) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            why = f"answered {err.code}: {err.read()[:300].decode(errors='replace')}"
            if err.code not in RETRIED:
                raise RuntimeError(f"{where} {why}") from None
        except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as err:
            reason = getattr(err, "reason", err)
            why = (f"no answer within {left:.3g} s" if isinstance(reason, TimeoutError)
                   else f"{type(reason).__name__}: {reason}")
    raise RuntimeError(f"{where}: {why} ({server.retries + 1} attempts)")
