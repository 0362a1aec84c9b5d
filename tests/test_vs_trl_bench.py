"""The time-to-accuracy benchmark (ops/bench/vs_trl.py --minutes) checked for what a user reads in
it: TRL's side gets the demo's job setting for setting, a run's accuracy points are on one clock
from its launch, and the times to reach an accuracy and their ratio are read off the curves as
stated. TRL itself is not installed here; its side runs in the benchmark only."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from tests.harness.processes import ROOT, process_env

spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "ops" / "bench" / "vs_trl.py")
vs_trl = importlib.util.module_from_spec(spec)
spec.loader.exec_module(vs_trl)


def test_trls_side_gets_the_demos_job():
    config = vs_trl.job_config({"ROLLOUTS_TRAINER__LR": "3e-6"})
    job = vs_trl.trl_job(config)
    assert config.task.max_operand == 99 and config.task.ops == ["+"]  # 2-digit addition
    assert (job["prompts"], job["group"], job["new_tokens"]) == (
        config.rollout.prompts_per_step, config.rollout.group_size, config.rollout.max_new_tokens)
    assert (job["lr"], job["temperature"], job["clip_low"], job["clip_high"], job["kl"]) == (
        3e-6, config.rollout.temperature, config.trainer.loss.clip_low, config.trainer.loss.clip_high, 0.0)
    assert job["holdout"] == config.eval.holdout > 0 and job["bf16"] is (config.model.dtype == "bfloat16")
    # A setting TRL's side has no counterpart for is refused, naming it.
    with pytest.raises(AssertionError, match="seq_mean"):
        vs_trl.trl_job(vs_trl.job_config({"ROLLOUTS_TRAINER__LOSS__LOSS_AGG": "seq_mean"}))


def test_times_to_accuracy_and_the_ratio_are_read_off_the_curves():
    points = {
        "trl": [{"s": 0, "pass@1": 0.1}, {"s": 200, "pass@1": 0.5}, {"s": 400, "pass@1": 0.6},
                {"s": 600, "pass@1": 0.55}],
        "rollouts": [{"s": 0, "pass@1": 0.1}, {"s": 100, "pass@1": 0.4}, {"s": 150, "pass@1": 0.56},
                     {"s": 300, "pass@1": 0.7}],
    }
    result = vs_trl.time_to_accuracy(points)
    assert result["final"] == {"trl": 0.55, "rollouts": 0.7}
    # TRL first reached its final 0.55 at 400 s, rollouts at 150 s; rollouts' 0.7 TRL never did.
    assert result["reach"]["trl"] == {"trl": 400, "rollouts": 150}
    assert result["reach"]["rollouts"] == {"trl": None, "rollouts": 300}
    assert result["ratio"] == {"rollouts": 400 / 150}
    points["rollouts"] = [{"s": 0, "pass@1": 0.1}, {"s": 300, "pass@1": 0.5}]
    assert vs_trl.time_to_accuracy(points)["ratio"] == {"rollouts": None}  # never reached TRL's final


@pytest.mark.slow  # a timed run of the whole pipeline and its scoring (over a minute): the slow checks
def test_a_short_run_of_rollouts_side_is_scored_from_its_launch(tmp_path, tiny_model):
    out = tmp_path / "result.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops" / "bench" / "vs_trl.py"), "--minutes", "1", "--sides", "rollouts",
         "--engine", "hf", "--keep-every", "2", "--eval-prompts", "8", "--json", str(out), "--png",
         str(tmp_path / "curve.png"), "--env", f"ROLLOUTS_MODEL__PATH={tiny_model}",
         "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS=8", "ROLLOUTS_TRAINER__STATE_EVERY=0"],
        cwd=tmp_path, env=process_env({}), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    result = json.loads(out.read_text())
    points, steps = result["points"]["rollouts"], result["steps"]["rollouts"]
    # The start (the model both sides begin from) at 0 s, then every second step's checkpoint at
    # the time its step line came, within the minute, each scored on the same 8 held-out problems.
    assert points[0]["s"] == 0 and points[0]["step"] == 0 and len(points) >= 2, points
    assert [p["step"] for p in points[1:]] == [s["step"] for s in steps if s["step"] % 2 == 0], (points, steps)
    assert all(0 < p["s"] <= 60 for p in points[1:]) and [p["s"] for p in points] == sorted(p["s"] for p in points)
    assert all(p["pass@1"] in {k / 8 for k in range(9)} for p in points), points
    assert result["reach"]["rollouts"]["rollouts"] <= points[-1]["s"] and result["ratio"] == {}
    assert (tmp_path / "curve.png").stat().st_size > 0
    assert "held-out pass@1 against seconds since launch" in proc.stdout
