"""`python -m generators [--config FILE ...] [--section.field VALUE ...] [--id ID] [--runs FILE,FILE,...]`:
sample and score prompts into groups; with --runs, for the run of each config file at once, on one
engine (generators/pool.py; --config files and flags apply to every run)."""

import argparse
import atexit
import os
import socket
import sys

from common.config import Config, load_config
from common.process import EXIT_FAILED, exit_at_once, run_process


def main(config: Config, args: argparse.Namespace) -> None:
    generator_id = args.id or f"{socket.gethostname()}-{os.getpid()}"
    configs = [config] if not args.runs else [
        load_config([*(args.config or []), path], overrides=args.config_overrides) for path in runs_of(args.runs)]

    from generators.main import EngineStalled, run  # imports torch and transformers

    try:
        run(configs, generator_id=generator_id)
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


def runs_of(value: str) -> list[str]:
    """The config files --runs names, comma-separated; each must exist."""
    from common.config import ConfigError

    paths = [p.strip() for p in value.split(",") if p.strip()]
    missing = [p for p in paths if not os.path.isfile(p)]
    if missing:
        raise ConfigError(f"--runs: no config file {missing[0]}")
    return paths


def flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--id", help="generator id: its consumer name and heartbeat key (default: host-pid)")
    parser.add_argument("--runs", help="serve several runs at once: their config files, comma-separated (each "
                                       "trains LoRA adapters of one base model; generators/pool.py)")


if __name__ == "__main__":
    run_process("generator", main, prog="python -m generators", doc=__doc__, extra=flags)
