"""A version's files read ahead beside the sampling (engines/hf_engine.py `stage`): on a GPU the HF
engine's pause for a version was the files' read and a copy from pageable memory (0.22 s of 0.29 s
a version for the built-in model on an H200, docs/gpu.md); the check that verifies a version's files
now hands them to the engine, which reads them into page-locked memory in a worker thread, and its
load copies from there. On a CPU the engine reads nothing ahead (its load is one read already);
these tests turn it on (`engine.stages`) to check what a GPU runs: the weights loaded are the
version's, never another's read ahead, whatever the order of the threads."""

from __future__ import annotations

import concurrent.futures
import threading
from functools import partial

import pytest
import torch
import trio

import engines.hf_engine
from common.messages import WeightVersion, encode
from engines.choice import open_engine
from generators.engine_loop import load_weights
from generators.state import State
from generators.weights import Checked, check
from tests.harness.models import trained
from trainer.checkpoints import write_checkpoint


@pytest.fixture
def versions(tiny_model, tmp_path):
    """Two checkpoints of the tiny model with different weights: {version: (path, checksums, state_dict)}."""
    out = {}
    for v in (1, 2):
        model = trained(tiny_model, seed=10 + v)
        path, sums = write_checkpoint(model, checkpoint_dir=tmp_path / "checkpoints", step=v, source_dir=tiny_model)
        out[v] = (path, sums, {k: t.detach().clone() for k, t in model.state_dict().items()})
    return out


def engine_reading_ahead(tiny_model):
    engine = open_engine("hf", tiny_model)
    assert not engine.stages  # a CPU: nothing read ahead unless asked
    engine.stages = True
    return engine


def holds(engine, weights: dict[str, torch.Tensor]) -> bool:
    own = engine.model.state_dict()
    return all(torch.equal(own[k], t) for k, t in weights.items() if k in own)


def test_a_version_read_ahead_is_loaded_from_memory_and_is_the_files(tiny_model, versions, monkeypatch):
    engine = engine_reading_ahead(tiny_model)
    path, _, weights = versions[1]
    assert engine.stage(str(path))
    monkeypatch.setattr(engines.hf_engine, "copy_into", lambda *a: pytest.fail("read the files again"))
    engine.load_weights(str(path), version=1)
    assert engine.loaded_staged and engine.version == 1 and holds(engine, weights)


def test_weights_read_ahead_for_another_version_are_not_loaded(tiny_model, versions):
    engine = engine_reading_ahead(tiny_model)
    (one, _, w1), (two, _, w2) = versions[1], versions[2]
    assert engine.stage(str(two))  # version 2 announced while version 1 waits to be loaded
    engine.load_weights(str(one), version=1)
    assert not engine.loaded_staged and holds(engine, w1) and not holds(engine, w2)
    engine.load_weights(str(two), version=2)
    assert engine.loaded_staged and holds(engine, w2)
    # read ahead once, loaded once: a second load of it reads the files
    engine.load_weights(str(two), version=2)
    assert not engine.loaded_staged and holds(engine, w2)


def test_loads_and_reads_ahead_in_two_threads_load_the_version_asked_for(tiny_model, versions):
    # the check reads ahead in a worker thread while the engine's thread loads: whichever comes first,
    # a load copies the version it was asked for, never one half read over by the next
    engine = engine_reading_ahead(tiny_model)
    paths = {v: str(p) for v, (p, _, _) in versions.items()}
    stop = threading.Event()

    def announce() -> None:
        v = 1
        while not stop.is_set():
            engine.stage(paths[v])
            v = 3 - v

    reader = threading.Thread(target=announce)
    reader.start()
    try:
        staged = 0
        for i in range(40):
            v = 1 + i % 2
            engine.load_weights(paths[v], version=v)
            staged += engine.loaded_staged
            assert holds(engine, versions[v][2]), f"load {i} of version {v}"
    finally:
        stop.set()
        reader.join()
    assert staged > 0  # some loads did come from what was read ahead


def test_the_check_hands_verified_files_to_the_engine_and_a_generator_loads_them(tiny_model, versions, capsys):
    path, sums, weights = versions[2]
    seen: list[str] = []

    def stage(p: str) -> bool:
        seen.append(p)
        return True

    wv = WeightVersion(version=2, step=2, path=str(path), format="safetensors", checksums=sums, created_at=1.0)
    checked = trio.run(partial(check, Checked(encode(wv)), stage=stage))
    assert checked.error == "" and seen == [str(path)] and checked.staged is not None
    # files that fail their checksums are not read ahead
    bad = dict(sums, **{"model.safetensors": "xxh64:0000000000000000"})
    refused = trio.run(partial(check, Checked(encode(WeightVersion(
        version=3, step=3, path=str(path), format="safetensors", checksums=bad, created_at=2.0))), stage=stage))
    assert refused.error and seen == [str(path)] and refused.staged is None
    # the generator's load: its check read ahead through the engine, the engine loaded from memory
    thread = concurrent.futures.ThreadPoolExecutor(1)
    engine = thread.submit(engine_reading_ahead, tiny_model).result()
    state = State()
    state.latest = encode(wv)
    trio.run(partial(load_weights, state, engine, thread, name="g"))
    thread.shutdown()
    assert state.weights_refused == 0 and engine.version == 2 and holds(engine, weights)
    said = capsys.readouterr().out
    assert "g: loaded weights version 2 (verify " in said and " from the files read ahead (" in said, said
