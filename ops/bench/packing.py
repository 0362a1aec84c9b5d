"""Positions through the model / the sequences' own positions, on the demo and gsm8k shapes.

    .venv/bin/python ops/bench/packing.py [--tree DIR]

`--tree` imports `trainer` from another checkout (e.g. `git archive HEAD | tar -x -C /tmp/old`)
to measure the code before a change. The groups are synthetic, seeded, of each config's shapes:

    demo:  4 prompts x 4 completions a step, prompts of 30-45 tokens, completions of 4-24
           (configs/demo.toml: micro_batch_size 8, no token cap; SmolLM2-135M, hidden 576);
    gsm8k: 32 prompts x 8 completions, prompts of 100-300 tokens, completions of 50-512, one in
           eight cut at 512 (configs/gsm8k.toml: micro_batch_size 8, micro_batch_tokens 8192;
           Qwen2.5-0.5B, hidden 896).

For each, with trainer.share_prompts on (the default) and off: the positions the model body runs
(the packed or padded input's size), the sequences' own positions (each row's prompt + completion
- 1, a shared prompt once: what a pass must compute), their ratio, and micro-batches per step.
No model runs: this is the batching alone.

    .venv/bin/python ops/bench/packing.py --time MODEL_DIR [--tree DIR] [--steps 6]

instead times `train_step` (one thread, the demo's loss options, AdamW) on demo-shaped groups
(4 steps' worth, cycled) with the model in MODEL_DIR (the default model: SmolLM2-135M-Instruct),
after one warm-up step: seconds and CPU seconds a step, median. Run it once per tree, in turns.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

SHAPES = {  # name: (prompts, group size, prompt lengths, completion lengths, cut share, mbs, mbt, hidden)
    "demo": (4, 4, (30, 45), (4, 24), 0.0, 8, 0, 576),
    "gsm8k": (32, 8, (100, 300), (50, 512), 1 / 8, 8, 8192, 896),
}


def groups_of(name: str, seed: int = 0) -> list:
    from common.messages import Completion, SampleGroup

    prompts, size, (p0, p1), (c0, c1), cut, *_ = SHAPES[name]
    rng = random.Random(seed)
    out = []
    for g in range(prompts):
        prompt = [rng.randrange(1000) for _ in range(rng.randint(p0, p1))]
        completions = []
        for i in range(size):
            n = c1 if rng.random() < cut else rng.randint(c0, c1)
            reward = float(rng.random() < 0.5 if i else 1.0)  # no group scores alike: all rows trained
            completions.append(Completion(ids=[rng.randrange(1000) for _ in range(n)], logprobs=[-1.0] * n,
                                          reward=reward, rewards={}, finish="length" if n == c1 else "stop", text=""))
        out.append(SampleGroup(id=f"g{g}", prompt_id=f"g{g}", prompt_ids=prompt, version=0, generator="bench",
                               engine="hf", completions=completions))
    return out


def measure(name: str, share: bool) -> tuple[int, int, int, int]:
    """(positions through the model, sequence positions, row positions, micro-batches)."""
    from trainer.batch import micro_batches

    *_, mbs, mbt, hidden = SHAPES[name]
    groups = groups_of(name)
    batches, _, _ = micro_batches(groups, micro_batch_size=mbs, micro_batch_tokens=mbt, share_prompts=share,
                                  hidden_size=hidden)
    through = sum(mb.input_ids.numel() if mb.packed is None else mb.packed.ids.numel() for mb in batches)
    own = sum(int(mb.attention_mask.sum()) if mb.packed is None else int((mb.packed.segments >= 0).sum())
              for mb in batches)
    rows = sum(len(g.prompt_ids) + len(c.ids) - 1 for g in groups for c in g.completions)
    return through, own, rows, len(batches)


def time_steps(model_dir: Path, steps: int) -> None:
    import statistics
    import time

    import torch

    import trainer.batch
    from common.config import GrpoLoss
    from trainer.loading import load_model
    from trainer.step import GrpoOptions, train_step

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = load_model(model_dir)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    batches = [groups_of("demo", seed=k) for k in range(4)]
    how = GrpoOptions(loss=GrpoLoss(clip_high=0.28), estimator="grpo", overlong="none", overlong_penalty=0.0,
                      micro_batch_size=8, micro_batch_tokens=0, updates=1, max_grad_norm=1.0, temperature=0.8,
                      max_new_tokens=24)
    wall, cpu = [], []
    for k in range(steps + 1):
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(model, optimizer, batches[k % len(batches)], how=how)
        if k:  # the first: a warm-up (AdamW allocates its state)
            wall.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
    print(f"{trainer.batch.__file__}: step {statistics.median(wall):.3f} s, {statistics.median(cpu):.3f} CPU s "
          f"(median of {steps})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the checkout whose trainer is measured")
    parser.add_argument("--time", type=Path, help="time train_step with the model in this directory")
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    if args.time:
        return time_steps(args.time, args.steps)
    import trainer.batch


    print(f"tree {args.tree} (trainer.batch from {trainer.batch.__file__})")
    print(f"{'shapes':6} {'share_prompts':13} {'through':>8} {'sequences':>9} {'ratio':>6} {'rows':>7} "
          f"{'micro-batches':>13}")
    for name in SHAPES:
        for share in (True, False):
            through, own, rows, n = measure(name, share)
            print(f"{name:6} {str(share):13} {through:8d} {own:9d} {through / own:6.2f} {rows:7d} {n:13d}")


if __name__ == "__main__":
    main()
