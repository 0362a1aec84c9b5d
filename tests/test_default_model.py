"""Slow: the pipeline on the built-in default model (SmolLM2-135M-Instruct). `pytest -m slow`."""

import tomllib

import pytest
from safetensors.torch import load_file

from common.models import prepare_default_model
from tests.harness.metrics import read_steps
from tests.harness.processes import ROOT, spawn, stop

pytestmark = pytest.mark.slow


def test_default_model_trains_two_steps(tmp_path, redis_url):
    initial_dir = prepare_default_model()
    env = {"ROLLOUTS_CONFIG": "configs/demo.toml", "ROLLOUTS_REDIS_URL": redis_url,
           "ROLLOUTS_OUTPUT_DIR": str(tmp_path / "run"), "ROLLOUTS_TRAINER__MAX_STEPS": "2"}
    procs = [spawn(m, cwd=ROOT, env=env, log=tmp_path / f"{m}.log") for m in ("producers", "generators")]
    trainer = spawn("trainer", cwd=ROOT, env=env, log=tmp_path / "trainer.log")
    try:
        assert trainer.wait(timeout=900) == 0, (tmp_path / "trainer.log").read_text()[-3000:]
    finally:
        for p in procs:
            stop(p)
    metrics = read_steps(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2]
    for m in metrics:  # the demo's reward is the arithmetic task's correctness alone: its mean is the accuracy
        assert m["accuracy"] == pytest.approx(m["reward"]) and m["completions/mean_length"] > 0, m
        assert m["accuracy"] * 16 == round(m["accuracy"] * 16), m  # 4 prompts x 4 completions
    # The weights moved where there was a gradient. AdamW's first update of a weight with a
    # gradient is lr times the gradient's sign: a step with one moves the most-moved weight by
    # about lr. No gradient in either step (every group all right or all wrong) leaves them put;
    # 4 groups a step (the demo's, not 2) make that rare: of three runs, each had one in step 1.
    lr = tomllib.loads((ROOT / "configs" / "demo.toml").read_text())["trainer"]["lr"]
    assert [m["learning_rate"] for m in metrics] == [lr, lr], metrics
    initial = load_file(initial_dir / "model.safetensors")
    trained = load_file(tmp_path / "run" / "checkpoints" / "step_2" / "model.safetensors")
    assert trained.keys() == initial.keys(), (sorted(trained)[:5], sorted(initial)[:5])
    moved = {k: (trained[k].float() - initial[k].float()).abs().max().item() for k in trained}
    print(f"grad_norm {[m['grad_norm'] for m in metrics]}; largest change {max(moved.values()):.3g}, "
          f"{sum(v > 0 for v in moved.values())}/{len(moved)} tensors moved")
    if any(m["grad_norm"] > 0 for m in metrics):
        assert max(moved.values()) >= lr / 2, moved
    else:
        assert max(moved.values()) == 0, moved


def test_processes_preparing_the_model_at_once_get_one_whole_checkpoint(tmp_path):
    """A generator and a trainer started together on a fresh cache both convert the GGUF: one
    converts, the other waits for it, and both get the same whole checkpoint (with one scratch
    folder between them, one removed the other's files mid-write)."""
    import subprocess
    import sys

    code = "from common.models import prepare_default_model as p; print(p())"
    env = {**__import__("os").environ, "ROLLOUTS_CACHE": str(tmp_path / "cache")}
    procs = [subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=600) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [e[-2000:] for _, e in outs]
    (path,) = {o.strip().splitlines()[-1] for o, _ in outs}
    assert sum("converting" in o for o, _ in outs) == 1, outs  # one conversion, the others waited for it
    weights = load_file(f"{path}/model.safetensors")
    assert weights and all(t.isfinite().all() for t in weights.values())
    assert not [p.name for p in (tmp_path / "cache" / "models").iterdir() if ".tmp" in p.name]
