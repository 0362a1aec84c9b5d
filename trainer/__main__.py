"""`python -m trainer [--config FILE ...] [--section.field VALUE ...]`: GRPO steps on the run's sample
groups, publishing weights."""

import os
import sys

import redis

from common.config import ConfigError, config_from_args
from common.streams import lost_redis, no_permission, stop_while_starting


def main() -> None:
    stop_while_starting("trainer")
    try:
        config, _ = config_from_args("python -m trainer", __doc__)
    except ConfigError as err:
        print(f"trainer: {err}", file=sys.stderr)
        sys.exit(2)

    from trainer.losses import loss_function  # imports torch

    try:
        loss_function(config.trainer.loss)  # a custom loss that does not load
    except ValueError as err:
        print(f"trainer: {err}", file=sys.stderr)
        sys.exit(2)

    from common.models import ModelError, resolve_model_path

    try:
        resolve_model_path(config.model.path)
    except ModelError as err:
        print(f"trainer: {err}", file=sys.stderr)
        sys.exit(2)

    from trainer.main import PublishFailed, run  # imports torch and transformers

    try:
        run(config)
        # Stopped or done, everything saved: exit without the interpreter's teardown of torch, seconds
        # on a busy CPU that count against the launcher's grace (ops/honcho's STOP_GRACE_S).
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
    except ModelError as err:  # e.g. a model directory with pickled weights only
        print(f"trainer: {err}", file=sys.stderr)
        sys.exit(2)
    except PublishFailed as err:  # a full disk: nothing announced, the saved state resumable
        print(f"trainer: {err}", file=sys.stderr)
        sys.exit(1)
    except redis.exceptions.ConnectionError as err:
        sys.exit(lost_redis("trainer", config.redis_url, err))
    except redis.exceptions.NoPermissionError as err:  # an ACL user without a command or key it needs
        sys.exit(no_permission("trainer", config.redis_url, err))


if __name__ == "__main__":
    main()
