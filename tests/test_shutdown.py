"""Graceful shutdown: the first SIGTERM (or Ctrl-C) lets the trainer or the producer finish what it
is doing and exit 0 with everything consistent; a second signal exits at once; either way a
restart resumes the run, and no prompt is lost or trained twice. Run with -s to see the numbers."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest
import redis

from common.keys import GENERATORS_GROUP, PAYLOAD
from common.messages import decode_group, decode_prompt
from common.progress import read_producer, read_trainer, write_step
from common.tiny import tiny_run_config
from tests.harness.audit import accounting, assert_accounted, report
from tests.harness.pipeline import KEYS, Pipeline, metrics, pipeline_config, trained_once
from tests.harness.processes import ROOT, spawn, spawn_ops_honcho, stop, wait_for
from tests.harness.servers import free_port, start_redis


def two_signals(proc) -> float:
    """Ctrl-C then SIGTERM (as a terminal and a process manager would send them), back to back;
    seconds until the process exited."""
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=30)
    return time.monotonic() - t0


def saved_consistently(r, tmp_path) -> int:
    """The trainer's step, checking that what it acknowledged is exactly what its newest saved
    state holds and that nothing half-written is left."""
    progress = read_trainer(r, KEYS)
    step, state_step, version = progress.step, progress.state_step, progress.version
    trained = {m.decode(): int(s) for m, s in r.zrange(KEYS.trained, 0, -1, withscores=True)}
    assert all(s <= state_step for s in trained.values()), f"acknowledged past the saved state {state_step}"
    assert read_trainer(r, KEYS).groups_trained == len(trained)
    if state_step:
        assert (tmp_path / "run" / "trainer_state" / f"step_{state_step}").is_dir()
        assert (tmp_path / "run" / "checkpoints" / f"step_{version}").is_dir()
    leftovers = [*(tmp_path / "run").glob("*/.step_*.tmp")]
    assert not leftovers or state_step < step, f"half-written after a clean stop: {leftovers}"
    return step


def test_trainer_first_sigterm_finishes_the_step_saves_and_a_restart_resumes(tmp_path, redis_url, r, tiny_model):
    steps = 8
    # state saved every 3 steps: at the signal it holds trained groups not yet acknowledged
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=steps, state_every=3))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    wait_for(lambda: any(m["step"] == 4 for m in metrics(tmp_path)), timeout=180, what="step 4",
             procs=list(pipe.procs.values()))
    trainer = pipe.procs["trainer"]
    at_signal = accounting(r, KEYS)
    trainer.send_signal(signal.SIGTERM)
    assert trainer.wait(timeout=60) == 0, pipe.log("trainer").read_text()
    log = pipe.log("trainer").read_text()
    assert "SIGTERM: finishing the current step" in log and "stopped at step" in log, log
    # everything it trained is saved and acknowledged: the step it was in, finished, is the last
    step = saved_consistently(r, tmp_path)
    assert read_trainer(r, KEYS).state_step == step == max(m["step"] for m in metrics(tmp_path))
    stopped = accounting(r, KEYS)
    assert stopped["trained"] == 4 * step, stopped
    print(f"\ntrainer SIGTERM at step {step}: saved state step {step}, groups trained {stopped['trained']}, "
          f"groups read and not trained (left pending) {stopped['samples_pending']}")

    pipe.start("trainer")
    pipe.finish()
    after = accounting(r, KEYS)
    report("trainer SIGTERM", at_signal, after)
    assert f"resuming at step {step} from its trainer state" in pipe.log("trainer").read_text()
    assert_accounted(after)
    assert after["trained"] == len(trained_once(r, tmp_path, steps)) == steps * 4


def test_trainer_second_signal_exits_at_once_and_a_restart_retrains_what_was_not_saved(
        tmp_path, redis_url, r, tiny_model):
    steps = 6
    # no trainer state until the last step: every group it trains stays unacknowledged till then
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, tiny_model, steps=steps, state_every=steps))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    wait_for(lambda: any(m["step"] == 2 for m in metrics(tmp_path)), timeout=180, what="step 2",
             procs=list(pipe.procs.values()))
    at_signal = accounting(r, KEYS)
    seconds = two_signals(pipe.procs["trainer"])
    code = pipe.procs["trainer"].returncode
    log = pipe.log("trainer").read_text()
    assert code == 130 and "second signal, exiting now" in log, (code, log)
    assert read_trainer(r, KEYS).state_step == 0 and r.zcard(KEYS.trained) == 0
    stopped = accounting(r, KEYS)
    print(f"\ntrainer second signal: exited in {seconds:.2f}s at step {read_trainer(r, KEYS).step}, "
          f"nothing saved; groups left pending {stopped['samples_pending']}")
    assert stopped["samples_pending"] >= 8  # the groups of the two steps it trained: not lost

    pipe.start("trainer")
    pipe.finish()
    after = accounting(r, KEYS)
    report("trainer second signal", at_signal, after)
    assert_accounted(after)
    assert after["trained"] == len(trained_once(r, tmp_path, steps)) == steps * 4


def test_producer_first_sigterm_stops_cleanly_and_a_second_at_once(tmp_path, redis_url, r, tiny_model):
    env = pipeline_config(tmp_path, redis_url, tiny_model, steps=1)
    log = tmp_path / "producer.log"

    def start():
        return spawn("producers", cwd=tmp_path, env=env, log=log)

    def admitted() -> int:
        return read_producer(r, KEYS).admitted

    def consistent() -> int:
        """Admitted prompts, each on the stream once, the position where the next one starts."""
        n = admitted()
        assert r.xinfo_stream(KEYS.prompts)["entries-added"] == n
        assert read_producer(r, KEYS).sources["arithmetic"].offset == n
        return n

    # first signal: it stops after the admission in hand, exit 0
    producer = start()
    wait_for(lambda: admitted() == 8, timeout=60, what="8 prompts admitted (the limit at version 0)",
             procs=[producer])
    producer.send_signal(signal.SIGTERM)
    assert producer.wait(timeout=30) == 0, log.read_text()
    assert "producer: stopped" in log.read_text()
    assert consistent() == 8

    # started again it resumes with the next prompt once the trainer's version allows more
    producer = start()
    wait_for(lambda: "resuming after 8 prompts" in log.read_text(), timeout=60, what="the restart",
             procs=[producer])
    write_step(r, KEYS, step=3, version=3)  # the limit is now (1 + 3 + 1) * 4 = 20
    wait_for(lambda: admitted() == 20, timeout=60, what="20 prompts admitted", procs=[producer])

    # a second signal exits at once, leaving the position and the stream in step
    seconds = two_signals(producer)
    assert producer.returncode == 130, (producer.returncode, seconds, log.read_text())
    assert "producer: second signal, exiting now" in log.read_text()
    assert consistent() == 20
    producer = start()
    write_step(r, KEYS, step=4, version=4)
    wait_for(lambda: admitted() == 24, timeout=60, what="24 prompts admitted", procs=[producer])
    assert stop(producer) == 0
    assert consistent() == 24
    ids = [decode_prompt(fields[PAYLOAD]).id for _, fields in r.xrange(KEYS.prompts)]
    assert ids == [f"arithmetic:0:{i}" for i in range(24)], "a prompt admitted twice or skipped"


def test_a_generator_gives_up_what_it_cannot_finish_within_the_grace_and_another_takes_it_over(
        tmp_path, redis_url, r, tiny_model):
    """Under a launcher that SIGKILLs what still runs STOP_GRACE_S after its signal, a generator
    whose prompts cannot be finished in time (a reward that takes an hour) gives them up before
    then and exits 0, writing nothing for them; they stay pending, and a generator started later
    takes them over (claim_idle_s) and writes their groups: none lost, none written twice."""
    def config(name: str, reward: str) -> dict[str, str]:
        path = tmp_path / f"{name}.toml"
        path.write_text(tiny_run_config(
            run=KEYS.run, redis_url=redis_url, output_dir=tmp_path / "run", model=tiny_model,
            generator={"claim_idle_s": 2.0, "reward_timeout_s": 3600.0}, trainer={"max_steps": 1})
            + f'[[data.sources]]\nname = "arithmetic"\nkind = "arithmetic"\nreward = "{reward}"\n')
        return {"ROLLOUTS_CONFIG": str(path)}

    slow, quick = config("slow", "tests.reward_fixtures:slow"), config("quick", "tests.reward_fixtures:half")
    producer = spawn("producers", cwd=tmp_path, env=quick, log=tmp_path / "producer.log")
    g1 = spawn("generators", "--id", "g1", cwd=tmp_path, env={**slow, "STOP_GRACE_S": "4"}, log=tmp_path / "g1.log")
    try:
        wait_for(lambda: len(pending(r, "g1")) >= 2, timeout=120, what="g1 holding prompts", procs=[producer, g1])
        g1.send_signal(signal.SIGTERM)
        assert g1.wait(timeout=60) == 0, (tmp_path / "g1.log").read_text()[-3000:]
        out, held = (tmp_path / "g1.log").read_text(), pending(r, "g1")
        assert f"g1: giving up the {len(held)} prompts it has not finished" in out, out[-3000:]
        assert r.xlen(KEYS.samples) == 0 and pending(r, "g1") == held
        g2 = spawn("generators", "--id", "g2", cwd=tmp_path, env=quick, log=tmp_path / "g2.log")
        try:
            wait_for(lambda: held <= written(r), timeout=120, what="g2 writing the groups g1 gave up", procs=[g2])
        finally:
            assert stop(g2) == 0
    finally:
        stop(producer)
        stop(g1)
    ids = [decode_group(fields[PAYLOAD]).id for _, fields in r.xrange(KEYS.samples)]
    assert len(ids) == len(set(ids)), ids


def pending(r, consumer: str) -> set[str]:
    """The ids of the prompts `consumer` holds (taken, not acknowledged)."""
    try:
        entries = r.xpending_range(KEYS.prompts, GENERATORS_GROUP, "-", "+", 100, consumername=consumer)
    except redis.exceptions.ResponseError:  # no prompts stream yet
        return set()
    return {decode_prompt(r.xrange(KEYS.prompts, e["message_id"], e["message_id"])[0][1][PAYLOAD]).id
            for e in entries}


def written(r) -> set[str]:
    return {decode_group(fields[PAYLOAD]).prompt_id for _, fields in r.xrange(KEYS.samples)}


@pytest.mark.slow  # two whole runs under ops/honcho (over a minute): the slow checks
def test_ops_honcho_stopped_with_ctrl_c_and_started_again_resumes_the_run(tmp_path, tiny_model):
    steps = 8
    port = free_port()
    data = tmp_path / "redis"
    data.mkdir()
    url = f"redis://127.0.0.1:{port}/0"
    env = pipeline_config(tmp_path, url, tiny_model, steps=steps)
    procfile = tmp_path / "Procfile"
    procfile.write_text(  # the project's Procfile, on a port and directory of this test's own
        f"redis: exec {sys.executable} {ROOT / 'ops' / 'redis-last'} redis-server --port {port} --bind 127.0.0.1 "
        f"--appendonly yes --dir {data} --save ''\n"
        f"producer: exec {sys.executable} -m producers\n"
        f"generator: exec {sys.executable} -m generators --id g1\n"
        f"trainer: exec {sys.executable} -m trainer\n")
    log = tmp_path / "honcho.log"

    def honcho():
        return spawn_ops_honcho(procfile, cwd=tmp_path, env=env, log=log)

    r = redis.Redis.from_url(url)

    def step() -> int:
        try:
            return read_trainer(r, KEYS).step
        except redis.exceptions.ConnectionError:
            return 0

    run = honcho()
    try:
        wait_for(lambda: step() >= 3, timeout=180, what="step 3", procs=[run])
        at_signal = accounting(r, KEYS)
        run.send_signal(signal.SIGINT)  # Ctrl-C: honcho sends SIGTERM to each process
        run.wait(timeout=90)
        first = log.read_text()
        assert "SIGINT received" in first, first
        # Redis stopped last, cleanly, so nobody waited on it until honcho's SIGKILL
        assert "SIGKILL" not in first and "rc=-9" not in first, first
        assert "redis.1 stopped (rc=0)" in first, first
        stopped_at = max(m["step"] for m in metrics(tmp_path))

        run = honcho()  # started again: Redis reloads its append-only file, everyone resumes
        assert run.wait(timeout=300) == 0, log.read_text()[len(first):]  # the trainer reached max_steps
    finally:
        stop(run)
    again = log.read_text()[len(first):]
    assert "resuming after" in again and "trainer: resuming at step" in again, again

    server = start_redis(data, port)  # look at what the run left
    try:
        after = accounting(r, KEYS)
        report("honcho Ctrl-C", at_signal, after)
        codes = ", ".join(f"{n} {c}" for n, c in re.findall(r"(\w+)\.1 stopped \(rc=(-?\d+)\)", first))
        print(f"honcho Ctrl-C: stopped at step {stopped_at}; exit codes: {codes}")
        assert_accounted(after)
        assert after["trained"] == len(trained_once(r, tmp_path, steps)) == steps * 4
    finally:
        server.kill()


def test_redis_under_ops_redis_last_stops_after_its_clients_and_cleanly(tmp_path):
    """The Procfile's Redis: a SIGTERM (honcho sends it to everyone at once) leaves it serving
    while a client is still connected, and stops it cleanly once the last one has gone."""
    port = free_port()
    wrapper = subprocess.Popen([sys.executable, str(ROOT / "ops" / "redis-last"), "redis-server", "--port", str(port),
                                "--bind", "127.0.0.1", "--appendonly", "yes", "--dir", str(tmp_path), "--save", ""],
                               env={**os.environ, "STOP_GRACE_S": "120"})  # a grace of 119 s
    try:
        client = redis.Redis(port=port)
        wait_for(lambda: _pings(client), timeout=10, what="redis-server under ops/redis-last")
        client.set("k", "v")
        wrapper.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert wrapper.poll() is None and client.get("k") == b"v", "Redis stopped under a connected client"
        client.close()  # the last client goes: Redis stops at once, not after the grace
        assert wrapper.wait(timeout=60) == 0  # well inside its grace: it went when its last client did
        with pytest.raises(redis.exceptions.ConnectionError):
            redis.Redis(port=port).ping()
    finally:
        stop(wrapper)
    server = start_redis(tmp_path, port)  # what it wrote is in the append-only file
    try:
        assert redis.Redis(port=port).get("k") == b"v"
    finally:
        server.kill()


def _pings(client) -> bool:
    try:
        return client.ping()
    except redis.exceptions.ConnectionError:
        return False


SLOW_TO_STOP = """
import signal, sys, time
signals = []
signal.signal(signal.SIGTERM, lambda *_: signals.append(time.monotonic()))
print("ready", flush=True)
while not signals:
    time.sleep(0.05)
print("finishing its step", flush=True)
while len(signals) < 2 and time.monotonic() - signals[0] < {seconds}:
    time.sleep(0.05)
print("exiting now" if len(signals) > 1 else "step saved", flush=True)
sys.exit(130 if len(signals) > 1 else 0)
"""


def _ops_honcho(tmp_path, seconds: float):
    script = tmp_path / "slow.py"
    script.write_text(SLOW_TO_STOP.format(seconds=seconds))
    procfile = tmp_path / "Procfile"
    quick = ("import signal, sys, time; signal.signal(signal.SIGTERM, lambda *_: sys.exit(0)); "
             "print(\"quick and ready\", flush=True); time.sleep(600)")
    # a process that stops at once (as the producer does) must not count as a second signal
    procfile.write_text(f"slow: exec {sys.executable} {script}\nquick: exec {sys.executable} -c '{quick}'\n")
    log = tmp_path / "honcho.log"
    proc = spawn_ops_honcho(procfile, cwd=tmp_path, env={"STOP_GRACE_S": "20"}, log=log)
    # both with their handlers in place (a signal before that kills a process: rc -15)
    wait_for(lambda: "| ready" in log.read_text() and "quick and ready" in log.read_text(), timeout=60,
             what="the processes under ops/honcho", procs=[proc])
    return proc, log


def test_ops_honcho_gives_a_process_its_time_to_stop(tmp_path):
    """Under ops/run's honcho a process that needs longer than plain honcho's 5 s to finish its
    step (a trainer on a CPU) is not SIGKILLed: it finishes and exits 0."""
    proc, log = _ops_honcho(tmp_path, seconds=7)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGINT)
    proc.wait(timeout=30)  # honcho's own exit status after a Ctrl-C is 130, as a shell's
    out = log.read_text()
    assert time.monotonic() - t0 >= 6.5 and "step saved" in out and "slow.1 stopped (rc=0)" in out, out
    assert "quick.1 stopped (rc=0)" in out, out


def test_ops_honcho_second_ctrl_c_makes_everything_exit_at_once(tmp_path):
    proc, log = _ops_honcho(tmp_path, seconds=30)
    proc.send_signal(signal.SIGINT)
    wait_for(lambda: "finishing its step" in log.read_text(), timeout=10, what="the first signal", procs=[proc])
    proc.send_signal(signal.SIGINT)  # a second Ctrl-C: a second SIGTERM to every process
    proc.wait(timeout=30)
    out = log.read_text()
    # it exited on the second signal ("exiting now", 130), not at the end of its 30 s step ("step saved")
    assert "exiting now" in out and "step saved" not in out and "slow.1 stopped (rc=130)" in out, out


def test_ops_honcho_refuses_a_grace_that_is_not_a_number(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "ops" / "honcho"), "start"], capture_output=True, text=True,
                         env={**os.environ, "STOP_GRACE_S": "a minute"}, cwd=tmp_path)
    assert out.returncode != 0 and "STOP_GRACE_S must be a number of seconds, got 'a minute'" in out.stderr
