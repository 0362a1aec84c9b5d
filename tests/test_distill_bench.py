"""The distillation benchmark (ops/bench/distill.py) checked for what a user reads in it: its
distill side is the RL side's job with the teacher set and nothing else, and its dry run on the
tiny model trains a teacher, runs both sides from the same start (only the distill side with the
teacher's KL, from the teacher the bench trained) and scores them on held-out problems."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys

import pytest

from tests.harness.processes import ROOT, process_env

spec = importlib.util.spec_from_file_location("distill_bench", ROOT / "ops" / "bench" / "distill.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def test_the_distill_side_is_the_rl_sides_job_with_the_teacher(tiny_model):
    rl = bench.vs_trl.job_config(bench.side_env("rl", tiny_model, 0.5))
    distill = bench.vs_trl.job_config(bench.side_env("distill", tiny_model, 0.5))
    assert rl.teacher.path == "" and distill.teacher.path == str(tiny_model)
    assert distill.teacher.distill_weight == 0.5
    assert distill.model_dump(exclude={"teacher"}) == rl.model_dump(exclude={"teacher"})  # the same job otherwise
    assert (rl.task.max_operand, rl.task.ops) == (99, ["+"])  # 2-digit addition
    with pytest.raises(ValueError, match="side 'sft' is not one of rl, distill"):
        bench.side_env("sft", tiny_model, 1.0)


@pytest.mark.slow  # three short runs of the whole pipeline and their scoring (about two minutes): the slow checks
def test_a_dry_run_trains_a_teacher_and_distils_from_it_beside_rl(tmp_path, tiny_model):
    out, work = tmp_path / "result.json", tmp_path / "work"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops" / "bench" / "distill.py"), "--dry-run", "--model", str(tiny_model),
         "--minutes", "0.5", "--teacher-minutes", "0.5", "--keep-seconds", "15", "--eval-prompts", "8",
         "--engine", "hf", "--work", str(work), "--json", str(out)],
        cwd=tmp_path, env=process_env({}), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["points"]) == {"teacher", "rl", "distill"}
    for side in ("rl", "distill"):
        points = result["points"][side]
        assert points[0] == {"step": 0, "s": 0.0, "pass@1": result["start"]}  # both from the same start
        assert len(points) >= 2 and all(0.0 <= p["pass@1"] <= 1.0 for p in points), points
        assert result["steps"][side], side
    # only the distill side trains with the teacher's KL, and its teacher is the teacher run's last checkpoint
    assert not any(s["teacher_kl"] for s in result["steps"]["rl"]), result["steps"]["rl"]
    assert any(s["teacher_kl"] for s in result["steps"]["distill"]), result["steps"]["distill"]
    kept = sorted((work / "teacher" / "kept").glob("step_*"), key=lambda d: int(d.name.split("_")[1]))
    said = re.search(r"teacher (step_\d+) \((\S+), hf\) scores every sampled token",
                     (work / "distill" / "honcho.log").read_text())
    assert said and said.group(2) == str(kept[-1]), (said, kept)
    assert re.search(r"final held-out pass@1 on 8 problems \(start [\d.]+\):\n  teacher  pass@1 [\d.]+", proc.stdout)
