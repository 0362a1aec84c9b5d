"""Several runs on one generator (generators/pool.py): each run's share of the groups under unequal demand.

    .venv/bin/python ops/bench/pool_share.py [--big 96] [--small 16] [--max-in-flight 4] [--repeat 2]
    .venv/bin/python ops/bench/pool_share.py --dry-run      # 24 and 4 prompts: seconds

Two runs of the tiny model (built in-process; LoRA adapters of rank 4 published for each, version 1)
share one generator process (`python -m generators --runs big.toml,small.toml`, the HF engine, one
thread, each run's generator.max_in_flight = --max-in-flight). Demand is unequal: the big run has
--big prompts waiting in its stream, the small run --small, all admitted before the generator
starts. The time each group was written is its samples-stream entry id (Redis's clock, ms). Printed,
per repeat: the small run's share of the groups written until its last one (while both had prompts
waiting: an even share is 0.50; a pool that served runs in the order their prompts came, or one
run's backlog first, gives near 0), each run's groups per second over that span, and the big run's
alone afterwards (what its groups per second are once the other run has nothing left: the pool's
capacity goes to the run with work).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.lib.models import ADAPTED as TARGETS  # noqa: E402


def adapter(model_dir: Path, out: Path, *, seed: int) -> tuple[Path, dict[str, str]]:
    """An adapter of rank 4 on q and v with random weights (a trained one, not zeros), published as
    the trainer publishes it."""
    from ops.lib.models import adapted
    from trainer.checkpoints import write_checkpoint

    return write_checkpoint(adapted(model_dir, seed=seed), checkpoint_dir=out, step=1, source_dir=model_dir,
                            adapter=True)


def run_toml(path: Path, *, run: str, redis_url: str, model: Path, max_in_flight: int) -> Path:
    path.write_text(f"""run = "{run}"
redis_url = "{redis_url}"
output_dir = "{path.parent / run}"
[model]
path = "{model}"
[rollout]
max_new_tokens = 8
[generator]
engine = "hf"
threads = 1
max_in_flight = {max_in_flight}
batch_prompts = {max_in_flight}
[trainer.lora]
rank = 4
alpha = 8.0
target_modules = {TARGETS!r}
publish = "adapter"
[[data.sources]]
name = "calc"
kind = "arithmetic"
""")
    return path


def once(tmp: Path, *, model: Path, big: int, small: int, max_in_flight: int) -> dict[str, float]:
    import redis

    from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
    from common.localredis import free_port, start_redis
    from common.messages import PromptTask, WeightVersion, encode
    from ops.lib.processes import spawn, stop, wait_for

    port = free_port()
    server = start_redis(tmp / "redis", port)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    counts = {"big": big, "small": small}
    try:
        paths = []
        for seed, (run, count) in enumerate(counts.items()):
            keys = Keys(run)
            path, sums = adapter(model, tmp / run / "checkpoints", seed=seed)
            wv = WeightVersion(version=1, step=1, path=str(path), format="lora_adapter", checksums=sums,
                               created_at=time.time())
            r.xadd(keys.weights, {PAYLOAD: encode(wv)})
            r.set(keys.weights_latest, encode(wv))
            r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
            for i in range(count):
                task = PromptTask(id=f"calc:0:{i}", messages=None, text=f"{i % 50} + {i // 50} =",
                                  meta={"answer": i % 50 + i // 50}, n=4, admitted_at=1, source="calc")
                r.xadd(keys.prompts, {PAYLOAD: encode(task)})
            paths.append(run_toml(tmp / f"{run}.toml", run=run, redis_url=url, model=model,
                                  max_in_flight=max_in_flight))
        proc = spawn("generators", "--id", "pool", "--runs", ",".join(map(str, paths)), cwd=tmp, env={},
                     log=tmp / "generator.log")
        try:
            wait_for(lambda: all(r.xlen(Keys(run).samples) >= n for run, n in counts.items()), timeout=1800,
                     what="every group", procs=[proc])
        finally:
            stop(proc)
        written = {run: [int(e.decode().split("-")[0]) / 1000 for e, _ in r.xrange(Keys(run).samples)]
                   for run in counts}
    finally:
        server.terminate()
        server.wait()
    start = min(min(t) for t in written.values())
    end = max(written["small"])
    both = {run: sum(1 for t in ts if t <= end) for run, ts in written.items()}
    span = max(end - start, 1e-3)
    after = [t for t in written["big"] if t > end]
    alone = (len(after) - 1) / (after[-1] - after[0]) if len(after) > 2 else float("nan")
    return {"small_share": both["small"] / (both["small"] + both["big"]), "big_per_s": both["big"] / span,
            "small_per_s": both["small"] / span, "big_alone_per_s": alone, "span_s": span}


def main(argv: list[str] | None = None) -> list[dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big", type=int, default=96)
    parser.add_argument("--small", type=int, default=16)
    parser.add_argument("--max-in-flight", type=int, default=4)
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--dry-run", action="store_true", help="24 and 4 prompts, once")
    args = parser.parse_args(argv)
    if args.dry_run:
        args.big, args.small, args.repeat = 24, 4, 1

    from common.tiny import build_tiny_model

    out = []
    with tempfile.TemporaryDirectory(prefix="pool-share-") as tmp:
        model = build_tiny_model(Path(tmp) / "model")
        print(f"big run {args.big} prompts, small run {args.small}; max_in_flight {args.max_in_flight} each; "
              "groups of 4, 8 new tokens, HF engine, tiny model")
        for i in range(args.repeat):
            work = Path(tmp) / f"repeat-{i}"
            work.mkdir()
            m = once(work, model=model, big=args.big, small=args.small, max_in_flight=args.max_in_flight)
            out.append(m)
            print(f"repeat {i + 1}: small run's share while both had prompts {m['small_share']:.2f} over "
                  f"{m['span_s']:.1f} s (groups/s: small {m['small_per_s']:.2f}, big {m['big_per_s']:.2f}); big "
                  f"alone afterwards {m['big_alone_per_s']:.2f} groups/s", flush=True)
    return out


if __name__ == "__main__":
    main()
