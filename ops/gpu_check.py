#!/usr/bin/env python3
"""`ops/gpu-check`: one command to check a GPU host, and one report of what it measured.

It runs from the checkout with the `python3` on PATH and installs nothing: the project's packages
come from the checkout (PYTHONPATH), whatever the host lacks from PYTHONPATH (the kit: docs/gpu.md),
Redis from `--redis-server`. Three steps, each reported as ran, skipped (with the reason) or failed
(with the tail of its log); one that fails does not stop the others, and the exit status is 1 when
any failed:

  gpu-tests  `pytest -m gpu` (tests/test_gpu.py; the cuda cases of tests/test_shared_prompts.py,
             tests/test_varlen.py (the flash varlen kernel against its reference) and
             tests/test_logprobs.py (trainer/head.py's backward in bf16)), with
             the check's redis-server first on PATH for the tests' own Redis
  one-gpu    a short run of configs/gsm8k.toml on GPU 0: the producer, one generator and the trainer
             sharing it, and the evaluator, each started here as a process of its own with its own log
             (not under honcho), against a redis-server of the check's own on a free port; once the
             trainer exits, the producer and generators are stopped and the evaluations already queued
             are waited for (within --time-limit, counted from the run's start) before the evaluator is
             stopped
  two-gpus   the same run with the trainer under torchrun at world size 2 on GPUs 0 and 1 (NCCL),
             generators on the other GPUs, each leasing one (on GPU 1 where there are only two);
             skipped with fewer than two GPUs

The runs change configs/gsm8k.toml through the variables every process reads
(ROLLOUTS_<SECTION>__<FIELD>), and in nothing else; report.md lists each one with its reason:
model.path (a random model of Qwen2.5-0.5B's shape with the tiny tokenizer, built here: there is no
hub), the data (`openai/gsm8k` as a local directory of GSM8K-shaped problems in the run's working
directory, common/tiny.py), generator.engine "hf" where vLLM is not installed, redis_url, output_dir
and trainer.max_steps (`--steps`). A ROLLOUTS_<SECTION>__<FIELD> set when calling the check wins over
these and is listed too.

`--dry-run` takes the same steps on the CPU with the tiny model, fewer and shorter rollouts and one
short evaluation of the last version (listed) and the HF engine, skipping what needs CUDA
(tests/test_gpu_check.py runs it in the default suite).

The report (report.md, report.json under `--out`) holds the host (devices, torch and CUDA, vLLM or
not, what does not import) and each step's status, and from each run: the generators' and the
trainer's tokens/s, the trainer's MFU against the GPU's dense bf16 peak, the time a weight version
takes to reach the generators by each path, the peak memory of each process (and when it peaked:
seconds since the start and the trainer's phase; the trainer's resident set after its start-up and
each step), steps per minute, and each finished evaluation's figures as the evaluator wrote them to
the run's metrics (or what cut the wait for it).
Every figure is read from the run (its metrics.jsonl, resolved config.json, logs, evaluations in
its Redis, and samples of each process's memory taken here once a second); none is written in
here. `--out` also keeps each run's logs, metrics.jsonl and config.json; the model, checkpoints and
Redis's files (gigabytes on a GPU) go to `--work` (default OUT/work).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # common/ from the checkout, without `pip install -e .`

STEPS = ("gpu-tests", "one-gpu", "two-gpus")
KIT = ROOT / ".gpu-kit"
# What each step needs to import (module names); the check itself needs only the standard library,
# torch, transformers and tokenizers (to build the model), and psutil (for memory; optional).
RUN_NEEDS = ("redis", "rq", "trio", "pydantic", "pydantic_settings", "datasets", "msgpack", "xxhash", "numpy",
             "torch", "transformers", "tokenizers", "safetensors", "jinja2")
TEST_NEEDS = ("pytest", "pytest_timeout", *RUN_NEEDS)
# Qwen2.5-0.5B's shape (its config.json): the model the GPU runs train, with the tiny tokenizer.
QWEN_05B = {"hidden": 896, "layers": 24, "heads": 14, "kv_heads": 2, "intermediate": 4864, "max_positions": 1024}
# Dense bf16 tensor-core peak of one GPU, FLOP/s, from NVIDIA's datasheets, by a part of the name
# the device reports; the first match wins. A GPU not here has no MFU ("unknown peak").
PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200", 989e12), ("A100", 312e12))
STOP_GRACE_S = 30  # each process's STOP_GRACE_S: a generator gives up what it holds past it
EVALUATOR = "evaluator"  # the process whose queued evaluations a run waits for once the trainer is done


def say(line: str) -> None:
    print(f"gpu-check: {line}", flush=True)


@dataclass
class Step:
    """One step's outcome, as the report shows it."""

    name: str  # one of STEPS
    status: str  # "ran", "skipped" or "failed"
    reason: str = ""  # why skipped or failed; what it did where it ran
    log_tail: str = ""  # the end of the log that shows the failure
    details: dict = field(default_factory=dict)  # what the step measured and how it ran


# ---------------------------------------------------------------------- the host

PROBE = """
import importlib, importlib.util, json, sys
out = {"python": sys.executable, "python_version": sys.version.split()[0], "missing": {},
       # as engines.choice.vllm_available decides engine "auto": the distribution is there
       "vllm": importlib.util.find_spec("vllm") is not None}
for name in json.loads(sys.argv[1]):
    try:
        importlib.import_module(name)  # imported, not looked up: a package whose own dependency is missing fails
    except Exception as err:  # whatever stops it importing is what the probe reports
        out["missing"][name] = f"{type(err).__name__}: {err}"
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, cuda_available=torch.cuda.is_available(),
               devices=[torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])
except (ImportError, OSError, RuntimeError) as err:  # a torch that does not load here
    out.update(torch=None, torch_error=f"{type(err).__name__}: {err}", devices=[])
print(json.dumps(out))
"""


def probe_host() -> dict:
    """What this python sees, asked in a process of its own (CUDA stays uninitialised here)."""
    needs = sorted(set(TEST_NEEDS) | {"psutil"})
    out = subprocess.run([sys.executable, "-c", PROBE, json.dumps(needs)], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, f"probing {sys.executable} failed:\n{out.stderr[-3000:]}"
    host = json.loads(out.stdout.strip().splitlines()[-1])
    host["hostname"] = socket.gethostname()
    host["nvidia_smi"] = shutil.which("nvidia-smi")
    return host


def missing_line(missing: dict[str, str]) -> str:
    """What does not import ({module: the error}) and what to do about it: the kit's one line where
    the kit is here."""
    listed = "; ".join(f"{name} ({why})" for name, why in missing.items())
    wheels = KIT / "whl"
    if wheels.is_dir():
        return (f"python packages that do not import: {listed}; install the kit's wheels first: "
                f"pip install --no-index --no-deps --target /tmp/site {wheels.relative_to(ROOT)}/*.whl && "
                f"export PYTHONPATH=/tmp/site")
    return f"python packages that do not import: {listed} (no {wheels.relative_to(ROOT)} here: see docs/gpu.md)"


def peak_flops(device: str) -> float | None:
    return next((peak for part, peak in PEAK_BF16 if part in device), None)


# ---------------------------------------------------------------------- Redis

def redis_binary(given: str | None) -> Path | None:
    """--redis-server, else `redis-server` on PATH, else the kit's."""
    if given:
        return Path(given).resolve()
    found = shutil.which("redis-server")
    if found:
        return Path(found)
    kit = KIT / "redis" / "redis-server"
    return kit if kit.is_file() else None


def redis_wrapper(binary: Path, bin_dir: Path) -> Path:
    """`bin_dir/redis-server`: runs `binary` with its own directory on LD_LIBRARY_PATH where its
    shared libraries travel beside it (the kit), so no other process of the check sees them."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    wrapper = bin_dir / "redis-server"
    libs = any(binary.parent.glob("*.so*"))
    env = f'LD_LIBRARY_PATH="{binary.parent}${{LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}}" ' if libs else ""
    wrapper.write_text(f'#!/bin/sh\n{env}exec "{binary}" "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def redis_problem(wrapper: Path) -> str | None:
    """Why this redis-server cannot be used, or None."""
    try:
        out = subprocess.run([str(wrapper), "--version"], capture_output=True, text=True, timeout=30)
    except OSError as err:
        return f"{wrapper}: {err}"
    return None if out.returncode == 0 else f"redis-server --version exited {out.returncode}: {out.stderr[-500:]}"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1) as s:
        s.sendall(b"PING\r\n")
        return s.recv(64).startswith(b"+PONG")
    return False


def start_redis(wrapper: Path, *, files: Path, log: Path, port: int) -> subprocess.Popen:
    """A redis-server for one run (append-only, its files in `files`, loopback), up and answering."""
    files.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen([str(wrapper), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(files),
                             "--appendonly", "yes", "--save", "", "--daemonize", "no"],
                            stdout=open(log, "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115 - the child owns it
    deadline = time.monotonic() + 30
    while not redis_answers(port):
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"redis-server did not start on port {port}: {tail(log)}")
        time.sleep(0.1)
    return proc


def tail(path: Path, chars: int = 3000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else f"({path} was not written)"


# ---------------------------------------------------------------------- step 1: pytest -m gpu

GPU_TESTS = ("tests/test_gpu.py", "tests/test_shared_prompts.py", "tests/test_varlen.py", "tests/test_logprobs.py")


def gpu_tests(host: dict, *, bin_dir: Path | None, out: Path, time_limit: float, cuda: bool) -> Step:
    """`pytest -m gpu` over GPU_TESTS, the check's redis-server first on PATH (tests/conftest.py
    starts the one PATH gives it), CUDA hidden unless `cuda`. Ran where a test passed and none
    failed; skipped where every test skipped (no CUDA), saying why."""
    missing = {m: why for m, why in host["missing"].items() if m in TEST_NEEDS}
    if missing:
        return Step("gpu-tests", "failed", missing_line(missing))
    if bin_dir is None:
        return Step("gpu-tests", "failed", "no usable redis-server (--redis-server PATH)")
    log = out / "gpu-tests.log"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
           **({} if cuda else {"CUDA_VISIBLE_DEVICES": ""})}
    argv = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-rs", "-p", "no:cacheprovider", *GPU_TESTS]
    say(f"gpu-tests: {' '.join(argv[1:])} (log {log})")
    try:
        with open(log, "wb") as f:
            code = subprocess.run(argv, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                  timeout=time_limit).returncode
    except subprocess.TimeoutExpired:
        return Step("gpu-tests", "failed", f"still running after the time limit ({time_limit:g} s)", tail(log))
    return pytest_outcome(log.read_text(errors="replace"), code, cuda=cuda)


def pytest_outcome(text: str, code: int, *, cuda: bool) -> Step:
    """The step as pytest's `-q -rs` output and exit status tell it."""
    counts = {kind: int(n) for n, kind in re.findall(r"(\d+) (passed|failed|skipped|error|errors)\b",
                                                     text.strip().splitlines()[-1] if text.strip() else "")}
    reasons = sorted({m.strip() for m in re.findall(r"^SKIPPED \[\d+\] [^:]+:\d+: (.*)$", text, re.M)})
    summary = ", ".join(f"{n} {kind}" for kind, n in counts.items())
    details = {"counts": counts, "skip_reasons": reasons}
    if code != 0:
        return Step("gpu-tests", "failed", f"pytest exited {code} ({summary or 'no summary'})", text[-3000:], details)
    if not counts.get("passed"):
        why = "no CUDA" if not cuda else "every test skipped"
        return Step("gpu-tests", "skipped", f"{why}: {summary} ({'; '.join(reasons)})", details=details)
    return Step("gpu-tests", "ran", summary + (f" ({'; '.join(reasons)})" if reasons else ""), details=details)


# ---------------------------------------------------------------------- steps 2 and 3: the gsm8k run

@dataclass(frozen=True)
class Proc:
    """One process of a run."""

    name: str  # "trainer", "generator g1", ...; its log is logs/<name with - for spaces>.log
    argv: tuple[str, ...]  # after the python executable
    gpus: str | None  # its CUDA_VISIBLE_DEVICES ("": none, the CPU); None: the caller's (producer, evaluator)


def plan(*, gpus: int, ranks: int) -> list[Proc]:
    """The processes of a run on a host with `gpus` GPUs (0: the CPU) whose trainer has `ranks`
    ranks: with one, everything on GPU 0 (the generator shares it with the trainer); with more,
    the trainer under torchrun on GPUs 0..ranks-1 and one generator per other GPU, each leasing one
    of them through Redis (generators/devices.py), or one generator on the trainer's last GPU
    where there is no other. Without GPUs every process sees none (CUDA_VISIBLE_DEVICES empty)."""
    assert ranks == 1 or gpus >= ranks, f"a trainer of {ranks} ranks needs {ranks} GPUs, found {gpus}"
    if ranks == 1:
        trainer: tuple[str, ...] = ("-m", "trainer")
        trainer_gpus, generator_gpus = ("0", ["0"]) if gpus else ("", [""])
    else:
        trainer = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks), "-m", "trainer")
        trainer_gpus = ",".join(str(i) for i in range(ranks))
        others = [str(i) for i in range(ranks, gpus)]
        generator_gpus = [",".join(others)] * len(others) if others else [str(ranks - 1)]
    return [Proc("producer", ("-m", "producers"), None if gpus else ""),
            *(Proc(f"generator g{i}", ("-m", "generators", "--id", f"g{i}"), g)
              for i, g in enumerate(generator_gpus, 1)),
            Proc("trainer", trainer, trainer_gpus),
            Proc(EVALUATOR, ("-m", "evaluator"), None if gpus else "")]


def substitutions(*, scratch: Path, model: Path, redis_url: str, steps: int, vllm: bool, dry_run: bool,
                  ranks: int = 1) -> dict[str, tuple[str, str]]:
    """{variable: (value, why)}: what the run changes of configs/gsm8k.toml; the caller's own
    ROLLOUTS_<SECTION>__<FIELD> variables win over these. A run whose trainer has `ranks` > 1 also
    sends its weights over NCCL (rank 0 on GPU 0, the generators on others)."""
    from common.config import ENV_NOT_FIELDS, ENV_PREFIX

    subs = {
        "ROLLOUTS_MODEL__PATH": (str(model), "no hub here: a random model built by the check (common/tiny.py)"),
        "ROLLOUTS_REDIS_URL": (redis_url, "the check's own redis-server"),
        "ROLLOUTS_OUTPUT_DIR": (str(scratch / "run"), "under --work"),
        "ROLLOUTS_TRAINER__MAX_STEPS": (str(steps), "a short run (--steps)"),
    }
    if dry_run:
        subs["ROLLOUTS_GENERATOR__ENGINE"] = ("hf", "dry run: the HF engine starts in seconds on a CPU")
        for name, value in (("GROUP_SIZE", "4"), ("PROMPTS_PER_STEP", "4"), ("MAX_NEW_TOKENS", "16")):
            subs[f"ROLLOUTS_ROLLOUT__{name}"] = (value, "dry run: fewer, shorter rollouts on a CPU")
        subs["ROLLOUTS_EVAL__EVERY"] = (str(steps), "dry run: one evaluation, of the last version, waited for")
        for name, value in (("PROMPTS", "4"), ("PASS_K", "2")):
            subs[f"ROLLOUTS_EVAL__{name}"] = (value, "dry run: a short evaluation on a CPU")
    elif not vllm:
        subs["ROLLOUTS_GENERATOR__ENGINE"] = ("hf", "vLLM is not installed on this host")
    if ranks > 1 and not dry_run:
        subs["ROLLOUTS_TRAINER__WEIGHT_TRANSFER"] = ("nccl", "weights also broadcast over NCCL from the trainer's "
                                                     "rank 0 (GPU 0) to the generators on the other GPUs")
    for name, value in sorted(os.environ.items()):
        if name.startswith(ENV_PREFIX) and name not in ENV_NOT_FIELDS:
            subs[name] = (value, "set when calling the check")
    return subs


def process_env(subs: dict[str, tuple[str, str]], *, scratch: Path, gpus: str | None) -> dict[str, str]:
    """A run's process environment: the caller's (its PYTHONPATH after the checkout), the config
    file, the substitutions, no hub, and the GPUs it may see."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    env.update({name: value for name, (value, _) in subs.items()},
               ROLLOUTS_CONFIG=str(ROOT / "configs" / "gsm8k.toml"),
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")])),
               PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", HF_HOME=str(scratch / "hf"),
               STOP_GRACE_S=str(STOP_GRACE_S), TRANSFORMERS_VERBOSITY="error",
               PYTHONWARNINGS="ignore::DeprecationWarning,ignore::FutureWarning")
    if gpus is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpus
    return env


@dataclass(frozen=True)
class Dirs:
    """Where one run's files go."""

    kept: Path  # under --out: its processes' logs, its metrics.jsonl and resolved config.json
    scratch: Path  # under --work: its working directory (the data), output_dir (checkpoints), Redis's files

    def log(self, name: str) -> Path:
        return self.kept / "logs" / f"{name.replace(' ', '-')}.log"


@dataclass
class Outcome:
    """How a run's processes ended."""

    codes: dict[str, int | None] = field(default_factory=dict)  # exit status by process; None: killed by us
    problem: str = ""  # what went wrong ("" nothing)
    culprit: str = ""  # the process whose log shows it
    seconds: float = 0.0  # from the first process started to the trainer's exit (or the stop)
    # What became of the run's evaluations once the trainer was done (wait_for_evals); {}: not
    # waited for (the run did not end cleanly)
    evals: dict = field(default_factory=dict)


def run_processes(procs: list[Proc], subs: dict[str, tuple[str, str]], *, dirs: Dirs, steps: int,
                  time_limit: float, memory: Memory, redis_url: str) -> Outcome:
    """Start `procs` and wait for the trainer to exit (or any other process, or the time limit).
    The trainer done, stop all but the evaluator, wait for the evaluations queued to end (within
    the same time limit), then stop it: each with SIGTERM, as honcho does under ./ops/run."""
    started: dict[str, subprocess.Popen] = {}
    try:
        for p in procs:
            with sigterm_held():  # one arriving between a start and its record would leave that process running
                started[p.name] = subprocess.Popen(
                    [sys.executable, *p.argv], cwd=dirs.scratch,
                    env=process_env(subs, scratch=dirs.scratch, gpus=p.gpus),
                    stdout=open(dirs.log(p.name), "ab"),  # noqa: SIM115 - the child owns it
                    stderr=subprocess.STDOUT, start_new_session=True)
        memory.watch(started)
        t0, out = time.monotonic(), Outcome()
        out.problem, out.culprit = wait_for_trainer(started, steps=steps, time_limit=time_limit)
        out.seconds = time.monotonic() - t0
        codes: dict[str, int | None] = {}
        if not out.problem and EVALUATOR in started:
            codes = stop_all({name: p for name, p in started.items() if name != EVALUATOR})
            resolved = json.loads((dirs.scratch / "run" / "config.json").read_text())  # the trainer's, as it ran
            out.evals = wait_for_evals(started[EVALUATOR], redis_url=redis_url, run=resolved["run"],
                                       deadline=t0 + time_limit, time_limit=time_limit)
        codes.update(stop_all({name: p for name, p in started.items() if name not in codes}))
        out.codes = {name: codes[name] for name in started}
        if not out.problem:
            bad = {name: code for name, code in out.codes.items() if code != 0}
            if bad:
                out.culprit = next(iter(bad))
                out.problem = "stopped with SIGTERM, not every process exited 0: " + \
                    ", ".join(f"{name} {code}" for name, code in bad.items())
        return out
    except BaseException:  # SIGTERM or Ctrl-C mid-run: nothing of the run is left behind
        stop_all(started)  # those that ended too: what their sessions still hold
        raise


@contextlib.contextmanager
def sigterm_held() -> Iterator[None]:
    """A SIGTERM arriving within is acted on (by the handler in place before) at its end. Not the
    signal mask: a process started within would inherit it, and never see its own SIGTERM."""
    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, _frame: got.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
        if got:
            signal.raise_signal(signal.SIGTERM)


def wait_for_trainer(started: dict[str, subprocess.Popen], *, steps: int, time_limit: float) -> tuple[str, str]:
    """(what went wrong, the process whose log shows it) once the trainer exits, another process
    exits first, or `time_limit` passes; ("", "trainer") where the trainer exited 0."""
    t0 = time.monotonic()
    while True:
        ended = {name: p.returncode for name, p in started.items() if p.poll() is not None}
        if "trainer" in ended:
            return ("" if ended["trainer"] == 0 else f"the trainer exited {ended['trainer']}"), "trainer"
        if ended:
            name, code = next(iter(ended.items()))
            return f"{name} exited {code} before the trainer's last step", name
        if time.monotonic() - t0 > time_limit:
            return f"time limit ({time_limit:g} s) reached before step {steps}", "trainer"
        time.sleep(0.5)


def wait_for_evals(evaluator: subprocess.Popen, *, redis_url: str, run: str, deadline: float,
                   time_limit: float) -> dict:
    """Wait until none of the run's evaluation jobs is queued or running (or the evaluator exits,
    or `deadline` passes); then what became of them: each finished evaluation as the evaluator
    wrote it to the run's metrics (common.evals.EvalResult.entry), the job ids left unfinished and
    failed, the seconds waited, and what cut the wait ("" nothing)."""
    from common.evals import failed_evals, read_evals, unfinished_evals
    from common.keys import Keys
    from common.streams import connect

    r, keys, t0, cut = connect(redis_url), Keys(run), time.monotonic(), ""
    try:
        waiting = unfinished_evals(r, keys)
        if waiting:
            say(f"the trainer is done; waiting for {len(waiting)} evaluation(s): {', '.join(waiting)}")
        while waiting:
            if evaluator.poll() is not None:
                cut = f"the evaluator exited {evaluator.returncode}"
                break
            if time.monotonic() > deadline:
                cut = f"the time limit ({time_limit:g} s) cut the wait"
                break
            time.sleep(1.0)
            waiting = unfinished_evals(r, keys)
        done = read_evals(r, keys)
        return {"finished": [done[v].entry() for v in sorted(done)], "unfinished": waiting,
                "failed": failed_evals(r, keys), "waited_s": round(time.monotonic() - t0, 1), "cut": cut}
    finally:
        r.close()


def stop_all(started: dict[str, subprocess.Popen]) -> dict[str, int | None]:
    """SIGTERM to each process still running (its whole session: torchrun's ranks, reward
    workers); SIGKILL what is left after STOP_GRACE_S and a margin. Returns once every process of
    those sessions is gone, not only the ones started (a reward worker may outlive its generator
    by a moment). Exit statuses by name."""
    for p in started.values():
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S + 15
    codes: dict[str, int | None] = {}
    for name, p in started.items():
        try:
            codes[name] = p.wait(timeout=max(deadline - time.monotonic(), 0.1))
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            codes[name] = None
    # What else the sessions hold (reward workers run in process groups of their own, deaf to
    # SIGTERM, and exit when they see their generator gone): waited for, then killed.
    sessions = {p.pid for p in started.values()}
    while session_members(sessions) and time.monotonic() < deadline:
        time.sleep(0.1)
    for pid in session_members(sessions):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while session_members(sessions) and time.monotonic() < deadline + 10:
        time.sleep(0.1)
    return codes


def session_members(sessions: set[int]) -> list[int]:
    """The live processes (not zombies) whose session is one of `sessions` (Linux: /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getsid(int(entry)) in sessions:
                state = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    out.append(int(entry))
        except (OSError, IndexError):
            continue
    return out


def build_model(path: Path, *, dry_run: bool) -> Path:
    """The run's model: the tiny one in a dry run, else Qwen2.5-0.5B's shape with the tiny tokenizer."""
    from transformers.utils import logging as hf_logging

    from common.tiny import build_tiny_model

    hf_logging.disable_progress_bar()
    if (path / "config.json").is_file():
        return path
    say(f"building {'the tiny model' if dry_run else 'a random model of Qwen2.5-0.5B shape'} in {path}")
    return build_tiny_model(path, max_positions=1024) if dry_run else build_tiny_model(path, **QWEN_05B)


def gsm8k_run(name: str, host: dict, *, ranks: int, wrapper: Path, model: Path, dirs: Dirs, steps: int,
              time_limit: float, dry_run: bool) -> Step:
    """One short run of configs/gsm8k.toml (`ranks` trainer ranks), measured."""
    from common.tiny import write_gsm8k

    (dirs.kept / "logs").mkdir(parents=True)
    dirs.scratch.mkdir(parents=True)
    write_gsm8k(dirs.scratch)  # the data set configs/gsm8k.toml names by hub id, as a local directory of that name
    port = free_port()
    subs = substitutions(scratch=dirs.scratch, model=model, redis_url=f"redis://127.0.0.1:{port}/0", steps=steps,
                         vllm=host["vllm"], dry_run=dry_run, ranks=ranks)
    procs = plan(gpus=0 if dry_run else len(host["devices"]), ranks=ranks)
    say(f"{name}: {', '.join(f'{p.name} (GPUs {p.gpus})' if p.gpus else p.name for p in procs)}; logs in "
        f"{dirs.kept / 'logs'}")
    server = start_redis(wrapper, files=dirs.scratch / "redis", log=dirs.log("redis"), port=port)
    memory = Memory(nvidia_smi=None if dry_run else host["nvidia_smi"], metrics=dirs.scratch / "run" / "metrics.jsonl",
                    trainer_log=dirs.log("trainer"), steps=steps)
    if not dry_run and not host["nvidia_smi"]:
        memory.note = "no nvidia-smi on PATH: no GPU memory figures"
    try:
        outcome = run_processes(procs, subs, dirs=dirs, steps=steps, time_limit=time_limit, memory=memory,
                                redis_url=subs["ROLLOUTS_REDIS_URL"][0])
    finally:
        memory.stop()
        server.terminate()
        server.wait(timeout=30)
    for kept in ("metrics.jsonl", "config.json"):  # the run's own records, beside its logs
        if (dirs.scratch / "run" / kept).exists():
            shutil.copy(dirs.scratch / "run" / kept, dirs.kept / kept)
    details = {"processes": [asdict(p) for p in procs], "substitutions": subs, "exit_codes": outcome.codes,
               "seconds": round(outcome.seconds, 1), "memory": memory.peaks(), "evaluations": outcome.evals,
               "kept": str(dirs.kept),
               "scratch": str(dirs.scratch)}
    figures, problem = run_figures(dirs.kept, steps=steps,
                                   device=host["devices"][0] if host["devices"] and not dry_run else None)
    details["figures"] = figures
    if outcome.problem or problem:
        culprit = dirs.log(outcome.culprit) if outcome.culprit else None
        return Step(name, "failed", outcome.problem or problem, tail(culprit) if culprit else "", details)
    return Step(name, "ran", f"{figures['steps']} trainer steps in {outcome.seconds:.0f} s", details=details)


# ---------------------------------------------------------------------- memory, sampled once a second

class Memory:
    """Peak memory of each process of a run, sampled once a second in a thread: resident memory
    of its process tree (psutil), with when it peaked (seconds since the start, and the trainer's
    phase then: start-up, step N, after its exit) and the trainer's own at each of its boundaries;
    and GPU memory by process and by GPU (nvidia-smi)."""

    def __init__(self, *, nvidia_smi: str | None, metrics: Path | None = None, trainer_log: Path | None = None,
                 steps: int = 0) -> None:
        self.nvidia_smi = nvidia_smi
        self.metrics = metrics  # the trainer's metrics.jsonl: a line per step done
        self.trainer_log = trainer_log  # where the trainer says it is loaded (RANKS)
        self.steps = steps  # the trainer's last step
        self.rss: dict[str, int] = {}  # process name -> peak resident bytes of its tree
        self.rss_peak_at: dict[str, dict] = {}  # process name -> {"at_s", "trainer": its phase} at that peak
        self.trainer_rss: list[dict] = []  # {"after": "start-up" or "step N", "at_s", "mib"}: the first sample
        # after each of the trainer's boundaries
        self.gpu_by_pid: dict[str, int] = {}  # "name (pid N)" -> peak MiB nvidia-smi showed
        self.gpu_by_device: dict[str, int] = {}  # "GPU i" -> peak MiB used (every process on it)
        self.note = ""  # why a figure is missing
        self.started: dict[str, subprocess.Popen] = {}
        self.t0 = time.monotonic()
        self.loaded, self.steps_done = False, 0  # the trainer's progress, as last sampled
        self.done = threading.Event()
        self.thread = threading.Thread(target=self.loop, daemon=True)

    def watch(self, started: dict[str, subprocess.Popen]) -> None:
        self.started, self.t0 = started, time.monotonic()
        self.thread.start()

    def loop(self) -> None:
        try:
            import psutil
        except ImportError:
            self.note = "psutil is not installed: no resident memory figures"
            psutil = None
        # A second on a GPU host (nvidia-smi is slow); a quarter of one without, where the tiny
        # model's trainer can load, step and exit between two samples a second apart.
        while not self.done.wait(1.0 if self.nvidia_smi else 0.25):
            pids, totals = self.sample_rss(psutil) if psutil else ({}, {})
            self.keep_rss(totals)
            if self.nvidia_smi:
                self.sample_gpus(pids)

    def sample_rss(self, psutil) -> tuple[dict[int, str], dict[str, int]]:  # noqa: ANN001 - the module
        """({pid: process name} of every process of each tree, {process name: resident bytes of its tree})."""
        pids, totals = {}, {}
        for name, popen in self.started.items():
            with contextlib.suppress(psutil.Error):
                tree = [psutil.Process(popen.pid)]
                tree += tree[0].children(recursive=True)
                total = 0
                for p in tree:
                    with contextlib.suppress(psutil.Error):
                        total += p.memory_info().rss
                        pids[p.pid] = name
                totals[name] = total
        return pids, totals

    def keep_rss(self, totals: dict[str, int]) -> None:
        """Each process's peak and when it came; the trainer's resident set at a boundary it crossed."""
        at = round(time.monotonic() - self.t0, 1)
        phase, crossed = self.trainer_phase()
        for name, total in totals.items():
            if total > self.rss.get(name, 0):
                self.rss[name] = total
                self.rss_peak_at[name] = {"at_s": at, "trainer": phase}
        for boundary in crossed if totals.get("trainer") else ():  # 0: gone since the look at its phase
            self.trainer_rss.append({"after": boundary, "at_s": at, "mib": round(totals["trainer"] / 2**20)})

    def trainer_phase(self) -> tuple[str, list[str]]:
        """The trainer's phase now ("start-up" until it says it is loaded, "step N" while it takes
        step N, its publish included, "shutdown" after its last, "exited"), and the boundaries it
        crossed since the last sample ("start-up", then the last "step N"; both where a short
        start-up and a fast step fall between two samples)."""
        trainer = self.started.get("trainer")
        if trainer is None or trainer.poll() is not None:
            return "exited", []
        crossed = []
        if not self.loaded and self.trainer_log is not None and RANKS.search(tail(self.trainer_log, 10**6)):
            self.loaded = True
            crossed.append("start-up")
        done = steps_written(self.metrics, before=self.steps_done) if self.metrics is not None else 0
        if done > self.steps_done:
            self.steps_done = done
            crossed.append(f"step {done}")
        if not self.loaded:
            return "start-up", crossed
        return ("shutdown" if self.steps and self.steps_done >= self.steps else f"step {self.steps_done + 1}"), crossed

    def sample_gpus(self, pids: dict[int, str]) -> None:
        """nvidia-smi's memory in use by GPU and by process; a process of another PID namespace (a
        container's, seen from the host's) is not one of `pids` and is shown by its number."""
        gpus = smi(self.nvidia_smi, "--query-gpu=index,uuid,memory.used")
        index = {row[1]: row[0] for row in gpus if len(row) == 3}
        for row in gpus:
            if len(row) == 3:
                peak(self.gpu_by_device, f"GPU {row[0]}", row[2])
        for row in smi(self.nvidia_smi, "--query-compute-apps=pid,gpu_uuid,used_memory"):
            if len(row) == 3 and row[0].isdigit():
                who = pids.get(int(row[0]), "not started by the check (or of another PID namespace)")
                peak(self.gpu_by_pid, f"{who} (pid {row[0]}, GPU {index.get(row[1], '?')})", row[2])

    def stop(self) -> None:
        self.done.set()
        if self.thread.is_alive():
            self.thread.join(timeout=30)

    def peaks(self) -> dict:
        return {"rss_mib": {name: round(b / 2**20) for name, b in self.rss.items()},
                "rss_peak_at": self.rss_peak_at, "trainer_rss_mib": self.trainer_rss,
                "gpu_mib_by_process": self.gpu_by_pid, "gpu_mib_by_device": self.gpu_by_device,
                "note": self.note}


def steps_written(metrics: Path, *, before: int) -> int:
    """Trainer steps in its metrics.jsonl; `before` while there is none yet or a line is half written."""
    from common.metrics import read_metrics

    try:
        return len(read_metrics(metrics))
    except (OSError, ValueError):
        return before


def peak(peaks: dict[str, int], key: str, mib: str) -> None:
    """Keep the larger of `peaks[key]` and nvidia-smi's `mib` (which may say "[N/A]")."""
    with contextlib.suppress(ValueError):
        peaks[key] = max(peaks.get(key, 0), int(float(mib)))


def smi(nvidia_smi: str, query: str) -> list[list[str]]:
    """nvidia-smi's CSV rows for `query` (no header, no units); [] where it fails."""
    try:
        out = subprocess.run([nvidia_smi, query, "--format=csv,noheader,nounits"], capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [[c.strip() for c in line.split(",")] for line in out.stdout.splitlines() if line.count(",")] \
        if out.returncode == 0 else []


# ---------------------------------------------------------------------- the run's figures

# A generator's line for each weight load (generators/engine_loop.py), its seconds by stage.
LOADED = re.compile(r"loaded weights version (\d+) \(verify ([\d.]+|nan) s, reload ([\d.]+|nan) s; announced "
                    r"([\d.]+|nan) s after publishing, drained ([\d.]+|nan) s")
RANKS = re.compile(r"trainer: run .*?(\d+) rank\(s\) on (\w+)")  # the trainer's start-up line (trainer/main.py)


def run_figures(kept: Path, *, steps: int, device: str | None) -> tuple[dict, str]:
    """The figures of the run whose records and logs are in `kept`, and what is wrong with them
    ("" nothing): fewer than `steps` trainer steps, or none at all."""
    from common.metrics import read_metrics

    try:
        rows = read_metrics(kept / "metrics.jsonl")
    except (OSError, ValueError) as err:
        return {"steps": 0}, f"no trainer steps: {err}"
    resolved = json.loads((kept / "config.json").read_text())
    trainer_log = tail(kept / "logs" / "trainer.log", 10**7)
    found = RANKS.search(trainer_log)
    world, on = (int(found[1]), found[2]) if found else (1, "?")
    steady = rows[1:] or rows  # the first step waits for the engines to start and warms CUDA up
    train_s, step_s = sum(m.time_train for m in steady), sum(m.time_step for m in steady)
    trainer_tps = sum(m.tokens_per_s * m.time_train for m in steady) / train_s
    figures = {
        "steps": len(rows), "counted": f"step {steady[0].step}" if len(steady) == 1 else
        f"steps {steady[0].step}-{steady[-1].step}", "ranks": world, "device": on,
        "model": resolved["model"]["path"], "dtype": resolved["model"]["dtype"],
        "engine": resolved["generator"]["engine"],
        "rollout": {k: resolved["rollout"][k] for k in ("group_size", "prompts_per_step", "max_new_tokens")},
        "steps_per_minute": 60 * len(steady) / step_s,
        "trainer_tokens_per_s": trainer_tps,
        "trained_tokens_per_s": sum(m.tokens_trained for m in steady) / step_s,
        "wait_data_share": sum(m.time_wait_data for m in steady) / step_s,
        "generator_tokens_per_s": sum(m.generators_tokens_per_s for m in steady) / len(steady),
        "generator_tokens_per_s_max": max(m.generators_tokens_per_s for m in rows),
        "mean_completion_tokens": sum(m.mean_length for m in steady) / len(steady),
        "transfer": transfer(rows, kept / "logs", resolved),
        "per_step": [{"step": m.step, "time_step": m.time_step, "time_wait_data": m.time_wait_data,
                      "time_train": m.time_train, "time_publish": m.time_publish, "tokens_per_s": m.tokens_per_s,
                      "tokens_trained": m.tokens_trained, "generators_tokens_per_s": m.generators_tokens_per_s,
                      "mean_length": m.mean_length} for m in rows],
    }
    figures.update(mfu(figures["model"], trainer_tps, world=world, device=device))
    problem = f"the trainer took {len(rows)} steps of {steps}" if len(rows) < steps else ""
    return figures, problem


def transfer(rows: list, logs: Path, resolved: dict) -> dict:
    """Seconds a weight version takes by path: the trainer's step publishing it (`time/publish`: the
    write and announcement where the step makes them, with the trainer state; otherwise the copy to
    the host, and the wait for the version before, written beside the step), then each generator's
    wait to hear of it, to finish the completions in flight (drained), its checksum check (in the
    meantime) and reload (its log)."""
    loads = [tuple(float(x) for x in m.groups()[1:]) for log in sorted(logs.glob("generator-*.log"))
             for m in LOADED.finditer(log.read_text(errors="replace"))]
    publish = [m.time_publish for m in rows]

    def stats(values: list[float]) -> dict:
        values = [v for v in values if not math.isnan(v)]
        return {"mean": sum(values) / len(values), "max": max(values), "n": len(values)} if values else {}

    return {"disk": {"publish_s": stats(publish), "heard_s": stats([x[2] for x in loads]),
                     "drained_s": stats([x[3] for x in loads]), "verify_s": stats([x[0] for x in loads]),
                     "reload_s": stats([x[1] for x in loads])},
            "collective": collective(resolved["trainer"].get("weight_transfer", "disk"), logs)}


# The trainer's line for each broadcast, and for one that failed (trainer/transfer.py).
BROADCAST = re.compile(r"version \d+ broadcast over \w+ to (\d+) generator\(s\), ([\d.]+) MiB in ([\d.]+) s")
BROADCAST_FAILED = re.compile(r"broadcasting version \d+ to .* failed")


def collective(backend: str, logs: Path) -> dict | str:
    """The broadcasts of a run with trainer.weight_transfer = `backend`, from the trainer's log and
    the generators': seconds, MiB, and how many loads came from the broadcast and how many from the files."""
    if backend == "disk":
        return "not used: trainer.weight_transfer = \"disk\" (ROLLOUTS_TRAINER__WEIGHT_TRANSFER=gloo|nccl sets it)"
    trainer = tail(logs / "trainer.log", 10**7)
    sent = [(int(m[1]), float(m[2]), float(m[3])) for m in BROADCAST.finditer(trainer)]
    gens = [log.read_text(errors="replace") for log in sorted(logs.glob("generator-*.log"))]
    over = sum(text.count("received over the broadcast") for text in gens)
    seconds = [x[2] for x in sent]
    return {"backend": backend, "broadcasts": len(sent), "failed": len(BROADCAST_FAILED.findall(trainer)),
            "mib": sent[-1][1] if sent else None, "seconds": {"mean": sum(seconds) / len(seconds),
                                                              "max": max(seconds), "n": len(seconds)} if sent else {},
            "loads_received": over, "loads_from_files": sum(len(LOADED.findall(text)) for text in gens) - over}


def collective_line(c: dict | str) -> str:
    if isinstance(c, str):
        return c
    return (f"{c['backend']}, {c['broadcasts']} broadcasts of {number(c['mib'])} MiB in {fmt_stats(c['seconds'])}, "
            f"{c['failed']} failed; generators loaded {c['loads_received']} versions from the broadcast and "
            f"{c['loads_from_files']} from the files")


def safetensors_params(model: Path) -> int | None:
    """Parameters that take part in matmuls, from the safetensors headers: all of them, less the
    input embedding (a lookup) where the output layer has weights of its own."""
    files = sorted(model.glob("*.safetensors")) if model.is_dir() else []
    if not files:
        return None
    shapes = {}
    for path in files:
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    total = sum(math.prod(s) for s in shapes.values())
    embedding = next((math.prod(s) for k, s in shapes.items() if k.endswith("embed_tokens.weight")), 0)
    return total - embedding if any(k.endswith("lm_head.weight") for k in shapes) else total


def mfu(model: str, tokens_per_s: float, *, world: int, device: str | None) -> dict:
    """The trainer's model FLOPs utilisation: 6 x parameters x tokens through the model per second
    of training (forward and backward, attention's quadratic term and recomputation left out),
    over the peak of its `world` GPUs."""
    params = safetensors_params(Path(model))
    peak = peak_flops(device) if device else None
    out = {"params": params, "peak_flops_per_gpu": peak}
    if device is None:
        out["mfu"] = "no GPU (dry run)"
    elif peak is None or params is None:
        out["mfu"] = f"unknown peak for {device!r}" if peak is None else "unknown parameter count"
    else:
        out["mfu"] = 6 * params * tokens_per_s / (world * peak)
    return out


# ---------------------------------------------------------------------- the report

def write_report(out: Path, host: dict, steps: list[Step], argv: list[str]) -> None:
    """report.json (everything) and report.md (the same, to read), written after every step."""
    data = {"when": datetime.datetime.now().isoformat(timespec="seconds"), "command": " ".join(argv), "host": host,
            "steps": [asdict(s) for s in steps]}
    (out / "report.json").write_text(json.dumps(data, indent=2, default=str) + "\n")
    (out / "report.md").write_text(markdown(data, steps))


def markdown(data: dict, steps: list[Step]) -> str:
    host = data["host"]
    devices = ", ".join(sorted(set(host["devices"]))) or "none"
    lines = ["# GPU check", "",
             f"{data['when']} on {host['hostname']}: `{data['command']}`", "",
             f"- python {host['python_version']} ({host['python']})",
             f"- torch {host['torch'] or 'not importable: ' + host.get('torch_error', '')}, CUDA {host.get('cuda')}",
             f"- devices: {len(host['devices'])} x {devices}",
             f"- vLLM: {'installed' if host['vllm'] else 'not installed (the runs sample with the HF engine)'}",
             f"- python packages that do not import: "
             f"{'; '.join(f'{m} ({why})' for m, why in host['missing'].items()) or 'none'}", "",
             "| step | status | |", "|---|---|---|"]
    lines += [f"| {s.name} | {s.status} | {s.reason.replace('|', '/')} |" for s in steps]
    for s in steps:
        if s.log_tail:
            lines += ["", f"## {s.name}: {s.status}, the end of its log", "", "```", s.log_tail.strip(), "```"]
        if "figures" in s.details:
            lines += run_section(s)
    return "\n".join(lines) + "\n"


def number(value: object, spec: str = ".3g") -> str:
    return format(value, spec) if isinstance(value, int | float) else str(value)


def run_section(s: Step) -> list[str]:
    d, f = s.details, s.details["figures"]
    lines = ["", f"## {s.name}: the run", ""]
    lines += [f"- {p['name']}: `python {' '.join(p['argv'])}`" + (f", CUDA_VISIBLE_DEVICES={p['gpus']}"
                                                                    if p["gpus"] else "") for p in d["processes"]]
    lines += ["", "What it changed of configs/gsm8k.toml:", ""]
    lines += [f"- `{name}={value}`: {why}" for name, (value, why) in d["substitutions"].items()]
    if f.get("steps"):
        t, mem = f["transfer"], d["memory"]
        disk = t["disk"]
        lines += ["", f"Figures over {f['counted']} of {f['steps']} ({f['ranks']} trainer rank(s) on {f['device']}, "
                  f"{f['dtype']}, {f['engine']} engine; rollouts {f['rollout']}):", "",
                  f"- steps per minute: {number(f['steps_per_minute'])} (waiting for data "
                  f"{number(100 * f['wait_data_share'], '.0f')}% of the step)",
                  f"- trainer tokens/s: {number(f['trainer_tokens_per_s'])} through the model per second of training; "
                  f"{number(f['trained_tokens_per_s'])} trained (loss) tokens per second of step",
                  f"- trainer MFU: {mfu_line(f)}",
                  f"- generator tokens/s: {number(f['generator_tokens_per_s'])} mean of the steps' heartbeats (all "
                  f"generators), {number(f['generator_tokens_per_s_max'])} at most; completions "
                  f"{number(f['mean_completion_tokens'])} tokens on average",
                  f"- weight transfer, disk: the trainer's step publishing {fmt_stats(disk['publish_s'])} (a version "
                  f"is written beside the next step); generators "
                  f"heard it after {fmt_stats(disk['heard_s'])}, finished what was in flight in "
                  f"{fmt_stats(disk['drained_s'])}, verified it in {fmt_stats(disk['verify_s'])} (meanwhile), "
                  f"reloaded in {fmt_stats(disk['reload_s'])}",
                  f"- weight transfer, collective: {collective_line(t['collective'])}",
                  f"- peak resident memory (MiB, each process with its children; when, in seconds since the start "
                  f"and the trainer's phase then): {rss_line(mem)}",
                  f"- the trainer's resident memory (MiB) at its boundaries (the first sample after): "
                  f"{boundaries_line(mem['trainer_rss_mib'])}",
                  f"- peak GPU memory (MiB in use, nvidia-smi once a second: the CUDA context and what the caching "
                  f"allocator holds) by process: {mem['gpu_mib_by_process'] or mem['note'] or '-'}; "
                  f"by GPU: {mem['gpu_mib_by_device'] or '-'}"]
    lines += eval_lines(d["evaluations"])
    lines += ["", f"Exit statuses: {d['exit_codes']}; {d['seconds']} s; logs, metrics.jsonl and config.json in "
              f"{d['kept']}; checkpoints in {d['scratch']}/run"]
    return lines


def rss_line(mem: dict) -> str:
    if not mem["rss_mib"]:
        return mem["note"]
    return ", ".join(f"{name} {mib} at {mem['rss_peak_at'][name]['at_s']:g} s "
                     f"(trainer {mem['rss_peak_at'][name]['trainer']})" for name, mib in mem["rss_mib"].items())


def boundaries_line(samples: list[dict]) -> str:
    return ", ".join(f"{b['after']} {b['mib']} ({b['at_s']:g} s)" for b in samples) or "-"


def eval_lines(evals: dict) -> list[str]:
    """The run's evaluations: each finished one's figures as the evaluator wrote them, then the wait."""
    from common.evals import EvalResult

    if not evals:
        return ["", "Evaluations: not waited for (the run did not end cleanly)."]
    lines = ["", "Evaluations:", ""]
    for e in map(EvalResult.from_entry, evals["finished"]):
        lines.append(f"- version {e.version} (step {e.step}): skipped, {e.skipped}" if e.skipped is not None else
                     f"- version {e.version} (step {e.step}): {e.summary()} on {e.prompts} problems in "
                     f"{e.seconds:.1f} s")
    if not evals["finished"] and not evals["unfinished"]:
        lines.append("- none queued (eval.every)")
    wait = f"- waited {evals['waited_s']:g} s for them after the trainer's exit"
    if evals["cut"]:
        wait += f"; {evals['cut']}, unfinished: {', '.join(evals['unfinished'])}"
    if evals["failed"]:
        wait += f"; failed (RQ's failed registry): {', '.join(evals['failed'])}"
    return lines + [wait]


def mfu_line(f: dict) -> str:
    if not isinstance(f["mfu"], float):
        return f["mfu"]
    return (f"{100 * f['mfu']:.1f}% (6 x {f['params']:,} parameters x {f['trainer_tokens_per_s']:.4g} tokens/s / "
            f"({f['ranks']} x {f['peak_flops_per_gpu']:.4g} FLOP/s, dense bf16 peak))")


def fmt_stats(s: dict) -> str:
    return f"mean {s['mean']:.3g} s, max {s['max']:.3g} s over {s['n']}" if s else "-"


# ---------------------------------------------------------------------- the check

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # SIGTERM (a `timeout` around the check, a job's end) unwinds like Ctrl-C: the run's processes
    # and its Redis are stopped on the way out, never left behind
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    out = Path(args.out).resolve()
    work = Path(args.work).resolve() if args.work else out / "work"
    for folder, old in [(out, name) for name in (*STEPS, "gpu-tests.log", "report.md", "report.json")] + \
            [(work, name) for name in (*STEPS, "model", "bin")]:  # a previous check's
        if (folder / old).is_dir():
            shutil.rmtree(folder / old)
        else:
            (folder / old).unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    host = probe_host()
    say(f"python {host['python_version']} ({host['python']}), torch {host['torch']} (CUDA {host.get('cuda')}), "
        f"{len(host['devices'])} CUDA device(s): {', '.join(host['devices']) or 'none'}, "
        f"vLLM {'installed' if host['vllm'] else 'not installed'}{'; dry run on the CPU' if args.dry_run else ''}")
    if host["missing"]:
        say(missing_line(host["missing"]))
    binary = redis_binary(args.redis_server)
    wrapper = redis_wrapper(binary, work / "bin") if binary else None
    if wrapper and (problem := redis_problem(wrapper)):
        say(f"redis-server unusable: {problem}")
        wrapper = None
    say(f"redis-server: {binary or 'none (--redis-server PATH, or the kit: docs/gpu.md)'}")
    steps_done: list[Step] = []
    cuda = bool(host["devices"]) and not args.dry_run
    steps = args.steps or (2 if args.dry_run else 4)
    for name in STEPS:
        step = take_step(name, host, args=args, out=out, work=work, wrapper=wrapper, cuda=cuda, steps=steps)
        say(f"{name}: {step.status}{': ' + step.reason if step.reason else ''}")
        steps_done.append(step)
        write_report(out, host, steps_done, ["ops/gpu-check", *(argv if argv is not None else sys.argv[1:])])
    say(f"report: {out / 'report.md'}")
    return 1 if any(s.status == "failed" for s in steps_done) else 0


def take_step(name: str, host: dict, *, args: argparse.Namespace, out: Path, work: Path, wrapper: Path | None,
              cuda: bool, steps: int) -> Step:
    if name in args.skip:
        return Step(name, "skipped", "--skip")
    if name == "gpu-tests":
        return gpu_tests(host, bin_dir=wrapper.parent if wrapper else None, out=out, time_limit=args.time_limit,
                         cuda=cuda)
    ranks = 1 if name == "one-gpu" else 2
    if ranks == 2 and (not cuda or len(host["devices"]) < 2):
        return Step(name, "skipped", f"needs 2 GPUs, found {len(host['devices']) if cuda else 0}"
                    + (" (dry run)" if args.dry_run else ""))
    if ranks == 1 and not cuda and not args.dry_run:
        return Step(name, "skipped", "no CUDA device (--dry-run runs it on the CPU)")
    missing = {m: why for m, why in host["missing"].items() if m in RUN_NEEDS}
    if missing:
        return Step(name, "failed", missing_line(missing))
    if wrapper is None:
        return Step(name, "failed", "no usable redis-server (--redis-server PATH)")
    try:
        model = build_model(work / "model", dry_run=args.dry_run)
        return gsm8k_run(name, host, ranks=ranks, wrapper=wrapper, model=model, dirs=Dirs(out / name, work / name),
                         steps=steps, time_limit=args.time_limit, dry_run=args.dry_run)
    except (OSError, RuntimeError, ImportError, ValueError) as err:  # the step fails, the check goes on
        return Step(name, "failed", f"{type(err).__name__}: {err}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="ops/gpu-check", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true",
                   help="the same steps on the CPU with the tiny model, skipping what needs CUDA")
    p.add_argument("--steps", type=int, default=0, help="trainer steps of each run (default 4; 2 in a dry run)")
    p.add_argument("--out", default=str(ROOT / "runs" / "gpu-check"),
                   help="the report, and each run's logs, metrics.jsonl and config.json (default runs/gpu-check)")
    p.add_argument("--work", help="the model, checkpoints and Redis's files, gigabytes on a GPU (default OUT/work)")
    p.add_argument("--redis-server", help="the redis-server binary (default: on PATH, else .gpu-kit/redis/)")
    p.add_argument("--time-limit", type=float, default=600.0, help="seconds each step may take (default 600)")
    p.add_argument("--skip", action="append", default=[], choices=STEPS, help="leave a step out (repeatable)")
    return p.parse_args(argv)


if __name__ == "__main__":
    sys.exit(main())
