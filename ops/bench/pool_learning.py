"""Two runs learning on one generator (generators/pool.py): each run's held-out accuracy over its steps.

    .venv/bin/python ops/bench/pool_learning.py [--runs add mul] [--minutes 30] [--steps 60] [--rank 16] [--lr 1e-4]
    .venv/bin/python ops/bench/pool_learning.py --dry-run     # the tiny model, 2 steps each: a minute

Two runs of the demo's configuration (configs/demo.toml: the default model) with LoRA adapters
published alone (`[trainer.lora] rank = --rank, alpha = 2 x rank, publish = "adapter"`, trainer.lr
--lr), each on its own task, two of: "add" (the demo's arithmetic, + and -), "mul" (times tables:
arithmetic's * on operands up to 12) and "reverse" (tasks/reverse.py: reverse a word of 3-5
letters). Each run has its producer, trainer and evaluator (eval.every = 5:
greedy pass@1 on 32 held-out problems of its task); ONE generator serves both (`python -m generators
--runs add.toml,mul.toml`, vLLM where installed). Its own Redis on a free port, everything in a
temporary directory. Stopped when both trainers reach --steps or after --minutes. Printed: each
run's evaluations (step, pass@1) and its mean training reward over its first and last five steps.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TASKS = {"add": '[task]\nname = "arithmetic"\n',
         "mul": '[task]\nname = "arithmetic"\nops = ["*"]\nmax_operand = 12\n',
         "reverse": '[task]\nname = "reverse"\nmin_letters = 3\nmax_letters = 5\n'}


def run_config(tmp: Path, run: str, *, redis_url: str, rank: int, lr: float, steps: int, model: str) -> Path:
    """configs/demo.toml with the run's name, output, task, LoRA adapters and evaluations."""
    import tomllib

    demo = (ROOT / "configs" / "demo.toml").read_text()
    head = f'run = "{run}"\nredis_url = "{redis_url}"\noutput_dir = "{tmp / run}"\n'
    head += f'[model]\npath = "{model}"\n' if model else ""
    text = (head + TASKS[run] + demo.replace("[trainer]\n", f"[trainer]\nmax_steps = {steps}\n", 1)
            .replace("lr = 1e-5", f"lr = {lr:g}").replace("every = 10 ", "every = 5 ")
            + f'\n[trainer.lora]\nrank = {rank}\nalpha = {2.0 * rank}\npublish = "adapter"\n')
    tomllib.loads(text)
    path = tmp / f"{run}.toml"
    path.write_text(text)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs=2, choices=sorted(TASKS), default=["add", "mul"])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model, 2 steps each")
    args = parser.parse_args()

    import redis

    from common.keys import Keys
    from common.localredis import free_port, start_redis
    from common.progress import read_trainer
    from ops.lib.processes import spawn, stop_all

    with tempfile.TemporaryDirectory(prefix="pool-learning-") as name:
        tmp = Path(name)
        model = ""
        if args.dry_run:
            from common.tiny import build_tiny_model

            model, args.steps = str(build_tiny_model(tmp / "model")), 2
        port = free_port()
        server = start_redis(tmp / "redis", port)
        url = f"redis://127.0.0.1:{port}/0"
        r = redis.Redis.from_url(url)
        configs = {run: run_config(tmp, run, redis_url=url, rank=args.rank, lr=args.lr, steps=args.steps, model=model)
                   for run in args.runs}
        procs = {}
        started = time.monotonic()
        try:
            for run, path in configs.items():
                for module in ("producers", "trainer", "evaluator"):
                    procs[f"{run}-{module}"] = spawn(module, cwd=tmp, env={"ROLLOUTS_CONFIG": str(path)},
                                                     log=tmp / f"{run}-{module}.log")
            procs["generator"] = spawn("generators", "--id", "pool", "--runs", ",".join(map(str, configs.values())),
                                       cwd=tmp, env={}, log=tmp / "generator.log")
            while time.monotonic() - started < args.minutes * 60:
                if all(procs[f"{run}-trainer"].poll() is not None for run in configs):
                    break
                if procs["generator"].poll() is not None:
                    raise SystemExit(f"the generator exited:\n{(tmp / 'generator.log').read_text()[-3000:]}")
                time.sleep(5)
            steps = {run: read_trainer(r, Keys(run)).step for run in configs}
            time.sleep(0 if args.dry_run else 60)  # the last evaluations queued
        finally:
            stop_all(procs.values())
            server.terminate()
            server.wait()
        print(f"{(time.monotonic() - started) / 60:.1f} minutes; steps {steps}; LoRA rank {args.rank}, lr {args.lr:g}")
        for run in configs:
            rows = [json.loads(line) for line in (tmp / run / "metrics.jsonl").read_text().splitlines() if line]
            rewards = [row["reward"] for row in rows if "reward" in row]
            evals_file = tmp / run / "evals.jsonl"
            evals = [json.loads(line) for line in evals_file.read_text().splitlines() if line] \
                if evals_file.exists() else []
            shown = ", ".join(f"step {e['step']}: {e.get('eval/pass@1', float('nan')):.3f}" for e in evals)
            first = sum(rewards[:5]) / max(len(rewards[:5]), 1)
            last = sum(rewards[-5:]) / max(len(rewards[-5:]), 1)
            print(f"{run}: held-out pass@1 {shown or 'none'}; training reward first 5 steps {first:.3f}, last 5 "
                  f"{last:.3f}")


if __name__ == "__main__":
    main()
