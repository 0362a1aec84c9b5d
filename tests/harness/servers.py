"""A real redis-server on a free port (appendonly on), for tests and benchmarks."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
