"""Every process's entrypoint in one shape: its config parsed and validated, its `main` run, and
the errors a user can act on turned into one line on stderr and the same exit status everywhere.

    python -m producers | generators | trainer | evaluator   ->   run_process(name, main, ...)

Exit statuses, the same for the four processes:
  0    stopped cleanly (a first SIGTERM or Ctrl-C lets the current step finish)
  1    failed at its work: Redis lost or refusing the credentials or a command, or an error the
       process names (`Stop`: a full disk, a data source that ended)
  2    a bad configuration: a value (the message names the field), a model or loss that does not load
  130  interrupted (KeyboardInterrupt; a second signal exits so from the process's own handler)
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
from collections.abc import Callable
from typing import NoReturn

import redis

from common.config import Config, ConfigError, config_from_args
from common.models import ModelError
from common.streams import lost_redis, no_permission, stop_while_starting

EXIT_STOPPED = 0
EXIT_FAILED = 1
EXIT_CONFIG = 2
EXIT_INTERRUPTED = 130

# How long the launcher waits after its first signal before it SIGKILLs what still runs (seconds;
# ops/honcho sets it, 60 by default); Redis, under ops/redis-last, stops 1 s before that. A process
# gives up what it cannot finish STOP_MARGIN_S before the end, and exits 0 in time.
ENV_STOP_GRACE = "STOP_GRACE_S"
STOP_MARGIN_S = 2.0


def stop_grace_s() -> float | None:
    """How long the launcher waits after its first signal (ENV_STOP_GRACE); None when it is not set
    or not a number (no known deadline: what is in hand is always finished)."""
    try:
        return float(os.environ[ENV_STOP_GRACE])
    except (KeyError, ValueError):
        return None


class Stop(Exception):
    """What a process's main raises to exit with its one-line `message` and status `code` (a
    process's own errors: a full disk, a source that ended)."""

    def __init__(self, message: str, code: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.code = code


def leave(process: str, message: object, code: int) -> NoReturn:
    """Exit with status `code` after one line on stderr, "`process`: `message`"."""
    print(f"{process}: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


def exit_at_once() -> NoReturn:
    """Exit 0 at once, for a process that stopped cleanly with everything written: without the
    interpreter's teardown of torch and transformers (or vLLM's final garbage collections), seconds
    on a busy CPU that count against the launcher's grace (ops/honcho's STOP_GRACE_S)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_STOPPED)


def exit_within(seconds: float) -> None:
    """Exit 0 `seconds` from now, whatever the process is doing then (a daemon timer): a process that
    gave up what it could not finish within the launcher's grace is gone before the launcher's
    SIGKILL and before Redis stops, even where its clean-up waits (a blocked read, a worker)."""
    timer = threading.Timer(seconds, exit_at_once)
    timer.daemon = True
    timer.start()


def run_process(process: str, main: Callable[[Config, argparse.Namespace], None], *, prog: str, doc: str,
                extra: Callable[[argparse.ArgumentParser], object] | None = None) -> None:
    """Parse `process`'s config (`extra` adds its own flags) and call `main(config, args)`, which
    imports the heavy libraries late; the errors above end it with their line and status (never a
    traceback), anything else propagates."""
    stop_while_starting(process)
    try:
        config, args = config_from_args(prog, doc, extra=extra)
    except ConfigError as err:
        leave(process, err, EXIT_CONFIG)
    try:
        main(config, args)
    except ConfigError as err:
        leave(process, err, EXIT_CONFIG)
    except Stop as err:
        leave(process, err, err.code)
    except ModelError as err:  # model.path holds no usable checkpoint: the config's to mend
        leave(process, err, EXIT_CONFIG)
    except redis.exceptions.ConnectionError as err:  # AuthenticationError is one: a refused password
        print(lost_redis(process, config.redis_url, err), file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    except redis.exceptions.NoPermissionError as err:  # an ACL user without a command or key it needs
        print(no_permission(process, config.redis_url, err), file=sys.stderr, flush=True)
        sys.exit(EXIT_FAILED)
    except KeyboardInterrupt:
        leave(process, "interrupted", EXIT_INTERRUPTED)
