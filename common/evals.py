"""Checkpoint evaluations: the request the trainer queues and the result the evaluator records.

The request travels as an RQ job on the `eval` queue, as JSON (rq's JSONSerializer): nothing on
the wire is pickle. The job names `JOB_FUNCTION`, the one function the evaluator's worker runs.
The result goes to the metrics stream (kind "eval"), the run's `evals` hash (read by `rollouts
status`) and `evals.jsonl` beside the trainer's metrics (read by `rollouts plot`).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

import redis
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from common.keys import Keys
from common.metrics import write_metrics

if TYPE_CHECKING:
    from common.config import Config
    from common.messages import WeightVersion

JOB_FUNCTION = "evaluator.jobs.evaluate_checkpoint"  # what an evaluation job names; the evaluator runs nothing else


class EvalRequestError(ValueError):
    """A job's spec is not an evaluation request (a field missing, unknown or of the wrong type)."""


@dataclass(frozen=True, slots=True)
class EvalRequest:
    """What to evaluate and how: the job's `spec`, written by the trainer, read by the evaluator."""

    run: str  # the run whose keys the result goes to
    version: int  # the published weight version to evaluate
    step: int  # the trainer step that wrote it
    path: str  # its checkpoint directory
    checksums: dict[str, str]  # file name -> checksum (common/checkpoints.py), verified before loading
    prompts: int  # problems to score per source
    seed: int  # synthetic problems are drawn from this seed (eval.seed, apart from the training problems)
    pass_k: int  # 0: greedy pass@1 only; k > 0: also pass@k of k sampled completions
    temperature: float  # sampling temperature of pass@k
    max_new_tokens: int  # longest completion
    sources: list[dict]  # the sources to evaluate on, as SourceConfig dicts (problems and rewards)
    holdout: float  # > 0: only their held-out split (tasks.rows.held_out); 0: all their problems
    pass_reward: float  # a completion passes when its reward is at least this
    dtype: str  # the engine's dtype (model.dtype)
    evals_path: str  # JSONL file the result is appended to; "" for none
    engine: str  # the engine to sample with ("auto", "hf", "vllm": eval.engine, or generator.engine)
    engine_settings: dict  # the [generator] table the engine is opened with (memory, parallelism, threads)


_KINDS = {"int": int, "str": str, "float": (int, float), "list[dict]": list, "dict[str, str]": dict,
          "dict": dict}  # JSON's types
assert {f.type for f in fields(EvalRequest)} <= set(_KINDS), "an EvalRequest field type has no JSON check"


def eval_queue(r: redis.Redis, keys: Keys) -> Queue:
    return Queue(keys.eval_queue, connection=r, serializer=JSONSerializer)


def unfinished_evals(r: redis.Redis, keys: Keys) -> list[str]:
    """Ids of the run's evaluation jobs not done yet: queued, being handed to a worker (RQ's
    intermediate queue), running, or waiting for a retry. Read only (no registry clean-up)."""
    q = eval_queue(r, keys)
    return list(dict.fromkeys([*q.get_job_ids(), *q.intermediate_queue.get_job_ids(),
                               *q.started_job_registry.get_job_ids(cleanup=False),
                               *q.scheduled_job_registry.get_job_ids(cleanup=False)]))


def failed_evals(r: redis.Redis, keys: Keys) -> list[str]:
    """Ids of the run's evaluation jobs in RQ's failed registry (retries spent, or refused)."""
    return eval_queue(r, keys).failed_job_registry.get_job_ids(cleanup=False)


def enqueue_eval(r: redis.Redis, config: Config, wv: WeightVersion) -> Job:
    """Queue the evaluation of the checkpoint `wv` names on the held-out problems."""
    keys, ev = Keys(config.run), config.eval
    request = eval_request(config, wv)
    return eval_queue(r, keys).enqueue_call(
        JOB_FUNCTION, kwargs={"spec": asdict(request)}, timeout=ev.timeout_s, job_id=f"{config.run}-eval-v{wv.version}",
        retry=Retry(max=ev.retries) if ev.retries else None, description=f"evaluate {wv.path}")


def eval_request(config: Config, wv: WeightVersion) -> EvalRequest:
    """The evaluation of the checkpoint `wv` names, as the run's config asks for it."""
    ev = config.eval
    return EvalRequest(
        run=config.run, version=wv.version, step=wv.step, path=wv.path, checksums=wv.checksums,
        prompts=ev.prompts, seed=ev.seed, pass_k=ev.pass_k, temperature=config.rollout.temperature,
        max_new_tokens=config.rollout.max_new_tokens, sources=[s.model_dump() for s in config.eval_sources],
        holdout=0.0 if config.eval.sources else config.eval.holdout, pass_reward=config.eval.pass_reward,
        dtype=config.model.dtype, evals_path=str(config.evals_path), engine=eval_engine(config),
        engine_settings=config.generator.model_dump(mode="json"))


def eval_engine(config: Config) -> str:
    """The engine the evaluator samples with (eval.engine; "generator": the generators' own, HF for a
    server engine, which samples on a server the evaluator does not lease)."""
    if config.eval.engine != "generator":
        return config.eval.engine
    from common.config import ENGINES

    kind = ENGINES.get(config.generator.engine)  # None: "auto"
    return "hf" if kind is not None and kind.server else config.generator.engine


def read_request(spec: dict[str, Any]) -> EvalRequest:
    """The request a job's `spec` holds; EvalRequestError naming what is wrong otherwise."""
    if not isinstance(spec, dict):
        raise EvalRequestError(f"an evaluation spec is a dict, got {type(spec).__name__}")
    names = {f.name for f in fields(EvalRequest)}
    missing, unknown = sorted(names - set(spec)), sorted(set(spec) - names)
    if missing or unknown:
        raise EvalRequestError(f"evaluation spec: missing {missing}, unknown {unknown}")
    request = EvalRequest(**spec)
    for f in fields(EvalRequest):
        kind = _KINDS[f.type]
        value = getattr(request, f.name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise EvalRequestError(f"evaluation spec: {f.name} is {value!r}, not {f.type}")
    return request


# ---------------------------------------------------------------------- the result


@dataclass(frozen=True, slots=True)
class EvalResult:
    """One evaluated (or skipped) checkpoint."""

    step: int  # the trainer step that wrote the checkpoint
    version: int  # its weight version
    prompts: int | None = None  # problems scored; None when skipped
    pass_at: dict[int, float] = field(default_factory=dict)  # k -> pass@k (1: greedy), over every problem
    by_source: dict[str, dict[int, float]] = field(default_factory=dict)  # source -> k -> its pass@k
    seconds: float | None = None  # how long the evaluation took
    skipped: str | None = None  # why the checkpoint was not evaluated (pruned before its turn)

    def entry(self) -> dict[str, Any]:
        """The result as it is written: {"kind": "eval", "step", "version", "eval/prompts",
        "eval/pass@1", ..., "eval/seconds"} or, when skipped, "eval/skipped"."""
        out: dict[str, Any] = {"kind": "eval", "step": self.step, "version": self.version}
        if self.skipped is not None:
            return {**out, "eval/skipped": self.skipped}
        out["eval/prompts"] = self.prompts
        out.update({f"eval/pass@{k}": v for k, v in sorted(self.pass_at.items())})
        for name, pass_at in self.by_source.items():
            out.update({f"eval/{name}/pass@{k}": v for k, v in sorted(pass_at.items())})
        if self.seconds is not None:
            out["eval/seconds"] = self.seconds
        return out

    @classmethod
    def from_entry(cls, entry: dict[str, Any]) -> EvalResult:
        by_source: dict[str, dict[int, float]] = {}
        for key, v in entry.items():
            name, _, k = key.removeprefix("eval/").rpartition("/pass@")
            if key.startswith("eval/") and name and k.isdigit():
                by_source.setdefault(name, {})[int(k)] = v
        return cls(step=entry["step"], version=entry["version"], prompts=entry.get("eval/prompts"),
                   pass_at={int(k.removeprefix("eval/pass@")): v for k, v in entry.items()
                            if k.startswith("eval/pass@")}, by_source=by_source,
                   seconds=entry.get("eval/seconds"), skipped=entry.get("eval/skipped"))

    def summary(self, sep: str = ", ") -> str:
        """"pass@1 0.500, pass@4 0.750", or why it was skipped."""
        if self.skipped is not None:
            return self.skipped
        overall = sep.join(f"pass@{k} {v:.3f}" for k, v in sorted(self.pass_at.items()))
        if len(self.by_source) < 2:
            return overall
        return overall + sep + sep.join(f"{name} pass@{k} {v:.3f}" for name, pass_at in self.by_source.items()
                                        for k, v in sorted(pass_at.items()))


def record_eval(r: redis.Redis, keys: Keys, result: EvalResult, *, evals_path: str = "") -> dict[str, Any]:
    """The result to the metrics stream, the run's evals hash and (if given) the evals JSONL file;
    returns the entry written."""
    entry = result.entry()
    with r.pipeline(transaction=True) as pipe:
        write_metrics(pipe, keys, entry)
        pipe.hset(keys.evals, str(result.version), json.dumps(entry))
        pipe.execute()
    if evals_path:
        path = Path(evals_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")
    return entry


def read_evals(r: redis.Redis, keys: Keys) -> dict[int, EvalResult]:
    """{version: result} of every checkpoint of the run evaluated so far."""
    return {int(v): EvalResult.from_entry(json.loads(e)) for v, e in r.hgetall(keys.evals).items()}


def read_evals_file(path: str | Path) -> list[EvalResult]:
    """The results in an evals JSONL file, oldest step first; [] if there is none yet."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = [EvalResult.from_entry(json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
    return sorted(rows, key=lambda e: e.step)
