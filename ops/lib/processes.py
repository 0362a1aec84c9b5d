"""Running the project's processes for real: spawned as OS processes from this checkout, waited
for, stopped."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: what the processes run from


def spawn(module: str, *args: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `python -m module` as its own OS process, output to `log`."""
    return start([sys.executable, "-m", module, *args], cwd=cwd, env=env, log=log)


def process_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of a process of ours: this one's without its ROLLOUTS_ settings, this
    checkout importable (before what PYTHONPATH held: packages installed with `pip install --target`,
    as ops/gpu-check's kit is), no hub, then `env`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    full_env.update(PYTHONPATH=path, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                    HF_HUB_OFFLINE="1", **env)
    return full_env


def start(argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `argv` in `cwd` with `process_env(env)`, its output appended to `log`."""
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(argv, cwd=cwd, env=process_env(env), stdout=out, stderr=subprocess.STDOUT)


def wait_for(cond: Callable[[], object], *, timeout: float, what: str, procs=(), poll: float = 0.2):
    """Poll `cond` until truthy; fail naming `what` (and any process that died) on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        for p in procs:
            if p.poll() not in (None, 0):
                raise AssertionError(f"{what}: process {p.args} exited with {p.returncode}")
        time.sleep(poll)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def stop(proc: subprocess.Popen, timeout: float = 30) -> int:
    """SIGTERM `proc` if it still runs and wait for it, SIGKILL after `timeout`; its exit status."""
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def stop_all(procs: Iterable[subprocess.Popen], timeout: float = 120) -> list[int]:
    """SIGTERM every process still running at once (so they stop side by side, each within its
    grace), then `stop` each in turn; their exit statuses."""
    procs = list(procs)
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    return [stop(proc, timeout) for proc in procs]
