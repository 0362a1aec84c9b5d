"""The evaluator's RQ worker: it runs `evaluator.jobs.evaluate_checkpoint` and nothing else.

An RQ job names the function it calls (and any success, failure or stopped callback) in the job
itself, and a stock worker imports and calls whatever is named: whoever may write `rq:*` keys could
queue `os.system`. Here a job that names any other function, a method of some object, or a callback
is failed before anything it names is imported: it goes to the queue's failed registry with the
reason, is not retried, and the worker goes on with the next job.
"""

from __future__ import annotations

from rq import SimpleWorker
from rq.job import Job

from common.evals import JOB_FUNCTION


class RefusedJob(Exception):
    """A job that names something other than the evaluation function."""


def refusal(job: Job) -> str | None:
    """Why `job` may not run here, or None if it is an evaluation job."""
    try:
        func_name, instance = job.func_name, job.instance
    except Exception as err:  # noqa: BLE001 - data that does not even decode is refused too
        return f"job {job.id} refused: its data does not decode ({type(err).__name__}: {err})"
    if func_name != JOB_FUNCTION or instance is not None:
        named = func_name if instance is None else f"a method {func_name!r} of {type(instance).__name__}"
        return f"job {job.id} refused: it names {named!r}; this evaluator runs only {JOB_FUNCTION}"
    callbacks = [name for name in (job._success_callback_name, job._failure_callback_name,
                                   job._stopped_callback_name) if name]
    if callbacks:
        return f"job {job.id} refused: it names callbacks {callbacks}; evaluation jobs have none"
    return None


class EvalJob(Job):
    """A job that resolves its function only if it is the evaluation function, and never imports
    a callback (evaluation jobs have none; one that names any is refused by `func`)."""

    @property
    def func(self):
        reason = refusal(self)
        if reason is not None:
            self.retries_left = 0  # asking again gets the same answer
            print(f"evaluator: {reason}", flush=True)
            raise RefusedJob(reason)
        return super().func

    @property
    def success_callback(self):
        return None

    @property
    def failure_callback(self):
        return None

    @property
    def stopped_callback(self):
        return None


class EvalWorker(SimpleWorker):
    """A SimpleWorker (no fork per job: the loaded engine stays loaded) that runs only evaluation
    jobs."""

    job_class = EvalJob
