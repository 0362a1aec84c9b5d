"""A real one-host Slurm cluster in a temporary directory: its own slurm.conf (SLURM_CONF, so
/etc/slurm is never read), slurmctld and slurmd in the foreground on free ports, no cgroups and
no munge (auth/none, which Slurm 22.05 still has); and the jobs it runs."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import psutil

from tests.harness.needs import skip_without_root
from tests.harness.processes import wait_for
from tests.harness.servers import free_port

COMMANDS = ("slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "srun")


def need_slurm() -> None:
    """Skip (fail in CI) where Slurm is not installed or its daemons cannot run: ./ops/test installs
    slurm-wlm where it runs as root with apt-get, and slurmd runs jobs as root."""
    missing = [c for c in COMMANDS if shutil.which(c) is None]
    if missing:
        skip_without_root(f"Slurm is not installed ({', '.join(missing)} missing; ./ops/test installs "
                          "slurm-wlm as root where apt-get is)")
    if os.geteuid() != 0:
        skip_without_root("slurmd needs root to run jobs")


def slurm_conf(tmp: Path, *, host: str, cpus: int, kill_wait_s: int) -> str:
    return "\n".join([
        "ClusterName=rollouts-test",
        f"SlurmctldHost={host}(127.0.0.1)",
        f"SlurmctldPort={free_port()}",
        f"SlurmdPort={free_port()}",
        "AuthType=auth/none",
        "CredType=cred/none",
        "SlurmUser=root",
        "SlurmdUser=root",
        f"StateSaveLocation={tmp / 'state'}",
        f"SlurmdSpoolDir={tmp / 'spool'}",
        f"SlurmctldPidFile={tmp / 'slurmctld.pid'}",
        f"SlurmdPidFile={tmp / 'slurmd.pid'}",
        "ProctrackType=proctrack/linuxproc",
        "TaskPlugin=task/none",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "MpiDefault=none",
        "MailProg=/bin/true",
        "ReturnToService=2",
        f"KillWait={kill_wait_s}",
        "MinJobAge=3600",  # a finished job stays in `scontrol show job`
        f"NodeName={host} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
        f"PartitionName=test Nodes={host} Default=YES MaxTime=INFINITE State=UP",
        "",
    ])


@contextlib.contextmanager
def one_host_cluster(tmp: Path, *, kill_wait_s: int) -> Iterator[dict[str, str]]:
    """slurmctld and slurmd on this host, as this test's own cluster; yields the environment that
    points Slurm's commands at it. At the end its jobs are cancelled, then the daemons and whatever
    of its jobs still runs are killed."""
    need_slurm()
    tmp.mkdir(parents=True, exist_ok=True)
    for d in ("state", "spool"):
        (tmp / d).mkdir(exist_ok=True)
    host = socket.gethostname().split(".")[0]
    conf = tmp / "slurm.conf"
    conf.write_text(slurm_conf(tmp, host=host, cpus=os.cpu_count() or 1, kill_wait_s=kill_wait_s))
    env = {**os.environ, "SLURM_CONF": str(conf)}
    daemons = [subprocess.Popen([d, "-D", "-v"], env=env, stdout=open(tmp / f"{d}.log", "ab"),  # noqa: SIM115
                                stderr=subprocess.STDOUT) for d in ("slurmctld", "slurmd")]
    try:
        wait_for(lambda: idle(env, host), timeout=120, what=f"node {host} idle in the test's Slurm "
                 f"(logs in {tmp})", procs=daemons)
        yield {"SLURM_CONF": str(conf)}
    finally:
        subprocess.run(["scancel", "--full", "--signal=KILL", "--partition=test"], env=env, capture_output=True)
        with contextlib.suppress(AssertionError):
            wait_for(lambda: not ours(conf), timeout=60, what="the jobs killed")
        for d in daemons:
            d.terminate()
        for d in daemons:
            try:
                d.wait(timeout=30)
            except subprocess.TimeoutExpired:
                d.kill()
        for p in ours(conf):  # what outlived the daemons: started under this cluster's SLURM_CONF
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()


def idle(env: dict[str, str], host: str) -> bool:
    out = subprocess.run(["sinfo", "-h", "-n", host, "-o", "%t"], env=env, capture_output=True, text=True)
    return out.returncode == 0 and out.stdout.strip() == "idle"


def ours(conf: Path) -> list[psutil.Process]:
    """The processes started under the cluster whose slurm.conf is `conf` (its jobs inherit SLURM_CONF)."""
    found = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("SLURM_CONF") == str(conf) and p.pid != os.getpid():
                found.append(p)
    return found


def sbatch(script: Path, *args: str, cwd: Path, env: dict[str, str]) -> int:
    out = subprocess.run(["sbatch", "--parsable", *args, str(script)], cwd=cwd, env=env, capture_output=True,
                         text=True, check=True)
    return int(out.stdout.strip().split(";")[0])


def job_state(job: int, env: dict[str, str]) -> str:
    out = subprocess.run(["scontrol", "show", "job", str(job)], env=env, capture_output=True, text=True)
    found = re.search(r"JobState=(\S+)", out.stdout)
    return found[1] if found else ""
