"""ops/slurm/rollouts.sbatch submitted to a real Slurm (slurmctld and slurmd of this test's own,
one host, CPUs only, the tiny model): the whole run trains; `scancel` stops it with the trainer's
step saved, no process SIGKILLed and Redis last; the same script submitted again resumes at the
saved step, nothing lost or trained twice. Run with -s to see the jobs' output."""

import re
from pathlib import Path

import psutil
import pytest
import redis

from common.keys import Keys
from common.progress import read_trainer
from tests.harness.audit import accounting, assert_accounted
from tests.harness.configs import write_config
from tests.harness.processes import ROOT, process_env, run_once, wait_for
from tests.harness.servers import free_port, start_redis
from tests.harness.slurm import job_state, one_host_cluster, sbatch

SCRIPT = ROOT / "ops" / "slurm" / "rollouts.sbatch"
RUN = "slurm"
KEYS = Keys(RUN)
KILL_WAIT_S = 60  # Slurm's SIGKILL after its SIGTERM: a tiny step is saved well within it, even loaded


def step(r: redis.Redis) -> int:
    try:
        return read_trainer(r, KEYS).step
    except redis.exceptions.ConnectionError:
        return 0


def running_under(config: Path) -> list[str]:
    """The run's processes still alive: those whose environment names its config."""
    alive = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("ROLLOUTS_CONFIG") == str(config):
                alive.append(" ".join(p.cmdline()))
        except psutil.Error:
            continue
    return alive


def cancel_and_wait(job: int, env: dict[str, str], config: Path, out: Path) -> None:
    """`scancel` the job; wait for Slurm to say it ended, its launcher's last line, and every process gone."""
    assert run_once(f"scancel {job}", cwd=ROOT, env=env).returncode == 0
    wait_for(lambda: job_state(job, env) == "CANCELLED" and "slurm: redis stopped" in out.read_text(),
             timeout=KILL_WAIT_S + 120, what=f"job {job} ended after scancel ({out})")
    wait_for(lambda: not running_under(config), timeout=60, what="every process of the run gone")


def audit(run_dir: Path, port: int) -> dict[str, int]:
    """Start Redis on what the job left in its append-only files; the run's accounting."""
    server = start_redis(run_dir / "redis", port)
    try:
        return accounting(redis.Redis(port=port), KEYS)
    finally:
        server.kill()
        server.wait()


@pytest.mark.slow
def test_a_slurm_job_trains_stops_on_scancel_with_its_step_saved_and_resumes_when_submitted_again(
        tmp_path, tiny_model):
    port = free_port()
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    write_config(config, run=RUN, redis_url=f"redis://127.0.0.1:{port}/0", output_dir=run_dir, model=tiny_model,
                 trainer={"max_steps": 1000})
    r = redis.Redis(port=port)
    with one_host_cluster(tmp_path / "slurm", kill_wait_s=KILL_WAIT_S) as slurm:
        env = process_env({**slurm, "ROLLOUTS_CONFIG": str(config), "RDZV_PORT": str(free_port())})

        def submit() -> tuple[int, Path]:
            job = sbatch(SCRIPT, f"--output={tmp_path}/job-%j.out", cwd=ROOT, env=env)
            return job, tmp_path / f"job-{job}.out"

        def output(path: Path) -> str:
            return path.read_text(errors="replace") if path.exists() else ""

        first, out1 = submit()
        wait_for(lambda: step(r) >= 2, timeout=600, what=f"step 2 of job {first} ({out1})")
        r.close()
        cancel_and_wait(first, env, config, out1)
        text = output(out1)
        print(f"\n--- job {first}: submitted, cancelled ---\n{text}")
        stopped = re.search(r"^trainer: stopped at step (\d+)$", text, re.M)
        assert stopped, f"the trainer did not save its step:\n{text}"
        saved = int(stopped[1])
        assert (run_dir / "trainer_state" / f"step_{saved}").is_dir(), text
        assert "giving up" not in text and "second signal" not in text and "worker died" not in text, text
        assert re.search(r"^slurm: redis stopped \(0\)$", text, re.M), text
        exits = dict(re.findall(r"^slurm: (\w+) step exited (-?\d+)", text, re.M))
        assert exits == {"producer": "0", "trainer": "0", "generators": "0", "evaluator": "0"}, text
        before = audit(run_dir, port)
        print(f"accounting after job {first}: {before}")
        assert_accounted(before)

        second, out2 = submit()
        wait_for(lambda: re.search(rf"^trainer: resuming at step {saved} from its trainer state", output(out2), re.M)
                 and step(r) >= saved + 2, timeout=600,
                 what=f"job {second} resuming at step {saved} and 2 steps on ({out2})")
        r.close()
        cancel_and_wait(second, env, config, out2)
        text = output(out2)
        print(f"\n--- job {second}: the same script submitted again, cancelled ---\n{text}")
        assert "giving up" not in text and "second signal" not in text and "worker died" not in text, text
    acc = audit(run_dir, port)
    print(f"accounting after job {second}: {acc}")
    assert_accounted(acc)
    assert acc["duplicate"] == 0 and acc["trained"] > before["trained"], (before, acc)


@pytest.mark.slow
def test_sigusr1_to_the_batch_step_stops_the_job_and_a_job_that_reaches_max_steps_completes(tmp_path, tiny_model):
    """The launcher's own stop (what `--signal=B:USR1@N` does before the time limit): every step
    signalled once through scancel, Redis spared until they end; then, submitted again, the trainer
    reaching max_steps ends the job by itself, COMPLETED with every step's status 0."""
    port = free_port()
    run_dir = tmp_path / "run"
    config = tmp_path / "run.toml"
    write_config(config, run=RUN, redis_url=f"redis://127.0.0.1:{port}/0", output_dir=run_dir, model=tiny_model,
                 trainer={"max_steps": 1000})
    r = redis.Redis(port=port)
    with one_host_cluster(tmp_path / "slurm", kill_wait_s=KILL_WAIT_S) as slurm:
        env = process_env({**slurm, "ROLLOUTS_CONFIG": str(config), "RDZV_PORT": str(free_port())})
        first = sbatch(SCRIPT, f"--output={tmp_path}/job-%j.out", cwd=ROOT, env=env)
        out1 = tmp_path / f"job-{first}.out"
        wait_for(lambda: step(r) >= 2, timeout=600, what=f"step 2 of job {first} ({out1})")
        r.close()
        assert run_once(f"scancel --batch --signal=USR1 {first}", cwd=ROOT, env=env).returncode == 0
        wait_for(lambda: job_state(first, env) == "COMPLETED", timeout=KILL_WAIT_S + 120,
                 what=f"job {first} completed after SIGUSR1 ({out1})")
        text = out1.read_text(errors="replace")
        print(f"\n--- job {first}: SIGUSR1 to its batch step ---\n{text}")
        assert "slurm: stopping: SIGUSR1; SIGTERM to every step" in text, text
        stopped = re.search(r"^trainer: stopped at step (\d+)$", text, re.M)
        assert stopped, f"the trainer did not save its step:\n{text}"
        saved = int(stopped[1])
        exits = dict(re.findall(r"^slurm: (\w+) step exited (-?\d+)", text, re.M))
        assert exits == {"producer": "0", "trainer": "0", "generators": "0", "evaluator": "0"}, text
        assert re.search(r"^slurm: redis stopped \(0\)$", text, re.M), text
        assert "giving up" not in text and "second signal" not in text and "worker died" not in text, text
        wait_for(lambda: not running_under(config), timeout=60, what="every process of the run gone")
        before = audit(run_dir, port)
        assert_accounted(before)

        env["ROLLOUTS_TRAINER__MAX_STEPS"] = str(saved + 2)
        second = sbatch(SCRIPT, f"--output={tmp_path}/job-%j.out", cwd=ROOT, env=env)
        out2 = tmp_path / f"job-{second}.out"
        wait_for(lambda: job_state(second, env) == "COMPLETED", timeout=600,
                 what=f"job {second} completed at max_steps {saved + 2} ({out2})")
        text = out2.read_text(errors="replace")
        print(f"\n--- job {second}: submitted again with max_steps {saved + 2} ---\n{text}")
        assert f"trainer: resuming at step {saved} from its trainer state" in text, text
        assert f"trainer: stopped at step {saved + 2}" in text, text
        assert "slurm: stopping: the trainer step ended; SIGTERM to every step" in text, text
        exits = dict(re.findall(r"^slurm: (\w+) step exited (-?\d+)", text, re.M))
        assert exits == {"producer": "0", "trainer": "0", "generators": "0", "evaluator": "0"}, text
        wait_for(lambda: not running_under(config), timeout=60, what="every process of the run gone")
    acc = audit(run_dir, port)
    assert_accounted(acc)
    assert acc["duplicate"] == 0 and acc["trained"] > before["trained"], (before, acc)
