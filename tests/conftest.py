"""Shared fixtures: a real redis-server on a free port, and a tiny model built in-process."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest
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


@pytest.fixture
def redis_url(tmp_path):
    """URL of a fresh, real redis-server (appendonly on) that lives for one test."""
    port = free_port()
    proc = start_redis(tmp_path / "redis", port)
    yield f"redis://127.0.0.1:{port}/0"
    proc.terminate()
    proc.wait(timeout=10)


@pytest.fixture
def r(redis_url):
    return redis.Redis.from_url(redis_url)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """Directory of a tiny random Llama with tokenizer and chat template (built once per session)."""
    from common.tiny import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model")
