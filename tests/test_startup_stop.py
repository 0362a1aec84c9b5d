"""Ctrl-C while Redis is not there yet: each of the four processes, started as the Procfile starts
them and pointed at a port where nothing listens, stops at once and cleanly (status 0, one line),
by the one start-up rule of common/streams.py (connect's stopped_at_once). Before it, the producer
waited on until the launcher's SIGKILL and the trainer used the whole grace (issue 41)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from pathlib import Path

from tests.harness.configs import write_config
from tests.harness.processes import process_env
from tests.harness.servers import free_port

ROOT = Path(__file__).resolve().parent.parent
GRACE_S = 60  # the launcher's grace (ops/honcho's STOP_GRACE_S default): a stop that used it was the bug
# Ctrl-C reaches a process as SIGTERM through honcho and ops/respawn, as SIGINT when started by hand.
SIGNALS = {"producers": signal.SIGTERM, "trainer": signal.SIGINT, "generators": signal.SIGINT,
           "evaluator": signal.SIGTERM}


class Started:
    """A process of the run, its stderr collected line by line as it comes."""

    def __init__(self, module: str, env: dict[str, str]) -> None:
        self.module, self.lines = module, []
        self.waiting = threading.Event()  # it said it waits for Redis
        self.proc = subprocess.Popen([sys.executable, "-m", module], cwd=ROOT, env=env, stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            if "waiting up to" in line and "for Redis" in line:
                self.waiting.set()
        self.waiting.set()  # it ended: the asserts below say how


def test_every_process_waiting_for_redis_stops_at_once_on_ctrl_c(tmp_path, tiny_model):
    port = free_port()  # held for this test, and nothing listens on it
    env = process_env({"STOP_GRACE_S": str(GRACE_S), **write_config(
        tmp_path / "run.toml", run="startstop", redis_url=f"redis://127.0.0.1:{port}/0", output_dir=tmp_path / "run",
        model=tiny_model)})
    env.pop("REDIS_PORT", None)  # the config's redis_url as written
    started = [Started(module, env) for module in SIGNALS]
    try:
        for p in started:
            assert p.waiting.wait(timeout=300), f"{p.module} never said it waits for Redis: {p.lines}"
            assert p.proc.poll() is None, f"{p.module} ended before it was stopped: {p.lines}"
        for p in started:
            p.proc.send_signal(SIGNALS[p.module])
        for p in started:
            try:  # at once; a bound well within the launcher's grace, which the broken stop used up
                code = p.proc.wait(timeout=GRACE_S / 2)
            except subprocess.TimeoutExpired:
                raise AssertionError(f"{p.module} still running {GRACE_S / 2:.0f} s after "
                                     f"{SIGNALS[p.module].name}: {p.lines}") from None
            assert code == 0, f"{p.module} exited {code}: {p.lines}"
            assert any(line.endswith(f"{SIGNALS[p.module].name} while waiting for Redis: stopped")
                       for line in p.lines), p.lines
            assert not any("Traceback" in line for line in p.lines), p.lines
    finally:
        for p in started:
            if p.proc.poll() is None:
                p.proc.kill()
                p.proc.wait()
