"""`ops/gpu-check` on this CPU: `--dry-run` takes every step (the gpu tests skip for want of CUDA, the
gsm8k run trains on the tiny model, the NCCL run skips for want of GPUs) and reports the run's
figures; a step that fails fails the check; and the pieces a GPU host needs that a CPU cannot run
(the process layout over GPUs, MFU against the GPU's peak) against values worked out by hand."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.evals import EvalResult
from ops.gpu_check import Memory, mfu, plan, pytest_outcome, safetensors_params
from tests.harness.processes import ROOT


def gpu_check(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess, str, dict]:
    """`ops/gpu-check ARGS` as a user types it, with this python as python3 and redis-server on PATH
    (nothing of ours installed for it but what the checkout holds); its output, report.md, report.json."""
    path = os.pathsep.join([str(Path(sys.executable).parent), str(Path(shutil.which("redis-server")).parent),
                            "/usr/local/bin:/usr/bin:/bin"])
    keep = {k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "USER")}
    out = tmp_path / "out"
    done = subprocess.run([str(ROOT / "ops" / "gpu-check"), "--out", str(out), *args], cwd=ROOT,
                          env={**keep, "PATH": path, **env}, capture_output=True, text=True, timeout=600)
    text = done.stdout + done.stderr
    assert (out / "report.md").exists(), text[-4000:]
    return done, (out / "report.md").read_text(), json.loads((out / "report.json").read_text())


def test_the_dry_run_takes_every_step_and_reports_the_runs_figures(tmp_path):
    # with its weights also broadcast (over gloo: CPUs), as a user sets it when calling the check
    done, report, data = gpu_check(tmp_path, "--dry-run", "--work", str(tmp_path / "work"),
                                   ROLLOUTS_TRAINER__WEIGHT_TRANSFER="gloo")
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    steps = {s["name"]: s for s in data["steps"]}
    assert list(steps) == ["gpu-tests", "one-gpu", "two-gpus"]
    assert steps["gpu-tests"]["status"] == "skipped" and steps["gpu-tests"]["reason"].startswith("no CUDA"), steps
    assert steps["gpu-tests"]["details"]["counts"]["skipped"] >= 4  # tests/test_gpu.py's and the cuda shared prompts
    assert steps["two-gpus"]["status"] == "skipped" and "needs 2 GPUs, found 0" in steps["two-gpus"]["reason"]
    run = steps["one-gpu"]
    assert run["status"] == "ran", run
    for line in ("| gpu-tests | skipped | no CUDA", "| one-gpu | ran | 2 trainer steps", "| two-gpus | skipped |"):
        assert line in report, report
    figures = run["details"]["figures"]
    assert figures["steps"] >= 2 and figures["device"] == "cpu" and figures["engine"] == "hf"
    assert figures["trainer_tokens_per_s"] > 0 and figures["steps_per_minute"] > 0, figures
    assert figures["generator_tokens_per_s"] > 0 and figures["trained_tokens_per_s"] > 0, figures
    assert figures["mfu"] == "no GPU (dry run)"
    assert figures["transfer"]["disk"]["publish_s"]["n"] >= 2, figures["transfer"]
    assert figures["transfer"]["disk"]["reload_s"]["n"] >= 1, figures["transfer"]  # a generator loaded a version
    broadcast = figures["transfer"]["collective"]
    assert broadcast["backend"] == "gloo" and broadcast["broadcasts"] >= 1 and broadcast["failed"] == 0, broadcast
    assert broadcast["loads_received"] >= 1 and broadcast["mib"] > 0, broadcast
    assert "- weight transfer, collective: gloo, " in report, report
    assert set(run["details"]["memory"]["rss_mib"]) == {"producer", "generator g1", "trainer", "evaluator"}
    assert min(run["details"]["memory"]["rss_mib"].values()) > 0
    assert run["details"]["exit_codes"] == {"producer": 0, "generator g1": 0, "trainer": 0, "evaluator": 0}
    # when each process peaked, and the trainer's resident set after its start-up and its steps
    memory = run["details"]["memory"]
    assert set(memory["rss_peak_at"]) == set(memory["rss_mib"]), memory
    assert all(p["at_s"] > 0 and p["trainer"] for p in memory["rss_peak_at"].values()), memory
    # sampled once a second: steps close together (a loaded host) are crossed in one sample, and
    # the last one's may come as the trainer exits, unsampled
    after = [b["after"] for b in memory["trainer_rss_mib"]]
    steps = [int(a.removeprefix("step ")) for a in after[1:]]
    assert after[0] == "start-up" and steps == sorted(set(steps)) and set(steps) <= {1, 2}, memory
    assert all(b["mib"] > 0 for b in memory["trainer_rss_mib"]), memory
    # the evaluation queued at the last step ran to its end before the processes were stopped, and
    # the report gives its figures as the evaluator wrote them to the run's metrics
    evals = run["details"]["evaluations"]
    assert (evals["unfinished"], evals["failed"], evals["cut"]) == ([], [], ""), evals
    (evaluated,) = [EvalResult.from_entry(e) for e in evals["finished"]]
    assert (evaluated.version, evaluated.step, evaluated.prompts, evaluated.skipped) == (2, 2, 4, None), evaluated
    assert set(evaluated.pass_at) == {1, 2} and all(0 <= v <= 1 for v in evaluated.pass_at.values()), evaluated
    assert evaluated.seconds > 0
    assert f"- version 2 (step 2): {evaluated.summary()} on 4 problems in " in report, report
    assert "evaluator: version 2: " in (tmp_path / "out" / "one-gpu" / "logs" / "evaluator.log").read_text()
    # configs/gsm8k.toml with only the substitutions the report lists, each with its reason
    subs = run["details"]["substitutions"]
    assert set(subs) == {"ROLLOUTS_MODEL__PATH", "ROLLOUTS_REDIS_URL", "ROLLOUTS_OUTPUT_DIR",
                         "ROLLOUTS_TRAINER__MAX_STEPS", "ROLLOUTS_GENERATOR__ENGINE", "ROLLOUTS_ROLLOUT__GROUP_SIZE",
                         "ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS",
                         "ROLLOUTS_EVAL__EVERY", "ROLLOUTS_EVAL__PROMPTS", "ROLLOUTS_EVAL__PASS_K",
                         "ROLLOUTS_TRAINER__WEIGHT_TRANSFER"}, subs
    assert subs["ROLLOUTS_TRAINER__WEIGHT_TRANSFER"] == ["gloo", "set when calling the check"]
    assert all(f"`{name}={value}`: {why}" in report for name, (value, why) in subs.items())
    resolved = json.loads((tmp_path / "out" / "one-gpu" / "config.json").read_text())
    assert resolved["run"] == "gsm8k" and resolved["data"]["sources"][0]["path"] == "openai/gsm8k"
    assert resolved["trainer"]["max_steps"] == 2 and resolved["model"]["dtype"] == "bfloat16"
    # what --out keeps: the report, logs and the run's records; the model and checkpoints stay in --work
    assert (tmp_path / "out" / "one-gpu" / "metrics.jsonl").exists()
    assert {p.name for p in (tmp_path / "out" / "one-gpu" / "logs").iterdir()} == {
        "producer.log", "generator-g1.log", "trainer.log", "evaluator.log", "redis.log"}
    assert not list((tmp_path / "out").rglob("*.safetensors"))
    assert list((tmp_path / "work" / "one-gpu" / "run" / "checkpoints").rglob("*.safetensors"))


def test_a_step_that_fails_fails_the_check_with_its_log(tmp_path):
    missing = tmp_path / "no-such-model"
    done, report, data = gpu_check(tmp_path, "--dry-run", "--skip", "gpu-tests", ROLLOUTS_MODEL__PATH=str(missing))
    assert done.returncode == 1, done.stdout[-4000:]
    steps = {s["name"]: s for s in data["steps"]}
    assert steps["gpu-tests"]["status"] == "skipped" and steps["gpu-tests"]["reason"] == "--skip"
    run = steps["one-gpu"]
    assert run["status"] == "failed" and "exited" in run["reason"], run
    assert str(missing) in run["log_tail"], run["log_tail"]
    assert f"`ROLLOUTS_MODEL__PATH={missing}`: set when calling the check" in report
    assert "| one-gpu | failed |" in report and "## one-gpu: failed, the end of its log" in report


def test_a_package_that_does_not_import_is_named_and_the_steps_that_need_it_fail(tmp_path):
    """A host without one of our dependencies (here rq, shadowed by a module that will not import):
    the check names it and what stopped it, fails the steps that need it and takes the others."""
    shadow = tmp_path / "shadow"
    shadow.mkdir()
    (shadow / "rq.py").write_text('raise ImportError("no rq on this host")\n')
    done, report, data = gpu_check(tmp_path, "--dry-run", PYTHONPATH=str(shadow))
    assert done.returncode == 1
    steps = {s["name"]: s for s in data["steps"]}
    for name in ("gpu-tests", "one-gpu"):
        assert steps[name]["status"] == "failed", steps[name]
        assert steps[name]["reason"].startswith("python packages that do not import: rq (ImportError: no rq on this "
                                                "host)"), steps[name]["reason"]
    assert steps["two-gpus"]["status"] == "skipped"
    assert "python packages that do not import: rq (ImportError: no rq on this host)" in report
    assert "python packages that do not import: rq" in done.stdout


def test_each_run_places_its_processes_on_the_gpus_it_has():
    def layout(gpus: int, ranks: int) -> list[tuple[str, str | None, bool]]:
        return [(p.name, p.gpus, "torch.distributed.run" in p.argv) for p in plan(gpus=gpus, ranks=ranks)]

    cpu = [("producer", "", False), ("generator g1", "", False), ("trainer", "", False), ("evaluator", "", False)]
    assert layout(0, 1) == cpu
    assert layout(8, 1) == [("producer", None, False), ("generator g1", "0", False), ("trainer", "0", False),
                            ("evaluator", None, False)]
    assert layout(2, 2) == [("producer", None, False), ("generator g1", "1", False), ("trainer", "0,1", True),
                            ("evaluator", None, False)]
    assert layout(3, 2)[1:3] == [("generator g1", "2", False), ("trainer", "0,1", True)]
    eight = layout(8, 2)
    assert [g for name, g, _ in eight if name.startswith("generator")] == ["2,3,4,5,6,7"] * 6  # each leases one
    assert ("trainer", "0,1", True) in eight
    (trainer,) = [p for p in plan(gpus=2, ranks=2) if p.name == "trainer"]
    assert trainer.argv[-2:] == ("-m", "trainer") and "--nproc-per-node" in trainer.argv
    with pytest.raises(AssertionError, match="needs 2 GPUs, found 1"):
        plan(gpus=1, ranks=2)


def test_mfu_is_six_times_parameters_times_tokens_over_the_gpus_peak(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    embedding = model.get_input_embeddings().weight.numel()
    params = sum(p.numel() for p in model.parameters()) - embedding  # untied: the lookup does no matmul
    assert safetensors_params(tiny_model) == params
    got = mfu(str(tiny_model), 1000.0, world=2, device="NVIDIA H100 80GB HBM3")
    assert got["params"] == params and got["peak_flops_per_gpu"] == 989e12
    assert got["mfu"] == pytest.approx(6 * params * 1000.0 / (2 * 989e12))
    assert mfu(str(tiny_model), 1.0, world=1, device="NVIDIA H100 PCIe")["peak_flops_per_gpu"] == 756e12
    assert mfu(str(tiny_model), 1.0, world=1, device="NVIDIA A100-SXM4-80GB")["peak_flops_per_gpu"] == 312e12
    assert mfu(str(tiny_model), 1.0, world=1, device="Tesla T4")["mfu"] == "unknown peak for 'Tesla T4'"


def test_pytests_outcome_ran_skipped_or_failed():
    skipped = ("ssss\nSKIPPED [3] tests/test_gpu.py:27: needs a CUDA GPU; torch sees none here\n"
               "4 skipped, 990 deselected in 5.10s\n")
    step = pytest_outcome(skipped, 0, cuda=False)
    assert (step.status, step.reason) == ("skipped", "no CUDA: 4 skipped (needs a CUDA GPU; torch sees none here)")
    ran = "..s.\nSKIPPED [1] tests/test_gpu.py:31: needs vLLM for CUDA (pip install vllm)\n3 passed, 1 skipped in 80s\n"
    assert pytest_outcome(ran, 0, cuda=True).status == "ran"
    failed = pytest_outcome("F...\n1 failed, 3 passed in 90s\n", 1, cuda=True)
    assert failed.status == "failed" and failed.reason == "pytest exited 1 (1 failed, 3 passed)"
    assert pytest_outcome("no tests ran in 0.1s\n", 5, cuda=True).status == "failed"


def test_gpu_memory_is_read_by_gpu_and_by_process_from_nvidia_smi(tmp_path):
    """nvidia-smi's CSV as it prints it, from a stand-in: the peaks kept, each process by name, one
    of another PID namespace by its number, "[N/A]" passed over."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncase \"$1\" in\n"
                   f"--query-gpu=*) echo \"0, GPU-aaa, $(cat {tmp_path / 'used'})\"; echo '1, GPU-bbb, [N/A]';;\n"
                   f"--query-compute-apps=*) echo '111, GPU-aaa, 3000'; echo '999, GPU-bbb, 500';;\n"
                   f"esac\n")
    smi.chmod(0o755)
    memory = Memory(nvidia_smi=str(smi))
    for used in ("4000", "6500", "5000"):
        (tmp_path / "used").write_text(used)
        memory.sample_gpus({111: "trainer"})
    peaks = memory.peaks()
    assert peaks["gpu_mib_by_device"] == {"GPU 0": 6500}
    other = "not started by the check (or of another PID namespace)"
    assert peaks["gpu_mib_by_process"] == {"trainer (pid 111, GPU 0)": 3000, f"{other} (pid 999, GPU 1)": 500}


# What the GPU hosts this project is lent hold of rollouts' dependencies (docs/gpu.md): the kit
# brings the rest.
HOST_HAS = {"torch", "transformers", "safetensors", "accelerate", "peft", "numpy", "matplotlib", "xxhash", "msgpack",
            "jinja2", "pyarrow"}


def test_ops_gpu_kit_brings_every_dependency_such_a_host_lacks_and_a_redis_server_that_serves(tmp_path):
    import re
    import time
    import tomllib

    import redis

    from tests.harness.servers import free_port

    checkout = tmp_path / "checkout"
    subprocess.run(["git", "clone", "-q", str(ROOT), str(checkout)], check=True, timeout=120)
    shutil.copy(ROOT / "ops" / "gpu-kit", checkout / "ops" / "gpu-kit")  # as in this working tree
    done = subprocess.run([str(checkout / "ops" / "gpu-kit")], cwd=checkout, env={**os.environ, "PY": sys.executable},
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kit = checkout / ".gpu-kit"
    wheels = {re.sub(r"[-_.]+", "-", w.name.split("-")[0]).lower() for w in (kit / "whl").glob("*.whl")}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    needed = {re.sub(r"[-_.]+", "-", re.split(r"[<>=!~ \[;]", d)[0]).lower() for d in deps}
    assert needed - HOST_HAS <= wheels, f"not in the kit: {sorted(needed - HOST_HAS - wheels)}"
    assert all(w.name.endswith(("-none-any.whl", "-py312-none-any.whl")) or "cp312" in w.name
               for w in (kit / "whl").glob("*.whl")), "wheels for CPython 3.12"
    assert "/.gpu-kit/" in subprocess.run(["git", "check-ignore", "-v", ".gpu-kit/whl"], cwd=checkout,
                                          capture_output=True, text=True).stdout, "the kit is never committed"
    # the kit's redis-server, through its wrapper, serves
    port = free_port()
    server = subprocess.Popen([str(kit / "bin" / "redis-server"), "--port", str(port), "--bind", "127.0.0.1",
                               "--save", "", "--appendonly", "no"], stdout=subprocess.DEVNULL)
    try:
        r = redis.Redis(port=port)
        for _ in range(100):
            try:
                assert r.ping()
                break
            except redis.ConnectionError:
                time.sleep(0.1)
        assert r.info("server")["redis_version"].startswith("7.")
    finally:
        server.kill()


def test_a_check_stopped_by_sigterm_leaves_no_process_of_its_run_behind(tmp_path):
    import signal
    import time

    import psutil

    work = tmp_path / "work"
    env = {k: v for k, v in os.environ.items() if k in ("HOME", "LANG", "LC_ALL", "TMPDIR", "USER")}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), str(Path(shutil.which("redis-server")).parent),
                                   "/usr/local/bin:/usr/bin:/bin"])
    check = subprocess.Popen([str(ROOT / "ops" / "gpu-check"), "--dry-run", "--skip", "gpu-tests", "--out",
                              str(tmp_path / "out"), "--work", str(work)], cwd=ROOT, env=env)

    def ours() -> list[psutil.Process]:
        found = []
        for p in psutil.process_iter():
            try:
                if p.pid != check.pid and str(work) in p.cwd():
                    found.append(p)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass
        return found

    deadline = time.monotonic() + 300
    while not (tmp_path / "out" / "one-gpu" / "logs" / "trainer.log").exists() or len(ours()) < 4:
        assert check.poll() is None and time.monotonic() < deadline, "the run's processes never started"
        time.sleep(0.5)
    check.send_signal(signal.SIGTERM)
    assert check.wait(timeout=120) == 128 + signal.SIGTERM
    assert ours() == []



# A run's process for the test below: a child in a process group of its own, deaf to SIGTERM, that
# ends within a second of its parent going (as a generator's reward worker does), then a wait.
CHILD = """
import os, subprocess, sys, time
worker = ("import os, signal, time\\n"
          "signal.signal(signal.SIGTERM, signal.SIG_IGN)\\n"
          "parent = os.getppid()\\n"
          "while os.getppid() == parent: time.sleep(1.0)\\n")
subprocess.Popen([sys.executable, "-c", worker], process_group=0)
time.sleep(60)
"""


def test_a_sigterm_while_the_run_starts_its_processes_leaves_none_behind(tmp_path, monkeypatch):
    """SIGTERM between starting the run's second process and recording it (gpu-check's own handler
    in place, as its main installs it): every process started is stopped, the one in hand too, and
    what their sessions hold (a child in a group of its own, deaf to SIGTERM)."""
    import signal

    from ops import gpu_check

    real_popen, started = subprocess.Popen, []

    def popen(*args, **kwargs):
        proc = real_popen(*args, **kwargs)
        started.append(proc)
        if len(started) == 2:  # the signal lands as the second start returns, the first one's worker running
            import time

            import psutil

            deadline = time.monotonic() + 60
            while not psutil.Process(started[0].pid).children() and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(0.5)  # in its loop
            signal.raise_signal(signal.SIGTERM)
        return proc

    monkeypatch.setattr(gpu_check.subprocess, "Popen", popen)
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))
    procs = [gpu_check.Proc(name=f"p{i}", argv=("-c", CHILD), gpus=None) for i in range(3)]
    dirs = gpu_check.Dirs(kept=tmp_path / "kept", scratch=tmp_path)
    (tmp_path / "kept" / "logs").mkdir(parents=True)
    try:
        with pytest.raises(SystemExit):
            gpu_check.run_processes(procs, {}, dirs=dirs, steps=1, time_limit=60, memory=Memory(nvidia_smi=None),
                                    redis_url="redis://127.0.0.1:1/0")
    finally:
        signal.signal(signal.SIGTERM, previous)
        monkeypatch.undo()
    assert len(started) == 2, started  # the third was never started
    assert all(p.poll() is not None for p in started), started
    assert gpu_check.session_members({p.pid for p in started}) == []
