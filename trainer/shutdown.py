"""Two-stage shutdown: the first SIGTERM/SIGINT lets the trainer finish its step, the second exits.

A launcher waits only so long after its first signal before it SIGKILLs what still runs:
`ops/honcho` STOP_GRACE_S seconds (60 by default; it passes the number on in the environment),
and Redis, under ops/redis-last, stops 1 s before that. A step that cannot be finished and saved
in that time (the default model on a slow CPU) is given up at once instead, saying so, and the
trainer exits 0 before the launcher's SIGKILL and before Redis goes: nothing is acknowledged
before a saved state holds it, so the groups trained since the last saved state stay pending and
a restart trains them again. It is given up at the first signal when the step in hand, going by
the last step's time, would end past the grace; and at the grace's end, whatever the trainer is
doing then (a save slower than expected), if it is still running.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from common.process import STOP_MARGIN_S


class Shutdown:
    """Two-stage shutdown: the first SIGTERM/SIGINT asks the loop to finish its step, the second
    exits; with a `grace_s`, a step that cannot end within it is given up instead.

    The loop calls `step_started` when a step's update begins and `step_ended` once it is
    published, which is how the step in hand and the time a step takes are known here."""

    def __init__(self, *, grace_s: float | None = None) -> None:
        self.requested = False
        self.grace_s = grace_s
        self.step = 0  # the step in hand (steps done + 1) while busy; the steps done otherwise
        self.busy_since: float | None = None  # monotonic time the step in hand began; None between steps
        self.last_step_s: float | None = None  # how long the last step took, update to publish
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def step_started(self, step: int) -> None:
        self.step, self.busy_since = step, time.monotonic()

    def step_ended(self) -> None:
        if self.busy_since is not None:
            self.last_step_s = time.monotonic() - self.busy_since
        self.busy_since = None

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            print("trainer: second signal, exiting now", file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = True
        print(f"trainer: {signal.Signals(signum).name}: finishing the current step "
              "(again to exit at once)", file=sys.stderr, flush=True)
        if self.grace_s is None:
            return
        left = self.grace_s - STOP_MARGIN_S
        if self.busy_since is not None and self.last_step_s is not None \
                and self.busy_since + self.last_step_s > time.monotonic() + left:
            self._give_up(f"a step takes {self.last_step_s:.0f} s")
        timer = threading.Timer(max(left, 0.0), self._give_up, args=("it is still running",))
        timer.daemon = True
        timer.start()

    def _give_up(self, why: str) -> None:
        what = f"step {self.step}" if self.busy_since is not None else "the stop"
        print(f"trainer: giving up {what} unsaved: {why}, and the launcher kills what still runs "
              f"{self.grace_s:g} s after its signal (STOP_GRACE_S). Nothing unsaved was acknowledged: the groups "
              "trained since the last saved state stay pending, and a restart trains them again",
              file=sys.stderr, flush=True)
        os._exit(0)
