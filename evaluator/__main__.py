"""`python -m evaluator [--config FILE] [--burst]`: an RQ worker that evaluates published checkpoints."""

import argparse
import sys

import redis

from common.config import ConfigError, load_config
from common.streams import lost_redis, no_permission, stop_while_starting


def main() -> None:
    stop_while_starting("evaluator")
    parser = argparse.ArgumentParser(prog="python -m evaluator", description=__doc__)
    parser.add_argument("--config", help="TOML file (default: $ROLLOUTS_CONFIG or ./rollouts.toml)")
    parser.add_argument("--burst", action="store_true", help="exit once the queue is empty")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
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
    except redis.exceptions.ConnectionError as err:
        sys.exit(lost_redis("evaluator", config.redis_url, err))
    except redis.exceptions.NoPermissionError as err:  # an ACL user without a command or key it needs
        sys.exit(no_permission("evaluator", config.redis_url, err))


if __name__ == "__main__":
    main()
