"""The evaluator's RQ worker: it runs `evaluator.jobs.evaluate_checkpoint` and nothing else.

An RQ job names the function it calls (and any success, failure or stopped callback) in the job
itself, and a stock worker imports and calls whatever is named: whoever may write `rq:*` keys could
queue `os.system`. Here a job that names any other function, a method of some object, or a callback
is failed before anything it names is imported: it goes to the queue's failed registry with the
reason, is not retried, and the worker goes on with the next job.

A first SIGTERM or SIGINT stops the worker between two problems of the job in hand (RQ's own
warm shutdown would finish the job first, a minute on a CPU, past the launcher's grace, which
then SIGKILLs it mid-job); that job goes back to the front of the queue, its retries untouched,
for the evaluator's next start. A second signal is RQ's cold shutdown: it exits at once.
"""

from __future__ import annotations

import signal

from rq import SimpleWorker
from rq.job import Job

from common.evals import JOB_FUNCTION
from evaluator.jobs import STOP, Interrupted


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
    interrupted = False  # whether the job being failed was stopped between problems

    def request_stop(self, signum, frame):
        STOP.set()  # the job in hand, if any, stops between problems
        print(f"evaluator: {signal.Signals(signum).name}: stopping (between problems, if evaluating; "
              "again to exit at once)", flush=True)
        super().request_stop(signum, frame)

    def register_death(self):
        """RQ's record of this worker's end (out of the workers' registry), tried again once on a
        fresh connection where Redis's reply went wrong: a stop's signal arriving while a reply was
        being read once left a transaction's answer out of step ("Wrong number of response items")
        and the evaluator exited 1 after a clean stop. The record is bookkeeping (RQ drops a worker
        whose key has expired from its registry): if the retry fails too, it is said, not raised."""
        from redis.exceptions import ConnectionError, ResponseError

        for attempt in (1, 2):
            try:
                return super().register_death()
            except (ResponseError, ConnectionError) as e:
                self.connection.connection_pool.disconnect()  # every pooled connection afresh
                if attempt == 2:
                    print(f"evaluator: could not record this worker's end in Redis ({e}); RQ drops it from "
                          "its registry when its key expires", flush=True)

    def handle_exception(self, job: Job, *exc_info):
        self.interrupted = isinstance(exc_info[1], Interrupted)
        if not self.interrupted:  # a stop is no error: no traceback for it
            super().handle_exception(job, *exc_info)

    def handle_job_failure(self, job: Job, queue, started_job_registry=None, exc_string="", execution=None):
        if not self.interrupted:
            return super().handle_job_failure(job, queue, started_job_registry=started_job_registry,
                                              exc_string=exc_string, execution=execution)
        with self.connection.pipeline() as pipe:  # back to the front of the queue, as if never started
            pipe.multi()  # one transaction: out of the started registry and into the queue
            self.cleanup_execution(job, pipeline=pipe, execution=execution)
            queue.enqueue_job(job, pipeline=pipe, at_front=True)
            pipe.execute()
        print(f"evaluator: job {job.id} stopped between problems; back on the queue for the next start", flush=True)
