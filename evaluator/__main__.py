"""`python -m evaluator [--config FILE ...] [--section.field VALUE ...] [--burst]`: an RQ worker that
evaluates published checkpoints."""

import argparse
import os

from common.config import Config
from common.process import exit_at_once, run_process


def main(config: Config, args: argparse.Namespace) -> None:
    lower_priority(config.eval.nice)  # before any thread or child starts: they inherit it
    from rq.serializers import JSONSerializer
    from transformers.utils import logging as hf_logging

    import evaluator.jobs  # noqa: F401 - imports torch and transformers before the first job

    hf_logging.disable_progress_bar()  # one line per evaluation, not progress bars
    from common.evals import eval_queue
    from common.keys import Keys
    from common.streams import connect
    from evaluator.worker import EvalWorker

    r = connect(config.redis_url, process="evaluator")
    queue = eval_queue(r, Keys(config.run))
    worker = EvalWorker([queue], connection=r, serializer=JSONSerializer)
    print(f"evaluator: waiting for jobs on {queue.name}", flush=True)
    worker.work(burst=args.burst, logging_level="WARNING")
    exit_at_once()  # stopped (or the queue empty, with --burst)


def lower_priority(nice: int) -> None:
    """Run every thread at niceness `nice` at least (one already nicer stays so); threads and
    children started later inherit it. Linux keeps a niceness per thread, hence each of them."""
    for tid in (int(t) for t in os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else [0]:
        try:
            if nice > os.getpriority(os.PRIO_PROCESS, tid):
                os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:  # a thread that ended meanwhile
            pass


if __name__ == "__main__":
    run_process("evaluator", main, prog="python -m evaluator", doc=__doc__, extra=lambda p: p.add_argument(
        "--burst", action="store_true", help="exit once the queue is empty"))
