#!/usr/bin/env python3
"""`ops/slurm/torchrun.py ARGS...`: torchrun, deaf to SIGTERM, for a Slurm step.

Slurm signals every process of a step (scancel, a time limit): each trainer rank gets its SIGTERM
itself and finishes and saves its step. torchrun, on its own SIGTERM, would send every rank a
second one, which they take as "exit now", and SIGKILL them 30 s later. Here torchrun's SIGTERM
does nothing (a handler, not SIG_IGN, so the ranks it starts get the default back) and torchrun
handles only its other signals (--signals-to-handle); it exits as its ranks do.
"""

import runpy
import signal
import sys

if __name__ == "__main__":
    signal.signal(signal.SIGTERM, lambda signum, frame: None)
    sys.argv = ["torchrun", "--signals-to-handle=SIGINT,SIGHUP,SIGQUIT", *sys.argv[1:]]
    runpy.run_module("torch.distributed.run", run_name="__main__", alter_sys=True)
