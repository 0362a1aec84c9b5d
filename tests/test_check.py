"""`rollouts check`: a right config passes with its figures; an engine sampling at another
temperature, an engine on other weights and a reward that always raises each fail, each for its own
reason. The command runs as a user runs it (a process, `python -m common.cli check`) on the tiny
model with the HF engine; its verdict's rules are checked by hand below."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import torch

from checks.check import BOUNDS, Mismatch, mismatch_problems, reward_problems
from common.messages import Completion, SampleGroup
from tests.harness.configs import write_config
from tests.harness.processes import ROOT


def check_config(tmp_path: Path, model: Path, *, reward: str = "tests.reward_fixtures:length") -> Path:
    """The run's config for the check: the HF engine, 4 completions of 16 tokens at temperature 1."""
    path = tmp_path / "run.toml"
    write_config(path, run="check", output_dir=tmp_path / "out", model=model, base={}, generator={"engine": "hf"},
                 rollout={"group_size": 4, "max_new_tokens": 16, "temperature": 1.0},
                 data={"sources": [{"name": "arith", "kind": "arithmetic", "reward": reward}]})
    return path


def check(tmp_path: Path, config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_") or k == "ROLLOUTS_CACHE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    return subprocess.run([sys.executable, "-m", "common.cli", "check", "--config", str(config), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def failures(out: str) -> list[str]:
    return [line.removeprefix("check: FAILED: ") for line in out.splitlines() if line.startswith("check: FAILED: ")]


def test_a_right_config_passes_with_its_figures(tmp_path, tiny_model):
    done = check(tmp_path, check_config(tmp_path, tiny_model), "--prompts", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("check: 3 prompts from arith, 4 completions each, hf engine at temperature 1")
    for label in ("mismatch   mean |log-ratio| ", "           by position  0-15 ", "ratio      exp(",
                  "rewards    12 completions, 0 errors, constant no, zero-variance groups ", "time       sampling ",
                  "estimate   at prompts_per_step 8: "):
        assert any(line.startswith(label) for line in lines), (label, done.stdout)
    assert lines[-1].startswith("check: ok (mean |log-ratio| ")
    assert failures(done.stdout) == []


def test_an_engine_sampling_at_another_temperature_fails_saying_which(tmp_path, tiny_model):
    done = check(tmp_path, check_config(tmp_path, tiny_model), "--prompts", "3", "--engine-temperature", "2.0")
    assert done.returncode == 1, done.stdout + done.stderr
    [reason] = failures(done.stdout)
    assert reason.startswith("mismatch: mean |log-ratio| "), done.stdout
    fitted = re.search(r"the engine samples at temperature (\d+\.\d+) ", reason)
    assert fitted and abs(float(fitted[1]) - 2.0) <= 0.02, reason  # the fit's own tolerance: 0.3%
    assert "the trainer computes them at rollout.temperature = 1.0" in reason


def test_an_engine_on_other_weights_fails_saying_so(tmp_path, tiny_model):
    from common.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1)
    done = check(tmp_path, check_config(tmp_path, tiny_model), "--prompts", "3", "--engine-model", str(other))
    assert done.returncode == 1, done.stdout + done.stderr
    reason, *ratio = failures(done.stdout)  # some tokens may also be far likelier under the trainer
    assert reason.startswith("mismatch: mean |log-ratio| "), done.stdout
    assert "no temperature explains it" in reason and "other weights than the trainer's model.path" in reason
    assert all(line.startswith("ratio: max importance ratio ") for line in ratio), done.stdout


def test_a_reward_that_always_raises_fails_with_its_error(tmp_path, tiny_model):
    (tmp_path / "broken_rewards.py").write_text(
        "def score(**_):\n    raise RuntimeError('the grader is down')\n")
    done = check(tmp_path, check_config(tmp_path, tiny_model, reward="broken_rewards:score"), "--prompts", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    [reason] = failures(done.stdout)  # the log-probs agree: only the rewards fail
    assert reason.startswith("rewards: every completion's reward raised: ")
    assert "the grader is down" in reason


# ---------------------------------------------------------------------- the verdict's rules


def mismatch_of(log_ratios: list[float]) -> Mismatch:
    return Mismatch(log_ratio=torch.tensor(log_ratios, dtype=torch.float64),
                    position=torch.arange(len(log_ratios)), forward_s=0.0)


def test_the_bounds_by_hand():
    bound, max_ratio = BOUNDS["float32"]
    assert mismatch_problems(mismatch_of([bound / 2, -bound / 2]), fitted=None, temperature=1.0,
                             dtype="float32") == []
    [mean] = mismatch_problems(mismatch_of([0.05, -0.05]), fitted=None, temperature=1.0, dtype="float32")
    assert mean.startswith(f"mismatch: mean |log-ratio| 0.05 above {bound}: ")
    assert mismatch_problems(mismatch_of([0.05, -0.05]), fitted=None, temperature=1.0, dtype="bfloat16") == []
    # one token 4x likelier under the trainer: the mean over 1000 stays in bounds, the ratio does not
    [ratio] = mismatch_problems(mismatch_of([0.0] * 999 + [1.3863]), fitted=None, temperature=1.0, dtype="float32")
    assert ratio.startswith(f"ratio: max importance ratio 4 above {max_ratio}")
    [fitted] = mismatch_problems(mismatch_of([0.1]), fitted=(0.7, 1e-4), temperature=1.0, dtype="float32")
    assert "the engine samples at temperature 0.70" in fitted
    [unfitted] = mismatch_problems(mismatch_of([0.1]), fitted=(0.25, 0.09), temperature=1.0, dtype="float32")
    assert "no temperature explains it" in unfitted


def group_of(*rewards: float | str) -> SampleGroup:
    completions = [Completion(ids=[1], logprobs=[-0.5], reward=r if isinstance(r, float) else 0.0, rewards={},
                              finish="stop", text="x", reward_error=r if isinstance(r, str) else None)
                   for r in rewards]
    return SampleGroup(id="p", prompt_id="p", prompt_ids=[2], version=0, generator="g", engine="hf",
                       completions=completions)


def test_reward_problems_by_hand():
    assert reward_problems([group_of(0.0, 1.0)]) == ([], [])
    assert reward_problems([group_of("ValueError: no", "ValueError: no")]) == (
        ["rewards: every completion's reward raised: ValueError: no"], [])
    assert reward_problems([group_of(1.0, "timeout"), group_of(0.0, 1.0)])[0] == [
        "rewards: 1 of 4 completions' rewards failed: timeout"]
    assert reward_problems([group_of(0.0, 0.0), group_of(0.0, 0.0)]) == (
        [], ["rewards: every completion scored 0: no group teaches anything yet"])
