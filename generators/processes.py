"""The worker processes that run rewards and environments (user code that may raise, hang or
crash): starting them with "spawn", their start-up handshake, replacing one, killing and reaping.

A worker runs `serve_worker(load, serve, ...)`: its own process group (a kill takes whatever the
user code started along), deaf to SIGTERM and SIGINT (they are the generator's to handle: a
launcher that signals every process, as Slurm does a step's, would otherwise end the workers that
the generator still needs to finish the prompts it holds; a handler that does nothing, not
SIG_IGN, so that what the user code starts gets the default back), a thread that ends it once the
generator is gone, then `load()` (the
user's modules) answered on the pipe by ("ready", None) or ("failed", why), then `serve(loaded,
conn)` until the pipe closes. Scoring and environment requests each have their own protocol on
top (generators/scoring.py, generators/environments.py).
"""

from __future__ import annotations

import atexit
import contextlib
import multiprocessing
import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

REAP_TIMEOUT_S = 10.0
START_TIMEOUT_S = 120.0  # a worker has this long to import the user's code and say it is ready


def kill(process: BaseProcess, conn: Connection) -> None:
    """SIGKILL the process and its process group, reap it, and close both ends of it.

    `join` alone is not enough when other threads start processes: `Process.start` reaps every
    finished child it knows of, so another thread may collect our exit status between our kill and
    our `join`, which then returns with the exit code still unknown and `close` raises. The exit
    code is waited for instead (set by whichever thread reaped it), for at most REAP_TIMEOUT_S.
    Two threads may kill one worker (a pool closed while a scoring call it gave up on replaces
    it): the process object the other closed meanwhile (ValueError) is killed and reaped already."""
    with contextlib.suppress(ProcessLookupError):  # gone already, or killed before it made its own group
        os.killpg(process.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError, ValueError):
        process.kill()
        deadline = time.monotonic() + REAP_TIMEOUT_S
        process.join(timeout=REAP_TIMEOUT_S)
        while process.exitcode is None and time.monotonic() < deadline:
            process.join(timeout=0.05)
    with contextlib.suppress(ValueError):  # still unknown after the deadline: left to the interpreter's reaper
        process.close()
    conn.close()


# ---------------------------------------------------------------------- in the worker


def serve_worker(load: Callable[[], Any], serve: Callable[[Any, Connection], None], conn: Connection,
                 parent: int) -> None:
    """A worker's life: its own process group, deaf to the stop signals, `load()` (a ValueError is
    answered as "failed"), then `serve` until the pipe closes."""
    signal.signal(signal.SIGTERM, _deaf)
    signal.signal(signal.SIGINT, _deaf)
    os.setpgrp()
    threading.Thread(target=_exit_with_parent, args=(parent,), daemon=True).start()
    try:
        loaded = load()
    except ValueError as err:
        conn.send(("failed", str(err)))
        return
    conn.send(("ready", None))
    serve(loaded, conn)


def _deaf(signum: int, frame: object) -> None:
    """A stop signal, in a worker: the generator decides when its workers end."""


def _exit_with_parent(parent: int) -> None:
    """End this worker once the generator is gone, even while user code hangs: this thread runs
    between its bytecodes, or whenever it releases the GIL (a sleep)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(1)


# ---------------------------------------------------------------------- in the generator


@dataclass(slots=True, eq=False)
class Worker:
    process: BaseProcess
    conn: Connection     # the generator's end of the worker's pipe
    ready: bool = False  # it said it loaded the user's code


class WorkerPool:
    """`workers` processes running `target(*args, conn, parent_pid)` (a module-level function that
    calls `serve_worker`), all started and ready before the constructor returns (else
    RuntimeError, with why). `take` hands out an idle worker (blocking while all are busy), `give`
    takes it back; `replace` kills one and starts its successor, waited for when next used.
    `kind` names the workers in errors ("reward", "environment"), `loads` what they load."""

    def __init__(self, target: Callable[..., None], args: tuple, *, workers: int, kind: str, loads: str) -> None:
        self._target, self._args, self._kind, self._loads = target, args, kind, loads
        self._ctx = multiprocessing.get_context("spawn")
        self._idle: queue.SimpleQueue[Worker] = queue.SimpleQueue()
        self._lock = threading.Lock()  # guards _live, _closed, restarts
        self._live: set[Worker] = set()  # every started worker not yet killed, for close()
        self._closed = False
        self.restarts = 0  # workers killed (over their time) or found dead, and replaced
        # Killed at the interpreter's exit whatever leads there (a stop signal's SystemExit while they
        # start included): multiprocessing's own exit handler, which runs after this one, would send
        # them a SIGTERM they are deaf to and then wait for them for ever.
        atexit.register(self.close)
        started = [self._start() for _ in range(workers)]  # start them all, then wait
        for worker in started:
            failed = self.await_ready(worker)
            if failed is not None:
                self.close()
                raise RuntimeError(failed)
            self._idle.put(worker)

    def take(self) -> Worker:
        return self._idle.get()

    def give(self, worker: Worker) -> None:
        self._idle.put(worker)

    def replace(self, old: Worker) -> Worker:
        """Kill `old` and start its successor."""
        with self._lock:
            self._live.discard(old)
            self.restarts += 1
        kill(old.process, old.conn)
        return self._start()

    def await_ready(self, worker: Worker) -> str | None:
        """None once the worker has loaded the user's code, else why it cannot serve."""
        if worker.ready:
            return None
        if not worker.conn.poll(START_TIMEOUT_S):
            return f"{self._kind} worker did not start within {START_TIMEOUT_S:g} s"
        try:
            kind, detail = worker.conn.recv()
        except (EOFError, OSError):
            worker.process.join(timeout=1.0)
            return f"{self._kind} worker died while starting (exit code {worker.process.exitcode})"
        if kind != "ready":
            return f"{self._kind} worker cannot load {self._loads}: {detail}"
        worker.ready = True
        return None

    def pids(self) -> list[int]:
        """The process ids of the workers started and not killed."""
        with self._lock:
            return [w.process.pid for w in self._live]

    def close(self) -> None:
        """Kill every worker; starting one afterwards is an error."""
        atexit.unregister(self.close)
        with self._lock:
            self._closed = True
            live, self._live = list(self._live), set()
        for worker in live:
            kill(worker.process, worker.conn)

    def _start(self) -> Worker:
        with self._lock:
            if self._closed:
                raise RuntimeError(f"the {self._kind} workers are closed")
            ours, theirs = self._ctx.Pipe(duplex=True)
            process = self._ctx.Process(target=self._target, args=(*self._args, theirs, os.getpid()),
                                        name=f"{self._kind}-worker", daemon=True)
            process.start()
            theirs.close()  # the worker holds its end: our recv sees EOF when it dies
            worker = Worker(process, ours)
            self._live.add(worker)
            return worker
