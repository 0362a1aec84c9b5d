"""Running the project's processes for real: spawned as OS processes (or typed into a shell),
waited for, stopped."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: what the processes run from


def spawn(module: str, *args: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `python -m module` as its own OS process, output to `log`."""
    return _start([sys.executable, "-m", module, *args], cwd=cwd, env=env, log=log)


def spawn_ops_honcho(procfile: Path, *names: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start honcho on `procfile` (only the processes `names`, if any) as ./ops/run does (through
    ops/honcho), output to `log`."""
    return _start([sys.executable, str(ROOT / "ops" / "honcho"), "-f", str(procfile), "-d", str(cwd), "start",
                   *names], cwd=cwd, env=env, log=log)


def process_env(env: dict[str, str]) -> dict[str, str]:
    """The environment of a process of ours: this one's without its ROLLOUTS_ settings, this
    checkout importable (before what PYTHONPATH held: packages installed with `pip install --target`,
    as ops/gpu-check's kit is), no hub, then `env`."""
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    full_env.update(PYTHONPATH=path, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                    HF_HUB_OFFLINE="1", **env)
    return full_env


def _start(argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
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
    if proc.poll() is None:
        proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


class Shell:
    """A command typed into a terminal: its own session, its output in a log."""

    def __init__(self, line: str, *, cwd: Path, env: dict[str, str], log: Path):
        self.log = log
        self.proc = subprocess.Popen(["bash", "-c", line], cwd=cwd, env=env, start_new_session=True,
                                     stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for(self, pattern: str, *, timeout: float, what: str) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.text(), re.M)
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        raise AssertionError(f"{what}: no {pattern!r} in the output (exit {self.proc.poll()}):\n"
                             f"{self.text()[-6000:]}")

    def ctrl_c(self, timeout: float = 180) -> None:
        """Ctrl-C: honcho exits 130, as a shell does on SIGINT, once every process stopped with 0."""
        os.killpg(self.proc.pid, signal.SIGINT)
        assert self.wait(timeout) == 130, self.text()[-4000:]
        stopped = re.findall(r"\| (\S+) stopped \(rc=(-?\d+)\)", self.text())
        assert stopped and all(rc == "0" for _, rc in stopped), (stopped, self.text()[-4000:])

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"still running after {timeout}s:\n{self.text()[-6000:]}") from None

    def kill(self) -> None:
        """SIGKILL the command and every process under it (honcho starts each in a session of its own)."""
        import psutil

        try:
            tree = [psutil.Process(self.proc.pid)]
            tree += tree[0].children(recursive=True)
        except psutil.NoSuchProcess:
            tree = []
        for p in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        psutil.wait_procs(tree, timeout=30)
        self.proc.wait()


def run_once(line: str, *, cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", line], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
