"""A soak: the tiny pipeline for a long while, generators joining and leaving, memory watched.

`python ops/bench/soak.py --minutes 60`: Redis (append-only), the producer, the trainer and one
generator that stays, on a tiny random model; every `--churn` minutes a second and third
generator start or stop (SIGTERM, as a user would). Every minute it prints each process's
resident memory, Redis's used memory, the lengths of the streams and of the trainer's `trained`
set and the producer's outstanding set; at the end a table of start (after the first minutes of
warm-up) against end. Trimming and the dedup window keep every one of them bounded: what grows
with the run's length would end a week-long run.
"""

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.keys import Keys  # noqa: E402
from common.localredis import free_port  # noqa: E402
from common.progress import read_trainer  # noqa: E402
from common.tiny import build_tiny_model, tiny_run_config  # noqa: E402

RUN = "soak"


def rss_mb(pid: int) -> float:
    """Resident memory of `pid` and its children (a generator's reward workers), in MiB."""
    out = subprocess.run(["ps", "-o", "rss=", "--ppid", str(pid), "-p", str(pid)], capture_output=True, text=True)
    return sum(int(x) for x in out.stdout.split()) / 1024


def snapshot(r: redis.Redis, keys: Keys, procs: dict[str, subprocess.Popen]) -> dict[str, float]:
    snap = {f"rss {name} MiB": rss_mb(p.pid) for name, p in procs.items() if p.poll() is None}
    snap["redis used MiB"] = r.info("memory")["used_memory"] / 2**20
    for name, key in [("prompts", keys.prompts), ("samples", keys.samples), ("metrics", keys.metrics),
                      ("weights", keys.weights)]:
        snap[f"stream {name}"] = r.xlen(key)
    snap["trained set"] = r.zcard(keys.trained)
    snap["outstanding set"] = r.scard(keys.outstanding)
    snap["step"] = read_trainer(r, keys).step
    return snap


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=60.0)
    ap.add_argument("--churn", type=float, default=4.0, help="minutes between generators joining or leaving")
    ap.add_argument("--warmup", type=float, default=3.0, help="minutes before the start snapshot")
    ap.add_argument("--dir", type=Path, default=ROOT / ".rollouts" / "soak")
    args = ap.parse_args()
    work = args.dir.resolve()
    shutil.rmtree(work, ignore_errors=True)
    (work / "logs").mkdir(parents=True)
    build_tiny_model(work / "model")
    port = free_port()
    (work / "run.toml").write_text(tiny_run_config(
        run=RUN, redis_url=f"redis://127.0.0.1:{port}/0", output_dir=work / "run", model=work / "model",
        generator={"claim_idle_s": 10}, trainer={"lr": 1e-4, "max_steps": 0, "dedup_window": 200}))
    env = {**os.environ, "ROLLOUTS_CONFIG": str(work / "run.toml")}
    redis_server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes",
                                     "--dir", str(work), "--save", ""], stdout=subprocess.DEVNULL)
    time.sleep(0.5)

    def start(name: str, *argv: str) -> subprocess.Popen:
        log = open(work / "logs" / f"{name}.log", "a")  # noqa: SIM115 - lives as long as the process
        return subprocess.Popen([sys.executable, "-m", *argv], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)

    procs = {"producer": start("producer", "producers"), "trainer": start("trainer", "trainer"),
             "g1": start("g1", "generators", "--id", "g1")}
    r, keys = redis.Redis(port=port), Keys(RUN)
    t0 = time.monotonic()
    first = None
    churn_at, joined = t0 + args.churn * 60, False
    try:
        while time.monotonic() - t0 < args.minutes * 60:
            time.sleep(60)
            minute = (time.monotonic() - t0) / 60
            snap = snapshot(r, keys, {"redis": redis_server, **procs})
            if first is None and minute >= args.warmup:
                first = snap
            print(f"{minute:5.1f} min: " + ", ".join(f"{k} {v:.0f}" for k, v in snap.items()), flush=True)
            if time.monotonic() >= churn_at:
                churn_at += args.churn * 60
                if joined:
                    for g in ("g2", "g3"):
                        procs[g].send_signal(signal.SIGTERM)
                        procs.pop(g).wait(timeout=120)
                    print(f"{minute:5.1f} min: g2 and g3 left", flush=True)
                else:
                    for g in ("g2", "g3"):
                        procs[g] = start(g, "generators", "--id", g)
                    print(f"{minute:5.1f} min: g2 and g3 joined", flush=True)
                joined = not joined
        last = snapshot(r, keys, {"redis": redis_server, **procs})
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        for p in procs.values():
            p.wait(timeout=120)
        redis_server.terminate()
        redis_server.wait(timeout=60)
    first = first or last
    print(f"\n| after {args.warmup:.0f} min | at {args.minutes:.0f} min | what |\n|---:|---:|---|")
    for k in last:
        print(f"| {first.get(k, float('nan')):.1f} | {last[k]:.1f} | {k} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
