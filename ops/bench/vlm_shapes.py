"""A vision-language run's reward over its steps: the tiny VLM learning to count the shapes task.

    .venv/bin/python ops/bench/vlm_shapes.py [--steps 150] [--minutes 20] [--engine hf|vllm] [--warm-start 30]
    .venv/bin/python ops/bench/vlm_shapes.py --steps 2 --warm-start 5     # a minute: the plumbing alone

The model is the tests' tiny random Idefics3 (ops/lib/models.py `tiny_vlm`: a one-layer
vision tower over 32-pixel pictures, the two-layer tiny Llama). A random model of 32,000 tokens
almost never writes a number, so no completion would ever be rewarded: first `--warm-start`
steps of supervised fine-tuning (here, plain AdamW, lr 3e-3, a batch of 8 pictures a step) teach it the
answer's form alone, a digit drawn uniformly from 1..max_shapes whatever the picture shows, then
its end of turn. Counts are uniform in 1..max_shapes too, so any answer that ignores the picture
earns 1/max_shapes on average (0.2): reward above that is read from the picture, which RL alone
teaches. Then the pipeline as a user runs it (producer, one generator on `--engine`, the trainer;
OS processes, a Redis of its own on a free port, everything in a temporary directory) on
`[task] name = "shapes"`: groups of 8 completions of at most 4 tokens at temperature 1, 8
prompts a step, lr 1e-3, until `--steps` steps or `--minutes`. Printed: the mean training reward
of each block of 10 steps, and the first and last 20 steps' means.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def warm_start(model_dir: Path, dst: Path, *, steps: int, max_shapes: int, seed: int = 0) -> Path:
    """`model_dir` fine-tuned for `steps` steps to answer each shapes prompt with a random digit in
    1..max_shapes and the end of turn (not the picture's count), saved at `dst` with its processor."""
    import torch

    from common.messages import PromptTask
    from common.vision import load_processor, pixel_inputs, prompt_ids
    from tasks import shapes
    from trainer.checkpoints import load_model

    processor = load_processor(model_dir)
    tok = processor.tokenizer
    model = load_model(model_dir).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    rng = random.Random(seed)
    options = shapes.Options(max_shapes=max_shapes)
    for step in range(steps):
        rows, labels, pictures = [], [], []
        for i in range(8):
            question, meta, images = shapes.make_prompt(options, seed=seed + 1, index=step * 8 + i)
            task = PromptTask(id="w", messages=[{"role": "user", "content": question}], text=None, meta=meta, n=1,
                              admitted_at=0, images=tuple(images))
            prompt = prompt_ids(processor, task)
            answer = tok.encode(str(rng.randint(1, max_shapes)), add_special_tokens=False) + [tok.eos_token_id]
            rows.append(prompt + answer)
            labels.append([-100] * len(prompt) + answer)
            pictures.append(tuple(images))
        width = max(map(len, rows))  # right-padded, the padding masked out
        mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
        ids = torch.tensor([row + [tok.eos_token_id] * (width - len(row)) for row in rows])
        targets = torch.tensor([row + [-100] * (width - len(row)) for row in labels])
        loss = model(input_ids=ids, attention_mask=mask, labels=targets, **pixel_inputs(processor, pictures)).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if step % 10 == 0 or step == steps - 1:
            print(f"warm start {step + 1}/{steps}: loss {loss.item():.3f}", flush=True)
    model.save_pretrained(dst, safe_serialization=True)
    processor.save_pretrained(dst)
    return dst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--engine", default="hf", choices=("hf", "vllm"))
    parser.add_argument("--warm-start", type=int, default=30, help="steps of SFT on the answer's form (0: none)")
    parser.add_argument("--max-shapes", type=int, default=5)
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    import redis

    from common.keys import Keys
    from common.localredis import free_port, start_redis
    from common.progress import read_trainer
    from common.tiny import build_tiny_model
    from ops.lib.configs import write_config
    from ops.lib.models import tiny_vlm
    from ops.lib.processes import spawn, stop_all

    with tempfile.TemporaryDirectory(prefix="vlm-shapes-") as name:
        tmp = Path(name)
        started = time.monotonic()
        model = tiny_vlm(build_tiny_model(tmp / "tiny"), tmp / "vlm")
        if args.warm_start:
            model = warm_start(model, tmp / "warm", steps=args.warm_start, max_shapes=args.max_shapes)
        print(f"model ready in {time.monotonic() - started:.0f} s", flush=True)
        port = free_port()
        server = start_redis(tmp / "redis", port)
        url = f"redis://127.0.0.1:{port}/0"
        env = write_config(tmp / "run.toml", run="vlm", redis_url=url, output_dir=tmp / "run", model=model,
                           task={"name": "shapes", "max_shapes": args.max_shapes},
                           rollout={"group_size": 8, "prompts_per_step": 8, "max_staleness": 1, "max_new_tokens": 4,
                                    "temperature": 1.0},
                           generator={"engine": args.engine, "batch_prompts": 4, "threads": 1},
                           trainer={"max_steps": args.steps, "lr": args.lr, "micro_batch_size": 16, "threads": 1,
                                    "keep_checkpoints": 2})
        procs = {}
        started = time.monotonic()
        try:
            for module in ("producers", "generators", "trainer"):
                procs[module] = spawn(module, *(("--id", "g1") if module == "generators" else ()), cwd=tmp, env=env,
                                      log=tmp / f"{module}.log")
            while time.monotonic() - started < args.minutes * 60 and procs["trainer"].poll() is None:
                for module, proc in procs.items():
                    if module != "trainer" and proc.poll() is not None:
                        raise SystemExit(f"{module} exited:\n{(tmp / f'{module}.log').read_text()[-3000:]}")
                time.sleep(5)
            steps = read_trainer(redis.Redis.from_url(url), Keys("vlm")).step
        finally:
            stop_all(procs.values())
            server.terminate()
            server.wait()
        rows = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines() if line]
        rewards = [row["reward"] for row in rows if "reward" in row]
        print(f"{steps} steps in {(time.monotonic() - started) / 60:.1f} min ({args.engine} engine, warm start "
              f"{args.warm_start} steps, lr {args.lr:g}); largest mismatch of tokens sampled by the trainer's own "
              f"weights {max((row['mismatch/by_staleness'].get('0', 0.0) for row in rows), default=0.0):.2e}")
        for i in range(0, len(rewards), 10):
            block = rewards[i:i + 10]
            print(f"steps {i + 1}-{i + len(block)}: mean reward {sum(block) / len(block):.3f}")
        first, last = rewards[:20], rewards[-20:]
        print(f"first {len(first)} steps {sum(first) / max(len(first), 1):.3f}, "
              f"last {len(last)} steps {sum(last) / max(len(last), 1):.3f}")


if __name__ == "__main__":
    main()
