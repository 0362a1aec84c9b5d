"""Killing and reaping the worker processes that run rewards and environments."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess

REAP_TIMEOUT_S = 10.0


def kill(process: BaseProcess, conn: Connection) -> None:
    """SIGKILL the process and its process group, reap it, and close both ends of it.

    `join` alone is not enough when other threads start processes: `Process.start` reaps every
    finished child it knows of, so another thread may collect our exit status between our kill and
    our `join`, which then returns with the exit code still unknown and `close` raises. The exit
    code is waited for instead (set by whichever thread reaped it), for at most REAP_TIMEOUT_S."""
    with contextlib.suppress(ProcessLookupError):  # gone already, or killed before it made its own group
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        process.kill()
    deadline = time.monotonic() + REAP_TIMEOUT_S
    process.join(timeout=REAP_TIMEOUT_S)
    while process.exitcode is None and time.monotonic() < deadline:
        process.join(timeout=0.05)
    with contextlib.suppress(ValueError):  # still unknown after the deadline: left to the interpreter's reaper
        process.close()
    conn.close()
