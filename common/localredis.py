"""A redis-server of one's own on a free port, append-only on: what the tests, the benchmarks and
`ops/chaos` start beside a run (a run itself gets its Redis from the Procfile or its operator)."""

from __future__ import annotations

import fcntl
import os
import random
import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis

# Ports handed out by free_port: below the kernel's ephemeral range (32768 and up on Linux), so no
# outgoing connection is given one between the pick and the server's bind, each claimed by a lock file
# under PORT_LOCKS held until this process exits, so no other test process (another pytest-xdist
# worker, another suite beside this one) is handed it meanwhile.
PORT_RANGE = range(20000, 32768)
PORT_LOCKS = Path("/tmp/rollouts-test-ports")
_claimed: list[int] = []  # the lock files' descriptors: a lock lives as long as its descriptor


def free_port() -> int:
    """A TCP port that nothing listens on and that no other test process is handed until this one
    exits."""
    PORT_LOCKS.mkdir(mode=0o777, exist_ok=True)
    start = random.randrange(len(PORT_RANGE))
    for i in range(len(PORT_RANGE)):
        port = PORT_RANGE[(start + i) % len(PORT_RANGE)]
        fd = os.open(PORT_LOCKS / str(port), os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        if _bindable(port):
            _claimed.append(fd)
            return port
        os.close(fd)  # someone outside the tests has it
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def _bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
        return True


def start_redis(tmp: Path, port: int, *extra: str) -> subprocess.Popen:
    exe = shutil.which("redis-server")
    assert exe, "redis-server is not installed: run ./ops/test, or apt-get install redis-server"
    tmp.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(tmp), "--appendonly", "yes",
         "--save", "", "--daemonize", "no", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port)
    for _ in range(200):
        try:
            client.ping()
            return proc
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    raise RuntimeError(f"redis-server did not start on port {port}")
