"""A trainer killed with SIGKILL between checkpoints resumes exactly: its final weights equal
those of a run that was never interrupted, fed the same sample groups."""

import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.keys import PAYLOAD, TRAINER_GROUP, Keys
from common.messages import encode
from common.progress import read_trainer
from tests.harness.configs import write_config
from tests.harness.groups import make_group
from tests.harness.metrics import read_steps
from tests.harness.processes import process_env


def resume_config(tmp_path: Path, run: str, redis_url: str, model_dir: Path, *, sync_every: int = 2,
                 state_every: int = 2) -> Path:
    # state_every 2: the trainer state of steps 2 and 4 is saved, step 3's is not (with sync_every 1
    # step 3's weights are published all the same; with 2 they are not). A cosine schedule with warm-up and
    # two updates per batch make the resume depend on the scheduler and AdamW state, not only weights.
    path = tmp_path / f"{run}.toml"
    write_config(path, run=run, redis_url=redis_url, output_dir=tmp_path / run, model=model_dir, base={},
                 rollout={"group_size": 4, "prompts_per_step": 2, "max_staleness": 10},
                 trainer={"max_steps": 4, "sync_every": sync_every, "state_every": state_every, "lr": 1e-3,
                          "lr_schedule": "cosine", "warmup_steps": 1, "updates_per_batch": 2, "micro_batch_size": 4,
                          "threads": 1, "keep_checkpoints": 2})
    return path


def trainer(config: Path, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trainer"], cwd=config.parent,
                            env=process_env({"ROLLOUTS_CONFIG": str(config)}), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **kw)


def finish(proc: subprocess.Popen) -> str:
    stdout, stderr = proc.communicate(timeout=240)
    assert proc.returncode == 0, f"trainer exited {proc.returncode}\n{stdout}\n{stderr}"
    return stdout


@pytest.mark.parametrize("sync_every", [2, 1])
def test_sigkill_between_checkpoints_then_restart_matches_an_uninterrupted_run(tmp_path, redis_url, r,
                                                                               tiny_model, sync_every):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(7)
    blobs = [encode(make_group(model, f"g{i}", version=0, rng=rng)) for i in range(8)]

    # ---- the uninterrupted run: all eight groups, four steps
    for blob in blobs:
        r.xadd(Keys("a").samples, {PAYLOAD: blob})
    finish(trainer(resume_config(tmp_path, "a", redis_url, tiny_model)))

    # ---- the interrupted run: killed after step 3, which was trained but never published
    keys = Keys("b")
    for blob in blobs[:6]:
        r.xadd(keys.samples, {PAYLOAD: blob})
    config = resume_config(tmp_path, "b", redis_url, tiny_model, sync_every=sync_every)
    proc = trainer(config)

    def killable() -> bool:  # step 3 trained and, with sync_every 1, its version announced (written beside step 4),
        # and step 2's state saved (written by its own thread: Redis records it once it is on disk)
        stepped = any(m["step"] == 3 for m in read_steps(tmp_path / "b" / "metrics.jsonl"))
        progress = read_trainer(r, keys)
        return stepped and progress.state_step == 2 and (sync_every == 2 or progress.version == 3)

    try:
        deadline = time.monotonic() + 180
        while not killable():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # Step 3's weights were published only with sync_every 1; its state was saved in neither case.
    assert read_trainer(r, keys).version == (3 if sync_every == 1 else 2)
    assert read_trainer(r, keys).state_step == 2
    assert r.xpending(keys.samples, TRAINER_GROUP)["pending"] == 2  # step 3's groups, never acknowledged

    for blob in blobs[6:]:
        r.xadd(keys.samples, {PAYLOAD: blob})
    stdout = finish(trainer(config))
    assert "resuming at step 2" in stdout and "from its trainer state" in stdout

    # Step 3 was trained twice (before the kill and after), on the same groups in the same order.
    got = [(m["step"], m["group_ids"]) for m in read_steps(tmp_path / "b" / "metrics.jsonl")]
    want = [(1, ["g0", "g1"]), (2, ["g2", "g3"]), (3, ["g4", "g5"]), (3, ["g4", "g5"]), (4, ["g6", "g7"])]
    assert got == want
    a_metrics, b_metrics = read_steps(tmp_path / "a" / "metrics.jsonl"), read_steps(tmp_path / "b" / "metrics.jsonl")
    lrs = [m["learning_rate"] for m in b_metrics[3:]]
    assert lrs == [m["learning_rate"] for m in a_metrics[2:]]  # the schedule resumed
    assert r.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0

    # Deterministic CPU torch on the same inputs in the same order: the weights are bit-identical.
    a = load_file(tmp_path / "a" / "checkpoints" / "step_4" / "model.safetensors")
    b = load_file(tmp_path / "b" / "checkpoints" / "step_4" / "model.safetensors")
    init = model.state_dict()
    assert a.keys() == b.keys()
    assert any(not torch.equal(a[k], init[k]) for k in a)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    assert diff == 0.0, f"largest difference {diff}"
    # Beside each kept checkpoint, its trainer state (the newest keep_checkpoints = 2).
    assert sorted(p.name for p in (tmp_path / "b" / "trainer_state").iterdir()) == ["step_2", "step_4"]


def test_states_saved_before_a_restart_from_an_older_one_do_not_crowd_out_those_saved_since(tmp_path):
    """Redis named the state of step 3 (it lost what came after), while states 7-9 are on disk:
    each state saved from step 4 on stays among the newest `keep`, and those of the abandoned steps go."""
    from trainer.state import prune_states

    root = tmp_path / "trainer_state"
    for step in (2, 3, 7, 8, 9):
        (root / f"step_{step}").mkdir(parents=True)
    (root / "step_4").mkdir()  # saved again, after the restart
    prune_states(root, keep=2, newest=4)
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]
    (root / ".step_5.tmp").mkdir()  # half written
    prune_states(root, keep=2)  # without `newest` (a failed publish): only the half-written one goes
    assert sorted(p.name for p in root.iterdir()) == ["step_3", "step_4"]
