"""Fault tests: the real processes on the tiny model, one of them killed with SIGKILL mid-run (a
generator holding prompts, the trainer between checkpoints, the producer, Redis itself), then
started again (a dead generator's prompts are reclaimed by the other one instead). Each ends with the
accounting: every admitted prompt is trained, dropped for a counted reason or still pending, and
no group is trained twice. Run with -s to see the numbers."""

import contextlib
import os
import re
import signal
import time
from pathlib import Path

import pytest
import redis

from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import decode_prompt, decode_weights
from common.progress import read_dropped, read_gone_back, read_producer, read_trainer
from tests.harness.audit import accounting, assert_accounted, report, unaccounted
from tests.harness.metrics import trained_twice
from tests.harness.needs import need_vllm
from tests.harness.pipeline import KEYS, Pipeline, metrics, pipeline_config, trained_once
from tests.harness.processes import Shell, wait_for
from tests.harness.servers import free_port, start_redis


def held_prompts(r, consumer: str) -> list[str]:
    """Ids of the prompts delivered to `consumer` and not yet acknowledged."""
    entries = [p["message_id"] for p in r.xpending_range(KEYS.prompts, GENERATORS_GROUP, min="-", max="+",
                                                         count=1000, consumername=consumer)]
    return [decode_prompt(r.xrange(KEYS.prompts, e, e)[0][1][PAYLOAD]).id for e in entries]


def stopped_holding_prompts(r, proc, consumer: str) -> list[str] | None:
    """SIGSTOP `proc` while it holds prompts mid-generation (and let it go on if it let them go
    meanwhile); the ids it held, or None to try again."""
    if not r.xpending_range(KEYS.prompts, GENERATORS_GROUP, min="-", max="+", count=1, consumername=consumer):
        return None
    proc.send_signal(signal.SIGSTOP)
    held = held_prompts(r, consumer)
    if not held:
        proc.send_signal(signal.SIGCONT)
    return held or None


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_generator_sigkill_holding_prompts(tmp_path, redis_url, r, tiny_model, engine):
    if engine == "vllm":
        need_vllm()
    # claim_idle_s: long enough that a live generator's prompts are not taken from it, short
    # enough that the test does not wait long for the dead one's
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=100, claim_idle_s=4,
                                           engine=engine))
    for name in ("producer", "g1", "g2", "trainer"):
        pipe.start(name)
    wait_for(lambda: read_trainer(r, KEYS).step >= 1, timeout=180, what="step 1",
             procs=list(pipe.procs.values()))
    g1 = pipe.procs["g1"]

    stopped_holding = wait_for(lambda: stopped_holding_prompts(r, g1, "g1"), timeout=120, what="g1 holding prompts",
                               procs=list(pipe.procs.values()), poll=0.01)
    pipe.kill("g1")
    pipe.forget("g1")
    at_kill = accounting(r, KEYS)
    # A read g1 had blocked in Redis before it stopped may still have been handed prompts since:
    # they are g1's too, and must be reclaimed like the rest.
    held = held_prompts(r, "g1")
    assert set(stopped_holding) <= set(held), (stopped_holding, held)
    # The run goes on without them; once they have been idle claim_idle_s, g2 takes them over.
    wait_for(lambda: all(r.zscore(KEYS.trained, p) is not None for p in held), timeout=120,
             what=f"the prompts g1 held ({held}) trained", procs=list(pipe.procs.values()))
    pipe.procs["trainer"].send_signal(signal.SIGTERM)  # finishes its step, saves, acknowledges
    pipe.finish()
    after = accounting(r, KEYS)
    report("generator SIGKILL", at_kill, after)
    print(f"generator SIGKILL: g1 held {len(held)} prompts when killed: {', '.join(held)}")
    assert_accounted(after)
    steps = read_trainer(r, KEYS).step
    ids = trained_once(r, tmp_path, steps)
    assert after["trained"] == len(ids) == steps * 4
    assert all(ids.count(p) == 1 for p in held), f"prompts g1 held, as trained: {held} in {ids}"
    assert held_prompts(r, "g1") == []


def test_trainer_sigkill_between_checkpoints(tmp_path, redis_url, r, tiny_model):
    steps = 6
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=steps, state_every=2))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    # Step 3 is trained and its weights published (announced once written, beside step 4), but its
    # groups wait for step 4's saved state; step 2's state is recorded (its own thread writes it,
    # and Redis records it once it is on disk)
    wait_for(lambda: any(m["step"] == 3 for m in metrics(tmp_path)) and read_trainer(r, KEYS).version >= 3
             and read_trainer(r, KEYS).state_step >= 2,
             timeout=180, what="step 3, its version and step 2's state", procs=list(pipe.procs.values()))
    pipe.kill("trainer")
    at_kill = accounting(r, KEYS)
    state_step = read_trainer(r, KEYS).state_step
    assert state_step in (2, 4)
    pipe.start("trainer")
    pipe.finish()
    after = accounting(r, KEYS)
    report("trainer SIGKILL", at_kill, after)
    assert after["dropped_stale"] == 0, "a fault made admitted prompts go stale"
    log = pipe.log("trainer").read_text()
    assert "from its trainer state" in log
    if state_step == 2:  # it went back below version 3 and trained step 3 again from the same groups
        assert "version 3 published again with the weights it had before" in log, log
    assert_accounted(after)
    assert after["trained"] == len(trained_once(r, tmp_path, steps)) == steps * 4


def test_producer_sigkill_mid_run(tmp_path, redis_url, r, tiny_model):
    steps = 4
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=steps))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    wait_for(lambda: read_trainer(r, KEYS).step >= 1, timeout=180, what="step 1",
             procs=list(pipe.procs.values()))
    pipe.kill("producer")
    at_kill = accounting(r, KEYS)
    pipe.start("producer")
    # started and taking work before the stop: one SIGTERMed while importing dies of it (-15)
    wait_for(lambda: pipe.log("producer").read_text().count("resuming after") >= 2, timeout=120,
             what="the restarted producer resuming", procs=[pipe.procs["producer"]])
    pipe.finish()
    after = accounting(r, KEYS)
    report("producer SIGKILL", at_kill, after)
    assert after["dropped_stale"] == 0, "a fault made admitted prompts go stale"
    assert_accounted(after)
    ids = trained_once(r, tmp_path, steps)
    assert after["trained"] == len(ids) == steps * 4
    # prompts are admitted exactly once each, in order: the trained ones are the first admitted
    assert set(ids) <= {f"arithmetic:0:{i}" for i in range(after["admitted"])}
    assert "resuming after" in pipe.log("producer").read_text()


def test_redis_sigkill_and_restart_from_its_append_only_file(tmp_path, tiny_model):
    steps = 5
    port = free_port()
    data = tmp_path / "redis"
    args = ("--appendfsync", "everysec")  # as the Procfile ships it: a SIGKILL keeps the page cache
    server = start_redis(data, port, *args)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, url, tiny_model, steps=steps))
    try:
        for name in ("producer", "generator", "trainer"):
            pipe.start(name)
        def busy() -> dict | None:  # past step 2, with a generator mid-batch
            acc = accounting(r, KEYS)
            return acc if read_trainer(r, KEYS).step >= 2 and acc["prompts_pending"] else None

        at_kill = wait_for(busy, timeout=180, what="step 2 and prompts in flight", procs=list(pipe.procs.values()),
                           poll=0.05)
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        time.sleep(2)  # everyone is without Redis for a while
        assert all(p.poll() is None for p in pipe.procs.values()), "a process gave up while Redis was away"
        server = start_redis(data, port, *args)
        pipe.finish()
        after = accounting(r, KEYS)
        report("Redis SIGKILL", at_kill, after)
        assert after["dropped_stale"] == 0, "a fault made admitted prompts go stale"
        assert_accounted(after)
        assert after["trained"] == len(trained_once(r, tmp_path, steps)) == steps * 4
        assert after["admitted"] >= at_kill["admitted"]
    finally:
        server.kill()


def aof_tail(data: Path) -> Path:
    """The append-only file Redis is writing to (Redis 7 keeps a base and an incremental file)."""
    return sorted((data / "appendonlydir").glob("*.incr.aof"))[-1]


def test_power_loss_forgets_a_second_of_redis_and_nothing_is_trained_twice_or_lost(tmp_path, tiny_model):
    """Redis with `appendfsync everysec` (as shipped) loses up to a second of writes when the
    machine loses power: SIGKILL it and cut its append-only file back to where it was a second
    before. The trainer, whose state on disk is ahead, refuses what comes round again and writes
    its record back; the producer admits again what Redis forgot; nothing is trained twice."""
    steps = 60
    port, data = free_port(), tmp_path / "redis"
    server = start_redis(data, port, "--appendfsync", "everysec")
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, url, tiny_model, steps=steps, claim_idle_s=3))
    try:
        for name in ("producer", "generator", "trainer"):
            pipe.start(name)
        wait_for(lambda: read_trainer(r, KEYS).step >= 1, timeout=180, what="step 1", procs=list(pipe.procs.values()))
        sizes, since = [], time.monotonic()  # the append-only file's size, for a second and more
        while (at_kill := read_trainer(r, KEYS).step) < 3 or time.monotonic() - since < 1.2:
            sizes.append((time.monotonic(), aof_tail(data).stat().st_size))
            time.sleep(0.02)
        assert at_kill < steps - 10, f"the trainer is at step {at_kill} of {steps}: too near its end to see the loss"
        server.send_signal(signal.SIGKILL)
        server.wait(timeout=30)
        killed_at, full = time.monotonic(), aof_tail(data).stat().st_size
        cut = max(size for t, size in sizes if t <= killed_at - 1.0)
        os.truncate(aof_tail(data), cut)  # the second the disk never got
        server = start_redis(data, port, "--appendfsync", "everysec")
        forgot_step = read_trainer(r, KEYS).step
        pipe.finish()
        print(f"\npower loss: AOF cut from {full} to {cut} bytes; Redis came back at trainer step {forgot_step}")
        assert cut < full
        log = pipe.log("trainer").read_text()
        assert "Redis had lost writes" in log, log[-3000:]
        ids = trained_once(r, tmp_path, steps)  # no group in two steps; Redis's trained set put back
        t = read_trainer(r, KEYS)
        assert len(ids) == steps * 4
        assert (t.step, t.version, t.groups_trained) == (steps, steps, len(ids)), t
        # no prompt lost: each admitted id is trained, still outstanding, or counted as dropped
        admitted = {f"arithmetic:0:{i}" for i in range(read_producer(r, KEYS).admitted)}
        outstanding = {m.decode() for m in r.smembers(KEYS.outstanding)}
        missing = admitted - set(ids) - outstanding
        assert len(missing) <= read_dropped(r, KEYS), (sorted(missing), read_dropped(r, KEYS))
    finally:
        server.kill()


@pytest.mark.slow
def test_a_whole_host_power_loss_then_ops_run_again_loses_nothing_and_trains_nothing_twice(
        checkout, user_env, tmp_path):
    """The host loses power under `./ops/run`: every process SIGKILLed at once, and Redis's
    append-only file (`appendfsync everysec`, as shipped) cut back to where it was a second before.
    `./ops/run` again: the run goes on, every admitted prompt is trained, dropped for a counted
    reason or still pending, and none is trained twice."""
    import psutil

    def steps(text: str) -> list[int]:
        return [int(n) for n in re.findall(r"trainer\.1\s+\| step\s+(\d+) \|", text)]

    data = checkout / ".rollouts/redis"
    run = Shell("./ops/run", cwd=checkout, env=user_env, log=tmp_path / "run.log")
    try:
        # Past the trainer state saved at step 10 (the demo's state_every), so a state is on disk.
        run.wait_for(r"trainer\.1\s+\| step\s+13 \|", timeout=600, what="step 13")
        sizes, since = [], time.monotonic()  # the append-only file's size, for a second and more
        while time.monotonic() - since < 1.5:
            sizes.append((time.monotonic(), aof_tail(data).stat().st_size))
            time.sleep(0.02)
        root = psutil.Process(run.proc.pid)
        everything = [root, *root.children(recursive=True)]
        for p in everything:  # the power goes: no process hears of it
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        killed_at = time.monotonic()
        psutil.wait_procs(everything, timeout=30)
    finally:
        run.kill()
    full = aof_tail(data).stat().st_size
    cut = max(size for t, size in sizes if t <= killed_at - 1.0)
    os.truncate(aof_tail(data), cut)  # the second the disk never got
    assert cut < full, (cut, full)
    before = max(steps(run.text()))
    port = free_port()
    server = start_redis(data, port)  # what the cut append-only file still holds of the trainer
    try:
        held = read_trainer(redis.Redis(port=port), Keys("demo"))
    finally:
        server.terminate()
        server.wait(timeout=30)

    again = Shell("./ops/run", cwd=checkout, env=user_env, log=tmp_path / "again.log")
    try:
        again.wait_for(rf"trainer\.1\s+\| step\s+{before + 5} \|", timeout=600,
                       what=f"five steps past the {before} the run had reached")
        again.ctrl_c()
    finally:
        again.kill()
    print(f"\npower loss at step {before}: AOF cut from {full} to {cut} bytes, keeping step {held.step} (saved "
          f"state {held.state_step}, version {max(held.version, held.version_max)}); the run went on from step "
          f"{steps(again.text())[0]}")

    port = free_port()
    server = start_redis(data, port)
    try:
        r, keys = redis.Redis(port=port), Keys("demo")
        acc = accounting(r, keys)
        gone = read_gone_back(r, keys)
        announced = [decode_weights(fields[PAYLOAD]) for _, fields in r.xrange(keys.weights)]
    finally:
        server.terminate()
        server.wait(timeout=30)
    assert not unaccounted(acc), (unaccounted(acc), acc)
    assert not trained_twice(checkout / "runs/demo/metrics.jsonl")
    resumed, published = steps(again.text())[0] - 1, max(held.version, held.version_max)
    if published <= resumed:  # the lost second held every publish past the saved state: nothing to go back on
        assert not gone, (gone, held, resumed)
        return
    # It went back to its saved state: the versions above it that Redis kept were published twice,
    # with other weights, and each time is told apart by when (groups say it: SampleGroup.published_at).
    [back] = gone
    assert back.step == resumed < back.upto == published, (back, held, before)
    twice = [v for v in range(back.step + 1, back.upto + 1) if sum(w.version == v for w in announced) > 1]
    assert twice, [(w.version, w.created_at) for w in announced]
    for v in twice:
        first, *_, last = [w for w in announced if w.version == v]
        assert first.created_at < back.at <= last.created_at


def test_generator_stopped_past_claim_idle_comes_back_and_its_late_groups_are_refused(
        tmp_path, redis_url, r, tiny_model):
    """A generator cut off longer than claim_idle_s (SIGSTOP: a partition or a stall) finds its
    prompts taken over and trained by another; the groups it writes when it comes back are
    recognised as duplicates and counted, and nothing is trained twice."""
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=100, claim_idle_s=4))
    for name in ("producer", "g1", "g2", "trainer"):
        pipe.start(name)
    wait_for(lambda: read_trainer(r, KEYS).step >= 1, timeout=180, what="step 1", procs=list(pipe.procs.values()))
    g1 = pipe.procs["g1"]

    held = wait_for(lambda: stopped_holding_prompts(r, g1, "g1"), timeout=120, what="g1 holding prompts",
                    procs=list(pipe.procs.values()), poll=0.01)
    wait_for(lambda: all(r.zscore(KEYS.trained, p) is not None for p in held), timeout=120,
             what=f"the prompts g1 held ({held}) trained by g2", procs=[pipe.procs["trainer"], pipe.procs["g2"]])
    duplicates_before = read_trainer(r, KEYS).groups_duplicate
    g1.send_signal(signal.SIGCONT)  # back: it finishes the prompts it thinks it holds
    # At least the prompts it held: a read it had blocked on before the stop can still hand it more
    # (Redis serves the blocked read, not g1), which g2 takes over and g1 also finishes.
    wait_for(lambda: read_trainer(r, KEYS).groups_duplicate >= duplicates_before + len(held), timeout=120,
             what=f"g1's {len(held)} late groups refused as duplicates", procs=list(pipe.procs.values()))
    pipe.procs["trainer"].send_signal(signal.SIGTERM)
    pipe.finish()
    after = accounting(r, KEYS)
    print(f"\ngenerator SIGSTOP: g1 held {len(held)} prompts; after: admitted {after['admitted']} = trained "
          f"{after['trained']} + dropped {after['dropped']} + pending {after['pending']}; its late groups refused "
          f"as duplicates {after['duplicate']}")
    steps = read_trainer(r, KEYS).step
    ids = trained_once(r, tmp_path, steps)  # nothing trained twice
    assert after["trained"] == len(ids) == steps * 4
    assert after["duplicate"] >= len(held), after
    assert unaccounted(after) == [f"{after['duplicate']} group(s) made twice from one prompt"], unaccounted(after)
