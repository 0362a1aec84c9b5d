"""`python -m producers [--config FILE]`: admit prompts onto the run's prompts stream."""

import argparse
import sys

import redis

from common.config import ConfigError, load_config
from common.streams import lost_redis, no_permission, stop_while_starting


def main() -> None:
    stop_while_starting("producer")
    parser = argparse.ArgumentParser(prog="python -m producers", description=__doc__)
    parser.add_argument("--config", help="TOML file (default: $ROLLOUTS_CONFIG or ./rollouts.toml)")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
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
