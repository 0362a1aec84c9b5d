"""The fault drill behind `ops/chaos`: random SIGKILLs under honcho, then an audit.

It starts `ops/honcho start -c generator=2` on the project's own Procfile, unchanged, as
`./ops/run` does (Redis with the append-only file, the producer, two generators, the trainer and
the evaluator, each under the Procfile's `ops/respawn`, which starts a process that dies again),
in a directory of its own (links to this checkout's `.venv` and `ops/`), over a tiny random
model. Then, for each trial, it waits a random while, SIGKILLs one randomly chosen process (a
generator, the trainer, the producer, the evaluator or redis-server) and waits until its
`ops/respawn` has started it again and the trainer has taken a step since. The one setting it
changes is RESPAWN_WINDOW_S (10 s, not 120): it kills faster than a process that keeps dying is
given up. At the end it stops everything with SIGTERM, as Ctrl-C would, starts Redis once more
from its append-only file and audits the run: every admitted prompt trained, dropped for a counted
reason or still pending (common/audit.py), no group trained in two steps, and every process
stopped with status 0. One line per trial, then the audit; exit status 1 when the audit finds
anything wrong.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from common.audit import accounting, last_trained, trained_twice, unaccounted  # noqa: E402
from common.keys import Keys  # noqa: E402
from common.localredis import free_port, start_redis  # noqa: E402
from common.progress import read_trainer  # noqa: E402
from common.tiny import build_tiny_model, tiny_run_config  # noqa: E402

RUN = "chaos"
KINDS = ("generator", "trainer", "producer", "evaluator", "redis")
PROCESSES = ["evaluator.1", "generator.1", "generator.2", "producer.1", "redis.1", "trainer.1"]
PROGRESS_TIMEOUT_S = 300.0
SETTLE_S = 10.0


def write_run(work: Path, port: int, *, claim_idle_s: float) -> dict[str, str]:
    """The run's config, and the links that let the shipped Procfile run in `work` as in this
    checkout; returns the environment honcho runs it with."""
    (work / ".venv").symlink_to(ROOT / ".venv")
    (work / "ops").symlink_to(ROOT / "ops")
    (work / "run.toml").write_text(tiny_run_config(
        run=RUN, redis_url=f"redis://127.0.0.1:{port}/0", output_dir=work / "run", model=work / "model",
        generator={"claim_idle_s": claim_idle_s}, trainer={"max_steps": 1000000}, eval={"every": 2, "prompts": 4}))
    return {"ROLLOUTS_CONFIG": str(work / "run.toml"), "REDIS_PORT": str(port), "STOP_GRACE_S": "60",
            "RESPAWN_WINDOW_S": "10", "PYTHONUNBUFFERED": "1"}


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def victim(log: Path, name: str) -> tuple[int, int | None]:
    """(pid of the `ops/respawn` running honcho's process `name`, pid of what it runs or None while
    it is down). honcho's pid is the Procfile line's: the wrapper itself, or (Redis) ops/redis-last
    with the wrapper beneath it."""
    pid = int(re.findall(rf"{re.escape(name)} started \(pid=(\d+)\)", log.read_text())[-1])
    for p in (pid, *children(pid)):
        try:
            cmdline = Path(f"/proc/{p}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if len(cmdline) > 1 and cmdline[1].endswith(b"ops/respawn"):  # python ops/respawn CMD...
            return p, next(iter(children(p)), None)
    raise SystemExit(f"chaos: no ops/respawn under {name} (pid {pid}): is the Procfile the project's?")


def trainer_step(r: redis.Redis, keys: Keys) -> int | None:
    try:
        return read_trainer(r, keys).step
    except redis.exceptions.RedisError:
        return None


def wait_until(cond, *, timeout: float, what: str, honcho: subprocess.Popen):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if honcho.poll() is not None:
            raise SystemExit(f"chaos: honcho ended (status {honcho.returncode}) while waiting for {what}")
        got = cond()
        if got:
            return got
        time.sleep(0.2)
    raise SystemExit(f"chaos: no {what} within {timeout:.0f}s")


def trial(i: int, n: int, rng: random.Random, *, log: Path, r: redis.Redis, keys: Keys,
          honcho: subprocess.Popen) -> str:
    """One SIGKILL of a random process; returns its kind once it is back and the trainer stepped."""
    kind = rng.choice(KINDS)
    name = rng.choice(["generator.1", "generator.2"]) if kind == "generator" else f"{kind}.1"
    wrapper, pid = wait_until(lambda: (w := victim(log, name))[1] and w, timeout=120, what=f"a live {name}",
                              honcho=honcho)
    before = wait_until(lambda: trainer_step(r, keys) is not None and (trainer_step(r, keys),),
                        timeout=60, what="Redis", honcho=honcho)[0]
    t0 = time.monotonic()
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: next(iter(children(wrapper)), None) not in (None, pid), timeout=120,
               what=f"{name} restarted", honcho=honcho)
    after = wait_until(lambda: (s := trainer_step(r, keys)) is not None and s > before and (s,),
                       timeout=PROGRESS_TIMEOUT_S, what=f"a trainer step after killing {name}", honcho=honcho)[0]
    print(f"trial {i:3d}/{n}: SIGKILL {name:<14} (pid {pid:>7}) at step {before:4d}; "
          f"trainer at step {after} {time.monotonic() - t0:5.1f}s later", flush=True)
    return kind


def exit_codes(honcho_log: Path) -> dict[str, int]:
    """Each process's exit status as honcho reported it ("trainer.1 stopped (rc=0)")."""
    found = re.findall(r"\| (\S+) stopped \(rc=(-?\d+)\)", honcho_log.read_text())
    return {name: int(code) for name, code in found}


def audit(work: Path, port: int, kinds: Counter) -> bool:
    """Start Redis on the run's append-only file, print the audit; True when it is clean."""
    server = start_redis(work / ".rollouts" / "redis", port)
    r = redis.Redis(port=port)
    try:
        acc = accounting(r, Keys(RUN))
        metrics = work / "run" / "metrics.jsonl"
        steps, twice = len(last_trained(metrics)), trained_twice(metrics)
    finally:
        server.terminate()
        server.wait(timeout=30)
    codes = exit_codes(work / "honcho.log")
    wrong = unaccounted(acc) + ([f"trained in two steps: {twice}"] if twice else [])
    if sorted(codes) != PROCESSES or any(codes.values()):
        wrong.append(f"not every process stopped cleanly: {codes}")
    print(f"audit: {sum(kinds.values())} faults ({', '.join(f'{k} {kinds[k]}' for k in KINDS)}); "
          f"{steps} steps")
    print(f"audit: admitted {acc['admitted']} = trained {acc['trained']} + dropped {acc['dropped']} "
          f"(stale {acc['dropped_stale']}, dead {acc['dead_groups'] + acc['dead_prompts']}, zero variance "
          f"{acc['dropped_zero_variance']}) + pending {acc['pending']}; duplicates {acc['duplicate']}; "
          f"trained twice {len(twice)}")
    print("audit: " + ("clean" if not wrong else "FAILED: " + "; ".join(wrong)), flush=True)
    return not wrong


def main() -> int:
    ap = argparse.ArgumentParser(prog="ops/chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--trials", type=int, default=30, help="SIGKILLs to deliver (default 30)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the choice of victims and moments")
    ap.add_argument("--gap", type=float, nargs=2, default=(1.0, 8.0), metavar=("MIN", "MAX"),
                    help="seconds to wait before each kill, drawn uniformly (default 1 8)")
    ap.add_argument("--dir", type=Path, default=None, help="working directory (default: a new one under "
                    ".rollouts/chaos); kept afterwards")
    args = ap.parse_args()
    rng = random.Random(args.seed)
    work = (args.dir or ROOT / ".rollouts" / "chaos" / time.strftime("%Y%m%d-%H%M%S")).resolve()
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    build_tiny_model(work / "model")
    port = free_port()
    env = {**os.environ, **write_run(work, port, claim_idle_s=5.0)}
    print(f"chaos: {args.trials} trials, seed {args.seed}, in {work} (honcho's output: {work / 'honcho.log'})",
          flush=True)
    with open(work / "honcho.log", "w") as log:
        honcho = subprocess.Popen([sys.executable, str(ROOT / "ops" / "honcho"), "-f", str(ROOT / "Procfile"),
                                   "-d", str(work), "start", "-c", "generator=2"], env=env, cwd=work,
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    r, keys, kinds = redis.Redis(port=port, socket_timeout=5), Keys(RUN), Counter()
    try:
        wait_until(lambda: (trainer_step(r, keys) or 0) >= 1, timeout=PROGRESS_TIMEOUT_S, what="trainer step 1",
                   honcho=honcho)
        for i in range(1, args.trials + 1):
            time.sleep(rng.uniform(*args.gap))
            kinds[trial(i, args.trials, rng, log=work / "honcho.log", r=r, keys=keys, honcho=honcho)] += 1
        time.sleep(SETTLE_S)  # the last one restarted is past its start-up, as a user's Ctrl-C would find it
    finally:
        r.close()  # Redis, stopping last, waits for its clients to go
        honcho.send_signal(signal.SIGTERM)  # as Ctrl-C: the trainer finishes its step, generators their prompts
        code = honcho.wait(timeout=180)
    print(f"chaos: stopped (honcho exit status {code})", flush=True)
    return 0 if audit(work, port, kinds) else 1


if __name__ == "__main__":
    sys.exit(main())
