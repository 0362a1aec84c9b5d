"""On-policy distillation's teacher: the log-prob a teacher model gives each token the student sampled.

`[teacher] path` names a local causal LM (as `save_pretrained` writes it; there is no hub download)
that shares the student's tokenizer: the same token ids mean the same text, which is checked only
as far as its vocabulary holding every id it is asked about. For each sampled completion the
teacher reads the group's prompt ids and the completion's ids in one forward pass (the whole group
right-padded into one batch), and each completion token's log-prob is `log_softmax(logits /
temperature)` at the position before it: the same prefix the student sampled it from, at the
sampler's temperature (`rollout.temperature`, as the behaviour log-probs). The sampler's top-k /
top-p truncation is not applied on the teacher's side (a token the teacher's truncation cut would
have log-prob -inf). Tokens whose loss_mask is 0 (an environment's tokens in a multi-turn episode)
are not the student's: they get 0 and the trainer leaves them out.

Where it runs, and why (the design's choice): inside each generator, after sampling and scoring,
as the reward models and LLM judges do (common/reward_models.py, common/judges.py,
generators/scoring.py): one copy per generator on its device (its GPU, else the CPU), in the
model's dtype, loaded on the first group that needs it, run on one thread of its own with a budget
of `timeout_s` per group (the load not counted). A process of its own between the samples stream
and the trainer would need a second consumer group, its own re-delivery and exactly-once logic, and
a second write of every group; in the generator the group is written once, by the MULTI/EXEC that
acknowledges its prompt, as before. Its cost is the teacher's memory on each generator's device
(`engine = "vllm"` runs it on an in-process vLLM engine instead, common/teacher_vllm.py; a teacher
too large for the generator's device is a later OpenAI-compatible server engine: one more module).

A teacher that fails (cannot be loaded, raises, overruns its budget) never loses the prompt: the
group is written without teacher log-probs, its `teacher_error` saying why, counted by the
generator, and the trainer treats it as reward-only (k = 0 on its tokens). Leaving the prompt for a
retry would loop on a teacher that is broken for good and hold a prompt the producer has admitted;
a reward-only group is still a valid on-policy group (in distillation alone its advantage is 0: it
teaches nothing, but it is delivered exactly once and the run goes on). A call that overran cannot
be killed (it is the generator's own thread): the next group's call waits for it.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.loaded_models import remembered

DTYPES = ("float32", "bfloat16", "float16")
# What runs the teacher: "hf" (transformers, here), "vllm" (common/teacher_vllm.py: prompt log-probs
# of an in-process vLLM engine) or "openai" (common/teacher_openai.py: a vLLM server's prompt
# log-probs at `url`). Another engine is one more module like those two.
ENGINES = ("hf", "vllm", "openai")
AT_TEMPERATURE_1 = ("vllm", "openai")  # engines whose prompt log-probs skip the sampler's temperature


def no_reward(*, prompt: str, completion: str, completion_ids: list[int], meta: dict[str, Any]) -> dict[str, float]:
    """The reward of a source with `reward = "none"` (distillation alone): no component, so 0 for
    every completion."""
    return {}


def check(path: str) -> Path:
    """`[teacher] path` resolved; ValueError naming it when it is no causal-LM directory (read from
    its config.json alone: no torch, no weights)."""
    where = Path(path).expanduser()
    if not path or not where.is_dir():
        raise ValueError(f"teacher.path {path!r}: no such directory (a teacher is a local causal-LM directory "
                         f"with config.json, as save_pretrained writes it)")
    try:
        config = json.loads((where / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"teacher.path {path!r}: no readable config.json, so it is no model directory "
                         f"({type(err).__name__}: {err})") from None
    architectures = [str(a) for a in config.get("architectures") or []]
    if not any(a.endswith(("ForCausalLM", "LMHeadModel")) for a in architectures):
        raise ValueError(f"teacher.path {path!r} holds {', '.join(architectures) or 'no architecture'}, not a "
                         f"causal LM (AutoModelForCausalLM)")
    return where.resolve()


def fingerprint(path: Path) -> str:
    """The teacher's version: 16 hex digits of XXH3 over its safetensors files' checksums (each
    file read once, at start-up), the same for the same weights wherever they lie."""
    from common.checkpoints import file_checksum, hasher

    h = hasher()
    for file in sorted(path.glob("*.safetensors")):
        h.update(f"{file.name}={file_checksum(file)}\n".encode())
    return h.hexdigest()[:16]


def check_vocabulary(path: Path, student: Path) -> None:
    """ValueError naming the teacher at `path` when it cannot score the token ids of the student at
    `student`: a token of the student's tokenizer with another id in the teacher's (where the
    teacher's directory has a tokenizer), or more student tokens than the teacher has embeddings.
    A teacher may know tokens the student does not (a bigger model of the same family)."""
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(student)
    try:
        theirs = AutoTokenizer.from_pretrained(path).get_vocab()
    except (OSError, ValueError, TypeError):  # no tokenizer files: the embeddings alone are checked
        theirs = None
    if theirs is not None:
        moved = sorted((t, i) for t, i in ours.get_vocab().items() if theirs.get(t) != i)
        if moved:
            token, i = moved[0]
            there = f"id {theirs[token]}" if token in theirs else "no id"
            raise ValueError(f"teacher.path {str(path)!r}: its tokenizer is not the student's ({student}): "
                             f"{len(moved)} of the student's tokens have other ids, e.g. {token!r} is id {i} "
                             f"in the student's and has {there} in the teacher's; a teacher scores the "
                             "student's token ids, so it must share the student's tokenizer")
    config = json.loads((path / "config.json").read_text())
    vocab = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    if vocab is not None and int(vocab) < len(ours):
        raise ValueError(f"teacher.path {str(path)!r}: its model has {vocab} token embeddings, fewer than the "
                         f"{len(ours)} tokens of the student's tokenizer ({student}); a teacher scores the "
                         "student's token ids, so it must share the student's tokenizer")


@dataclass(frozen=True, slots=True)
class Scores:
    """The teacher's answer for one group: a float32 array per completion (one log-prob per id, 0
    where its loss_mask is 0), or the error that stood in for them all."""

    logprobs: list[np.ndarray] | None
    error: str | None = None


class Teacher:
    """A teacher model run on one thread of its own, each group within `timeout_s`. Its state: where
    the model is, how to run it, and that thread (the loaded model is the process's, shared)."""

    def __init__(self, path: str, *, name: str, timeout_s: float, temperature: float = 1.0,
                 dtype: str = "float32", device: str | None = None, engine: str = "hf", url: str = "",
                 retries: int = 2) -> None:
        """path: the teacher's directory (checked: `check`). name: its label in groups and logs.
        timeout_s: one group's budget. temperature: the sampler's. dtype: the generator's model dtype.
        device: None = the process's visible GPU, else the CPU (hf; vLLM takes the GPU when there is
        one). engine: one of ENGINES; ValueError naming teacher.engine for another, or for "vllm" or
        "openai" at a temperature other than 1 (vLLM's prompt log-probs are at temperature 1:
        common/teacher_vllm.py). url: the server of engine "openai", whose `path` is its model's
        name there (not checked here: nothing connects before the first group); `retries`: how many
        times its failed request is tried again within the group's `timeout_s`."""
        assert dtype in DTYPES, f"dtype must be one of {DTYPES}, got {dtype!r}"
        assert timeout_s > 0 and temperature > 0, f"timeout_s {timeout_s} and temperature {temperature} must be > 0"
        if engine not in ENGINES:
            raise ValueError(f"teacher.engine {engine!r} is no teacher engine: one of {', '.join(ENGINES)}")
        if engine in AT_TEMPERATURE_1 and temperature != 1.0:
            raise ValueError(f"teacher.engine {engine!r} scores at temperature 1 only (vLLM's prompt log-probs "
                             f"skip temperature), and rollout.temperature is {temperature:g}: use teacher.engine 'hf'")
        self.engine = engine
        self.url = ""
        if engine == "openai":
            from common.teacher_openai import check_url

            if not url:
                raise ValueError("teacher.url is needed with teacher.engine 'openai': the http(s)://host:port of an "
                                 "OpenAI-compatible server that returns prompt log-probs (vllm serve)")
            if not path:
                raise ValueError("teacher.path names the teacher's model on the server (teacher.engine 'openai')")
            self.url = check_url(url)
            self.path = Path(path)
            self.version = ""  # the server's weights: not ours to read
        else:
            self.path = check(path)
            self.version = fingerprint(self.path)
        self.name = name
        self.timeout_s = timeout_s
        self.retries = retries
        self.temperature = temperature
        self.dtype = dtype
        self.device = device
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="teacher")

    def __repr__(self) -> str:
        return f"Teacher({str(self.path)!r})"

    def load(self) -> Any:
        """The model, loaded on the first call in this process; RuntimeError naming the teacher when
        it cannot be (every later call says the same, without trying again)."""
        import torch

        if self.engine == "openai":  # nothing to load: each group's request is made afresh
            from common.teacher_openai import Server

            return Server(self.url, str(self.path), self.timeout_s, self.retries)
        device = self.device or ("cuda" if torch.cuda.is_available() else "cpu")
        if self.engine == "vllm":
            from common import teacher_vllm

            loaded = remembered((self.path, "teacher:vllm", device, self.dtype),
                                lambda: teacher_vllm.load(self.path, dtype=self.dtype))
        else:
            loaded = remembered((self.path, "teacher:hf", device, self.dtype),
                                lambda: _load(self.path, device=device, dtype=self.dtype))
        if isinstance(loaded, str):
            raise RuntimeError(f"teacher {self.name!r} ({self.path}) cannot be loaded: {loaded}")
        return loaded

    def logprobs(self, prompt_ids: Sequence[int], completions: list[tuple[Sequence[int], Sequence[bool] | None]],
                 ) -> list[np.ndarray]:
        """The teacher's log-prob of each completion id after the prompt and the completion's earlier
        ids, at the sampler's temperature; 0 where the completion's mask (None: all) is 0. The group
        in one batch (hf: right-padded; vllm: one generate call), in this thread (no budget)."""
        model = self.load()
        prompt = [int(x) for x in prompt_ids]
        ids = [[int(x) for x in cids] for cids, _ in completions]
        if self.engine == "openai":  # the server checks its vocabulary (an id outside it: HTTP 400)
            from common import teacher_openai

            raw = teacher_openai.token_logprobs(model, prompt, ids)
            return _masked(raw, completions)
        if self.engine == "vllm":
            from common import teacher_vllm

            vocab = teacher_vllm.vocab_size(model)
        else:
            vocab = int(model.get_output_embeddings().weight.shape[0])
        rows = [prompt + row for row in ids]
        top = max(max(row) for row in rows)
        if top >= vocab or min(min(row) for row in rows) < 0:
            raise ValueError(f"token id {top} is outside the teacher's vocabulary of {vocab}: it must share the "
                             f"student's tokenizer")
        if self.engine == "vllm":
            raw = teacher_vllm.token_logprobs(model, prompt, ids)
        else:
            raw = _hf_logprobs(model, rows, len(prompt), [len(row) for row in ids], self.temperature)
        return _masked(raw, completions)

    def score(self, prompt_ids: Sequence[int], completions: list[tuple[Sequence[int], Sequence[bool] | None]],
              ) -> Scores:
        """`logprobs` on the teacher's thread within `timeout_s` (its first load not counted); a load
        failure, an exception or an overrun is the group's error, never raised. Thread-safe."""
        if not completions:
            return Scores([])
        try:
            self.load()
        except RuntimeError as err:
            return Scores(None, str(err))
        future = self._thread.submit(self.logprobs, prompt_ids, completions)
        try:
            return Scores(future.result(timeout=self.timeout_s))
        except FutureTimeout:
            future.cancel()  # still queued behind an overrunning call: never run it
            return Scores(None, f"teacher {self.name!r}: timeout after {self.timeout_s:g} s")
        except Exception as err:  # noqa: BLE001 - a teacher's failure is the group's recorded error
            return Scores(None, f"teacher {self.name!r}: {type(err).__name__}: {err}"[:500])

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)


def _masked(raw: list[np.ndarray], completions: list[tuple[Sequence[int], Sequence[bool] | None]],
            ) -> list[np.ndarray]:
    """Each completion's log-probs with 0 where its mask (None: all) is 0, none above 0."""
    out = []
    for values, (_, mask) in zip(raw, completions, strict=True):
        if mask is not None:
            values = np.where(np.asarray(mask, dtype=bool), values, np.float32(0.0)).astype(np.float32)
        out.append(np.minimum(values, np.float32(0.0)))
    return out


def _hf_logprobs(model: Any, rows: list[list[int]], p: int, lengths: list[int], temperature: float,
                 ) -> list[np.ndarray]:
    """Each row's log-probs of its last lengths[i] ids (those after the p prompt ids) under the HF
    model at `temperature`: the rows right-padded into one forward pass."""
    import torch

    width = max(len(row) for row in rows)
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)] = torch.tensor(row)
        attention[i, :len(row)] = 1
    with torch.inference_mode():
        logits = model(input_ids=ids.to(model.device), attention_mask=attention.to(model.device)).logits
    out = []
    for i, n in enumerate(lengths):
        # completion token j is predicted at position p - 1 + j
        scaled = logits[i, p - 1:p - 1 + n].float() / temperature  # (n, V)
        lp = torch.log_softmax(scaled, dim=-1).gather(-1, ids[i, p:p + n].to(scaled.device).unsqueeze(-1))
        out.append(lp.squeeze(-1).cpu().numpy().astype(np.float32))
    return out


def _load(path: Path, *, device: str, dtype: str) -> Any:
    """The model, in eval mode on `device`; or why it cannot be loaded."""
    import torch
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype))
        return model.eval().to(device)
    except Exception as err:  # a broken checkpoint, a device out of memory: the group's recorded error
        return f"{type(err).__name__}: {err}"[:500]
