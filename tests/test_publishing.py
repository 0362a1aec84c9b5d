"""Publishing beside the next step (trainer.publish_in_background): a version's checkpoint, and its
trainer state, are written while the trainer trains the steps after it, hold its own step's weights
and optimizer state; the version is announced once its weights are written, the state's groups
acknowledged once it is (the versions after it announced meanwhile), and a write that fails stops
the trainer as a publish in the step does."""

import random
import threading
import time

import pytest
import torch
import torch.distributed.checkpoint.filesystem
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import trainer.checkpoints
import trainer.publishing
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
from trainer.state import load_state, state_dir

KEYS = Keys("beside")


def a_run(tiny_model, r, tmp_path, *, background: bool, state_every: int = 10) -> Run:
    """A trainer of the tiny model in float32 on the CPU (its published weights are its own
    parameters' dtype, so only a snapshot keeps them from the next step), publishing every step,
    saving the trainer state every `state_every`."""
    torch.manual_seed(0)
    config = config_from_dict({"run": KEYS.run, "output_dir": str(tmp_path / "out"),
                               "model": {"path": str(tiny_model), "dtype": "float32"},
                               "trainer": {"lr": 1e-2, "state_every": state_every, "publish_in_background": background},
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


def trained(run: Run, step: int) -> list[str]:
    """Train step `step` on two groups, held for the next saved state as the trainer's loop holds them."""
    groups = groups_of(run.model, step)
    train(run, groups)
    run.unacked_entries += [f"{step}-{i}".encode() for i in range(len(groups))]
    run.unacked_ids += [g.id for g in groups]
    return [g.id for g in groups]


def moments(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [state[k].clone() for state in optimizer.state.values() for k in ("exp_avg", "exp_avg_sq")]


def test_a_trainer_state_is_written_while_the_next_step_trains_and_its_groups_acknowledged_once_it_is(
        tiny_model, r, tmp_path, monkeypatch):
    r.flushdb()
    run = a_run(tiny_model, r, tmp_path, background=True, state_every=1)
    updated = threading.Event()  # the next step's optimizer update is done
    run.optimizer.register_step_post_hook(lambda *_: updated.set())
    waited_out = []
    write_state = trainer.publishing.write_state

    def write_once_the_next_step_has_updated(state, **kwargs):
        if kwargs["step"] == 1 and not updated.wait(timeout=20):
            waited_out.append(1)  # the step after it did not train meanwhile: written in the step
        return write_state(state, **kwargs)

    monkeypatch.setattr(trainer.publishing, "write_state", write_once_the_next_step_has_updated)
    first = trained(run, 1)
    step_1 = moments(run.optimizer)
    updated.clear()
    publish_if_due(run, last=False)  # version 1 and its state: the state written once step 2 has updated
    # the version is announced as soon as its weights are written, the state still waiting: its
    # groups are not acknowledged, nor the state recorded, until it is on disk
    run.writing.done.result(timeout=60)
    assert latest_weights(r, KEYS).version == 1 and not updated.is_set()
    progress = read_trainer(r, KEYS)
    assert (progress.state_step, progress.groups_trained) == (0, 0), "acknowledged before its state was written"
    second = trained(run, 2)
    changed = [not torch.equal(a, b) for a, b in zip(moments(run.optimizer), step_1, strict=True)]
    assert any(changed), "step 2 changed nothing"
    run.saving.done.result(timeout=60)
    progress = read_trainer(r, KEYS)
    assert (progress.version, progress.state_step, progress.groups_trained) == (1, 1, 2)
    assert run.unacked_ids == first + second, "acknowledged groups were let go before the write was settled"
    settle_writing(run)
    assert run.unacked_ids == second and run.record.state_step == 1 and run.record.groups_trained == 2
    assert not waited_out, "the state of step 1 was written in its own step, not beside the next"

    step_2 = moments(run.optimizer)
    publish_if_due(run, last=False)  # version 2 and its state beside step 3, copied into step 1's buffer
    trained(run, 3)
    publish_if_due(run, last=True)  # the last: in its step, with the groups of step 3
    assert run.unacked_ids == [] and read_trainer(r, KEYS).groups_trained == 6
    for step, expected in ((1, step_1), (2, step_2)):  # each its own step's moments, not those after
        fresh = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
        assert load_state(fresh, opt, build_scheduler(opt, schedule="constant", warmup_steps=0, total_steps=0),
                          path=state_dir(run.state_root, step)) == step
        for saved, before in zip(moments(opt), expected, strict=True):
            assert torch.equal(saved, before), step


def test_the_versions_after_a_saved_state_are_announced_while_it_is_still_being_written(
        tiny_model, r, tmp_path, monkeypatch):
    """A trainer state takes a few steps' time to write on a GPU host (4.3 GB for Qwen2.5-0.5B):
    the next versions are published beside it, each announced once its own weights are, and the
    state's groups acknowledged once it is written."""
    r.flushdb()
    run = a_run(tiny_model, r, tmp_path, background=True, state_every=3)
    release = threading.Event()
    waited_out = []
    write_state = trainer.publishing.write_state

    def write_once_released(state, **kwargs):
        if not release.wait(timeout=20):
            waited_out.append(kwargs["step"])  # the versions after it waited for it instead
        return write_state(state, **kwargs)

    monkeypatch.setattr(trainer.publishing, "write_state", write_once_released)
    trained_ids = []
    for step in (1, 2, 3):
        trained_ids += trained(run, step)
        publish_if_due(run, last=False)  # 3: version 3 and its state, which waits
    for step in (4, 5):
        trained(run, step)
        publish_if_due(run, last=False)
        run.writing.done.result(timeout=60)
        assert latest_weights(r, KEYS).version == step, "a version waited for the state written before it"
    progress = read_trainer(r, KEYS)
    assert (progress.version, progress.state_step, progress.groups_trained) == (5, 0, 0)
    assert run.record.state_step == 0 and run.unacked_ids[:len(trained_ids)] == trained_ids
    release.set()
    run.saving.done.result(timeout=60)
    progress = read_trainer(r, KEYS)
    assert (progress.step, progress.version, progress.state_step, progress.groups_trained) == (5, 5, 3, 6)
    settle_writing(run)
    assert run.record.state_step == 3 and run.record.groups_trained == 6 and len(run.unacked_ids) == 4
    assert not waited_out


@pytest.mark.parametrize("background", [True, False], ids=["beside", "in-the-step"])
def test_a_trainer_state_that_cannot_be_written_stops_the_trainer_acknowledging_nothing(
        tiny_model, r, tmp_path, monkeypatch, background):
    r.flushdb()
    run = a_run(tiny_model, r, tmp_path, background=background, state_every=1)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch.distributed.checkpoint.filesystem, "_write_item", full_disk)
    first = trained(run, 1)
    # beside the steps the version's weights were written and announced before its state failed
    stands = ("saving the trainer state of step 1 failed: .*No space left on device. Its weights were announced "
              "[(]generators have version 1[)]" if background else
              "publishing step 1 failed: .*No space left on device. Nothing was announced: generators keep version 0")
    with pytest.raises(PublishFailed, match=stands + ", and the groups trained since the saved state of step 0 "
                                                     "stay pending"):
        publish_if_due(run, last=False)  # in the step: it fails here
        trained(run, 2)
        publish_if_due(run, last=False)  # beside: the next publish finds it failed
    announced = latest_weights(r, KEYS)
    assert (announced.version if announced else None) == (1 if background else None)
    assert read_trainer(r, KEYS).state_step == 0 and read_trainer(r, KEYS).groups_trained == 0
    assert run.unacked_ids[:2] == first
    assert not list(run.state_root.glob(".step_*.tmp")), "the half-written state was left"


def test_a_trainer_state_that_failed_beside_the_steps_stops_the_trainer_at_the_next_publish_not_the_next_save(
        tiny_model, r, tmp_path, monkeypatch):
    r.flushdb()
    run = a_run(tiny_model, r, tmp_path, background=True, state_every=10)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    trained(run, 1)
    publish_if_due(run, last=False)  # version 1, no state
    monkeypatch.setattr(torch.distributed.checkpoint.filesystem, "_write_item", full_disk)
    for step in range(2, 11):
        trained(run, step)
        publish_if_due(run, last=False)  # 10: version 10 and its state, which fails beside step 11
    run.saving.done.exception(timeout=60)
    trained(run, 11)
    with pytest.raises(PublishFailed, match="saving the trainer state of step 10 failed: .*No space left on device. "
                                            "Its weights were announced [(]generators have version 10[)]"):
        publish_if_due(run, last=False)  # version 11's: the failure found here, 9 steps before a save
    assert latest_weights(r, KEYS).version == 10  # version 11 never written
    assert read_trainer(r, KEYS).state_step == 0 and read_trainer(r, KEYS).groups_trained == 0
    assert not list(run.state_root.glob(".step_*.tmp")), "the half-written state was left"
