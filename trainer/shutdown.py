"""Two-stage shutdown: the first SIGTERM/SIGINT lets the trainer finish its step, the second exits."""

from __future__ import annotations

import os
import signal
import sys


class Shutdown:
    """Two-stage shutdown: the first SIGTERM/SIGINT asks the loop to finish its step, the second exits."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)

    def _handle(self, signum: int, frame: object) -> None:
        if self.requested:
            print("trainer: second signal, exiting now", file=sys.stderr, flush=True)
            os._exit(130)
        self.requested = True
        print(f"trainer: {signal.Signals(signum).name}: finishing the current step "
              "(again to exit at once)", file=sys.stderr, flush=True)
