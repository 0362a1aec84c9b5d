"""The shipped Procfile under ops/honcho, as `./ops/run` starts it: a process that dies is started
again and the run goes on; one that keeps dying stops the run with its error; Ctrl-C keeps its
promise whatever a step or an evaluation costs, and Redis stops last. Run with -s to see the numbers."""

import os
import re
import signal
from pathlib import Path

import redis
from rq.registry import StartedJobRegistry

from common.checkpoints import checksum_dir
from common.config import config_from_dict
from common.evals import enqueue_eval, eval_queue, read_evals
from common.keys import Keys
from common.messages import WeightVersion
from common.progress import read_trainer
from common.tiny import build_tiny_model
from tests.harness.audit import accounting, assert_accounted
from tests.harness.configs import write_config
from tests.harness.processes import ROOT, spawn_ops_honcho, stop, wait_for
from tests.harness.servers import free_port, start_redis

PROCFILE = ROOT / "Procfile"
RUN = "sup"
KEYS = Keys(RUN)


def shipped_run(tmp_path: Path, model: Path, port: int, **tables) -> dict[str, str]:
    """A directory where the shipped Procfile runs as in a checkout (its `.venv` and `ops/`), on a
    tiny run of its own (Redis on `port`, data in .rollouts/redis); returns the environment."""
    (tmp_path / ".venv").symlink_to(ROOT / ".venv")
    (tmp_path / "ops").symlink_to(ROOT / "ops")
    env = write_config(tmp_path / "run.toml", run=RUN, redis_url=f"redis://127.0.0.1:{port}/0",
                       output_dir=tmp_path / "run", model=model, **tables)
    return {**env, "REDIS_PORT": str(port)}


def step(r: redis.Redis) -> int:
    try:
        return read_trainer(r, KEYS).step
    except redis.exceptions.ConnectionError:
        return 0


def started(log: Path, name: str) -> int:
    """The pid honcho gave `name` (its ops/respawn wrapper)."""
    return int(re.findall(rf"{name}\.1 started \(pid=(\d+)\)", log.read_text())[-1])


def running(pid: int) -> int | None:
    """The process honcho's `pid` runs: the child of an ops/respawn wrapper (None while it has
    none), or `pid` itself where the Procfile line runs it bare."""
    try:
        if not Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[1].endswith(b"ops/respawn"):
            return pid
        found = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except (OSError, IndexError):
        return None
    return int(found[0]) if found else None


def stops(out: str) -> list[tuple[str, int]]:
    """(process, exit status) in the order honcho saw them stop."""
    return [(n, int(c)) for n, c in re.findall(r"(\w+)\.1 stopped \(rc=(-?\d+)\)", out)]


def audit(tmp_path: Path, port: int) -> dict[str, int]:
    """Start Redis on what the run left in its append-only file; the run's accounting."""
    server = start_redis(tmp_path / ".rollouts" / "redis", port)
    try:
        return accounting(redis.Redis(port=port), KEYS)
    finally:
        server.kill()


def test_a_sigkilled_generator_and_evaluator_are_started_again_and_the_run_trains_on(tmp_path, tiny_model):
    port = free_port()
    env = shipped_run(tmp_path, tiny_model, port, trainer={"max_steps": 1000}, eval={"every": 1, "prompts": 4})
    log = tmp_path / "honcho.log"
    r = redis.Redis(port=port)
    run = spawn_ops_honcho(PROCFILE, cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: step(r) >= 2 and "evaluator: version" in log.read_text(), timeout=300,
                 what="step 2 and an evaluation", procs=[run])
        for name, module in (("generator", "generators"), ("evaluator", "evaluator")):
            victim = wait_for(lambda name=name: running(started(log, name)), timeout=30, what=f"the {name}")
            os.kill(victim, signal.SIGKILL)
            wait_for(lambda m=module: f"respawn: {m} died (killed by SIGKILL)" in log.read_text(), timeout=60,
                     what=f"the {name}'s wrapper seeing it die", procs=[run])
            at = step(r)
            wait_for(lambda at=at: step(r) >= at + 2, timeout=300, what=f"2 steps after killing the {name}",
                     procs=[run])
            print(f"\nSIGKILL {name} (pid {victim}) at step {at}: started again, the trainer at step {step(r)}")
        restarted = log.read_text().index("respawn: evaluator died")
        wait_for(lambda: "evaluator: version" in log.read_text()[restarted:], timeout=300,
                 what="an evaluation by the evaluator started again", procs=[run])
        r.close()  # Redis, stopping last, waits for its clients to go
        run.send_signal(signal.SIGINT)
        run.wait(timeout=120)
    finally:
        stop(run)
    out = log.read_text()
    assert "sending SIGKILL" not in out and all(code == 0 for _, code in stops(out)), out
    acc = audit(tmp_path, port)
    assert_accounted(acc)
    assert acc["trained"] >= 4 * 4 and acc["duplicate"] == 0, acc


def test_a_process_that_keeps_dying_stops_the_run_with_its_error(tmp_path):
    """A mistyped model path: every start of the trainer fails at once; after 5 it is given up and
    the run stops, the trainer's own error repeated last."""
    port = free_port()
    env = shipped_run(tmp_path, tmp_path / "no-such-model", port)
    log = tmp_path / "honcho.log"
    # pauses of 0.2, 0.4, 0.8, 1.6 s between the starts rather than 1, 2, 4, 8: the same rule, sooner
    run = spawn_ops_honcho(PROCFILE, cwd=tmp_path, env={**env, "RESPAWN_BACKOFF_S": "0.2"}, log=log)
    try:
        code = run.wait(timeout=300)
    finally:
        stop(run)
    out = log.read_text()
    gave_up = re.search(r"\| respawn: (\w+) died 5 times within 120 s \(exit status (\d+)\)", out)
    assert gave_up, out
    name, status = gave_up.groups()
    assert code == int(status) != 0, (code, out)
    errors = [line.split("respawn:   ", 1)[1] for line in out[gave_up.end():].splitlines() if "respawn:   " in line]
    assert any("no-such-model" in line for line in errors), out
    assert out.count(f"respawn: {name} died (exit status {status})") == 4, out
    print(f"\n{name} given up after 5 deaths; its last error: {errors[-1]}")


def test_ctrl_c_with_a_step_slower_than_the_grace_loses_nothing_and_redis_stops_last(tmp_path):
    """STOP_GRACE_S shorter than a trainer step (as 60 s is on a slow CPU with the default model):
    the trainer saves the step in time or gives it up saying so, never SIGKILLed, and Redis stops
    after it; started again, the run resumes with nothing lost or trained twice."""
    port = free_port()
    model = build_tiny_model(tmp_path / "model", hidden=512, layers=8)  # a step of seconds on a CPU
    env = shipped_run(tmp_path, model, port, trainer={"max_steps": 1000})
    log = tmp_path / "honcho.log"
    r = redis.Redis(port=port)
    run = spawn_ops_honcho(PROCFILE, cwd=tmp_path, env={**env, "STOP_GRACE_S": "2"}, log=log)
    try:
        wait_for(lambda: step(r) >= 2, timeout=300, what="step 2", procs=[run])
        r.close()
        run.send_signal(signal.SIGINT)  # groups are waiting: the trainer is in its step 3
        run.wait(timeout=120)
    finally:
        stop(run)
    out = log.read_text()
    order = stops(out)
    print(f"\nCtrl-C with STOP_GRACE_S 2: {order}")
    # every process within the grace (a generator gives up the prompts it cannot finish: they stay
    # pending, and are taken over after the restart)
    codes = dict(order)
    assert codes["trainer"] == codes["redis"] == codes["evaluator"] == codes["producer"] == codes["generator"] == 0, out
    assert "trainer: lost Redis" not in out, out
    # saved, or given up: in its step ("giving up step N") or after it, in the stop's own save
    # ("giving up the stop"), whichever the grace ends in
    trainer_done = max(out.rfind("trainer: giving up step"), out.rfind("trainer: giving up the stop"),
                       out.rfind("trainer: stopped at step"))
    assert 0 < trainer_done < out.index("Received SIGTERM scheduling shutdown"), out  # Redis went after it
    assert_accounted(audit(tmp_path, port))

    first = len(out)
    run = spawn_ops_honcho(PROCFILE, cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: "trainer: resuming at step" in log.read_text()[first:] and step(r) >= 3, timeout=300,
                 what="the run resumed and at step 3", procs=[run])
        r.close()
        run.send_signal(signal.SIGINT)
        run.wait(timeout=300)
    finally:
        stop(run)
    acc = audit(tmp_path, port)
    assert_accounted(acc)
    assert acc["duplicate"] == 0, acc


def test_ctrl_c_stops_the_evaluator_between_problems_and_its_job_goes_back_on_the_queue(tmp_path, tiny_model):
    port = free_port()
    env = shipped_run(tmp_path, tiny_model, port)
    log = tmp_path / "honcho.log"
    # The evaluator stops at the first batch boundary after the signal, whatever the grace; the
    # grace only has to cover loading the engine and one batch on a loaded machine (8 s did not once).
    run = spawn_ops_honcho(PROCFILE, "redis", "evaluator", cwd=tmp_path, env={**env, "STOP_GRACE_S": "30"},
                           log=log)
    r = redis.Redis(port=port)
    try:
        wait_for(lambda: "evaluator: waiting for jobs" in log.read_text(), timeout=120, what="the evaluator",
                 procs=[run])
        # an evaluation far longer than the grace: 2000 problems of 32 tokens (arithmetic's default
        # operands hold only 48 held-out problems; up to 1000 they hold 100,000)
        # (the HF engine: it loads in a second, inside the grace; the stop between problems is the
        # evaluator's, whichever engine samples)
        config = config_from_dict({"run": RUN, "redis_url": f"redis://127.0.0.1:{port}/0",
                                   "generator": {"engine": "hf"},
                                   "rollout": {"max_new_tokens": 32}, "eval": {"every": 1, "prompts": 2000},
                                   "data": {"sources": [{"kind": "arithmetic", "name": "arithmetic",
                                                              "max_operand": 1000}]}})
        wv = WeightVersion(version=1, step=1, path=str(tiny_model), format="safetensors",
                           checksums=checksum_dir(tiny_model), created_at=0.0)
        job = enqueue_eval(r, config, wv)
        queue = eval_queue(r, KEYS)
        wait_for(lambda: job.id in StartedJobRegistry(queue=queue).get_job_ids(), timeout=60,
                 what="the evaluation started", procs=[run])
        retries = job.fetch(job.id, connection=r, serializer=queue.serializer).retries_left
        r.close()
        run.send_signal(signal.SIGINT)
        run.wait(timeout=60)
        out = log.read_text()
        assert "sending SIGKILL" not in out and all(code == 0 for _, code in stops(out)), out
        assert stops(out)[-1][0] == "redis", out
        assert f"job {job.id} stopped between problems" in out, out
    finally:
        stop(run)
    server = start_redis(tmp_path / ".rollouts" / "redis", port)
    try:
        queue = eval_queue(r, KEYS)
        assert queue.job_ids == [job.id] and not read_evals(r, KEYS)
        again = queue.fetch_job(job.id)
        assert again.get_status() == "queued" and again.retries_left == retries
    finally:
        server.kill()
