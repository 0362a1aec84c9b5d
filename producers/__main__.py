"""`python -m producers [--config FILE ...] [--section.field VALUE ...]`: admit prompts onto the run's
prompts stream."""

import sys

import redis

from common.config import ConfigError, config_from_args
from common.streams import lost_redis, no_permission, stop_while_starting


def main() -> None:
    stop_while_starting("producer")
    try:
        config, _ = config_from_args("python -m producers", __doc__)
    except ConfigError as err:
        sys.exit(f"producer: {err}")

    from producers.data import DataError
    from producers.main import ProducerError, run

    try:
        run(config)
    except (ProducerError, DataError) as err:
        sys.exit(f"producer: {err}")
    except redis.exceptions.ConnectionError as err:
        sys.exit(lost_redis("producer", config.redis_url, err))
    except redis.exceptions.NoPermissionError as err:  # an ACL user without a command or key it needs
        sys.exit(no_permission("producer", config.redis_url, err))


if __name__ == "__main__":
    main()
