"""One GPU per generator: leases in a real Redis, taken, renewed, expired and released."""

import time

import pytest

from common.keys import Keys
from generators import devices

KEYS = Keys("gpus")


def test_each_generator_leases_its_own_gpu_until_it_goes(r):
    gpus = ["0", "1", "2"]
    got = [devices.lease_gpu(r, KEYS, host="node1", devices=gpus, owner=f"g{i}", ttl_s=30) for i in range(3)]
    assert got == ["0", "1", "2"]
    assert devices.lease_gpu(r, KEYS, host="node1", devices=gpus, owner="g3", ttl_s=30) is None
    assert devices.lease_gpu(r, KEYS, host="node2", devices=gpus, owner="g3", ttl_s=30) == "0", "per host"
    devices.release_gpu(r, KEYS, host="node1", device="1", owner="g1")
    assert devices.lease_gpu(r, KEYS, host="node1", devices=gpus, owner="g4", ttl_s=30) == "1"
    # only the holder renews or releases
    assert not devices.renew_gpu(r, KEYS, host="node1", device="1", owner="g1", ttl_s=30)
    devices.release_gpu(r, KEYS, host="node1", device="1", owner="g1")
    assert r.get(KEYS.gpu_lease("node1", "1")) == b"g4"


def test_a_dead_generators_gpu_is_free_once_its_lease_expires(r):
    assert devices.lease_gpu(r, KEYS, host="h", devices=["0", "1"], owner="dead", ttl_s=1) == "0"
    assert devices.renew_gpu(r, KEYS, host="h", device="0", owner="dead", ttl_s=1)
    time.sleep(1.2)
    assert devices.lease_gpu(r, KEYS, host="h", devices=["0", "1"], owner="new", ttl_s=30) == "0"


def test_pick_gpu_sets_the_visible_device_and_refuses_one_generator_too_many(r, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert devices.pick_gpu(r, KEYS, host="h", owner="a", ttl_s=30) == "2"
    import os

    assert os.environ["CUDA_VISIBLE_DEVICES"] == "2"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert devices.pick_gpu(r, KEYS, host="h", owner="b", ttl_s=30) == "3"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    with pytest.raises(RuntimeError, match="all 2 GPUs of h"):
        devices.pick_gpu(r, KEYS, host="h", owner="c", ttl_s=30)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "5")  # pinned by the user: left alone
    assert devices.pick_gpu(r, KEYS, host="h", owner="d", ttl_s=30) is None
