"""Coordination at scale: 8, 32 and 64 generators against one Redis, one producer and one trainer.

    .venv/bin/python ops/bench/scale.py [--generators 8,32,64] [--seconds 20] [--processes 4]
                                        [--sample-s 2.0] [--claim-idle-s 5] [--out scale.json]

What is measured is coordination, not sampling. Each size N runs, on a fresh redis-server
(append-only, as the Procfile starts it): the real producer (`python -m producers`), the real trainer
(`python -m trainer`, the tiny model of common.tiny, one thread, a checkpoint published every step)
and N *logical generators* spread over `--processes` OS processes (this script with `--host`). Each
logical generator is the generator's own `generators.main.serve` (intake with XAUTOCLAIM and
XREADGROUP, the held prompts touched, heartbeats, the weights watcher's XREAD BLOCK and its checksum
check of every published checkpoint, the group and its prompt's XACK in one MULTI/EXEC) on its own
Redis client, with a scripted engine in place of a model: a request "samples" for `--sample-s`
seconds (every request in flight at once, as continuous batching would), then comes back as `n`
completions of max_new_tokens tokens of the tiny vocabulary, one of them the right answer, scored
by the task's real reward in the generator's process. One group per generator every
`--sample-s / max_in_flight` seconds is the offered load.

After a warm-up (every generator has written a group, the trainer has stepped) a window of
`--seconds` gives, per N:
  groups/s       groups written through the samples stream (the generators' own counts)
  Redis CPU      (used_cpu_user + used_cpu_sys) seconds per second of the window (INFO cpu), and
                 the server's used_memory at its end
  ops/group      commands the server ran (INFO commandstats) per group written
  fairness       groups per generator over the window: min / median / max and Jain's index
  heartbeat      commands per second per generator of the heartbeat path (HSET+EXPIRE of the beat,
                 the quarantine HGET, the EVAL that touches held prompts) and of all commands
  fan-out        per published version, from the trainer's announcement (WeightVersion.created_at)
                 until each generator's watcher saw it: the median generator, and the last one
Then one logical generator holding prompts is killed (its tasks cancelled, its connections
dropped, nothing cleaned up, as a crash leaves it); reclaim is the time until every prompt it held
was claimed by another generator and its group written and acknowledged, and how much of that came
after the prompts had been idle `--claim-idle-s` (when XAUTOCLAIM may take them). Last, the
producer is stopped, the rest killed, and common/audit.py accounts for every admitted prompt.

Prints one table and writes everything as JSON with `--out`.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUN = "scale"
GROUP_SIZE = 4
MAX_NEW_TOKENS = 8
MAX_IN_FLIGHT = 2  # per logical generator
# Admission's window, (max_staleness + 1) x prompts_per_step prompts: wide enough that the generators,
# which drain before loading each version, are not starved by it.
MAX_STALENESS = 4
# The heartbeat path's commands: the beat (HSET + EXPIRE in a MULTI), the quarantine read, and
# the script that touches held prompts (XPENDING + XCLAIM inside one EVAL).
HEARTBEAT_COMMANDS = ("hset", "expire", "hget", "eval", "evalsha")
QUESTION = re.compile(r"What is (-?\d+) ([-+*]) (-?\d+)\?")


# ====================================================================== the host of logical generators


class ScriptedEngine:
    """An engine that samples nothing: a request comes back `sample_s` after it was added, as `n`
    completions of `max_new_tokens` ids of the model's vocabulary, the first of them the answer to
    the arithmetic question its prompt asks. Prompts are tokenized with the model's own tokenizer
    and chat template, through `tokenizers` (importing transformers in every host would take
    seconds); `tokenizer` is that `tokenizers.Tokenizer`, enough for sources without an environment."""

    name = "scripted"

    def __init__(self, path: Path, *, sample_s: float, max_running: int) -> None:
        import jinja2
        from tokenizers import Tokenizer

        from common.tiny import CHAT_TEMPLATE

        self.path = path
        self.version = 0
        self.context_length = 512
        self.max_running = max_running
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.eos_ids = [self.tokenizer.token_to_id("<|im_end|>")]
        self.vocab = self.tokenizer.get_vocab_size()
        self._template = jinja2.Template(CHAT_TEMPLATE)
        self._sample_s = sample_s
        self._due: dict[str, tuple[float, Any, Any]] = {}  # request id -> (due, sampling, answer ids)
        self._count = 0

    def prompt_ids(self, task) -> list[int]:
        text = self._template.render(messages=task.messages, add_generation_prompt=True) \
            if task.messages is not None else task.text
        return self.tokenizer.encode(text).ids

    def add(self, request_id: str, prompt_ids: list[int], sampling) -> None:
        asked = QUESTION.findall(self.tokenizer.decode(prompt_ids))  # the arithmetic task's "What is 8 + 9?"
        answer = self.tokenizer.encode(str(solve(*asked[-1]))).ids if asked else []
        self._due[request_id] = (time.monotonic() + self._sample_s, sampling, answer)

    def step(self, *, yield_when=None) -> list:
        from engines.base import Finished, Sampled

        now = time.monotonic()
        first = min(due for due, _, _ in self._due.values())
        if first > now:
            time.sleep(min(first - now, 0.1))  # as an engine step takes time; new requests join after it
            now = time.monotonic()
        done = [rid for rid, (due, _, _) in self._due.items() if due <= now]
        out = []
        for rid in done:
            _, sampling, answer = self._due.pop(rid)
            samples = []
            for j in range(sampling.n):
                self._count += 1
                ids = [(self._count * 31 + k * 7) % self.vocab for k in range(sampling.max_new_tokens)]
                if j == 0:  # one right answer a group, so the trainer's advantages are not all zero
                    ids = answer[: sampling.max_new_tokens - 1] + self.eos_ids
                samples.append(Sampled(ids=ids, logprobs=[-2.0] * len(ids),
                                       finish="stop" if j == 0 else "length"))
            out.append(Finished(request_id=rid, samples=samples))
        return out

    def has_unfinished(self) -> bool:
        return bool(self._due)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids)

    def load_weights(self, path: str | Path, *, version: int) -> None:
        self.version = version

    def sample(self, prompts, sampling):
        raise NotImplementedError("the scripted engine only serves a generator")

    def greedy(self, prompts, *, max_new_tokens: int):
        raise NotImplementedError("the scripted engine only serves a generator")


def solve(a: str, op: str, b: str) -> int:
    return {"+": int(a) + int(b), "-": int(a) - int(b), "*": int(a) * int(b)}[op]


def host(config_path: Path, ids: list[str], *, status: Path, sample_s: float) -> None:
    """Run the logical generators `ids` in this process until killed; write what they did to
    `status` (JSON, about four times a second). SIGUSR1 kills one of them that holds prompts."""
    import trio

    from common.config import load_config

    config = load_config(config_path)
    trio.run(serve_all, config, ids, status, sample_s)


async def serve_all(config, ids: list[str], status: Path, sample_s: float) -> None:
    import trio

    from generators.state import State

    states = {gid: State() for gid in ids}
    scopes = {gid: trio.CancelScope() for gid in ids}
    engines: dict[str, ScriptedEngine] = {}
    async with trio.open_nursery() as nursery:
        for gid in ids:
            nursery.start_soon(serve_one, config, gid, states[gid], scopes[gid], engines, sample_s)
        nursery.start_soon(monitor, states, scopes, engines, status)


async def serve_one(config, gid: str, state, scope, engines: dict[str, ScriptedEngine], sample_s: float) -> None:
    """One logical generator: generators.main.run's start-up (its own Redis client, the group, the
    reward runner, the engine in a thread of its own) without a GPU, then its `serve`."""
    import concurrent.futures

    import trio

    from common import streams
    from common.keys import GENERATORS_GROUP, Keys
    from common.models import resolve_model_path
    from generators.main import serve
    from generators.scoring import RewardRunner, conversational_sources, reward_names

    keys, gen = Keys(config.run), config.generator
    r = await trio.to_thread.run_sync(streams.connect, config.redis_url)
    streams.ensure_group(r, keys.prompts, GENERATORS_GROUP)
    engine = ScriptedEngine(Path(resolve_model_path(config.model.path)), sample_s=sample_s,
                            max_running=gen.max_in_flight * config.rollout.group_size)
    engines[gid] = engine
    thread = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"engine-{gid}")
    rewards = RewardRunner(reward_names(config), timeout_s=gen.reward_timeout_s, workers=0,
                           conversational=conversational_sources(config))
    try:
        with scope:
            await serve(config, state, r=r, keys=keys, engine=engine, engine_thread=thread, rewards=rewards,
                        generator_id=gid, host=socket.gethostname(), gpu=None)
    finally:
        r.connection_pool.disconnect()  # a dead generator's connections go with it
        thread.shutdown(wait=False)


async def monitor(states: dict, scopes: dict, engines: dict[str, ScriptedEngine], status: Path) -> None:
    """Write each logical generator's counts and the versions its watcher saw, and kill one on SIGUSR1."""
    import trio

    from common.messages import MessageError, decode_weights

    seen: dict[str, dict[int, float]] = {gid: {} for gid in states}
    versions: dict[bytes, int | None] = {}
    killed: dict[str, Any] = {}
    with trio.open_signal_receiver(signal.SIGUSR1) as kills:
        while True:
            for gid, st in states.items():
                blob, at = st.seen
                if blob and blob not in versions:
                    try:
                        versions[blob] = decode_weights(blob).version
                    except MessageError:
                        versions[blob] = None
                v = versions.get(blob)
                if v is not None and v not in seen[gid]:
                    seen[gid][v] = at
            doc = {"pid": os.getpid(), "killed": killed, "generators": {
                gid: {"groups": st.groups, "held": len(st.held), "version": engines[gid].version
                      if gid in engines else 0, "seen": seen[gid], "alive": gid not in killed.get("ids", [])}
                for gid, st in states.items()}}
            tmp = status.with_suffix(".tmp")
            tmp.write_text(json.dumps(doc))
            tmp.replace(status)
            with trio.move_on_after(0.25):
                async for _ in kills:
                    victim = next((g for g, st in states.items() if st.held and g not in killed.get("ids", [])),
                                  None)
                    if victim is not None:
                        killed = {"ids": [victim], "at": time.time(), "entries": sorted(states[victim].held),
                                  "prompts": sorted(h.task.id for h in states[victim].held.values())}
                        scopes[victim].cancel()
                    break


# ====================================================================== the driver


def info_snapshot(r) -> dict[str, Any]:
    cpu, mem, stats = r.info("cpu"), r.info("memory"), r.info("commandstats")
    return {"t": time.monotonic(), "cpu": float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"]),
            "used_memory": int(mem["used_memory"]), "clients": int(r.info("clients")["connected_clients"]),
            "calls": {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in stats.items()}}


def read_statuses(paths: list[Path]) -> dict[str, dict]:
    out: dict[str, dict] = {}
    for p in paths:
        if p.exists():
            out.update(json.loads(p.read_text())["generators"])
    return out


def jain(xs: list[float]) -> float:
    """Jain's fairness index: 1 when every generator wrote as many groups, 1/n when one wrote all."""
    s, s2 = sum(xs), sum(x * x for x in xs)
    return s * s / (len(xs) * s2) if s2 else math.nan


def fan_out(r, keys, statuses: dict[str, dict], *, since: float, until: float) -> dict[str, Any]:
    """Per version published in the window: seconds from its announcement until the median and the
    last generator's watcher saw it or a newer one (a watcher that reads two announcements at once
    keeps the newer)."""
    from common.keys import PAYLOAD
    from common.messages import decode_weights

    seen = [{int(v): at for v, at in s["seen"].items()} for s in statuses.values()]
    medians, lasts, versions = [], [], 0
    for _, fields in r.xrange(keys.weights):
        wv = decode_weights(fields[PAYLOAD])
        if not since <= wv.created_at <= until:
            continue
        lags = [min((at for v, at in one.items() if v >= wv.version), default=math.inf) - wv.created_at
                for one in seen]
        medians.append(statistics.median(lags))
        lasts.append(max(lags))
        versions += 1
    return {"versions": versions,
            "median_ms": 1000 * statistics.median(medians) if medians else math.nan,
            "all_seen_median_ms": 1000 * statistics.median(lasts) if lasts else math.nan,
            "all_seen_max_ms": 1000 * max(lasts) if lasts else math.nan}


def run_size(n: int, *, seconds: float, processes: int, sample_s: float, claim_idle_s: float, model: Path,
             tmp: Path, warm_up_s: float, idle_s: float) -> dict[str, Any]:
    """Run N logical generators with the producer and the trainer and measure them."""
    import redis

    from common.audit import accounting, unaccounted
    from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
    from common.localredis import free_port, start_redis
    from common.messages import decode_group
    from common.progress import read_status, read_trainer
    from common.streams import group_backlog
    from ops.lib.configs import write_config
    from ops.lib.processes import spawn, stop

    tmp.mkdir(parents=True)
    port = free_port()
    server = start_redis(tmp / "redis", port)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    keys = Keys(RUN)
    per_step = max(4, n)  # the trainer steps once per round of the generators
    env = write_config(
        tmp / "rollouts.toml", run=RUN, redis_url=url, output_dir=tmp / "out", model=model,
        rollout={"group_size": GROUP_SIZE, "prompts_per_step": per_step, "max_staleness": MAX_STALENESS,
                 "max_new_tokens": MAX_NEW_TOKENS},
        generator={"engine": "hf", "batch_prompts": MAX_IN_FLIGHT, "max_in_flight": MAX_IN_FLIGHT,
                   "claim_idle_s": claim_idle_s,
                   "reward_workers": 0, "threads": 1},
        trainer={"micro_batch_size": 64, "threads": 1, "keep_checkpoints": 2, "quarantine": {"after": 0}})
    env = {**env, "OMP_NUM_THREADS": "1"}
    ids = [f"g{i:03d}" for i in range(n)]
    shares = [ids[i::processes] for i in range(min(processes, n))]
    statuses = [tmp / f"host{i}.json" for i in range(len(shares))]
    procs: list[subprocess.Popen] = []
    result: dict[str, Any] = {"generators": n, "processes": len(shares), "prompts_per_step": per_step,
                              "offered_groups_per_s": n * MAX_IN_FLIGHT / sample_s}
    try:
        trainer = spawn("trainer", cwd=tmp, env=env, log=tmp / "trainer.log")
        producer = spawn("producers", cwd=tmp, env=env, log=tmp / "producer.log")
        hosts = [subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--host", ",".join(share), "--config",
             str(tmp / "rollouts.toml"), "--status", str(path), "--sample-s", str(sample_s)],
            cwd=tmp, env={**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1",
                          **{k: v for k, v in env.items()}},
            stdout=open(tmp / f"host{i}.log", "ab"), stderr=subprocess.STDOUT)  # noqa: SIM115
            for i, (share, path) in enumerate(zip(shares, statuses, strict=True))]
        procs = [trainer, producer, *hosts]

        # ---- warm-up: every generator has written a group and the trainer has published
        phases = {"start": time.monotonic()}
        deadline = time.monotonic() + warm_up_s
        while True:
            for p in procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args} exited {p.returncode}; logs in {tmp}:\n"
                                       + tail(tmp, p))
            got = read_statuses(statuses)
            version = read_trainer(r, keys).version
            if len(got) == n and all(s["groups"] > 0 for s in got.values()) and version >= 1:
                break
            if time.monotonic() > deadline:
                wrote = sum(s["groups"] > 0 for s in got.values())
                raise RuntimeError(f"warm-up not done after {warm_up_s:.0f} s: {wrote} of {n} generators "
                                   f"wrote a group, trainer version {version}; logs in {tmp}")
            time.sleep(0.2)

        # ---- the window
        phases["warm_up"] = time.monotonic()
        a, wall_a, groups_a = info_snapshot(r), time.time(), read_statuses(statuses)
        cpu_a, step_a = process_cpu(procs), read_trainer(r, keys).step
        time.sleep(seconds)
        b, wall_b, groups_b = info_snapshot(r), time.time(), read_statuses(statuses)
        cpu_b, step_b, status = process_cpu(procs), read_trainer(r, keys).step, read_status(r, keys)
        span = b["t"] - a["t"]
        beats_ms, alive = time_read_heartbeats(r, keys)
        time.sleep(1.0)  # the watchers' last sightings reach the status files
        seen = read_statuses(statuses)
        per_gen = [groups_b[g]["groups"] - groups_a[g]["groups"] for g in ids]
        total = sum(per_gen)
        calls = {k: b["calls"].get(k, 0) - a["calls"].get(k, 0) for k in b["calls"]}
        ops = sum(calls.values())
        beats = sum(calls.get(k, 0) for k in HEARTBEAT_COMMANDS)
        result.update(
            seconds=span, groups=total, groups_per_s=total / span,
            redis_cpu_per_s=(b["cpu"] - a["cpu"]) / span,
            redis_cpu_us_per_group=1e6 * (b["cpu"] - a["cpu"]) / max(total, 1),
            used_memory=b["used_memory"], clients=b["clients"],
            ops_per_group=ops / max(total, 1), ops_per_s=ops / span,
            ops_per_s_per_generator=ops / span / n,
            heartbeat_ops_per_s_per_generator=beats / span / n,
            commands={k: v for k, v in sorted(calls.items(), key=lambda kv: -kv[1]) if v},
            fairness={"min": min(per_gen), "median": statistics.median(per_gen), "max": max(per_gen),
                      "jain": jain(per_gen)},
            trainer_steps_per_s=(step_b - step_a) / span,
            read_heartbeats_ms=beats_ms, heartbeats_alive=alive,
            trainer_last_step_s=status.last_step_s if status else math.nan,
            trainer_last_wait_s=status.last_wait_s if status else math.nan,
            cpu_per_s={name: (cpu_b[name] - cpu_a[name]) / span for name in cpu_a},
            host_cpu_ms_per_group=1000 * (cpu_b["hosts"] - cpu_a["hosts"]) / max(total, 1),
            fan_out=fan_out(r, keys, seen, since=wall_a, until=wall_b))

        # ---- reclaim: kill one logical generator that holds prompts
        phases["window"] = time.monotonic()
        os.kill(hosts[0].pid, signal.SIGUSR1)
        killed = wait_killed(statuses[0])
        idle = pending_idle(r, keys, killed["ids"][0])
        claimed: dict[str, float] = {}
        done: dict[str, float] = {}
        deadline = time.monotonic() + claim_idle_s + max(20.0, 5 * sample_s)
        while len(done) < len(killed["entries"]) and time.monotonic() < deadline:
            now = time.time()
            for entry in killed["entries"]:
                if entry in done:
                    continue
                got = r.xpending_range(keys.prompts, GENERATORS_GROUP, entry, entry, 1)
                if not got:
                    done[entry] = now
                    claimed.setdefault(entry, now)
                elif got[0]["consumer"].decode() != killed["ids"][0]:
                    claimed.setdefault(entry, now)
            time.sleep(0.05)
        fate = fates(r, keys, killed["prompts"], decode_group, PAYLOAD)
        written = sum(f in ("trained", "in_samples") for f in fate.values())
        eligible = [killed["at"] + max(claim_idle_s - idle.get(e, 0.0), 0.0) for e in killed["entries"]]
        result["reclaim"] = {
            "generator": killed["ids"][0], "prompts": len(killed["entries"]),
            "completed": len(done), "groups_written": written, "fates": fate,
            "accounting_then": accounting(r, keys),
            "claimed_s": max((claimed[e] - killed["at"] for e in claimed), default=math.nan),
            "claimed_after_idle_s": max((claimed[e] - t for e, t in zip(killed["entries"], eligible, strict=True)
                                         if e in claimed), default=math.nan),
            "completed_s": max((done[e] - killed["at"] for e in done), default=math.nan),
            "after_idle_s": max((done[e] - t for e, t in zip(killed["entries"], eligible, strict=True)
                                 if e in done), default=math.nan),
            "claim_idle_s": claim_idle_s}
        result["trainer_steps"] = read_trainer(r, keys).step

        # ---- idle: the producer stopped and every prompt written, what the generators cost by being there
        phases["reclaim"] = time.monotonic()
        stop(producer)
        deadline = time.monotonic() + 30
        while group_backlog(r, keys.prompts, GENERATORS_GROUP) != (0, 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        a = info_snapshot(r)
        time.sleep(idle_s)
        b = info_snapshot(r)
        idle_calls = sum(b["calls"].get(k, 0) - a["calls"].get(k, 0) for k in b["calls"])
        live = n - 1  # the one killed above
        result["idle"] = {"redis_cpu_per_s": (b["cpu"] - a["cpu"]) / (b["t"] - a["t"]),
                          "ops_per_s_per_generator": idle_calls / (b["t"] - a["t"]) / live,
                          "redis_cpu_us_per_s_per_generator": 1e6 * (b["cpu"] - a["cpu"]) / (b["t"] - a["t"]) / live}

        # ---- stop: what the producer admitted is accounted for (every transaction is whole: a kill loses nothing)
        phases["idle"] = time.monotonic()
        for p in hosts:
            p.kill()
            p.wait()
        trainer.kill()
        trainer.wait()
        marks = list(phases.items())
        result["phases_s"] = {name: round(t - before, 2)
                              for (_, before), (name, t) in zip(marks, marks[1:], strict=False)}
        acc = accounting(r, keys)
        result["accounting"] = acc
        result["unaccounted"] = unaccounted(acc)
        final = read_statuses(statuses)
        result["groups_per_generator"] = {g: final[g]["groups"] for g in ids}
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        server.terminate()
        server.wait(timeout=10)
    return result


def time_read_heartbeats(r, keys, *, times: int = 7) -> tuple[float, int]:
    """(median milliseconds, generators alive) of reading every heartbeat, as the trainer does every step."""
    from common.heartbeats import read_heartbeats

    spent, alive = [], 0
    for _ in range(times):
        t0 = time.perf_counter()
        alive = len(read_heartbeats(r, keys))
        spent.append(1000 * (time.perf_counter() - t0))
    return statistics.median(spent), alive


def process_cpu(procs: list[subprocess.Popen]) -> dict[str, float]:
    """CPU seconds so far (user + system) of the trainer, the producer and the generators' hosts together."""
    import psutil

    def cpu(p: subprocess.Popen) -> float:
        t = psutil.Process(p.pid).cpu_times()
        return t.user + t.system

    trainer, producer, *hosts = procs
    return {"trainer": cpu(trainer), "producer": cpu(producer), "hosts": sum(cpu(p) for p in hosts)}


def pending_idle(r, keys, consumer: str) -> dict[str, float]:
    """{entry id: seconds idle} of what `consumer` holds in the prompts group."""
    from common.keys import GENERATORS_GROUP

    return {e["message_id"].decode(): e["time_since_delivered"] / 1000
            for e in r.xpending_range(keys.prompts, GENERATORS_GROUP, "-", "+", 10_000, consumername=consumer)}


def fates(r, keys, prompt_ids: list[str], decode_group, payload: bytes) -> dict[str, str]:
    """Where each of `prompt_ids` is: "trained" (the trainer's dedup set), "in_samples" (a group in
    the samples stream), "outstanding" (admitted, nothing settled it) or "dropped" (settled without
    training: too stale, dead-lettered, zero variance)."""
    out = {gid: "trained" for gid in prompt_ids if r.zscore(keys.trained, gid) is not None}
    for _, fields in r.xrange(keys.samples):
        group = decode_group(fields[payload])
        if group.prompt_id in prompt_ids:
            out.setdefault(group.prompt_id, "in_samples")
    for gid in prompt_ids:
        out.setdefault(gid, "outstanding" if r.sismember(keys.outstanding, gid) else "dropped")
    return out


def wait_killed(status: Path, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        killed = json.loads(status.read_text())["killed"]
        if killed:
            return killed
        time.sleep(0.05)
    raise RuntimeError("no logical generator held prompts to be killed")


def tail(tmp: Path, p: subprocess.Popen) -> str:
    logs = sorted(tmp.glob("*.log"))
    return "\n".join(f"--- {f.name}\n{f.read_text(errors='replace')[-2000:]}" for f in logs)


def table(results: list[dict[str, Any]]) -> str:
    """The figures of each size as one markdown table."""
    rows = ["| generators | groups/s (offered) | trainer steps/s | Redis CPU s/s | Redis CPU µs/group | used_memory "
            "| Redis ops/group | groups per generator min / median / max (Jain) | heartbeat ops/s per generator "
            "| all ops/s per generator | weights seen, median / last generator (ms) "
            "| reclaim: prompts done, claimed after idle, written after kill "
            "| idle: ops/s and Redis CPU µs/s per generator | trainer's read of all heartbeats (ms) |"]
    rows.append("|" + "---|" * rows[0].count(" | ") + "---|")
    for x in results:
        f, fo, rc = x["fairness"], x["fan_out"], x["reclaim"]
        rows.append(
            f"| {x['generators']} | {x['groups_per_s']:.1f} ({x['offered_groups_per_s']:.0f}) "
            f"| {x['trainer_steps_per_s']:.2f} | {x['redis_cpu_per_s']:.3f} | {x['redis_cpu_us_per_group']:.0f} "
            f"| {x['used_memory'] / 2**20:.1f} MiB | {x['ops_per_group']:.1f} "
            f"| {f['min']} / {f['median']:g} / {f['max']} ({f['jain']:.3f}) "
            f"| {x['heartbeat_ops_per_s_per_generator']:.2f} | {x['ops_per_s_per_generator']:.1f} "
            f"| {fo['median_ms']:.0f} / {fo['all_seen_median_ms']:.0f} (max {fo['all_seen_max_ms']:.0f}; "
            f"{fo['versions']} versions) "
            f"| {rc['completed']}/{rc['prompts']}, {rc['claimed_after_idle_s']:.2f} s, {rc['completed_s']:.1f} s "
            f"| {x['idle']['ops_per_s_per_generator']:.2f}, {x['idle']['redis_cpu_us_per_s_per_generator']:.0f} "
            f"| {x['read_heartbeats_ms']:.1f} |")
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--generators", default="8,32,64", help="sizes, comma-separated")
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each size's measured window")
    ap.add_argument("--processes", type=int, default=4, help="OS processes the logical generators share")
    ap.add_argument("--sample-s", type=float, default=2.0, help="seconds the scripted engine takes a request")
    ap.add_argument("--claim-idle-s", type=float, default=15.0,
                    help="generator.claim_idle_s (15 and up: heartbeats every 5 s, as with the defaults)")
    ap.add_argument("--idle-s", type=float, default=5.0, help="length of the window with no prompts to take")
    ap.add_argument("--warm-up-s", type=float, default=120.0, help="longest wait for every generator's first group")
    ap.add_argument("--out", type=Path, help="write the figures as JSON here")
    ap.add_argument("--model", type=Path, help="a tiny model's directory (common.tiny); default: build one")
    ap.add_argument("--keep", action="store_true", help="keep the runs' directories (logs, Redis) and say where")
    ap.add_argument("--host", help=argparse.SUPPRESS)  # this process hosts these logical generators
    ap.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--status", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.host:
        host(args.config, args.host.split(","), status=args.status, sample_s=args.sample_s)
        return

    from common.tiny import build_tiny_model

    sizes = [int(x) for x in args.generators.split(",")]
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-scale-"))
    results = []
    try:
        model = args.model or build_tiny_model(tmp / "model")
        for n in sizes:
            t0 = time.monotonic()
            x = run_size(n, seconds=args.seconds, processes=args.processes, sample_s=args.sample_s,
                         claim_idle_s=args.claim_idle_s, model=model, tmp=tmp / f"n{n}", warm_up_s=args.warm_up_s,
                         idle_s=args.idle_s)
            x["wall_s"] = time.monotonic() - t0
            results.append(x)
            print(f"{n} generators: {x['groups_per_s']:.1f} groups/s, Redis CPU {x['redis_cpu_per_s']:.3f} s/s, "
                  f"{x['ops_per_group']:.1f} ops/group, Jain {x['fairness']['jain']:.3f}, reclaim "
                  f"{x['reclaim']['completed']}/{x['reclaim']['prompts']} in {x['reclaim']['completed_s']:.1f} s, "
                  f"unaccounted {x['unaccounted'] or 'none'} ({x['wall_s']:.0f} s)", flush=True)
    finally:
        if args.keep:
            print(f"runs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    print()
    print(table(results))
    if args.out:
        args.out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                                        "sample_s": args.sample_s, "claim_idle_s": args.claim_idle_s,
                                        "seconds": args.seconds, "results": results}, indent=1, default=str))


if __name__ == "__main__":
    main()
