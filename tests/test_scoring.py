"""RewardRunner: rewards in spawned worker processes, each completion within a time budget."""

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from generators.scoring import RewardRunner, Scored

FIX = "tests.reward_fixtures"
OK = Scored(1.0, {"reward": 1.0}, None)


def group(*texts: str) -> list[tuple[str, list[int]]]:
    return [(t, [1, 2, 3]) for t in texts]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_number_is_one_component_and_a_dict_is_named_components(workers):
    names = {"h": f"{FIX}:half", "p": f"{FIX}:parts", "l": f"{FIX}:length"}
    with RewardRunner(names, timeout_s=5, workers=workers) as runner:
        assert runner.score("h", prompt="p", completions=group("a", "b"), meta={}) == \
            [Scored(0.5, {"reward": 0.5}, None)] * 2
        assert runner.score("p", prompt="p", completions=group("a"), meta={}) == \
            [Scored(1.25, {"correct": 1.0, "format": 0.25}, None)]
        # the reward sees each completion's own text and ids
        assert runner.score("l", prompt="p", completions=[("abc", [7]), ("", [7, 8])], meta={}) == [
            Scored(4.0, {"chars": 3.0, "tokens": 1.0}, None), Scored(2.0, {"chars": 0.0, "tokens": 2.0}, None)]
        assert runner.score("h", prompt="p", completions=[], meta={}) == []


def test_a_combined_reward_sums_its_components():
    with RewardRunner({"g": f"{FIX}:answer_and_format"}, timeout_s=5, workers=1) as runner:
        out = runner.score("g", prompt="p", completions=group("6 * 7\n#### 42", "it is 42", "#### 41"),
                           meta={"answer": "42"})
    assert out == [Scored(1.1, {"correct": 1.0, "format": 0.1}, None),
                   Scored(1.0, {"correct": 1.0, "format": 0.0}, None),
                   Scored(0.1, {"correct": 0.0, "format": 0.1}, None)]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_raising_or_garbage_reward_is_that_completions_error(workers):
    with RewardRunner({"m": f"{FIX}:moody"}, timeout_s=5, workers=workers) as runner:
        out = runner.score("m", prompt="p", completions=group("ok", "raise", "nan", "text", "ok"), meta={})
    assert [out[0], out[4]] == [OK, OK]  # the rest of the group is scored
    assert out[1] == Scored(0.0, {}, "ValueError: no good")
    for bad in out[2:4]:
        assert (bad.reward, bad.rewards) == (0.0, {}) and "expected a finite number" in bad.error


@pytest.mark.parametrize("how", ["hang", "spin", "blocked"])
def test_a_hanging_reward_times_out_and_the_worker_is_replaced(how):
    with RewardRunner({"m": f"{FIX}:moody"}, timeout_s=0.5, workers=1) as runner:
        assert runner.score("m", prompt="p", completions=group("ok"), meta={}) == [OK]
        t0 = time.monotonic()
        out = runner.score("m", prompt="p", completions=group("ok", how, "ok"), meta={})
        assert time.monotonic() - t0 >= 0.5, "the reward had its budget before it was given up"
        assert out == [OK, Scored(0.0, {}, "timeout after 0.5 s"), OK]  # the replacement scored the last
        assert runner.restarts == 1
        assert runner.score("m", prompt="p", completions=group("ok", "ok"), meta={}) == [OK, OK]


def worker_processes() -> set[int]:
    """Pids of this process's children that are spawned workers (zombies included: not reaped)."""
    pids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == os.getpid() and (b"spawn_main" in cmdline or fields[0] == "Z"):
            pids.add(int(stat.parent.name))
    return pids


def test_hung_workers_are_killed_and_replaced_without_leaking_a_process_or_a_slot():
    # four groups at once on two workers, each with a reward stuck in a read with its signals blocked
    with RewardRunner({"m": f"{FIX}:moody"}, timeout_s=0.5, workers=2) as runner:
        out: list[list[Scored]] = []
        threads = [threading.Thread(target=lambda: out.append(runner.score(
            "m", prompt="p", completions=group("blocked", "ok"), meta={}))) for _ in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
        assert out == [[Scored(0.0, {}, "timeout after 0.5 s"), OK]] * 4
        assert runner.restarts == 4
        live = set(runner.pids())
        assert len(live) == 2 and worker_processes() == live, "a killed worker was left behind"
        assert runner.score("m", prompt="p", completions=group("ok", "ok"), meta={}) == [OK, OK]


def test_each_completion_has_its_own_budget():
    # three completions of 1 s each fit a budget of 2 s per completion, not per group (3 s)
    with RewardRunner({"s": f"{FIX}:slow_pid"}, timeout_s=2.0, workers=1) as runner:
        out = runner.score("s", prompt="p", completions=group("a", "b", "c"), meta={"sleep": 1.0})
    assert all(s.error is None for s in out) and runner.restarts == 0


def test_a_reward_that_kills_its_worker_is_an_error_not_a_dead_generator():
    with RewardRunner({"m": f"{FIX}:moody"}, timeout_s=5, workers=1) as runner:
        out = runner.score("m", prompt="p", completions=group("ok", "die", "ok"), meta={})
        assert out == [OK, Scored(0.0, {}, "reward worker died (exit code 3)"), OK]
        assert runner.score("m", prompt="p", completions=group("ok"), meta={}) == [OK]


def test_a_timeout_kills_what_the_reward_started(tmp_path: Path):
    pidfile = tmp_path / "child.pid"
    with RewardRunner({"m": f"{FIX}:moody"}, timeout_s=1.0, workers=1) as runner:
        out = runner.score("m", prompt="p", completions=group("child"), meta={"pidfile": str(pidfile)})
    assert out[0].error == "timeout after 1 s"
    child = int(pidfile.read_text())
    deadline = time.monotonic() + 30  # a guard: it goes with its worker
    while time.monotonic() < deadline and _alive(child):
        time.sleep(0.05)
    assert not _alive(child), f"the reward's child {child} outlived its killed worker"


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped by init counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_sources_pick_their_reward_and_an_unknown_one_is_an_error():
    with RewardRunner({"only": f"{FIX}:half"}, timeout_s=5, workers=1) as one:
        assert one.score(None, prompt="p", completions=group("a"), meta={})[0].reward == 0.5  # the only one
        assert one.score("other", prompt="p", completions=group("a", "b"), meta={}) == \
            [Scored(0.0, {}, "no reward configured for source 'other' (have ['only'])")] * 2
    with RewardRunner({"h": f"{FIX}:half", "p": f"{FIX}:parts"}, timeout_s=5, workers=0) as two:
        assert two.score(None, prompt="p", completions=group("a"), meta={})[0].error == \
            "no reward configured for source None (have ['h', 'p'])"


def test_concurrent_calls_use_different_workers(tmp_path: Path):
    # each reward returns only once both have started: they ran at the same time, in two workers
    with RewardRunner({"r": f"{FIX}:rendezvous"}, timeout_s=30, workers=2) as runner:
        out: list[list[Scored]] = [[], []]

        def call(i: int) -> None:
            out[i] = runner.score("r", prompt="p", completions=group(f"call{i}"),
                                  meta={"dir": str(tmp_path), "parties": 2})

        threads = [threading.Thread(target=call, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert [s.error for calls in out for s in calls] == [None, None], out
    pids = {s.reward for calls in out for s in calls}
    assert len(pids) == 2 and os.getpid() not in pids, f"two workers, not this process: {pids}"


def test_many_threads_get_their_own_results():
    # a budget that a trivial reward meets even on a loaded machine, short enough to keep it quick
    with RewardRunner({"l": f"{FIX}:length", "m": f"{FIX}:moody"}, timeout_s=2.0, workers=2) as runner:
        errors: list[str] = []

        def call(i: int) -> None:
            texts = ["x" * j for j in range(i, i + 4)]
            if i % 4 == 0:  # some hang meanwhile: their workers are replaced under the others' feet
                got = runner.score("m", prompt="p", completions=group("hang", "ok"), meta={})
                expected = [Scored(0.0, {}, "timeout after 2 s"), OK]
            else:
                got = runner.score("l", prompt="p", completions=[(t, [0] * i) for t in texts], meta={})
                expected = [Scored(len(t) + i, {"chars": len(t), "tokens": i}, None) for t in texts]
            if got != expected:
                errors.append(f"call {i}: {got} != {expected}")

        threads = [threading.Thread(target=call, args=(i,)) for i in range(12)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        assert runner.restarts == 3


def test_a_name_that_does_not_load_fails_at_start():
    # (reward_names turns this into a ConfigError naming the field: tests/test_rewards.py)
    with pytest.raises(ValueError, match="cannot be loaded"):
        RewardRunner({"x": "tests.reward_fixtures:nothing"}, timeout_s=1, workers=1)


def test_a_closed_runner_has_no_workers_left():
    runner = RewardRunner({"h": f"{FIX}:half"}, timeout_s=1, workers=2)
    pids = runner.pids()
    runner.close()
    assert not any(_alive(pid) for pid in pids)
    with pytest.raises(AssertionError, match="closed"):
        runner.score("h", prompt="p", completions=group("a"), meta={})


def test_workers_end_with_a_killed_generator(tmp_path: Path):
    # the idle worker sees its pipe close; the one stuck in a reward notices its parent is gone
    started = tmp_path / "started"
    code = textwrap.dedent(f"""
        import os, threading, time
        from generators.scoring import RewardRunner
        runner = RewardRunner({{"m": "tests.reward_fixtures:hang_once_started"}}, timeout_s=600, workers=2)
        print(*runner.pids(), flush=True)
        meta = {{"started": {str(started)!r}}}
        threading.Thread(target=runner.score, args=("m",), daemon=True,
                         kwargs={{"prompt": "p", "completions": [("x", [1])], "meta": meta}}).start()
        while not os.path.exists({str(started)!r}):  # one worker is inside the reward
            time.sleep(0.01)
        os.kill(os.getpid(), 9)
    """)
    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "out"
    with out.open("w") as f:  # a file, not a pipe: the workers inherit it and may outlive the script
        returncode = subprocess.run([sys.executable, "-c", code], cwd=root, stdout=f, stderr=f, timeout=120).returncode
    pids = [int(p) for p in out.read_text().split()[:2]]
    assert returncode == -9 and len(pids) == 2, (returncode, out.read_text())
    deadline = time.monotonic() + 30  # a guard: they notice within a second or so
    while time.monotonic() < deadline and any(_alive(pid) for pid in pids):
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in pids), f"workers {pids} outlived their generator"


def test_a_worker_reaped_by_another_thread_is_still_killed_and_closed():
    # `Process.start` in another thread reaps every finished child it knows of: it may collect the
    # killed worker's status after our kill and before our join, and set the exit code a moment later
    import multiprocessing

    from generators import processes

    ctx = multiprocessing.get_context("spawn")
    ours, theirs = ctx.Pipe()
    worker = ctx.Process(target=time.sleep, args=(60,), daemon=True)
    worker.start()
    pid = worker.pid
    os.kill(pid, 9)
    os.waitpid(pid, 0)  # the other thread's waitpid: our join now finds no child to wait for
    late = threading.Timer(0.3, lambda: setattr(worker._popen, "returncode", -9))  # ... and its bookkeeping
    late.start()
    processes.kill(worker, ours)  # raised "Cannot close a process while it is still running"
    late.join()
    assert pid not in worker_processes()
    with pytest.raises(ValueError, match="closed"):
        _ = worker.exitcode  # closed: its resources are released
    assert ours.closed


def test_a_worker_outlives_the_stop_signals_its_generator_handles():
    # Slurm signals every process of a step: the generator finishing its held prompts needs its workers
    with RewardRunner({"h": f"{FIX}:half"}, timeout_s=5, workers=1) as runner:
        [pid] = runner.pids()
        os.kill(pid, signal.SIGTERM)
        os.kill(pid, signal.SIGINT)
        assert runner.score("h", prompt="p", completions=group("a"), meta={}) == [Scored(0.5, {"reward": 0.5}, None)]
        assert runner.pids() == [pid]


def test_a_stop_signal_while_the_workers_start_ends_the_generator_and_its_workers(tmp_path: Path):
    # honcho stopping a run while a respawned generator still starts its reward workers: the stop's
    # SystemExit must not leave the interpreter's exit waiting for workers deaf to SIGTERM
    started = tmp_path / "started"
    (tmp_path / "slow_reward.py").write_text(textwrap.dedent(f"""
        import multiprocessing, os, time
        if multiprocessing.parent_process() is not None:  # a worker: slow to import, as a busy machine's
            open({str(started)!r}, "w").write(str(os.getpid()))
            time.sleep(60)
        def reward(completion, **kwargs):
            return 1.0
    """))
    code = textwrap.dedent("""
        from common.streams import stop_while_starting
        stop_while_starting("generator")
        from generators.scoring import RewardRunner
        RewardRunner({"s": "slow_reward:reward"}, timeout_s=5, workers=1)
    """)
    root = Path(__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(tmp_path)])}
    script = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 60
        while not (started.exists() and started.read_text()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert started.exists(), "the worker never started"
        worker = int(started.read_text())
        script.send_signal(signal.SIGTERM)
        out, _ = script.communicate(timeout=30)  # before: waited for the worker for ever
        assert script.returncode == 0 and "SIGTERM while starting: stopped" in out, (script.returncode, out)
        assert not _alive(worker), "the worker outlived its generator"
    finally:
        script.kill()
        if started.exists() and started.read_text() and _alive(int(started.read_text())):
            os.kill(int(started.read_text()), signal.SIGKILL)
