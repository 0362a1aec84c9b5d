#!/usr/bin/env python3
"""`ops/slurm/launch.py`: a whole run on the Slurm allocation it runs in (ops/slurm/rollouts.sbatch
starts it as the batch step, from the checkout, with the run's config in ROLLOUTS_CONFIG).

On the allocation's first node: Redis (append-only, its files in `<output_dir>/redis`, so a job
submitted again resumes from them), the producer and the evaluator. The trainer under torchrun
on the first TRAINER_NODES nodes (one `srun` step, one torchrun per node, rendezvous on the first
of them), generators on every node after those (GENERATORS_PER_NODE each), or on the first node
when the allocation has no other. Every process but Redis runs in an `srun` step of its own.
Slurm signals every process of a step, children included, so each gets a signal of Slurm's
exactly once provided nothing passes it on: torchrun does not (below), nor ops/respawn (not used
here), and a generator's reward and environment workers ignore it (generators/processes.py).

How it stops. `scancel` makes Slurm send SIGTERM to every process of the job at once, steps and
batch step alike, then SIGKILL KillWait seconds later (a setting of the cluster: `scontrol show
config | grep KillWait`). Each process takes that SIGTERM as its first signal: the trainer finishes
and saves its step (or gives it up, saying so, when a step would not fit in the grace), generators
finish the prompts they hold; STOP_GRACE_S is set to KillWait so that they know their deadline.
Redis must outlive its clients: it is started with SIGTERM blocked, so Slurm's signal stays
pending, and this launcher shuts it down (SHUTDOWN: the append-only file flushed) once every step
has ended, or 1 s before KillWait runs out. torchrun is started deaf to SIGTERM (ops/slurm/torchrun.py):
its ranks get Slurm's signal themselves, and a second one from torchrun would make them exit at once.

SIGUSR1 to this launcher (`#SBATCH --signal=B:USR1@N` before the time limit, or `scancel --batch
--signal=USR1 JOBID`) stops the run the same way, with the same deadline: every step gets SIGTERM
once, through `scancel --signal=TERM` (which spares the batch step, so Redis). A step that ends by
itself (the trainer at `max_steps`, or a process that failed) stops the others so, as honcho does
under ./ops/run; nothing is restarted here: submit the job again to resume. Not for this launcher:
`scancel --signal=TERM JOBID` or `--signal=TERM@N` without B:, which reach the steps and not this
launcher; it would signal the others again when the first ends, and a second SIGTERM is "exit now".

Settings, from the environment: TRAINER_NODES (1), TRAINER_PROCS_PER_NODE (1, or "gpu": one rank
per GPU of the first node), GENERATORS_PER_NODE (1, or "gpu"), RDZV_PORT (29500: the trainer's
rendezvous). Redis listens on the port of the config's redis_url, with its password, on the
loopback interface of a one-node allocation, on every interface of the first node otherwise (put a
password in redis_url: README "Across machines"); every process is pointed at it (ROLLOUTS_REDIS_URL).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import redis

from common.config import ConfigError, load_config

HERE = Path(__file__).resolve().parent
REDIS_MARGIN_S = 1.0  # Redis is shut down this long before Slurm's SIGKILL
POLL_S = 0.2
SCANCEL = "SIGTERM from Slurm (scancel, or the time limit)"


def say(line: str) -> None:
    print(f"slurm: {line}", flush=True)


# ---------------------------------------------------------------------- the allocation

@dataclass(frozen=True)
class Layout:
    head: str  # the first node: Redis, producer, evaluator
    trainer_nodes: list[str]  # torchrun on each, rendezvous on the first
    trainer_procs: int  # torchrun --nproc-per-node
    generator_nodes: list[str]  # GENERATORS_PER_NODE generators on each
    generators_per_node: int


def scontrol(*args: str) -> str:
    return subprocess.run(["scontrol", *args], check=True, capture_output=True, text=True).stdout


def kill_wait_s() -> float:
    """How long Slurm waits between its SIGTERM and its SIGKILL (the cluster's KillWait)."""
    found = re.search(r"^KillWait\s*=\s*(\d+)", scontrol("show", "config"), re.M)
    assert found, "scontrol show config says no KillWait"
    return float(found[1])


def gpus() -> int:
    """The GPUs this node shows (0 without nvidia-smi)."""
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return 0
    return sum(line.startswith("GPU ") for line in listed.splitlines())


def count(name: str, default: str) -> int:
    raw = os.environ.get(name, default)
    if raw == "gpu":
        return max(gpus(), 1)
    if not raw.isdigit() or int(raw) < 1:
        sys.exit(f"slurm: {name} must be a positive number or 'gpu', got {raw!r}")
    return int(raw)


def layout(nodes: list[str]) -> Layout:
    trainers = count("TRAINER_NODES", "1")
    if trainers > len(nodes):
        sys.exit(f"slurm: TRAINER_NODES is {trainers} but the allocation has {len(nodes)} nodes ({', '.join(nodes)})")
    generators = nodes[trainers:] or nodes[:1]
    return Layout(head=nodes[0], trainer_nodes=nodes[:trainers], trainer_procs=count("TRAINER_PROCS_PER_NODE", "1"),
                  generator_nodes=generators, generators_per_node=count("GENERATORS_PER_NODE", "1"))


# ---------------------------------------------------------------------- Redis on the first node

@dataclass(frozen=True)
class RedisSpec:
    port: int
    password: str | None
    url: str  # the config's redis_url on the first node (127.0.0.1 when it is the only one)
    dir: Path  # its append-only files: <output_dir>/redis


def redis_spec(config_url: str, host: str, output_dir: str) -> RedisSpec:
    parts = urlsplit(config_url)
    if parts.scheme != "redis":
        sys.exit(f"slurm: this launcher starts a plain Redis; the config's redis_url must be redis://..., "
                 f"got {parts.scheme}://")
    port = parts.port or 6379
    auth = parts.netloc.rsplit("@", 1)[0] + "@" if "@" in parts.netloc else ""
    return RedisSpec(port=port, password=parts.password, url=urlunsplit(parts._replace(netloc=f"{auth}{host}:{port}")),
                     dir=Path(output_dir) / "redis")


def block_sigterm() -> None:
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})


def start_redis(spec: RedisSpec, *, alone: bool) -> subprocess.Popen:
    """redis-server, SIGTERM blocked (Slurm's stays pending: `shutdown_redis` stops it once its
    clients are gone); on the loopback interface when the allocation is one node (`alone`), else
    on every interface, for the other nodes."""
    spec.dir.mkdir(parents=True, exist_ok=True)
    argv = ["redis-server", "--port", str(spec.port), "--bind", "127.0.0.1" if alone else "0.0.0.0",
            "--appendonly", "yes", "--dir", str(spec.dir.resolve()), "--save", ""]
    if spec.password:
        argv += ["--requirepass", spec.password]
    server = subprocess.Popen(argv, preexec_fn=block_sigterm)  # noqa: PLW1509 - only a signal mask
    client = local_redis(spec)
    while True:
        try:
            client.ping()
            return server
        except redis.exceptions.ConnectionError:
            if server.poll() is not None:
                sys.exit(f"slurm: redis-server exited with {server.returncode} at start-up")
            time.sleep(POLL_S)


def local_redis(spec: RedisSpec) -> redis.Redis:
    return redis.Redis(host="127.0.0.1", port=spec.port, password=spec.password, socket_timeout=5)


def shutdown_redis(server: subprocess.Popen, spec: RedisSpec) -> int:
    if server.poll() is None:
        with contextlib.suppress(redis.exceptions.ConnectionError):  # it closed the connection as it went
            local_redis(spec).shutdown()
    return server.wait()


# ---------------------------------------------------------------------- the steps

def cpus_per_task(tasks_per_node: int) -> list[str]:
    """Each task its share of the node's CPUs (a step gets one CPU per task unless told)."""
    cpus = int(os.environ.get("SLURM_CPUS_ON_NODE", "0") or 0)
    return [f"--cpus-per-task={max(cpus // tasks_per_node, 1)}"] if cpus else []


def srun(nodes: list[str], tasks_per_node: int, argv: list[str]) -> subprocess.Popen:
    """One step of `tasks_per_node` tasks on each of `nodes`, sharing their CPUs with the others (--overlap)."""
    return subprocess.Popen(["srun", "--overlap", "--kill-on-bad-exit=0", f"--nodes={len(nodes)}",
                             f"--nodelist={','.join(nodes)}", f"--ntasks-per-node={tasks_per_node}",
                             f"--ntasks={len(nodes) * tasks_per_node}", *cpus_per_task(tasks_per_node), *argv])


def start_steps(lay: Layout, python: str) -> dict[str, subprocess.Popen]:
    rdzv = f"{lay.trainer_nodes[0]}:{os.environ.get('RDZV_PORT', '29500')}"
    trainer = [python, str(HERE / "torchrun.py"), f"--nnodes={len(lay.trainer_nodes)}",
               f"--nproc-per-node={lay.trainer_procs}", "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}",
               f"--rdzv-id={os.environ.get('SLURM_JOB_ID', 'rollouts')}", "-m", "trainer"]
    return {
        "producer": srun([lay.head], 1, [python, "-m", "producers"]),
        "trainer": srun(lay.trainer_nodes, 1, trainer),
        "generators": srun(lay.generator_nodes, lay.generators_per_node, [python, "-m", "generators"]),
        "evaluator": srun([lay.head], 1, [python, "-m", "evaluator"]),
    }


def signal_steps() -> None:
    """SIGTERM to every process of every step of this job, once; not to the batch step."""
    subprocess.run(["scancel", "--signal=TERM", os.environ["SLURM_JOB_ID"]], check=False)


# ---------------------------------------------------------------------- the run

def main() -> int:  # noqa: C901, PLR0912 - one loop: start, watch, stop in order
    if "SLURM_JOB_NODELIST" not in os.environ:
        sys.exit("slurm: no Slurm allocation here: submit ops/slurm/rollouts.sbatch with sbatch")
    try:
        config = load_config()
    except ConfigError as err:
        sys.exit(f"slurm: {err}")
    nodes = scontrol("show", "hostnames", os.environ["SLURM_JOB_NODELIST"]).split()
    lay = layout(nodes)
    spec = redis_spec(config.redis_url, "127.0.0.1" if len(nodes) == 1 else lay.head, config.output_dir)
    grace = kill_wait_s()
    os.environ.update(ROLLOUTS_REDIS_URL=spec.url, STOP_GRACE_S=f"{grace:g}", PYTHONUNBUFFERED="1")
    say(f"job {os.environ.get('SLURM_JOB_ID')} run {config.run!r}: redis, producer, evaluator on {lay.head}; "
        f"trainer on {','.join(lay.trainer_nodes)} ({lay.trainer_procs} per node); "
        f"{lay.generators_per_node} generator(s) on each of {','.join(lay.generator_nodes)}; "
        f"KillWait {grace:g} s (STOP_GRACE_S)")
    if len(nodes) > 1 and not spec.password:
        say("warning: Redis listens on the cluster's network without a password: put one in redis_url")

    stops: list[tuple[str, float]] = []  # why the run stops, and since when (monotonic)
    signal.signal(signal.SIGTERM, lambda s, f: stops.append((SCANCEL, time.monotonic())))
    signal.signal(signal.SIGUSR1, lambda s, f: stops.append(("SIGUSR1", time.monotonic())))
    server = start_redis(spec, alone=len(nodes) == 1)
    say(f"redis up on {lay.head}:{spec.port}, append-only files in {spec.dir}")
    steps = {} if stops else start_steps(lay, sys.executable)
    status: dict[str, int] = {}  # the exit status of each step (and Redis) that ended
    signalled = False  # the steps have their SIGTERM (from Slurm itself, or from here)
    while not stops or not (set(steps) <= set(status) or time.monotonic() > stops[0][1] + grace - REDIS_MARGIN_S):
        for name, ended in [*steps.items(), ("redis", server)]:
            if name not in status and ended.poll() is not None:
                status[name] = ended.returncode
                say(f"{name} {'step ' if name in steps else ''}exited {ended.returncode}")
                stops.append((f"the {name} {'step' if name in steps else 'server'} ended", time.monotonic()))
        if stops and not signalled:
            signalled = True
            if stops[0][0] == SCANCEL:
                say(f"stopping: {SCANCEL}, every step has it; Redis stops once they end")
            else:
                say(f"stopping: {stops[0][0]}; SIGTERM to every step")
                signal_steps()
        time.sleep(POLL_S)
    running = [name for name in steps if name not in status]
    code = shutdown_redis(server, spec)
    say(f"redis stopped ({code})" + (f"; still running: {', '.join(running)}" if running else ""))
    failed = [c for n, c in status.items() if c != 0]
    return failed[0] if failed else 0


if __name__ == "__main__":
    sys.exit(main())
