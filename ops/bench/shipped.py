"""The shipped Procfile as the benchmarks run it: `ops/honcho start` of this checkout's Procfile
(what `./ops/run` starts: ops/respawn, ops/redis-last and the stop grace included) in a scratch
directory of its own, with its own Redis on a free port. The benchmarks measure that file, not a
copy of it."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROCFILE = ROOT / "Procfile"


def honcho_command(tmp: Path, *, env: dict[str, str], processes: Sequence[str] = ()) -> list[str]:
    """The command line that runs the shipped Procfile in `tmp` (only `processes`, if named) as in
    this checkout: tmp/.venv and tmp/ops link to the checkout's (to this interpreter's environment
    where the checkout has no .venv: a GPU host), Redis on a free port (REDIS_PORT, which the
    config's redis_url follows) with its data in tmp/.rollouts, and `env` (ROLLOUTS_CONFIG, config
    overrides) for every process. Run it with `process_env()`, in any directory."""
    from common.localredis import free_port

    tmp.mkdir(parents=True, exist_ok=True)
    if not (tmp / "ops").exists():
        (tmp / "ops").symlink_to(ROOT / "ops")
    if not (tmp / ".venv").exists():
        if (ROOT / ".venv" / "bin" / "python").exists():
            (tmp / ".venv").symlink_to(ROOT / ".venv")
        else:  # the Procfile's .venv/bin/python: this interpreter (exec'd, not linked: a link to a
            # virtual environment's python leaves that environment's packages behind)
            (tmp / ".venv" / "bin").mkdir(parents=True)
            (tmp / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
            (tmp / ".venv" / "bin" / "python").chmod(0o755)
    (tmp / ".env").write_text("\n".join([
        f"REDIS_PORT={free_port()}",
        f"PYTHONPATH={os.pathsep.join(filter(None, [str(ROOT), os.environ.get('PYTHONPATH', '')]))}",
        "PYTHONUNBUFFERED=1", "TOKENIZERS_PARALLELISM=false", "HF_HUB_OFFLINE=1",
        *(f"{k}={v}" for k, v in env.items()),
    ]) + "\n")
    return [str(tmp / ".venv" / "bin" / "python"), str(ROOT / "ops" / "honcho"), "start", "-f", str(PROCFILE),
            "-e", str(tmp / ".env"), "-d", str(tmp), *processes]


def process_env() -> dict[str, str]:
    """The environment to run `honcho_command` with: this one's without the variables the run's
    .env sets (ops/honcho lets the shell's win over the file's). PYTHONPATH too: the .env's puts the
    checkout before this one's, and an interpreter without rollouts installed (a GPU host's) finds
    its packages only there."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_") and k != "REDIS_PORT"}
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))}
