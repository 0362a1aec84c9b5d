"""Evaluation jobs: score a published checkpoint on held-out problems; results to the metrics stream.

The evaluator is an RQ SimpleWorker (no fork per job), so the engine loaded by the first job
stays loaded: later jobs only swap in the new checkpoint's weights.
"""

from __future__ import annotations

import time
from pathlib import Path

from rq import get_current_job

from common.checkpoints import verify_dir
from common.evals import EvalRequest, EvalResult, read_request, record_eval
from common.keys import Keys
from common.messages import PromptTask
from engines.base import SamplingSettings
from engines.hf_engine import HFEngine
from tasks import arithmetic

# The worker process's one loaded engine. A job function is all RQ can call, so the state an
# RQ worker keeps between jobs lives here; nothing else reads it.
_ENGINE: dict[str, HFEngine] = {}


def engine_for(path: str, *, version: int, dtype: str) -> HFEngine:
    """The loaded engine with the weights of checkpoint `path` in it."""
    engine = _ENGINE.get("engine")
    if engine is None:
        engine = _ENGINE["engine"] = HFEngine(path, dtype=dtype)
        engine.version = version
    elif engine.version != version:
        engine.load_weights(path, version=version)
    return engine


def evaluate_checkpoint(*, spec: dict) -> dict:
    """Greedy pass@1 (and sampled pass@k if asked) of a checkpoint on held-out arithmetic; the
    result (as written to the metrics stream) is also the job's return value."""
    t0 = time.monotonic()
    req = read_request(spec)
    keys = Keys(req.run)
    r = get_current_job().connection
    if not Path(req.path).is_dir():
        # The trainer keeps only its newest checkpoints; one pruned before its turn came is reported
        # as skipped (retrying cannot bring it back). Raise keep_checkpoints to evaluate them all.
        return report(r, keys, EvalResult(step=req.step, version=req.version,
                                          skipped="checkpoint pruned before its evaluation ran"), req)
    verify_dir(req.path, req.checksums)  # a bad checkpoint fails the job (and is retried)
    engine = engine_for(req.path, version=req.version, dtype=req.dtype)
    problems = [arithmetic.problem(seed=req.seed, index=i, max_operand=req.max_operand, ops=req.ops)
                for i in range(req.prompts)]
    tasks = [PromptTask(id=f"eval:{i}", messages=[{"role": "user", "content": p.question}], text=None,
                        meta={"answer": p.answer}, n=1, admitted_at=req.version) for i, p in enumerate(problems)]
    prompts = [engine.prompt_ids(t) for t in tasks]

    def correct(ids: list[int], task: PromptTask) -> bool:
        text = engine.decode(ids)
        q = task.messages[0]["content"]
        return arithmetic.reward(prompt=q, completion=text, completion_ids=ids, meta=task.meta)["correct"] == 1.0

    greedy = engine.greedy(prompts, max_new_tokens=req.max_new_tokens)
    pass_at = {1: sum(correct(ids, t) for ids, t in zip(greedy, tasks, strict=True)) / len(tasks)}
    if req.pass_k:
        groups = engine.sample(prompts, SamplingSettings(n=req.pass_k, max_new_tokens=req.max_new_tokens,
                                                         temperature=req.temperature))
        hits = [any(correct(s.ids, t) for s in group) for group, t in zip(groups, tasks, strict=True)]
        pass_at[req.pass_k] = sum(hits) / len(tasks)
    result = EvalResult(step=req.step, version=req.version, prompts=len(tasks), pass_at=pass_at,
                        seconds=time.monotonic() - t0)
    return report(r, keys, result, req)


def report(r, keys: Keys, result: EvalResult, req: EvalRequest) -> dict:
    """Record the result (metrics stream, evals hash, evals file) and say it on the console."""
    entry = record_eval(r, keys, result, evals_path=req.evals_path)
    print(f"evaluator: version {req.version}: {result.summary()}", flush=True)
    return entry
