"""Running the project's processes for real: spawned as OS processes (or typed into a shell),
waited for, stopped. What the benchmarks use too (spawn, wait_for, stop) lives in
ops/lib/processes.py."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from ops.lib.processes import ROOT, process_env, spawn, start, stop, wait_for  # noqa: F401 (the harness's)


def spawn_ops_honcho(procfile: Path, *names: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start honcho on `procfile` (only the processes `names`, if any) as ./ops/run does (through
    ops/honcho), output to `log`."""
    return start([sys.executable, str(ROOT / "ops" / "honcho"), "-f", str(procfile), "-d", str(cwd), "start",
                  *names], cwd=cwd, env=env, log=log)


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
