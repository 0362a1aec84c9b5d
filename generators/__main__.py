"""`python -m generators [--config FILE ...] [--section.field VALUE ...] [--id ID]`: sample and score
prompts into groups."""

import atexit
import os
import socket
import sys

import redis

from common.config import ConfigError, config_from_args
from common.streams import lost_redis, no_permission, stop_while_starting


def main() -> None:
    stop_while_starting("generator")
    try:
        config, args = config_from_args("python -m generators", __doc__, extra=lambda p: p.add_argument(
            "--id", help="generator id: its consumer name and heartbeat key (default: host-pid)"))
    except ConfigError as err:
        print(f"generator: {err}", file=sys.stderr)
        sys.exit(2)
    generator_id = args.id or f"{socket.gethostname()}-{os.getpid()}"

    from generators.main import EngineStalled, run  # imports torch and transformers

    try:
        run(config, generator_id=generator_id)
    except ConfigError as err:
        print(f"generator: {err}", file=sys.stderr)
        sys.exit(2)
    except EngineStalled as err:  # its thread is stuck in the engine: an interpreter exit would wait for it
        print(f"generator {generator_id}: {err}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)
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
