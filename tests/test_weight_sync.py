"""Weight sync: checksums hashed as the checkpoint is written, the weights watcher (XREAD BLOCK,
no polling), and a generator that picks a version up the moment it is announced, and still
refuses a staged file that was corrupted after its checksum was taken."""

from __future__ import annotations

import hashlib
import json
import re
import time
from functools import partial
from pathlib import Path

import pytest
import torch
import trio
import xxhash

from common.checkpoints import checksum_dir, write_safetensors
from common.heartbeats import read_heartbeat
from common.keys import PAYLOAD, Keys
from common.messages import WeightVersion, encode
from generators.weights import Checked, Watcher, check, unpin
from tests.harness.models import publish_weights, trained
from tests.harness.needs import skip_without_root
from tests.harness.processes import spawn, stop, wait_for
from trainer.checkpoints import load_model, write_checkpoint


def announce(r, keys: Keys, path, sums: dict[str, str], version: int) -> None:
    publish_weights(r, keys, WeightVersion(version=version, step=version, path=str(path), format="safetensors",
                                           checksums=sums, created_at=time.time()))


@pytest.mark.parametrize("dtype", [None, torch.bfloat16])
def test_checksums_taken_while_writing_are_those_of_the_files_read_back(dtype, tiny_model, tmp_path):
    model = trained(tiny_model, seed=1)
    path, sums = write_checkpoint(model, checkpoint_dir=tmp_path / "ckpt", step=1, source_dir=tiny_model, dtype=dtype)
    assert sums == checksum_dir(path)  # every file, the weights' hashed as written
    assert "model.safetensors" in sums and "config.json" in sums and "tokenizer.json" in sums
    want = dtype or torch.float32
    assert json.loads((path / "config.json").read_text())["dtype"] == str(want).removeprefix("torch.")
    loaded = load_model(path, want)  # an HF directory any engine loads
    for (name, a), b in zip(model.state_dict().items(), loaded.state_dict().values(), strict=True):
        assert torch.equal(a.to(want), b), name


def test_safetensors_hashed_while_written_match_their_bytes_with_many_chunks(tmp_path, monkeypatch):
    from safetensors.torch import load_file

    import common.checkpoints as ck

    monkeypatch.setattr(ck, "CHUNK", 1000)  # many chunks per tensor, hashed in order beside the writes
    tensors = {"b.weight": torch.randn(37, 41), "a.bias": torch.arange(5), "c": torch.randn(3).bfloat16(),
               "empty": torch.zeros(0, 4), "flag": torch.tensor([True, False])}
    digest = write_safetensors(tmp_path / "t.safetensors", tensors)
    assert digest == "xxh3_128:" + xxhash.xxh3_128((tmp_path / "t.safetensors").read_bytes()).hexdigest()
    back = load_file(tmp_path / "t.safetensors")
    assert set(back) == set(tensors) and all(torch.equal(back[k], v) for k, v in tensors.items())


def test_checksums_of_every_known_form_are_verified_and_an_unknown_one_is_refused_by_name(tiny_model, tmp_path):
    from common.checkpoints import CheckpointError, verify_dir

    path, sums = write_checkpoint(trained(tiny_model, seed=3), checkpoint_dir=tmp_path, step=1, source_dir=tiny_model)
    data = (path / "model.safetensors").read_bytes()
    sha = hashlib.sha256(data).hexdigest()
    assert sums["model.safetensors"] == "xxh3_128:" + xxhash.xxh3_128(data).hexdigest()
    for form in (f"sha256:{sha}", sha):  # what earlier versions published and recordings hold
        verify_dir(path, {**sums, "model.safetensors": form})
    wrong = {"sha256 of other bytes": ("sha256:" + hashlib.sha256(b"x").hexdigest(), "has checksum sha256:"),
             "xxh3 of other bytes": ("xxh3_128:" + xxhash.xxh3_128(b"x").hexdigest(), "has checksum xxh3_128:"),
             "an unknown algorithm": ("md5:" + "0" * 32, "'md5:"),
             "no algorithm": ("0" * 32, "is not ALGORITHM:HEX")}
    for what, (form, said) in wrong.items():
        with pytest.raises(CheckpointError, match=re.escape(said)):
            verify_dir(path, {**sums, "model.safetensors": form})
            pytest.fail(f"{what} was accepted")


def test_the_watcher_hears_a_version_as_it_is_announced_not_at_a_poll(tiny_model, tmp_path, r):
    keys = Keys("w")
    path = tmp_path / "step_1"
    path.mkdir()
    announce(r, keys, path, {"model.safetensors": "0" * 64}, version=1)
    # Each XREAD blocks up to 30 s: only a blocking read answered by the XADD itself meets the deadlines.
    with Watcher(r, keys, block_ms=30_000) as watcher:
        assert watcher.latest is not None and watcher.latest.version == 1, "a late starter begins with weights:latest"
        first = watcher.latest.seq
        assert watcher.wait(first, 0.3) is None, "nothing newer was announced"  # now blocked in its read
        t0 = time.time()
        announce(r, keys, path, {"model.safetensors": "0" * 64}, version=2)
        got = watcher.wait(first, 2.0)
        assert got is not None and got.version == 2, "no announcement heard"
        assert got.seen_at - t0 < 1.0
        r.xadd(keys.weights, {PAYLOAD: b"not a weight version"})  # heard, but no version to load
        assert watcher.wait(got.seq, 2.0).version is None
    assert watcher.error is None


def test_a_staged_file_corrupted_after_its_checksum_is_refused(tiny_model, tmp_path):
    path, sums = write_checkpoint(trained(tiny_model, seed=2), checkpoint_dir=tmp_path, step=3, source_dir=tiny_model)
    wv = WeightVersion(version=3, step=3, path=str(path), format="safetensors", checksums=sums, created_at=0.0)
    ok = trio.run(check, Checked(encode(wv)))
    assert ok.error == "" and ok.path == str(path)
    with open(path / "model.safetensors", "r+b") as f:  # one byte flipped in the staged weights
        f.seek(-3, 2)
        byte = f.read(1)
        f.seek(-3, 2)
        f.write(bytes([byte[0] ^ 0xFF]))
    bad = trio.run(check, Checked(encode(wv)))
    assert "model.safetensors has checksum" in bad.error
    garbage = trio.run(check, Checked(b"\x00garbage"))  # a payload that does not decode: refused too
    assert garbage.error and garbage.path == ""


def test_an_idle_generator_loads_a_version_at_once_and_refuses_a_corrupted_one(tiny_model, tmp_path, redis_url, r):
    keys = Keys("idle")
    # weights_poll_s 60: a generator that polled for new weights would see none within the deadlines
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "idle", "ROLLOUTS_MODEL__PATH": str(tiny_model),
           "ROLLOUTS_GENERATOR__ENGINE": "hf", "ROLLOUTS_GENERATOR__THREADS": "1",
           "ROLLOUTS_GENERATOR__WEIGHTS_POLL_S": "60"}
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: read_heartbeat(r, keys, "g1"), timeout=120, what="first heartbeat", procs=[proc])
        time.sleep(1.0)  # blocked in its loop: no prompt, no engine step
        ckpt = tmp_path / "staged"
        path, sums = write_checkpoint(trained(tiny_model, seed=1), checkpoint_dir=ckpt, step=1, source_dir=tiny_model)
        announce(r, keys, path, sums, version=1)
        wait_for(lambda: read_heartbeat(r, keys, "g1").version == 1, timeout=10, what="version 1 loaded",
                 procs=[proc], poll=0.05)

        path, sums = write_checkpoint(trained(tiny_model, seed=2), checkpoint_dir=ckpt, step=2, source_dir=tiny_model)
        with open(path / "model.safetensors", "r+b") as f:  # corrupted after its checksum was taken
            f.seek(200)
            byte = f.read(1)
            f.seek(200)
            f.write(bytes([byte[0] ^ 0x01]))
        announce(r, keys, path, sums, version=2)
        beat = wait_for(lambda: (b := read_heartbeat(r, keys, "g1")) and b.weights_refused >= 1 and b, timeout=10,
                        what="version 2 refused", procs=[proc], poll=0.05)
        assert beat.version == 1 and "checksum" in beat.last_refusal
    finally:
        code = stop(proc)
    output = log.read_text()
    assert code == 0, output
    assert "loaded weights version 1" in output and "refused weights" in output


def test_a_file_removed_while_it_is_checked_refuses_the_version_and_the_generator_goes_on(
        tiny_model, tmp_path, monkeypatch):
    # A trainer restarted from an older state publishes its steps again, replacing the step
    # directories it had published: a generator checking one of them must refuse it, not crash.
    import common.checkpoints as ck

    path, sums = write_checkpoint(trained(tiny_model, seed=4), checkpoint_dir=tmp_path, step=1, source_dir=tiny_model)
    wv = WeightVersion(version=1, step=1, path=str(path), format="safetensors", checksums=sums, created_at=0.0)
    algorithm_of = ck.algorithm_of

    def removed_meanwhile(checksum: str) -> str:  # runs after the file was found, before it is opened
        if checksum == sums["model.safetensors"]:
            (path / "model.safetensors").unlink()
        return algorithm_of(checksum)

    monkeypatch.setattr(ck, "algorithm_of", removed_meanwhile)
    got = trio.run(check, Checked(encode(wv)))  # raised FileNotFoundError, which ended the generator
    assert "could not be read" in got.error and "removed or replaced" in got.error and got.path == ""


def test_a_checkpoint_removed_between_its_check_and_its_load_is_refused_and_the_old_weights_stay(
        tiny_model, tmp_path, monkeypatch):
    import concurrent.futures

    import engines.hf_engine
    from engines.choice import open_engine
    from generators.engine_loop import load_weights
    from generators.state import State

    path, sums = write_checkpoint(trained(tiny_model, seed=5), checkpoint_dir=tmp_path, step=1, source_dir=tiny_model)
    wv = WeightVersion(version=1, step=1, path=str(path), format="safetensors", checksums=sums, created_at=0.0)
    checked = trio.run(check, Checked(encode(wv)))
    assert checked.error == ""
    check_fits = engines.hf_engine.check_fits

    def removed_meanwhile(*args, **kwargs):  # the engine has read the headers; the file goes before its data
        check_fits(*args, **kwargs)
        (path / "model.safetensors").unlink()

    monkeypatch.setattr(engines.hf_engine, "check_fits", removed_meanwhile)
    thread = concurrent.futures.ThreadPoolExecutor(1)
    engine = thread.submit(open_engine, "hf", tiny_model).result()
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    state = State()
    state.latest, state.checked = checked.blob, checked
    trio.run(partial(load_weights, state, engine, thread, name="g"))  # raised FileNotFoundError
    assert state.weights_refused == 1 and "removed or replaced" in state.last_refusal and engine.version == 0
    assert all(torch.equal(before[k], v) for k, v in engine.model.state_dict().items())
    thread.shutdown()


def test_a_checkpoint_pruned_after_its_check_is_loaded_from_the_generators_pin(tiny_model, tmp_path):
    # The trainer prunes checkpoints past keep_checkpoints while a slow generator (vLLM on a busy
    # CPU) still waits to load one it verified: vLLM's reload then failed part-way, its old
    # weights already let go, and the generator died. Pinned (hard links), the files stay.
    import concurrent.futures
    import shutil

    from engines.choice import open_engine
    from generators.engine_loop import load_weights
    from generators.state import State

    path, sums = write_checkpoint(trained(tiny_model, seed=6), checkpoint_dir=tmp_path / "checkpoints", step=2,
                                  source_dir=tiny_model)
    wv = WeightVersion(version=2, step=2, path=str(path), format="safetensors", checksums=sums, created_at=1.0)
    pins = tmp_path / "fetched" / "pinned-g1"
    checked = trio.run(partial(check, Checked(encode(wv)), pin_root=pins))
    assert checked.error == "" and checked.pinned is not None and checked.path == str(checked.pinned)
    # two checks of one version (the watcher's and the engine loop's) pin apart: neither removes the other's
    twice = trio.run(partial(check, Checked(encode(wv)), pin_root=pins))
    assert twice.pinned != checked.pinned and checked.pinned.is_dir()
    unpin(twice)
    assert not twice.pinned and [p.name for p in pins.iterdir()] == [checked.pinned.name]
    shutil.rmtree(path)  # pruned by the trainer before the engine was free to load it
    thread = concurrent.futures.ThreadPoolExecutor(1)
    engine = thread.submit(open_engine, "hf", tiny_model).result()
    state = State()
    state.latest, state.checked = checked.blob, checked
    trio.run(partial(load_weights, state, engine, thread, name="g1", pin_root=pins))
    thread.shutdown()
    assert state.weights_refused == 0 and engine.version == 2, state.last_refusal
    assert list(pins.iterdir()) == [] and state.checked is None  # the pin goes once loaded
    # a checkpoint already gone when it is announced is refused, naming the file
    gone = trio.run(partial(check, Checked(encode(wv)), pin_root=pins))
    assert "is missing" in gone.error or "does not exist" in gone.error, gone.error


def test_a_disk_with_room_for_keep_checkpoints_takes_every_publish(tiny_model, tmp_path, r):
    """The oldest checkpoint is removed before the next one is written, not after: a disk that holds
    `keep` checkpoints (and not one more) takes publish after publish, and every announced version
    is whole on it when it is announced."""
    import subprocess

    from common.checkpoints import verify_dir
    from common.streams import latest_weights
    from trainer.checkpoints import publish

    keep = 3
    model = trained(tiny_model, seed=0)
    size = sum(f.stat().st_size for f in write_checkpoint(
        model, checkpoint_dir=tmp_path / "sized", step=0, source_dir=tiny_model)[0].iterdir())
    disk = tmp_path / "checkpoints"
    disk.mkdir()
    room = keep * size + size // 2  # `keep` checkpoints fit, `keep + 1` do not
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={room}", "tmpfs", str(disk)], capture_output=True,
                          text=True)
    if done.returncode != 0:
        skip_without_root(f"cannot mount a small tmpfs (needs root with CAP_SYS_ADMIN): {done.stderr.strip()}")
    try:
        keys = Keys("prune")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
        for step in range(1, 3 * keep):
            with torch.no_grad():
                next(model.parameters()).add_(1.0)
            publish(r, keys, model, optimizer, scheduler, step=step, checkpoint_dir=disk,
                    state_root=tmp_path / "state", source_dir=tiny_model, keep=keep, save_state_now=False,
                    entry_ids=[], group_ids=[], dedup_window=10)
            latest = latest_weights(r, keys)
            assert latest.version == step
            verify_dir(latest.path, latest.checksums)
            kept = sorted(int(p.name.removeprefix("step_")) for p in disk.glob("step_*"))
            assert kept == list(range(max(1, step - keep + 1), step + 1))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_trainer_restarted_from_an_older_state_keeps_what_it_publishes_again(tiny_model, tmp_path, r):
    """Steps 1-9 were published, then the trainer went back to its state of step 3 (a crash, with
    `state_every` above `keep_checkpoints`): each step it publishes again stays on disk while it is
    the newest, instead of being deleted as the oldest beside steps 7-9 of the run before."""
    from common.checkpoints import verify_dir
    from common.streams import latest_weights
    from trainer.checkpoints import publish

    keep, disk = 3, tmp_path / "checkpoints"
    model = trained(tiny_model, seed=0)
    for step in range(7, 10):  # the run before the restart (its steps 1-6 long pruned)
        write_checkpoint(model, checkpoint_dir=disk, step=step, source_dir=tiny_model)
    keys = Keys("again")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    for step in range(4, 8):
        publish(r, keys, model, optimizer, scheduler, step=step, checkpoint_dir=disk, state_root=tmp_path / "state",
                source_dir=tiny_model, keep=keep, save_state_now=False, entry_ids=[], group_ids=[], dedup_window=10)
        latest = latest_weights(r, keys)
        assert latest.version == step
        verify_dir(latest.path, latest.checksums)
        kept = sorted(int(p.name.removeprefix("step_")) for p in disk.glob("step_*"))
        assert kept == list(range(max(4, step - keep + 1), step + 1))


def hf_engine(model_dir: Path):
    """An HF engine in its own thread, as a generator runs it, and a generator's State."""
    import concurrent.futures

    from engines.choice import open_engine
    from generators.state import State

    thread = concurrent.futures.ThreadPoolExecutor(1)
    return thread.submit(open_engine, "hf", model_dir).result(), thread, State()


def announcer(model_dir: Path, tmp_path: Path):
    """version(seed, step, created_at, **gone_back): an announcement of weights trained with `seed`
    (written as a checkpoint of `step`), and the model it holds."""
    def version(seed: int, step: int, created_at: float, **gone_back: float) -> tuple[bytes, torch.nn.Module]:
        model = trained(model_dir, seed=seed)
        path, sums = write_checkpoint(model, checkpoint_dir=tmp_path / str(seed), step=step, source_dir=model_dir)
        return encode(WeightVersion(version=step, step=step, path=str(path), format="safetensors", checksums=sums,
                                    created_at=created_at, **gone_back)), model
    return version


def loader(engine, thread, state):
    """load(blob): the generator's load_weights on `blob` as the newest announcement."""
    from generators.engine_loop import load_weights

    def load(blob: bytes) -> None:
        state.latest = blob
        trio.run(partial(load_weights, state, engine, thread, name="g"))
    return load


def holder(engine):
    """holds(model): whether the engine holds `model`'s weights."""
    def holds(model: torch.nn.Module) -> bool:
        mine = engine.model.state_dict()
        return all(torch.equal(mine[k], v) for k, v in model.state_dict().items())
    return holds


def test_a_lower_version_announced_later_is_loaded_once_nothing_is_in_flight(tiny_model, tmp_path, monkeypatch):
    """A trainer restarted from an older state announces versions the generator has passed, with
    other weights: the generator loads them (they were announced later), after its completions in
    flight, not never; a lower version published *before* its weights (a stale read) stays passed over."""
    from generators.engine_loop import load_weights

    engine, thread, state = hf_engine(tiny_model)
    version, load, holds = announcer(tiny_model, tmp_path), loader(engine, thread, state), holder(engine)

    before_restart, old = version(6, step=9, created_at=100.0)
    load(before_restart)
    assert engine.version == 9 and holds(old)
    stale, _ = version(7, step=3, created_at=50.0)
    load(stale)
    assert engine.version == 9 and holds(old) and state.went_back is None
    again, new = version(8, step=4, created_at=200.0)
    monkeypatch.setattr(engine, "has_unfinished", lambda: True)  # completions in flight
    load(again)
    assert engine.version == 9 and holds(old) and state.went_back == again
    monkeypatch.setattr(engine, "has_unfinished", lambda: False)  # drained
    trio.run(partial(load_weights, state, engine, thread, name="g"))
    assert engine.version == 4 and holds(new) and state.went_back is None and state.weights_refused == 0
    thread.shutdown()


def test_a_higher_version_published_after_the_trainer_went_back_waits_for_abandoned_completions(
        tiny_model, tmp_path, monkeypatch):
    """The engine holds version 12, which the trainer abandoned when it went back to step 10; the
    trainer's new version 13 is numbered higher, but the completions in flight under the old 12
    must not go on under it (a group would span two runs of weights): it is loaded as one that goes
    back, once they are done, and the versions loaded before are forgotten. A version 13 from a
    trainer that went back to 12 or later (the weights held are not abandoned) loads at once."""

    from generators.engine_loop import load_weights

    engine, thread, state = hf_engine(tiny_model)
    version, load, holds = announcer(tiny_model, tmp_path), loader(engine, thread, state), holder(engine)

    load(version(6, step=11, created_at=100.0)[0])
    old, old_model = version(7, step=12, created_at=110.0)
    load(old)
    assert engine.version == 12 and holds(old_model) and state.published == {11: 100.0, 12: 110.0}
    new, new_model = version(8, step=13, created_at=300.0, gone_back_step=10, gone_back_at=200.0)
    monkeypatch.setattr(engine, "has_unfinished", lambda: True)  # completions in flight under the old 12
    load(new)
    assert engine.version == 12 and holds(old_model) and state.went_back == new
    monkeypatch.setattr(engine, "has_unfinished", lambda: False)  # drained
    trio.run(partial(load_weights, state, engine, thread, name="g"))
    assert engine.version == 13 and holds(new_model) and state.went_back is None
    assert state.published == {13: 300.0}  # a group of version 12 from now on is of the new 12
    monkeypatch.setattr(engine, "has_unfinished", lambda: True)
    newer, newer_model = version(9, step=14, created_at=310.0, gone_back_step=10, gone_back_at=200.0)
    load(newer)  # the weights held were published after the go-back: an ordinary update, in flight
    assert engine.version == 14 and holds(newer_model) and state.published == {13: 300.0, 14: 310.0}
    thread.shutdown()


def test_a_checkpoint_queued_for_evaluation_outlives_its_pruning(tiny_model, tmp_path):
    """The evaluator may be slower than `keep_checkpoints` publishes: the checkpoint an evaluation
    is queued on is held (hard links, no second copy on disk) until two newer ones are held, so
    pruning the published one takes nothing from the evaluation."""
    import shutil

    from common.checkpoints import verify_dir
    from trainer.checkpoints import hold_for_eval

    held = []
    for step in (10, 20, 30):
        path, sums = write_checkpoint(trained(tiny_model, seed=step), checkpoint_dir=tmp_path / "checkpoints",
                                      step=step, source_dir=tiny_model)
        wv = WeightVersion(version=step, step=step, path=str(path), format="safetensors", checksums=sums,
                           created_at=0.0)
        held.append(hold_for_eval(wv))
        assert (path / "model.safetensors").stat().st_ino == (Path(held[-1].path) / "model.safetensors").stat().st_ino
        shutil.rmtree(path)  # pruned by the trainer before the evaluator got to it
        verify_dir(held[-1].path, held[-1].checksums)  # what the evaluator checks, and then loads
    assert held[-1].checksums == sums and held[-1].version == 30
    assert sorted(p.name for p in (tmp_path / "checkpoints" / "evaluating").iterdir()) == ["step_20", "step_30"]
