"""The sampling core of a CPU host, lent to the trainer while nothing there samples.

On a CPU host split between a generator and the trainer (the demo: one core each), the generator
samples a step's completions in a fraction of the trainer's step and then waits for newer weights
or prompts: its core idles. `trainer.borrow_threads` lends it to the trainer for exactly those
moments, through one lock file on the host (flock):

- a generator holds it shared while its engine has requests in flight, and so does the evaluator
  while it scores (any number of them at once);
- the trainer tries it exclusively before each micro-batch and before its optimizer step, without
  waiting: held, that pass runs on `threads + borrow_threads` torch threads, then the lock goes
  back; refused (someone samples), the pass runs on `threads`.

So a sampler waits at most one of the trainer's passes for its core, and the trainer never runs a
wider OpenMP team beside a sampler, where a descheduled thread stalls the team at every barrier
(a static second trainer thread made some steps 5-10x slower: docs/benchmarks.md, section 10).

The lock lives in the host's temporary directory, named for the run and its Redis, so two runs on
one host do not lend each other's cores; processes on other hosts never meet it. A process that
dies lets go of it with its file descriptors.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def lock_path(redis_url: str, run: str) -> Path:
    """The host's lock file of the run on the Redis at `redis_url`."""
    tag = hashlib.sha256(f"{redis_url}\x00{run}".encode()).hexdigest()[:16]
    return Path(tempfile.gettempdir()) / f"rollouts-{run}-{tag}.cores"


class Lease:
    """This process's handle on the host's lock file (one open file: flock locks belong to it)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
        self.held = False

    def share(self) -> None:
        """Hold it shared (a sampler), waiting while the trainer has it: at most one of its passes."""
        if not self.held:
            fcntl.flock(self.fd, fcntl.LOCK_SH)
            self.held = True

    def release(self) -> None:
        if self.held:
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            self.held = False

    def try_exclusive(self) -> bool:
        """Take it exclusively if no sampler holds it; never waits."""
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        self.held = True
        return True

    def close(self) -> None:
        os.close(self.fd)  # lets go of any lock


class Borrower:
    """The trainer's side: `with borrower.wider():` around one pass runs it on the borrowed threads
    when the lease is free. `extra` 0 borrows nothing and touches no file."""

    def __init__(self, *, path: Path | None, threads: int, extra: int) -> None:
        self.lease = Lease(path) if extra and path is not None else None
        self.threads, self.extra = threads, extra
        self.passes = self.borrowed = 0  # passes run, of them on borrowed threads (for the step's metrics)

    @contextlib.contextmanager
    def wider(self) -> Iterator[bool]:
        import torch

        self.passes += 1
        if self.lease is None or not self.lease.try_exclusive():
            yield False
            return
        self.borrowed += 1
        torch.set_num_threads(self.threads + self.extra)
        try:
            yield True
        finally:
            torch.set_num_threads(self.threads)
            self.lease.release()

    def share_taken(self) -> float:
        """The share of passes since the last call that ran on borrowed threads; counts reset."""
        share = self.borrowed / self.passes if self.passes else 0.0
        self.passes = self.borrowed = 0
        return share


@contextlib.contextmanager
def sampling(lease: Lease | None) -> Iterator[None]:
    """Hold `lease` shared for the block (a sampler's burst of work); None: nothing to hold."""
    if lease is None:
        yield
        return
    lease.share()
    try:
        yield
    finally:
        lease.release()


def sampler_lease(redis_url: str, run: str, *, borrow_threads: int) -> Lease | None:
    """A generator's or evaluator's lease, or None when the trainer borrows nothing."""
    return Lease(lock_path(redis_url, run)) if borrow_threads else None
