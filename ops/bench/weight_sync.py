"""Seconds from the trainer starting to publish weights until every generator samples with them.

    .venv/bin/python ops/bench/weight_sync.py [--models tiny default] [--engine hf] [--generators 1] [--versions 3]
        [--publish-dir DIR] [--dtype float32] [--idle] [--transfer disk|gloo]

For each model, a real redis-server and `--generators` real generator processes (`python -m
generators`, `--engine` hf or vllm, the demo's settings: 4 completions per prompt, at most 24 new
tokens, `max_in_flight` 8, `batch_prompts` 4, one thread), kept busy: the prompts stream never
runs dry.
This process then publishes `--versions` new weight versions with the trainer's own
`trainer.checkpoints.publish` (checkpoint to a temporary name and rename, checksums, one MULTI/EXEC
that sets `weights:latest`; no optimizer state, as on the demo's steps between `state_every`), in
`--dtype` (the trainer publishes in model.dtype: float32 for the default model) under
`--publish-dir` (trainer.publish_dir; default a directory on the disk), each at a random moment of
the generators' work, and times from each generator's log line `loaded weights version V (verify
a s, reload b s; announced c s after publishing, drained d s, waited e s for the checksums)`,
stamped as it arrives:

    save      publish() from its start to its return (weights:latest is set at its end);
    write     of it, writing the weights file, checksum included;
    checksum  of that, the time spent waiting for the checksum once the bytes were written (it is
              computed beside the writes, from the bytes as they are written);
    notice    from publish()'s announcement until the generator's watcher saw it (XREAD BLOCK);
    drain     from then until the engine, done with the prompts already in it (which finish with
              the weights they started with), began loading;
    verify    the generator's checksum check of the files (begun when it saw the version, so it
              runs while the engine drains); `wait` is how long loading waited for it;
    reload    the in-place load into the engine;
    total     from the start of publish() until the last generator has loaded, after which every
              prompt it starts is sampled with the new version.

`--transfer gloo` (trainer.weight_transfer) also broadcasts each version, beside the write, to the
generators, which load it from memory: `verify` is then the wait for the broadcast's receive.

`--idle` gives the generators no prompts: nothing is in flight, so nothing drains, and the total
is the weight sync itself.

Against code from before the watcher (a generator line without the announce/drain part), notice
is everything between publish()'s return and the load (poll and drain), reload includes the
verify, and write/checksum/drain are not known (nan).

The figures are medians over versions (and generators). Prints the default model's (the last
model's) total on its last line.
"""

from __future__ import annotations

import argparse
import inspect
import math
import os
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LOADED = re.compile(r"loaded weights version (\d+)(?: \(verify ([\d.]+) s, reload ([\d.]+) s"
                    r"(?:; announced ([\d.]+|nan) s after publishing, drained ([\d.]+|nan) s, "
                    r"waited ([\d.]+) s for the checksums)?)?")
PARTS = ("save", "write", "checksum", "notice", "drain", "verify", "wait", "reload", "total")


def feed(r, keys, *, low: int = 64, batch: int = 128, start: list[int]) -> None:
    """Keep at least `low` prompts waiting in the prompts stream (arithmetic, 4 completions each)."""
    from common.keys import GENERATORS_GROUP, PAYLOAD
    from common.messages import PromptTask, encode
    from common.streams import group_backlog
    from tasks.arithmetic import problem

    if group_backlog(r, keys.prompts, GENERATORS_GROUP)[1] >= low:
        return
    with r.pipeline(transaction=False) as pipe:
        for i in range(start[0], start[0] + batch):
            p = problem(seed=0, index=i, max_operand=20, ops=["+", "-"])
            pipe.xadd(keys.prompts, {PAYLOAD: encode(PromptTask(
                id=f"arithmetic:0:{i}", messages=[{"role": "user", "content": p.question}], text=None,
                meta={"answer": p.answer, "source": "arithmetic"}, n=4, admitted_at=0))})
        pipe.execute()
    start[0] += batch


def watch(proc: subprocess.Popen, log: Path, seen: dict[int, dict[str, float]]) -> None:
    """Copy the generator's output to `log`; stamp each weight load {version: {"at": time, part: s}}."""
    with open(log, "w") as out:
        for line in proc.stdout:
            now = time.monotonic()
            out.write(line)
            out.flush()
            m = LOADED.search(line)
            if m:
                parts = [float(x) if x is not None else math.nan for x in m.groups()[1:]]
                seen[int(m[1])] = dict(zip(("verify", "reload", "notice", "drain", "wait"), parts, strict=True),
                                       at=now)


def loads_row(loads: list[dict[str, float]], *, t0: float, t1: float, timing: dict[str, float]) -> dict[str, float]:
    """One version's parts (medians over generators) from its load lines and publish()'s timing."""
    row = {"save": t1 - t0, "write": timing.get("write", math.nan), "checksum": timing.get("checksum", math.nan),
           "total": max(x["at"] for x in loads) - t0}
    if all(math.isnan(x["notice"]) for x in loads):  # a generator from before the watcher
        row.update(notice=statistics.median(x["at"] - t1 - x["verify"] - x["reload"] for x in loads),
                   drain=math.nan, wait=math.nan, verify=statistics.median(x["verify"] for x in loads),
                   reload=statistics.median(x["verify"] + x["reload"] for x in loads))
        return row
    for part in ("notice", "drain", "verify", "wait", "reload"):
        row[part] = statistics.median(x[part] for x in loads)
    return row


def show(row: dict[str, float]) -> str:
    return ", ".join(f"{part} {row[part]:.2f}" for part in PARTS if part in row)


def bench_model(name: str, model_dir: Path, *, engine: str, generators: int, versions: int, max_in_flight: int,
                tmp: Path, publish_dir: str, dtype: str, idle: bool = False, transfer: str = "disk"
                ) -> dict[str, float]:
    import redis
    import torch

    from common.config import TrainerConfig
    from common.keys import GENERATORS_GROUP, Keys
    from common.localredis import free_port, start_redis
    from common.streams import ensure_group
    from trainer.checkpoints import load_model, publish

    tmp.mkdir(parents=True)
    port = free_port()
    server = start_redis(tmp / "redis", port)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    keys = Keys("bench")
    ensure_group(r, keys.prompts, GENERATORS_GROUP)
    config = tmp / "bench.toml"
    config.write_text(f"""run = "bench"
redis_url = "{url}"
output_dir = "{tmp / 'out'}"
[model]
path = "{model_dir}"
[rollout]
group_size = 4
temperature = 0.8
max_new_tokens = 24
[generator]
engine = "{engine}"
batch_prompts = 4
max_in_flight = {max_in_flight}
threads = 1
[trainer]
weight_transfer = "{transfer}"
transfer_host = "127.0.0.1"
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               ROLLOUTS_CONFIG=str(config))
    next_prompt = [0]

    def keep_busy() -> None:
        if not idle:
            feed(r, keys, start=next_prompt)

    keep_busy()
    procs, seen, logs, sender = [], [], [], None
    rows: list[dict[str, float]] = []
    try:
        for g in range(generators):
            proc = subprocess.Popen([sys.executable, "-m", "generators", "--id", f"w{g + 1}"], cwd=tmp, env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(proc)
            seen.append({})
            logs.append(tmp / f"w{g + 1}.log")
            threading.Thread(target=watch, args=(proc, logs[-1], seen[-1]), daemon=True).start()
        torch.set_num_threads(1)
        model = load_model(model_dir, getattr(torch, dtype))
        checkpoints = Path(publish_dir) / f"bench-{os.getpid()}" if publish_dir else tmp / "out" / "checkpoints"
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)

        def wait(what: str, cond, timeout: float = 600) -> None:
            deadline = time.monotonic() + timeout
            while not cond():
                keep_busy()
                for p, log in zip(procs, logs, strict=True):
                    assert p.poll() is None, f"generator exited {p.returncode}:\n{log.read_text()[-4000:]}"
                assert time.monotonic() < deadline, f"timed out waiting for {what}"
                time.sleep(0.01)

        # Every generator busy before the first publish: groups are coming out of each (--idle: up).
        wait("every generator's first group", lambda: sum(
            beat is not None and (idle or beat.groups > 0) for beat in heartbeats(r, keys, generators)) == generators)
        if transfer != "disk":
            from common.transfer import listening_members
            from trainer.transfer import Sender

            sender = Sender(r, keys, TrainerConfig(weight_transfer=transfer, transfer_host="127.0.0.1"),
                            device=torch.device("cpu"))
            wait("every generator listening", lambda: len(listening_members(r, keys)) == generators)
            extra_sender = {"sender": sender}
        else:
            extra_sender = {}
        rng = random.Random(0)
        for v in range(1, versions + 1):
            at = time.monotonic() + rng.uniform(1.0, 4.0)
            wait("a random moment", lambda at=at: time.monotonic() > at)
            with torch.no_grad():  # weights that changed, as after a step
                for p in model.parameters():
                    p.mul_(1 + 1e-6)
            timing: dict[str, float] = {}
            extra = {"timing": timing} if "timing" in inspect.signature(publish).parameters else {}
            t0 = time.monotonic()
            publish(r, keys, model, optimizer, scheduler, step=v, checkpoint_dir=checkpoints,
                    state_root=tmp / "out" / "trainer_state", source_dir=model_dir, keep=3, save_state_now=False,
                    entry_ids=[], group_ids=[], dedup_window=1000, dtype=getattr(torch, dtype), **extra,
                    **extra_sender)
            t1 = time.monotonic()
            wait(f"every generator to load version {v}", lambda v=v: all(v in s for s in seen))
            row = loads_row([s[v] for s in seen], t0=t0, t1=t1, timing=timing)
            rows.append(row)
            print(f"  {name} version {v} (s): {show(row)}", flush=True)
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=120)
    finally:
        if sender is not None:
            sender.close()
        for p in procs:
            if p.poll() is None:
                p.kill()
        server.terminate()
        server.wait(timeout=10)
        if publish_dir:
            shutil.rmtree(checkpoints, ignore_errors=True)
    return {k: statistics.median(row[k] for row in rows) for k in rows[0]}


def heartbeats(r, keys, count: int) -> list:
    """The heartbeat of each generator w1..w{count} (None before its first)."""
    from common.heartbeats import read_heartbeat

    return [read_heartbeat(r, keys, f"w{g + 1}") for g in range(count)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["tiny", "default"],
                    help="'tiny' (built in-process), 'default', or HF checkpoint directories")
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--generators", type=int, default=1)
    ap.add_argument("--max-in-flight", type=int, default=8, help="generator.max_in_flight (the demo's: 8)")
    ap.add_argument("--versions", type=int, default=3, help="weight versions published per model")
    ap.add_argument("--publish-dir", default="", help="trainer.publish_dir: where checkpoints are written "
                    "(e.g. /dev/shm/rollouts); default a directory on the disk")
    ap.add_argument("--dtype", default="float32", help="the published dtype: the trainer's model.dtype")
    ap.add_argument("--transfer", choices=["disk", "gloo"], default="disk",
                    help="trainer.weight_transfer: also broadcast each version over gloo")
    ap.add_argument("--idle", action="store_true", help="give the generators no prompts: nothing to drain, so "
                    "the total is the sync alone (publish, notice, checksums, reload)")
    args = ap.parse_args()

    from common.models import resolve_model_path
    from common.tiny import build_tiny_model

    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    results = {}
    try:
        for i, name in enumerate(args.models):
            model_dir = (build_tiny_model(tmp / "tiny-model") if name == "tiny"
                         else resolve_model_path("" if name == "default" else name))
            size = sum(f.stat().st_size for f in model_dir.glob("*.safetensors"))
            print(f"{name}: {model_dir.name}, {size / 1e6:.1f} MB of safetensors; {args.generators} {args.engine} "
                  f"generator(s), max_in_flight {args.max_in_flight}, {args.versions} versions, published in "
                  f"{args.dtype} to {args.publish_dir or 'the disk'}, weights over {args.transfer}", flush=True)
            results[name] = bench_model(name, model_dir, engine=args.engine, generators=args.generators,
                                        versions=args.versions, max_in_flight=args.max_in_flight, tmp=tmp / f"m{i}",
                                        publish_dir=args.publish_dir, dtype=args.dtype, idle=args.idle,
                                        transfer=args.transfer)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nmedians (s):")
    for name, m in results.items():
        print(f"  {name}: {show(m)}")
    last = args.models[-1]
    m = results[last]
    print(f"weight sync seconds ({last}, {args.engine}): total {m['total']:.2f} ({show(m)})")


if __name__ == "__main__":
    main()
