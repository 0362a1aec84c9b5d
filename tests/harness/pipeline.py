"""The real processes of a run: the trainer run to its end on what a test wrote to Redis (one
process, or ranks under torchrun), a generator alone on the prompts a test wrote, and the whole
pipeline (producer, generators, trainer), each process restartable, waited on until the trainer's
last step."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import PromptTask, encode
from tests.harness.configs import write_config
from tests.harness.metrics import last_trained, read_steps
from tests.harness.processes import process_env, spawn, stop, wait_for

# ---------------------------------------------------------------------- the trainer alone


# The groups a test writes carry behaviour log-probs of its own making, not a sampler's: the
# trainer's quarantine (common/quarantine.py) would rightly turn their "generator" away.
QUARANTINE_OFF = {"quarantine": {"after": 0}}


def run_trainer(config: dict[str, str], *, cwd: Path, nproc: int = 1, timeout: float = 300
                ) -> subprocess.CompletedProcess:
    """The trainer process on `config` (under torchrun with `nproc` ranks past one) until it exits,
    which must be with 0."""
    env = process_env({**config, "OMP_NUM_THREADS": "1"})
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    proc = subprocess.run([sys.executable, *launcher, "-m", "trainer"], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, f"trainer exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return proc


def train_groups(tmp_path: Path, redis_url: str, model_dir: Path, *, run: str, **trainer: object
                 ) -> subprocess.CompletedProcess:
    """The trainer on the groups a test wrote to run `run`'s samples stream, two a step, three steps
    unless `trainer` says otherwise; its output under tmp_path/out."""
    config = write_config(tmp_path / "rollouts.toml", run=run, redis_url=redis_url, output_dir=tmp_path / "out",
                          model=model_dir, base={},
                          rollout={"group_size": 4, "prompts_per_step": 2, "max_staleness": 1},
                          trainer={"max_steps": 3, "micro_batch_size": 4, "lr": 1e-3, "threads": 1,
                                   "keep_checkpoints": 2, **QUARANTINE_OFF, **trainer})
    return run_trainer(config, cwd=tmp_path, timeout=240)


def run_ranks(tmp_path: Path, run_name: str, redis_url: str, model_dir: Path, nproc: int, dtype: str = "float32",
              kl_coef: float = 0.0, share_prompts: bool = True, skip_zero_advantage: bool = True,
              pack_sequences: bool = True, attention: str = "auto", state_every: int = 1) -> str:
    """The trainer as `nproc` FSDP ranks on the groups a test wrote to run `run_name`, four a step,
    two steps (step 1's version written beside step 2: with its trainer state, each rank's shards
    by its own writer thread, at `state_every` 1; the weights alone at 2); its output under
    tmp_path/run_name. Returns what it printed."""
    config = write_config(tmp_path / f"{run_name}.toml", run=run_name, redis_url=redis_url,
                          output_dir=tmp_path / run_name, model={"path": str(model_dir), "dtype": dtype}, base={},
                          rollout={"group_size": 4, "prompts_per_step": 4, "max_staleness": 2},
                          trainer={"max_steps": 2, "lr": 1e-3, "micro_batch_size": 3, "micro_batch_tokens": 40,
                                   "threads": 1, "keep_checkpoints": 2, "state_every": state_every,
                                   "loss": {"kl_coef": kl_coef},
                                   "share_prompts": share_prompts, "skip_zero_advantage": skip_zero_advantage,
                                   "pack_sequences": pack_sequences, "attention": attention,
                                   **QUARANTINE_OFF})
    return run_trainer(config, cwd=tmp_path, nproc=nproc).stdout


# ---------------------------------------------------------------------- a generator alone


def generator_toml(*, run: str, redis_url: str, model: Path) -> str:
    """A run's TOML for one HF generator of `model` (4 new tokens, one thread, 30 s a reward), to
    which a test adds its sources as TOML text."""
    return f"""
run = "{run}"
redis_url = "{redis_url}"
[model]
path = "{model}"
[rollout]
max_new_tokens = 4
[generator]
engine = "hf"
threads = 1
reward_timeout_s = 30.0
"""


def generate_groups(r, keys: Keys, tasks: list[PromptTask], *, config: Path, groups: int, cwd: Path) -> str:
    """The generator process (id g1) on `config` in `cwd`, fed `tasks` through the run's prompts
    stream, until `groups` groups are in its samples stream; it must then stop with 0. Its log."""
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    for task in tasks:
        r.xadd(keys.prompts, {PAYLOAD: encode(task)})
    log = cwd / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=cwd, env={"ROLLOUTS_CONFIG": str(config)}, log=log)
    try:
        wait_for(lambda: r.xlen(keys.samples) >= groups, timeout=180, what=f"{groups} group(s)", procs=[proc])
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()
    return log.read_text()


# ---------------------------------------------------------------------- the whole pipeline

RUN = "faults"
KEYS = Keys(RUN)


def pipeline_config(tmp_path: Path, redis_url: str, model: Path, *, steps: int, state_every: int = 0,
                    claim_idle_s: float = 120.0, engine: str = "hf", keep_checkpoints: int = 3) -> dict:
    """The run's config on the tiny model (the HF engine by default: it starts in seconds, vLLM in a
    minute on a CPU; delivery does not depend on the engine)."""
    return write_config(tmp_path / "run.toml", run=RUN, redis_url=redis_url, output_dir=tmp_path / "run",
                        model=model, generator={"engine": engine, "claim_idle_s": claim_idle_s},
                        trainer={"max_steps": steps, "state_every": state_every,
                                 "keep_checkpoints": keep_checkpoints})


class Pipeline:
    """producer, generator and trainer as OS processes, each restartable."""

    def __init__(self, tmp_path: Path, env: dict) -> None:
        self.tmp, self.env, self.procs = tmp_path, env, {}
        (tmp_path / "logs").mkdir(exist_ok=True)

    def start(self, name: str) -> None:
        module, args = {"producer": ("producers", ()), "generator": ("generators", ("--id", "g1")),
                        "g1": ("generators", ("--id", "g1")), "g2": ("generators", ("--id", "g2")),
                        "trainer": ("trainer", ())}[name]
        self.procs[name] = spawn(module, *args, cwd=self.tmp, env=self.env, log=self.log(name))

    def log(self, name: str) -> Path:
        return self.tmp / "logs" / f"{name}.log"

    def kill(self, name: str) -> None:
        self.procs[name].send_signal(signal.SIGKILL)
        self.procs[name].wait(timeout=30)

    def forget(self, name: str) -> None:
        """Leave a killed process out of `finish` (it is not started again)."""
        assert self.procs.pop(name).returncode == -signal.SIGKILL

    def finish(self, timeout: float = 300) -> None:
        """Wait for the trainer to reach max_steps, then stop the producer and the generator
        (which writes the batch in hand first); all must exit cleanly."""
        trainer = self.procs["trainer"]
        try:
            wait_for(lambda: trainer.poll() is not None, timeout=timeout, what="the trainer to finish",
                     procs=list(self.procs.values()))
        finally:
            codes = {name: stop(p) for name, p in self.procs.items()}
        assert codes == dict.fromkeys(self.procs, 0), {n: self.log(n).read_text()[-3000:] for n in self.procs}


def metrics(tmp_path: Path) -> list[dict]:
    """The run's steps so far, from its metrics.jsonl."""
    return read_steps(tmp_path / "run" / "metrics.jsonl")


def trained_once(r, tmp_path: Path, steps: int) -> list[str]:
    """The groups of each step, as last trained (a step re-trained after a restart counts once):
    no group in two steps, and exactly the trainer's `trained` set."""
    last = last_trained(tmp_path / "run" / "metrics.jsonl")
    assert sorted(last) == list(range(1, steps + 1))
    ids = [g for s in sorted(last) for g in last[s]]
    assert len(ids) == len(set(ids)), f"a group trained in two steps: {ids}"
    assert {m.decode() for m in r.zrange(KEYS.trained, 0, -1)} == set(ids)
    return ids


def keep_groups(r, keys: Keys, group: str = "watch") -> None:
    """A consumer group of the test's own on the run's samples stream, from its start, made before
    any process does: the trainer trims the stream of what every group has acknowledged, so every
    group written stays in it for the test to read (with XRANGE, or read as `group`)."""
    r.xgroup_create(keys.samples, group, id="0", mkstream=True)


def run_watching_groups(tmp_path: Path, r, keys: Keys, env: dict[str, str]) -> tuple[list[dict], list]:
    """The Procfile's generators, trainer and producers under `env` until the trainer exits (its
    max_steps), each process asserted to exit 0: the run's step metrics, and every group it wrote,
    read as a consumer group of the test's own created before they start (the stream is trimmed only
    of what every group has acknowledged, so none is trimmed before the test has seen it)."""
    from common.messages import decode_group

    logs = tmp_path / "logs"
    logs.mkdir()
    keep_groups(r, keys)
    procs = {name: spawn(name, cwd=tmp_path, env=env, log=logs / f"{name}.log")
             for name in ("generators", "trainer", "producers")}
    seen = {}

    def read() -> None:
        for _, entries in r.xreadgroup("watch", "test", {keys.samples: ">"}) or []:
            for eid, f in entries:
                seen[eid] = decode_group(f[PAYLOAD])
                r.xack(keys.samples, "watch", eid)

    def trained() -> bool:
        read()
        return procs["trainer"].poll() == 0

    try:
        wait_for(trained, timeout=300, what="the trainer's steps", procs=list(procs.values()))
    finally:
        codes = {name: stop(p) for name, p in procs.items()}
    read()
    assert codes == {"generators": 0, "trainer": 0, "producers": 0}, {
        n: (logs / f"{n}.log").read_text()[-3000:] for n, c in codes.items() if c}
    return read_steps(tmp_path / "run" / "metrics.jsonl"), list(seen.values())
