"""Slow: the pipeline on the built-in default model (SmolLM2-135M-Instruct). `pytest -m slow`."""

import json

import pytest

from common.models import prepare_default_model
from tests.helpers import spawn, stop

pytestmark = pytest.mark.slow


def test_default_model_trains_two_steps(tmp_path, redis_url):
    prepare_default_model()
    env = {"ROLLOUTS_CONFIG": "configs/demo.toml", "ROLLOUTS_REDIS_URL": redis_url,
           "ROLLOUTS_OUTPUT_DIR": str(tmp_path / "run"), "ROLLOUTS_TRAINER__MAX_STEPS": "2",
           "ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP": "2"}
    from tests.helpers import ROOT

    procs = [spawn(m, cwd=ROOT, env=env, log=tmp_path / f"{m}.log") for m in ("producers", "generators")]
    trainer = spawn("trainer", cwd=ROOT, env=env, log=tmp_path / "trainer.log")
    try:
        assert trainer.wait(timeout=900) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for p in procs:
            stop(p)
    metrics = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # the demo's reward is the arithmetic task's correctness alone: its mean is the accuracy
        assert m["accuracy"] == pytest.approx(m["reward"]) and m["completions/mean_length"] > 0, m
        assert m["accuracy"] * 8 == round(m["accuracy"] * 8), m  # 2 prompts x 4 completions
    assert (tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors").is_file()
