"""Fault tests: the real processes on the tiny model, one of them killed with SIGKILL mid-run (a
generator holding prompts, the trainer between checkpoints, the producer, Redis itself), then
started again (a dead generator's prompts are reclaimed by the other one instead). Each ends with the
accounting: every admitted prompt is trained, dropped for a counted reason or still pending, and
no group is trained twice. Run with -s to see the numbers."""

import json
import signal
import time
from pathlib import Path

import pytest
import redis

from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import decode_prompt
from common.progress import read_trainer
from tests.conftest import free_port, start_redis
from tests.helpers import accounting, assert_accounted, need_vllm, spawn, stop, wait_for

RUN = "faults"
KEYS = Keys(RUN)


def write_config(tmp_path: Path, redis_url: str, model: Path, *, steps: int, state_every: int = 0,
                 claim_idle_s: float = 120.0, engine: str = "hf") -> dict:
    """The run's config on the tiny model (the HF engine by default: it starts in seconds, vLLM in a
    minute on a CPU; delivery does not depend on the engine)."""
    path = tmp_path / "run.toml"
    path.write_text(f"""
run = "{RUN}"
redis_url = "{redis_url}"
output_dir = "{tmp_path / 'run'}"
[model]
path = "{model}"
[rollout]
group_size = 4
prompts_per_step = 4
max_staleness = 1
max_new_tokens = 8
[generator]
engine = "{engine}"
batch_prompts = 2
threads = 1
claim_idle_s = {claim_idle_s}
[trainer]
lr = 1e-3
max_steps = {steps}
state_every = {state_every}
micro_batch_size = 8
threads = 1
""")
    return {"ROLLOUTS_CONFIG": str(path)}


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
    path = tmp_path / "run" / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def trained_once(r, tmp_path: Path, steps: int) -> list[str]:
    """The groups of each step, as last trained (a step re-trained after a restart counts once):
    no group in two steps, and exactly the trainer's `trained` set."""
    last = {m["step"]: m["group_ids"] for m in metrics(tmp_path)}
    assert sorted(last) == list(range(1, steps + 1))
    ids = [g for s in sorted(last) for g in last[s]]
    assert len(ids) == len(set(ids)), f"a group trained in two steps: {ids}"
    assert {m.decode() for m in r.zrange(KEYS.trained, 0, -1)} == set(ids)
    return ids


def report(fault: str, at_kill: dict, after: dict) -> None:
    in_flight = at_kill["prompts_pending"] + at_kill["samples_pending"]
    print(f"\n{fault}: in flight when it struck: {in_flight} (prompts being generated "
          f"{at_kill['prompts_pending']}, groups read by the trainer and unacknowledged {at_kill['samples_pending']}; "
          f"waiting: prompts {at_kill['prompts_waiting']}, groups {at_kill['samples_waiting']}; "
          f"admitted {at_kill['admitted']})")
    print(f"{fault}: after recovery: admitted {after['admitted']} = trained {after['trained']} + dropped "
          f"{after['dropped']} (stale {after['dropped_stale']}, dead {after['dead_groups'] + after['dead_prompts']}) "
          f"+ pending {after['pending']}; duplicates refused {after['duplicate']}")


def held_prompts(r, consumer: str) -> list[str]:
    """Ids of the prompts delivered to `consumer` and not yet acknowledged."""
    entries = [p["message_id"] for p in r.xpending_range(KEYS.prompts, GENERATORS_GROUP, min="-", max="+",
                                                         count=1000, consumername=consumer)]
    return [decode_prompt(r.xrange(KEYS.prompts, e, e)[0][1][PAYLOAD]).id for e in entries]


@pytest.mark.parametrize("engine", ["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def test_generator_sigkill_holding_prompts(tmp_path, redis_url, r, tiny_model, engine):
    if engine == "vllm":
        need_vllm()
    # claim_idle_s: long enough that a live generator's prompts are not taken from it, short
    # enough that the test does not wait long for the dead one's
    pipe = Pipeline(tmp_path, write_config(tmp_path, redis_url, tiny_model, steps=100, claim_idle_s=4,
                                           engine=engine))
    for name in ("producer", "g1", "g2", "trainer"):
        pipe.start(name)
    wait_for(lambda: read_trainer(r, KEYS).step >= 1, timeout=180, what="step 1",
             procs=list(pipe.procs.values()))
    g1 = pipe.procs["g1"]

    def g1_stopped_holding_prompts() -> list[str] | None:
        """SIGSTOP g1 while it holds prompts mid-generation (and go on if it let them go meanwhile)."""
        if not r.xpending_range(KEYS.prompts, GENERATORS_GROUP, min="-", max="+", count=1, consumername="g1"):
            return None
        g1.send_signal(signal.SIGSTOP)
        held = held_prompts(r, "g1")
        if not held:
            g1.send_signal(signal.SIGCONT)
        return held or None

    stopped_holding = wait_for(g1_stopped_holding_prompts, timeout=120, what="g1 holding prompts",
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
    pipe = Pipeline(tmp_path, write_config(tmp_path, redis_url, tiny_model, steps=steps, state_every=2))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    # Step 3 is trained and its weights published, but its groups wait for step 4's saved state.
    wait_for(lambda: any(m["step"] == 3 for m in metrics(tmp_path)), timeout=180, what="step 3",
             procs=list(pipe.procs.values()))
    pipe.kill("trainer")
    at_kill = accounting(r, KEYS)
    assert read_trainer(r, KEYS).state_step in (2, 4)
    pipe.start("trainer")
    pipe.finish()
    after = accounting(r, KEYS)
    report("trainer SIGKILL", at_kill, after)
    assert "from its trainer state" in pipe.log("trainer").read_text()
    assert_accounted(after)
    assert after["trained"] == len(trained_once(r, tmp_path, steps)) == steps * 4


def test_producer_sigkill_mid_run(tmp_path, redis_url, r, tiny_model):
    steps = 4
    pipe = Pipeline(tmp_path, write_config(tmp_path, redis_url, tiny_model, steps=steps))
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    wait_for(lambda: read_trainer(r, KEYS).step >= 1, timeout=180, what="step 1",
             procs=list(pipe.procs.values()))
    pipe.kill("producer")
    at_kill = accounting(r, KEYS)
    pipe.start("producer")
    pipe.finish()
    after = accounting(r, KEYS)
    report("producer SIGKILL", at_kill, after)
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
    args = ("--appendfsync", "always")  # every write on disk before Redis answers it
    server = start_redis(data, port, *args)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    pipe = Pipeline(tmp_path, write_config(tmp_path, url, tiny_model, steps=steps))
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
        assert_accounted(after)
        assert after["trained"] == len(trained_once(r, tmp_path, steps)) == steps * 4
        assert after["admitted"] >= at_kill["admitted"]
    finally:
        server.kill()
