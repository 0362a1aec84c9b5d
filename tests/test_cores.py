"""trainer.borrow_threads: the trainer computes on the host's sampling core only while no sampler
(generator, evaluator) holds it, and never makes a sampler wait longer than one of its passes."""

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import torch

from common.cores import Borrower, Lease, lock_path, sampler_lease, sampling

ROOT = Path(__file__).resolve().parents[1]


def test_the_trainer_borrows_only_while_no_sampler_holds_the_core(tmp_path):
    path = tmp_path / "cores"
    sampler, borrower = Lease(path), Borrower(path=path, threads=1, extra=1)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with borrower.wider() as wide:  # nobody samples: the pass runs on two threads
            assert wide and torch.get_num_threads() == 2
        assert torch.get_num_threads() == 1
        with sampling(sampler), borrower.wider() as wide:  # a generator's engine works: no borrowing
            assert not wide and torch.get_num_threads() == 1
        with borrower.wider() as wide:  # given back: borrowed again
            assert wide
        assert borrower.share_taken() == 2 / 3 and borrower.share_taken() == 0.0
    finally:
        torch.set_num_threads(before)


def test_a_sampler_waits_for_the_trainers_pass_then_gets_the_core(tmp_path):
    path = tmp_path / "cores"
    borrower, sampler = Borrower(path=path, threads=1, extra=1), Lease(path)
    got = threading.Event()
    with borrower.wider() as wide:
        assert wide
        waiting = threading.Thread(target=lambda: (sampler.share(), got.set()))
        waiting.start()
        assert not got.wait(0.5), "the sampler took the core in the middle of the trainer's pass"
    assert got.wait(5), "the sampler did not get the core once the trainer's pass ended"
    waiting.join()
    with borrower.wider() as wide:
        assert not wide
    sampler.release()


def test_several_samplers_share_the_core_and_a_dead_one_lets_go(tmp_path):
    path = tmp_path / "cores"
    first, second = Lease(path), Lease(path)
    first.share()
    second.share()  # a second generator on the host does not wait for the first
    first.release()
    borrower = Borrower(path=path, threads=1, extra=1)
    with borrower.wider() as wide:
        assert not wide  # the second still samples
    second.release()
    # A sampler process killed while it holds the core does not keep it from the trainer.
    holder = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import pathlib, time
        from common.cores import Lease
        Lease(pathlib.Path({str(path)!r})).share()
        print("holding", flush=True)
        time.sleep(60)
        """)], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    assert holder.stdout.readline().strip() == "holding"
    with borrower.wider() as wide:
        assert not wide
    holder.kill()
    holder.wait()
    deadline = time.monotonic() + 5
    while True:
        with borrower.wider() as wide:
            if wide:
                break
        assert time.monotonic() < deadline, "the killed sampler's hold outlived it"
        time.sleep(0.05)


def test_the_lock_is_the_runs_own_and_off_by_default(tmp_path):
    assert lock_path("redis://127.0.0.1:6390/0", "demo") == lock_path("redis://127.0.0.1:6390/0", "demo")
    assert lock_path("redis://127.0.0.1:6390/0", "demo") != lock_path("redis://127.0.0.1:6391/0", "demo")
    assert lock_path("redis://127.0.0.1:6390/0", "demo") != lock_path("redis://127.0.0.1:6390/0", "other")
    assert sampler_lease("redis://127.0.0.1:6390/0", "demo", borrow_threads=0) is None
    off = Borrower(path=tmp_path / "cores", threads=1, extra=0)
    with off.wider() as wide:
        assert not wide
    assert not (tmp_path / "cores").exists()  # borrowing nothing touches no file


def test_a_run_whose_trainer_borrows_the_generators_core_trains_every_group_once(tmp_path, redis_url, r,
                                                                                  tiny_model):
    from tests.harness.pipeline import Pipeline, metrics, pipeline_config, trained_once

    steps = 6
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=steps, threads=1,
                                              borrow_threads=1))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    pipe.finish()
    trained_once(r, tmp_path, steps)
    borrowed = [m["trainer/borrowed"] for m in metrics(tmp_path)]
    assert all(0.0 <= b <= 1.0 for b in borrowed) and any(b > 0 for b in borrowed), borrowed
