"""The `eval` RQ queue: the trainer enqueues a checkpoint evaluation; the evaluator runs it.

RQ jobs travel as JSON (rq's JSONSerializer): nothing on the wire is pickle.
"""

from __future__ import annotations

import redis
from rq import Queue, Retry
from rq.job import Job
from rq.serializers import JSONSerializer

from common.config import Config
from common.keys import Keys
from common.messages import WeightVersion

JOB_FUNCTION = "evaluator.jobs.evaluate_checkpoint"


def eval_queue(r: redis.Redis, keys: Keys) -> Queue:
    return Queue(keys.eval_queue, connection=r, serializer=JSONSerializer)


def enqueue_eval(r: redis.Redis, config: Config, wv: WeightVersion) -> Job:
    """Queue the evaluation of the checkpoint `wv` names on the held-out problems."""
    keys, ev = Keys(config.run), config.eval
    spec = {"run": config.run, "version": wv.version, "step": wv.step, "path": wv.path,
            "checksums": wv.checksums, "prompts": ev.prompts, "seed": ev.seed, "pass_k": ev.pass_k,
            "temperature": config.rollout.temperature, "max_new_tokens": config.rollout.max_new_tokens,
            "max_operand": config.task.max_operand, "ops": list(config.task.ops), "dtype": config.model.dtype,
            "evals_path": str(config.evals_path)}
    return eval_queue(r, keys).enqueue_call(
        JOB_FUNCTION, kwargs={"spec": spec}, timeout=ev.timeout_s, job_id=f"{config.run}-eval-v{wv.version}",
        retry=Retry(max=ev.retries) if ev.retries else None, description=f"evaluate {wv.path}")
