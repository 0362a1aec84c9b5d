"""Shared fixtures: a real redis-server on a free port, a tiny model built in-process, and a scratch
copy of the checkout with a user's environment for running the README's commands as written."""

from __future__ import annotations

import hashlib
import os
import subprocess
from pathlib import Path

import pytest
import redis

from tests.harness.processes import ROOT
from tests.harness.schedule import in_collection_order, longest_first
from tests.harness.servers import free_port, start_redis


def pytest_configure(config: pytest.Config) -> None:
    in_collection_order(config)


@pytest.hookimpl(trylast=True)  # after -m has deselected: the files' weights are the selected tests'
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The longest test files first, for xdist's workers (tests/harness/schedule.py)."""
    longest_first(items)


@pytest.fixture(autouse=True, scope="module")
def no_process_group_left_behind():
    """An in-process vLLM engine makes this process a one-rank torch.distributed group and leaves
    it: a later module on the same worker would then see the trainer's code sharding at world size
    1 (DTensors where a test expects plain tensors). Each module's group, whoever made it, goes
    with the module (after its own fixtures: this one is set up first, so torn down last)."""
    yield
    import sys

    if "torch" not in sys.modules:
        return
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if "vllm" in sys.modules:
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()
    if dist.is_initialized():
        dist.destroy_process_group()


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


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """ROLLOUTS_CACHE of the scratch checkouts: the built-in model prepared once a session."""
    return tmp_path_factory.mktemp("rollouts-cache")


@pytest.fixture
def checkout(tmp_path) -> Path:
    """A copy of this checkout's files as git sees them (what a clone has), with its .venv."""
    # ./ops/run bootstraps first; with a .venv installed for another pyproject.toml it would
    # reinstall the project into the shared .venv from the copy.
    digest = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()[:16]
    stamp = ROOT / ".venv" / f".rollouts-installed-{digest}"
    if not stamp.exists():
        pytest.fail(f"{ROOT / '.venv'} was installed for another pyproject.toml: ./ops/test installs it again")
    locks = [hashlib.sha256(path.read_bytes()).hexdigest()[:16] for path in (ROOT / "ops").glob("constraints-*.txt")]
    if not any((ROOT / ".venv" / f".rollouts-locked-{digest}").exists() for digest in locks):
        pytest.fail(f"{ROOT / '.venv'} was installed from another lock (ops/constraints-*.txt): ./ops/test installs "
                    "it again")
    files = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, check=True).stdout.decode().split("\0")
    dest = tmp_path / "rollouts"
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            (dest / name).write_bytes(src.read_bytes())
            (dest / name).chmod(src.stat().st_mode)
    (dest / ".venv").symlink_to(ROOT / ".venv")
    return dest


@pytest.fixture
def user_env(tmp_path, tiny_model, model_cache) -> dict[str, str]:
    """A user's shell for commands in `checkout`: nothing of ours set but what stands in for what this
    machine lacks (tests/test_readme.py says what): the tiny model, a free Redis port, no hub."""
    port = free_port()
    env = {k: v for k, v in os.environ.items()
           if k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "USER", "ROLLOUTS_NO_VLLM")}
    env.update(PATH="/usr/local/bin:/usr/bin:/bin", ROLLOUTS_MODEL__PATH=str(tiny_model),
               ROLLOUTS_CACHE=str(model_cache), REDIS_PORT=str(port),
               ROLLOUTS_REDIS_URL=f"redis://127.0.0.1:{port}/0", HF_HOME=str(tmp_path / "hf"),
               HF_HUB_OFFLINE="1", STOP_GRACE_S="60")
    return env
