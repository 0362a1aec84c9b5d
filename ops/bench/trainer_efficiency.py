"""Trainer tokens/s consuming the samples stream against a bare loop over the same groups in memory.

    .venv/bin/python ops/bench/trainer_efficiency.py [--model DIR] [--steps N]

Both sides run `trainer.main.train_step` on the same SampleGroups (random tokens, 4 prompts x 4
completions per step, behaviour log-probs from the model itself) on one thread. The stream side
is the real trainer process (`python -m trainer`) reading them from a real redis-server, with
publishing every `--sync-every` steps. Prints the ratio on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF checkpoint dir ('' = the default model)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--sync-every", type=int, default=1000, help="publish weights every N steps")
    args = ap.parse_args()

    import redis
    import torch
    from transformers import AutoModelForCausalLM

    from common.keys import PAYLOAD, Keys
    from common.messages import encode
    from common.models import resolve_model_path
    from tests.conftest import free_port, start_redis
    from tests.test_trainer import make_group
    from trainer.grpo import LossOptions
    from trainer.main import train_step

    torch.set_num_threads(1)
    model_dir = resolve_model_path(args.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    rng = random.Random(0)
    per_step = 4
    groups = [make_group(model, f"b{i}", version=0, rng=rng) for i in range(args.steps * per_step)]
    tokens = sum(len(g.prompt_ids) * len(g.completions) + sum(len(c.ids) for c in g.completions) for g in groups)

    # ---- bare loop: the same update over the same groups held in memory
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    t0 = time.perf_counter()
    for s in range(args.steps):
        train_step(model, optimizer, groups[s * per_step:(s + 1) * per_step], loss=LossOptions(), ref_model=None,
                   temperature=1.0, estimator="grpo", overlong="none", overlong_penalty=0.0, micro_batch_size=8,
                   micro_batch_tokens=0, updates=1, recompute_old_logp=False, max_grad_norm=1.0)
    bare_s = time.perf_counter() - t0
    del model, optimizer

    # ---- the trainer process reading the same groups from a real Redis stream
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    port = free_port()
    server = start_redis(tmp / "redis", port)
    try:
        r = redis.Redis(port=port)
        for g in groups:
            r.xadd(Keys("bench").samples, {PAYLOAD: encode(g)})
        env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
        env.update(PYTHONPATH=str(ROOT), ROLLOUTS_RUN="bench", ROLLOUTS_REDIS_URL=f"redis://127.0.0.1:{port}/0",
                   ROLLOUTS_MODEL__PATH=str(model_dir), ROLLOUTS_OUTPUT_DIR=str(tmp / "out"),
                   ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP=str(per_step), ROLLOUTS_ROLLOUT__MAX_STALENESS="100",
                   ROLLOUTS_TRAINER__MAX_STEPS=str(args.steps), ROLLOUTS_TRAINER__SYNC_EVERY=str(args.sync_every),
                   ROLLOUTS_TRAINER__LR="1e-6", ROLLOUTS_TRAINER__THREADS="1", ROLLOUTS_TRAINER__MICRO_BATCH_SIZE="8")
        subprocess.run([sys.executable, "-m", "trainer"], cwd=tmp, env=env, check=True, stdout=subprocess.DEVNULL)
        rows = [json.loads(x) for x in (tmp / "out" / "metrics.jsonl").read_text().splitlines()]
    finally:
        server.terminate()
        shutil.rmtree(tmp, ignore_errors=True)
    step_s = sum(m["time/step"] for m in rows)
    publish_s = sum(m["time/publish"] for m in rows)
    wait_s = sum(m["time/wait_data"] for m in rows)
    print(f"model {model_dir.name}, {args.steps} steps x {per_step} groups, {tokens} tokens, 1 thread")
    print(f"bare loop:    {tokens / bare_s:8.1f} tokens/s ({bare_s:.1f} s)")
    print(f"from stream:  {tokens / step_s:8.1f} tokens/s ({step_s:.1f} s of steps; publish {publish_s:.1f} s, "
          f"wait for data {wait_s:.2f} s = {wait_s / step_s:.1%})")
    print(f"ratio stream/bare without publishing: {bare_s / (step_s - publish_s):.3f}")
    print(f"ratio stream/bare: {bare_s / step_s:.3f}")


if __name__ == "__main__":
    main()
