"""`python -m evaluator [--config FILE ...] [--section.field VALUE ...] [--burst]`: an RQ worker that
evaluates published checkpoints."""

import os
import sys

import redis

from common.config import ConfigError, config_from_args
from common.streams import lost_redis, no_permission, stop_while_starting


def main() -> None:
    stop_while_starting("evaluator")
    try:
        config, args = config_from_args("python -m evaluator", __doc__, extra=lambda p: p.add_argument(
            "--burst", action="store_true", help="exit once the queue is empty"))
    except ConfigError as err:
        sys.exit(f"evaluator: {err}")

    from rq.serializers import JSONSerializer
    from transformers.utils import logging as hf_logging

    import evaluator.jobs  # noqa: F401 - imports torch and transformers before the first job

    hf_logging.disable_progress_bar()  # one line per evaluation, not progress bars
    from common.evals import eval_queue
    from common.keys import Keys
    from common.streams import connect
    from evaluator.worker import EvalWorker

    try:
        r = connect(config.redis_url)
        queue = eval_queue(r, Keys(config.run))
        worker = EvalWorker([queue], connection=r, serializer=JSONSerializer)
        print(f"evaluator: waiting for jobs on {queue.name}", flush=True)
        worker.work(burst=args.burst, logging_level="WARNING")
        # Stopped (or the queue empty, with --burst): exit without the interpreter's teardown of torch
        # and transformers, seconds on a busy CPU that count against the launcher's grace.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except redis.exceptions.ConnectionError as err:
        sys.exit(lost_redis("evaluator", config.redis_url, err))
    except redis.exceptions.NoPermissionError as err:  # an ACL user without a command or key it needs
        sys.exit(no_permission("evaluator", config.redis_url, err))


if __name__ == "__main__":
    main()
