"""`python -m generators [--config FILE] [--id ID]`: sample and score prompts into groups."""

import argparse
import atexit
import os
import socket
import sys

import redis

from common.config import ConfigError, load_config
from common.streams import lost_redis, no_permission, stop_while_starting


def main() -> None:
    stop_while_starting("generator")
    parser = argparse.ArgumentParser(prog="python -m generators", description=__doc__)
    parser.add_argument("--config", help="TOML file (default: $ROLLOUTS_CONFIG or ./rollouts.toml)")
    parser.add_argument("--id", help="generator id: its consumer name and heartbeat key (default: host-pid)")
    args = parser.parse_args()
    try:
        config = load_config(args.config)
    except ConfigError as err:
        print(f"generator: {err}", file=sys.stderr)
        sys.exit(2)
    generator_id = args.id or f"{socket.gethostname()}-{os.getpid()}"

    from generators.main import run  # imports torch and transformers

    try:
        run(config, generator_id=generator_id)
    except ConfigError as err:
        print(f"generator: {err}", file=sys.stderr)
        sys.exit(2)
    except redis.exceptions.ConnectionError as err:
        sys.exit(lost_redis("generator", config.redis_url, err))
    except redis.exceptions.NoPermissionError as err:  # an ACL user without a command or key it needs
        sys.exit(no_permission("generator", config.redis_url, err))
    # Stopped cleanly, everything written. Run the exit handlers (vLLM's engine shutdown) and skip
    # the interpreter's teardown: with vLLM loaded its final garbage collections take seconds, past
    # honcho's 5 s stop window.
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
