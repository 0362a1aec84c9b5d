"""Publishing beside the next step (trainer.publish_in_background): a version's checkpoint is
written while the trainer trains the step after it, holds the weights of its own step, is announced
once whole, and a write that fails stops the trainer as a publish in the step does."""

import random
import threading
import time

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import trainer.checkpoints
from common.checkpoints import WEIGHTS_FILE, verify_dir
from common.config import config_from_dict
from common.keys import Keys
from common.progress import read_trainer
from common.streams import latest_weights
from tests.harness.groups import make_group
from trainer.devices import placement
from trainer.main import objective, train
from trainer.publishing import PublishFailed, publish_if_due, settle_writing
from trainer.record import Record
from trainer.run import Run
from trainer.schedule import build_scheduler

KEYS = Keys("beside")


def a_run(tiny_model, r, tmp_path, *, background: bool) -> Run:
    """A trainer of the tiny model in float32 on the CPU (its published weights are its own
    parameters' dtype, so only a snapshot keeps them from the next step), publishing every step,
    saving the trainer state every 10."""
    torch.manual_seed(0)
    config = config_from_dict({"run": KEYS.run, "output_dir": str(tmp_path / "out"),
                               "model": {"path": str(tiny_model), "dtype": "float32"},
                               "trainer": {"lr": 1e-2, "state_every": 10, "publish_in_background": background},
                               "eval": {"every": 0}})
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    where = placement(dtype="float32", master_fp32=True, activation_checkpointing=False)
    return Run(config=config, r=r, keys=KEYS, model=model, optimizer=opt,
               scheduler=build_scheduler(opt, schedule="constant", warmup_steps=0, total_steps=0),
               update=objective(config.trainer, config.rollout, source_dir=tiny_model, where=where),
               source_dir=tiny_model, state_root=tmp_path / "out" / "trainer_state", step=0, version=0,
               record=Record(step=0, version=0, state_step=0, groups_trained=0))


def groups_of(model, step: int) -> list:
    rng = random.Random(step)
    return [make_group(model, f"s{step}g{i}", version=step - 1, rng=rng) for i in range(2)]


def test_a_version_is_written_while_the_next_step_trains_and_holds_its_own_steps_weights(
        tiny_model, r, tmp_path, monkeypatch):
    r.flushdb()
    run = a_run(tiny_model, r, tmp_path, background=True)
    updating = threading.Event()  # the next step's forward and backward are done: its update begins
    run.optimizer.register_step_pre_hook(lambda *_: updating.set())
    waited_out = []
    write = trainer.checkpoints.write_checkpoint

    def write_once_the_next_step_is_updating(*args, **kwargs):
        if kwargs["step"] == 1:
            if not updating.wait(timeout=20):
                waited_out.append(1)  # the step after it did not train meanwhile: written in the step
            time.sleep(0.5)  # the update would be done by now, were it not held for the write
        return write(*args, **kwargs)

    monkeypatch.setattr(trainer.checkpoints, "write_checkpoint", write_once_the_next_step_is_updating)
    train(run, groups_of(run.model, 1))
    step_1 = {k: v.clone() for k, v in run.model.state_dict().items()}
    updating.clear()
    publish_if_due(run, last=False)  # version 1: written once step 2 has run its forward and backward
    assert latest_weights(r, KEYS) is None and run.record.version == 0  # not announced before it is whole
    train(run, groups_of(run.model, 2))  # its update waits for version 1's write
    assert any(not torch.equal(v, step_1[k]) for k, v in run.model.state_dict().items()), "step 2 changed nothing"
    publish_if_due(run, last=False)  # version 1 settled, version 2 written beside
    settle_writing(run)

    assert not waited_out, "version 1 was written in its own step, not beside the next"
    assert run.record.version == 2 and read_trainer(r, KEYS).version == 2
    latest = latest_weights(r, KEYS)
    assert latest.version == 2
    one = latest.path.replace("step_2", "step_1")
    written = load_file(f"{one}/{WEIGHTS_FILE}")
    for name, value in written.items():  # version 1 holds step 1's weights, not step 2's
        assert torch.equal(value, step_1[name]), name
    verify_dir(latest.path, latest.checksums)
    two = load_file(f"{latest.path}/{WEIGHTS_FILE}")
    for name, value in two.items():
        assert torch.equal(value, run.model.state_dict()[name]), name


def test_a_version_that_cannot_be_written_beside_the_next_step_stops_the_trainer_announcing_nothing(
        tiny_model, r, tmp_path, monkeypatch):
    r.flushdb()
    run = a_run(tiny_model, r, tmp_path, background=True)

    def full_disk(path, tensors, **kwargs):
        path.parent.joinpath("half").write_bytes(b"x")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trainer.checkpoints, "write_safetensors", full_disk)
    train(run, groups_of(run.model, 1))
    publish_if_due(run, last=False)
    train(run, groups_of(run.model, 2))
    with pytest.raises(PublishFailed, match="publishing step 1 failed: .*No space left on device. Nothing was "
                                            "announced: generators keep version 0"):
        publish_if_due(run, last=False)
    assert latest_weights(r, KEYS) is None
    assert read_trainer(r, KEYS).publish_failed == 1
    assert not list(run.config.checkpoint_dir.glob(".step_*.tmp")), "the half-written checkpoint was left"
