"""LLM judges served over an OpenAI-compatible URL: a server's chat model asked about each
completion, its answer parsed into the reward, as the local judge's is (common/judges.py).

A source names one among its `reward_funcs` as "judge:URL?model=M&parser=P[&template=T]
[&max_new_tokens=N][&name=C][&timeout_s=S][&retries=R][&api_key_env=V]": URL the API's base, as an
OpenAI client's `base_url` (http:// or https://, e.g. http://host:8000/v1; the entry's first "?"
starts the judge's options, so the URL has no query of its own); M the model the server serves
(sent as the request's "model"); P, T, N and C as for a local judge (`judges.PARSERS`,
`judges.TEMPLATES`; C defaults to M's last "/" part); S the seconds one request may wait for its
answer (default 30); R how many times a failed request is tried again (default 2, at most
`MAX_RETRIES`), after 0.5 s, then 1 s, 2 s, ...; V an environment variable holding the server's
API key (sent as "Authorization: Bearer ..."; the key itself never goes into the config).

One POST URL/chat/completions per completion, the group's all sent at once, each from a thread of its
own; the server batches them (vLLM's continuous batching does). Chat rather than one /v1/completions
request with the group's prompts as a list: the judge is a chat model (the local judge puts its
question under the model's chat template too), and only the server knows that template, as here
there is no tokenizer; hosted OpenAI-compatible APIs serve chat models on /chat/completions only;
and each completion's request fails, times out and is retried alone, so one bad answer costs
that completion, not the group. The request is greedy (temperature 0) with max_tokens N.

Retried: no connection, no answer within S, HTTP 429 and 5xx. Not retried (trying again would get
the same): any other HTTP status (a model the server does not serve, a bad key) and a body that is
no chat completion. A request that fails for good, or an answer the parser cannot read, is that
completion's reward error naming the judge and why (never a 0); the other completions keep their
values. A request's worst case is (R + 1) x S plus the waits; the group's budget in the generator
(`reward_timeout_s` x (completions + 1), generators/scoring.py) still bounds the whole call, and a
group past it gets its timeout error on every completion.

At start-up the entry is checked without the network: the URL's form, its options (the model
required), the template and the key's variable set; else a ValueError naming the entry.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from common import judges, loaded_models

SCHEMES = ("http://", "https://")
KEYS = ("model", "parser", "template", "max_new_tokens", "name", "timeout_s", "retries", "api_key_env")
ROUTE = "/chat/completions"  # below the URL, as the OpenAI client posts a chat completion
MAX_RETRIES = 10
BACKOFF_S = 0.5  # wait before the first retry, doubled before each next one
RETRIED = frozenset({429, 500, 502, 503, 504})  # HTTP statuses worth trying again
EXCERPT = 200  # characters of a server's error body kept in the reward error


def is_served(name: str) -> bool:
    """Whether a reward entry names a judge served at a URL ("judge:http://...")."""
    return name.startswith(tuple(judges.PREFIX + s for s in SCHEMES))


def _number(name: str, opts: dict[str, str], key: str, default: str, kind: type, low: float, high: float) -> Any:
    text = opts.get(key, default)
    try:
        value = kind(text)
    except ValueError:
        value = None
    if value is None or not low <= value <= high:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"reward {name!r}: {key} must be {what} from {low:g} to {high:g}, got {text!r}")
    return value


def check(name: str) -> dict[str, Any]:
    """{url, model, parser, template, max_new_tokens, name, timeout_s, retries, api_key_env} of a
    "judge:URL?..." entry, checked; ValueError naming the entry when any is wrong."""
    url, _, query = name.removeprefix(judges.PREFIX).partition("?")
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.fragment or "#" in query:
        raise ValueError(f"reward {name!r}: {url!r} is no http(s)://host[:port]/path URL "
                         f"(judge:http://host:8000/v1?model=NAME&parser=yesno)")
    try:
        _ = parts.port  # raises on a port that is no number
    except ValueError as err:
        raise ValueError(f"reward {name!r}: {url!r}: {err}") from None
    opts = loaded_models.entry_options(name, query, KEYS, "a judge at a URL")
    model = opts.get("model", "")
    if not model:
        raise ValueError(f"reward {name!r}: no model (the name the server serves it under: "
                         f"judge:{url}?model=NAME&parser=yesno)")
    parser = opts.get("parser", "")
    if parser not in judges.PARSERS:
        raise ValueError(f"reward {name!r}: parser {parser!r} is not one of {', '.join(judges.PARSERS)} "
                         f"(judge:{url}?model={model}&parser=yesno)")
    component = opts.get("name") or model.rstrip("/").rpartition("/")[2]
    if not re.fullmatch(r"[A-Za-z0-9_.\-]+", component):
        raise ValueError(f"reward {name!r}: name {component!r} may hold only letters, digits, '_', '.', '-' "
                         f"(give one: &name=...)")
    key_env = opts.get("api_key_env")
    if key_env is not None and not os.environ.get(key_env):
        raise ValueError(f"reward {name!r}: api_key_env names {key_env!r}, which is not set in this environment")
    return {"url": url.rstrip("/"), "model": model, "parser": parser,
            "template": judges.template(name, opts.get("template", parser)),
            "max_new_tokens": _number(name, opts, "max_new_tokens", "64", int, 1, 1 << 20), "name": component,
            "timeout_s": _number(name, opts, "timeout_s", "30", float, 0.001, 3600.0),
            "retries": _number(name, opts, "retries", "2", int, 0, MAX_RETRIES), "api_key_env": key_env}


class _Failed(Exception):
    """A request that got no chat completion; its text says why."""


class ServedJudge:
    """A "judge:URL?..." entry as a TRL reward function: a float per completion, or the completion's
    error (a string) where its request failed or its answer does not parse. Its state: the checked
    entry (each call opens its own connections)."""

    errors_per_completion = True  # common.rewards: a string among its values is that completion's error

    def __init__(self, name: str) -> None:
        """name: the entry (checked: `check`)."""
        spec = check(name)
        self.entry = name
        self.url: str = spec["url"]
        self.model: str = spec["model"]
        self.parser: str = spec["parser"]
        self.template: str = spec["template"]
        self.max_new_tokens: int = spec["max_new_tokens"]
        self.__name__: str = spec["name"]
        self.timeout_s: float = spec["timeout_s"]
        self.retries: int = spec["retries"]
        self.api_key_env: str | None = spec["api_key_env"]

    def __repr__(self) -> str:
        return f"ServedJudge({self.entry!r})"

    def load(self) -> None:
        """Nothing to load: the server holds the model (the generator calls it on every judge)."""

    def _request(self, question: str) -> urllib.request.Request:
        body = {"model": self.model, "messages": [{"role": "user", "content": question}],
                "max_tokens": self.max_new_tokens, "temperature": 0}
        headers = {"Content-Type": "application/json"}
        if self.api_key_env is not None:
            headers["Authorization"] = f"Bearer {os.environ.get(self.api_key_env, '')}"
        return urllib.request.Request(self.url + ROUTE, data=json.dumps(body).encode(), headers=headers,
                                      method="POST")

    def ask(self, question: str) -> str:
        """The server's answer to one question, trying again (`retries` times) what may pass;
        `_Failed` saying why there is none."""
        why = ""
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(BACKOFF_S * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(self._request(question), timeout=self.timeout_s) as response:
                    body = response.read()
            except urllib.error.HTTPError as err:
                why = f"HTTP {err.code} {err.reason}: {_excerpt(err)!r}"
                if err.code not in RETRIED:
                    raise _Failed(why) from None
                continue
            except (TimeoutError, urllib.error.URLError, http.client.HTTPException, OSError) as err:
                reason = getattr(err, "reason", err)
                why = (f"no answer within {self.timeout_s:g} s" if isinstance(reason, TimeoutError)
                       else f"{type(reason).__name__}: {reason}")
                continue
            return _content(body)
        raise _Failed(f"{why} ({self.retries + 1} attempts)")

    def answers(self, prompts: list[Any], completions: list[Any]) -> list[str | _Failed]:
        """The server's answer to each completion's question, or why there is none: every request sent
        at once, each from its own thread."""
        questions = [judges.question(self.template, p, c) for p, c in zip(prompts, completions, strict=True)]
        if not questions:
            return []

        def one(question: str) -> str | _Failed:
            try:
                return self.ask(question)
            except _Failed as failed:
                return failed

        with ThreadPoolExecutor(max_workers=len(questions), thread_name_prefix="judge-request") as pool:
            return list(pool.map(one, questions))

    def __call__(self, prompts: list[Any], completions: list[Any]) -> list[float | str]:
        """Each completion's parsed value, or its error naming the judge and why."""
        values: list[float | str] = []
        for answer in self.answers(prompts, completions):
            if isinstance(answer, _Failed):
                values.append(f"judge {self.__name__}: {self.url}{ROUTE}: {answer}")
                continue
            try:
                values.append(judges.parse(self.parser, answer))
            except ValueError as why:
                values.append(f"judge {self.__name__}: parser {self.parser!r}: {why}, in the answer "
                              f"{answer.strip()[:judges.EXCERPT]!r}")
        return values


def _excerpt(err: urllib.error.HTTPError) -> str:
    """The start of an HTTP error's body (the server's reason, as vLLM's {"error": ...})."""
    try:
        return err.read()[:EXCERPT].decode(errors="replace")
    except OSError:  # the server closed the connection mid-body
        return ""


def _content(body: bytes) -> str:
    """The answer in a chat completion's body (its first choice's message); `_Failed` if it has none."""
    try:
        content = json.loads(body)["choices"][0]["message"]["content"]
    except (ValueError, KeyError, IndexError, TypeError):
        raise _Failed(f"the answer is no chat completion: {body[:EXCERPT].decode(errors='replace')!r}") from None
    if content is not None and not isinstance(content, str):
        raise _Failed(f"the answer's content is no text: {str(content)[:EXCERPT]!r}")
    return content or ""
