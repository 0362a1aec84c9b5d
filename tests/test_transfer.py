"""Weights over a collective (trainer.weight_transfer): the trainer's rank-0 Sender and generators'
Receivers over gloo and a real Redis, in one process (each end in threads of its own): what arrives
is what was sent, generators join and leave between versions, one that stops listening fails only
its epoch (bounded by the timeout), and bytes that differ from the offer's fingerprints are refused."""

from __future__ import annotations

import signal
import threading
import time
from pathlib import Path

import pytest
import redis
import torch

from common.config import TrainerConfig
from common.keys import Keys
from common.progress import read_trainer
from common.transfer import decode_offer, layout, pack, unpack
from generators.transfer import Receiver
from tests.harness.audit import accounting, assert_accounted
from tests.harness.configs import write_config
from tests.harness.pipeline import KEYS, RUN, Pipeline, trained_once
from tests.harness.processes import wait_for
from trainer.transfer import Sender

TIMEOUT_S = 4.0


def weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"model.embed_tokens.weight": torch.randn(64, 16, generator=g).to(torch.bfloat16),
            "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16, generator=g),
            "model.norm.weight": torch.ones(16, dtype=torch.bfloat16),
            "step": torch.tensor([seed], dtype=torch.int64)}


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def sender_for(r, keys: Keys, **cfg) -> Sender:
    config = TrainerConfig(weight_transfer="gloo", transfer_timeout_s=TIMEOUT_S, transfer_host="127.0.0.1", **cfg)
    return Sender(r, keys, config, device=torch.device("cpu"))


def listening(r, keys: Keys, *receivers: Receiver) -> list[Receiver]:
    started = [x.start() for x in receivers]
    deadline = time.time() + 10
    while {x.id for x in started} - {k.decode() for k in r.hkeys(keys.transfer_members)}:
        assert time.time() < deadline, "the receivers never said they listen"
        time.sleep(0.05)
    return started


def test_buckets_hold_every_tensor_bit_exact_and_split_at_the_size():
    w = weights(1)
    slots, sizes = layout(w, bucket_bytes=2048)
    assert len(sizes) > 1 and all(n <= 2048 or len([s for s in slots if s.bucket == i]) == 1
                                  for i, n in enumerate(sizes))
    assert same(unpack(pack(w, slots, sizes), slots), w)


def test_every_listening_generator_receives_the_weights_bit_exact_and_a_newcomer_joins_at_the_next_version(r):
    keys = Keys("xfer")
    sender = sender_for(r, keys, transfer_bucket_mb=1)
    a, b = listening(r, keys, Receiver(r, keys, generator_id="g1"), Receiver(r, keys, generator_id="g2"))
    try:
        digest = sender.start(weights(1), version=1).result()
        assert digest
        for x in (a, b):
            assert same(x.take(1, digest, timeout=10), weights(1))
        assert a.take(1, digest, timeout=0) is None  # taken once
        first = sender.epoch
        (c,) = listening(r, keys, Receiver(r, keys, generator_id="g3"))
        digest2 = sender.start(weights(2), version=2).result()
        assert digest2 and digest2 != digest and sender.epoch == first + 1 and sender.members == ["g1", "g2", "g3"]
        for x in (a, b, c):
            assert same(x.take(2, digest2, timeout=10), weights(2))
        # the same members: the same group, no new meeting
        digest3 = sender.start(weights(3), version=3).result()
        assert digest3 and sender.epoch == first + 1
        assert same(c.take(3, digest3, timeout=10), weights(3))
        offer = decode_offer(r.xrevrange(keys.transfer_offers, count=1)[0][1][b"m"])
        assert offer.version == 3 and offer.members == ["g1", "g2", "g3"] and offer.digest == digest3
    finally:
        for x in (a, b, c):
            x.stop()
        sender.close()


def test_a_version_announced_before_the_generator_read_its_offer_is_still_taken_from_memory(r):
    # gloo broadcasts along a tree: the trainer's end is done (and the version announced) once its
    # children have the weights, while a generator further down, g3 here (fed by g2), may not yet have
    # read the offer. Its weights check asks for the version then, and must wait for the read and the
    # receive, not find nothing and read the files.
    keys = Keys("xfer")
    sender = sender_for(r, keys)
    own = redis.Redis(connection_pool=r.connection_pool)  # g3's client, its reads held back below
    gate, held = threading.Event(), threading.Event()
    read = own.xread

    def lagging(*args, **kwargs):
        got = read(*args, **kwargs)
        if got and not gate.is_set():
            held.set()
            gate.wait(timeout=30)
        return got

    gate.set()
    own.xread = lagging
    a, b, c = listening(r, keys, Receiver(r, keys, generator_id="g1"), Receiver(r, keys, generator_id="g2"),
                        Receiver(own, keys, generator_id="g3"))
    try:
        digest = sender.start(weights(1), version=1).result()
        for x in (a, b, c):  # the group met
            assert same(x.take(1, digest, timeout=10), weights(1))
        gate.clear()
        digest2 = sender.start(weights(2), version=2).result()
        assert digest2, "the trainer's end of the broadcast failed"
        assert held.wait(timeout=10), "g3 did not read the offer of version 2"
        taken: list = []
        asking = threading.Thread(target=lambda: taken.append(c.take(2, digest2, timeout=20)))
        asking.start()
        time.sleep(0.5)  # the weights check waits while the offer is unread
        gate.set()
        asking.join(timeout=30)
        assert taken and taken[0] is not None, "version 2 was not taken from memory: the generator reads the files"
        assert same(taken[0], weights(2))
        for x in (a, b):
            assert same(x.take(2, digest2, timeout=10), weights(2))
    finally:
        gate.set()
        for x in (a, b, c):
            x.stop()
        sender.close()


def test_a_generator_that_stops_listening_fails_only_its_epoch_and_the_next_version_reaches_the_others(r):
    keys = Keys("xfer")
    sender = sender_for(r, keys)
    a, b = listening(r, keys, Receiver(r, keys, generator_id="g1"), Receiver(r, keys, generator_id="g2"))
    try:
        assert sender.start(weights(1), version=1).result()
        # g2 dies without a word: its thread ends, its membership stays as fresh as it was
        b._stop.set()
        b._thread.join()
        b._leave()
        t0 = time.perf_counter()
        assert sender.start(weights(2), version=2).result() == ""  # nobody waits forever
        assert time.perf_counter() - t0 < 3 * TIMEOUT_S
        assert a.take(2, "", timeout=0) is None
        deadline = time.time() + 15  # g1, still listening, says so again; g2 does not
        while r.hkeys(keys.transfer_members) != [b"g1"]:
            assert time.time() < deadline, r.hkeys(keys.transfer_members)
            time.sleep(0.1)
        digest = sender.start(weights(3), version=3).result()
        assert digest and sender.members == ["g1"]
        assert same(a.take(3, digest, timeout=10), weights(3))
        assert a.received + a.failed == 3  # version 2 may have reached g1 before the trainer gave up on g2
    finally:
        a.stop()
        sender.close()


def test_bytes_that_differ_from_the_offers_fingerprints_are_refused(r, monkeypatch):
    keys = Keys("xfer")
    sender = sender_for(r, keys)
    (a,) = listening(r, keys, Receiver(r, keys, generator_id="g1"))
    try:
        import trainer.transfer

        real = trainer.transfer.bucket_fingerprint  # the sender's fingerprints, wrong on purpose
        monkeypatch.setattr(trainer.transfer, "bucket_fingerprint", lambda b: real(b + 1))
        digest = sender.start(weights(1), version=1).result()
        assert digest  # the trainer sent it...
        assert a.take(1, digest, timeout=10) is None  # ...and the generator refused it
        assert a.failed == 1 and "refused" in a.last_error and a.received == 0
        monkeypatch.setattr(trainer.transfer, "bucket_fingerprint", real)
        digest = sender.start(weights(2), version=2).result()
        assert same(a.take(2, digest, timeout=10), weights(2))  # the group itself was fine
    finally:
        a.stop()
        sender.close()


def test_nobody_listening_sends_nothing(r):
    sender = sender_for(r, Keys("xfer"))
    try:
        assert sender.start(weights(1), version=1).result() == ""
    finally:
        sender.close()


@pytest.mark.parametrize("bad", ["nccl"])
def test_nccl_without_a_gpu_is_refused_in_one_line(r, bad):
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    with pytest.raises(RuntimeError, match="needs the trainer on a GPU"):
        Sender(r, Keys("xfer"), TrainerConfig(weight_transfer=bad), device=torch.device("cpu"))


def loads(log: Path, *, after: int = 0) -> tuple[int, int]:
    """(versions loaded from the broadcast, from the files) by the generator whose log is `log`,
    from byte `after` of it on."""
    lines = [x for x in log.read_bytes()[after:].decode().splitlines() if "loaded weights version" in x]
    over = sum("received over the broadcast" in x for x in lines)
    return over, len(lines) - over


def test_a_run_over_gloo_loads_the_broadcast_goes_on_when_a_generator_dies_and_takes_in_a_new_one(
        tmp_path, redis_url, r, tiny_model):
    env = write_config(tmp_path / "run.toml", run=RUN, redis_url=redis_url, output_dir=tmp_path / "run",
                       model=tiny_model, generator={"engine": "hf", "claim_idle_s": 4},
                       trainer={"max_steps": 0, "weight_transfer": "gloo", "transfer_timeout_s": TIMEOUT_S,
                                "transfer_host": "127.0.0.1"})
    pipe = Pipeline(tmp_path, env)
    for name in ("producer", "g1", "g2", "trainer"):
        pipe.start(name)
    procs = list(pipe.procs.values())
    wait_for(lambda: min(loads(pipe.log("g1"))[0], loads(pipe.log("g2"))[0]) >= 2, timeout=240,
             what="both generators loading broadcast weights", procs=procs)
    pipe.kill("g2")  # dies without a word: the trainer finds out at its next broadcast
    pipe.forget("g2")
    killed_at, g1_before = read_trainer(r, KEYS).step, loads(pipe.log("g1"))[0]
    wait_for(lambda: read_trainer(r, KEYS).step >= killed_at + 3 and loads(pipe.log("g1"))[0] >= g1_before + 2,
             timeout=180, what="steps and broadcasts after g2 died", procs=list(pipe.procs.values()))
    restarted = pipe.log("g2").stat().st_size
    pipe.start("g2")  # a new generator (the same id, a new process) joins at a later version
    wait_for(lambda: loads(pipe.log("g2"), after=restarted)[0] >= 1, timeout=180, what="the new g2 loading a broadcast",
             procs=list(pipe.procs.values()))
    pipe.procs["trainer"].send_signal(signal.SIGTERM)  # it runs until stopped (max_steps 0)
    pipe.finish()
    trainer_log = pipe.log("trainer").read_text()
    assert "broadcasting version" in trainer_log and "failed" in trainer_log, trainer_log[-3000:]
    # the new g2 started from the files (the newest version on disk), then took the broadcast
    over, files = loads(pipe.log("g2"), after=restarted)
    assert over >= 1 and files >= 1, pipe.log("g2").read_text()[-3000:]
    # nothing lost: every trained group trained once, all of them accounted for
    assert_accounted(accounting(r, KEYS))
    trained_once(r, tmp_path, read_trainer(r, KEYS).step)
