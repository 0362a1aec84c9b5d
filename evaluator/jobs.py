"""Evaluation jobs: score a published checkpoint on held-out problems; results to the metrics stream.

The evaluator is an RQ SimpleWorker (no fork per job), so the engine loaded by the first job
stays loaded: later jobs only swap in the new checkpoint's weights.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import msgpack
from rq import get_current_job

from common.checkpoints import verify_dir
from common.keys import METRICS_MAXLEN, PAYLOAD, Keys
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
    """Greedy pass@1 (and sampled pass@k if asked) of a checkpoint on held-out arithmetic."""
    t0 = time.monotonic()
    if not Path(spec["path"]).is_dir():
        # The trainer keeps only its newest checkpoints; one pruned before its turn came is reported
        # as skipped (retrying cannot bring it back). Raise keep_checkpoints to evaluate them all.
        return record({"kind": "eval", "step": spec["step"], "version": spec["version"],
                       "eval/skipped": "checkpoint pruned before its evaluation ran"}, spec)
    verify_dir(spec["path"], spec["checksums"])  # a bad checkpoint fails the job (and is retried)
    engine = engine_for(spec["path"], version=spec["version"], dtype=spec["dtype"])
    problems = [arithmetic.problem(seed=spec["seed"], index=i, max_operand=spec["max_operand"], ops=spec["ops"])
                for i in range(spec["prompts"])]
    tasks = [PromptTask(id=f"eval:{i}", messages=[{"role": "user", "content": p.question}], text=None,
                        meta={"answer": p.answer}, n=1, admitted_at=spec["version"]) for i, p in enumerate(problems)]
    prompts = [engine.prompt_ids(t) for t in tasks]

    def correct(ids: list[int], task: PromptTask) -> bool:
        text = engine.decode(ids)
        q = task.messages[0]["content"]
        return arithmetic.reward(prompt=q, completion=text, completion_ids=ids, meta=task.meta)["correct"] == 1.0

    greedy = engine.greedy(prompts, max_new_tokens=spec["max_new_tokens"])
    result = {"kind": "eval", "step": spec["step"], "version": spec["version"], "eval/prompts": len(tasks),
              "eval/pass@1": sum(correct(ids, t) for ids, t in zip(greedy, tasks, strict=True)) / len(tasks)}
    if spec["pass_k"]:
        k = spec["pass_k"]
        groups = engine.sample(prompts, SamplingSettings(n=k, max_new_tokens=spec["max_new_tokens"],
                                                         temperature=spec["temperature"]))
        hits = [any(correct(s.ids, t) for s in group) for group, t in zip(groups, tasks, strict=True)]
        result[f"eval/pass@{k}"] = sum(hits) / len(tasks)
    result["eval/seconds"] = time.monotonic() - t0
    return record(result, spec)


def record(result: dict, spec: dict) -> dict:
    """The result to the metrics stream, the run's evals hash and (if given) the evals JSONL file."""
    r = get_current_job().connection
    keys = Keys(spec["run"])
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.metrics, {PAYLOAD: msgpack.packb(result, use_bin_type=True)},
                  maxlen=METRICS_MAXLEN, approximate=True)
        pipe.hset(keys.evals, str(spec["version"]), json.dumps(result))
        pipe.execute()
    if spec.get("evals_path"):
        path = Path(spec["evals_path"])
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(result) + "\n")
    print(f"evaluator: version {spec['version']}: " + (", ".join(
        f"{k[5:]} {v:.3f}" for k, v in result.items() if k.startswith("eval/pass")) or result.get("eval/skipped", "")),
        flush=True)
    return result
