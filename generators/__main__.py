"""`python -m generators [--config FILE ...] [--section.field VALUE ...] [--id ID]`: sample and score
prompts into groups."""

import argparse
import atexit
import os
import socket
import sys

from common.config import Config
from common.process import EXIT_FAILED, exit_at_once, run_process


def main(config: Config, args: argparse.Namespace) -> None:
    generator_id = args.id or f"{socket.gethostname()}-{os.getpid()}"

    from generators.main import EngineStalled, run  # imports torch and transformers

    try:
        run(config, generator_id=generator_id)
    except EngineStalled as err:  # its thread is stuck in the engine: an interpreter exit would wait for it
        print(f"generator {generator_id}: {err}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(EXIT_FAILED)
    except SystemExit as stop:  # a second signal: exit now, not once the engine's call in hand returns
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(stop.code if isinstance(stop.code, int) else EXIT_FAILED)
    # Stopped cleanly, everything written. Run the exit handlers (vLLM's engine shutdown), then skip
    # the interpreter's teardown.
    atexit._run_exitfuncs()
    exit_at_once()


if __name__ == "__main__":
    run_process("generator", main, prog="python -m generators", doc=__doc__, extra=lambda p: p.add_argument(
        "--id", help="generator id: its consumer name and heartbeat key (default: host-pid)"))
