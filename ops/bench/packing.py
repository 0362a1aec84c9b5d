"""Positions through the model / the sequences' own positions, on the demo and gsm8k shapes.

    .venv/bin/python ops/bench/packing.py [--tree DIR]

`--tree` imports `trainer` from another checkout (e.g. `git archive HEAD | tar -x -C /tmp/old`)
to measure the code before a change. The groups are synthetic, seeded, of each config's shapes:

    demo:  4 prompts x 4 completions a step, prompts of 30-45 tokens, completions of 4-24
           (configs/demo.toml: micro_batch_size 8, no token cap; SmolLM2-135M, hidden 576);
    gsm8k: 32 prompts x 8 completions, prompts of 100-300 tokens, completions of 50-512, one in
           eight cut at 512 (configs/gsm8k.toml until 2026-11-29: micro_batch_size 8, micro_batch_tokens 8192;
           Qwen2.5-0.5B, hidden 896); gsm8k-mbs64 the same with micro_batch_size 64, where the
           token budget binds instead (micro-batches of ~8k tokens, not ~2.8k).

For each, with trainer.share_prompts on (the default) and off: the positions the model body runs
(the packed or padded input's size, padding included), the sequences' own positions (each row's
prompt + completion - 1, a shared prompt once: what a pass must compute), their ratio, the
(query, key) pairs an attention with a dense mask computes (SDPA's: every pair of a row, the
trainer's `trainer.attention` on the CPU; the packed rows as the trainer lays them out for it),
the pairs varlen attention computes (`trainer.attention = "varlen"`, the default on a GPU in
bf16: one packed row a micro-batch, each document's causal pairs, a shared prompt's further
completions over the prompt and themselves; trainer/varlen.py), and micro-batches per step. No
model runs: this is the batching alone.

    .venv/bin/python ops/bench/packing.py --time MODEL_DIR [--tree DIR] [--steps 6]

instead times `train_step` (one thread, the demo's loss options, AdamW) on demo-shaped groups
(4 steps' worth, cycled) with the model in MODEL_DIR (the default model: SmolLM2-135M-Instruct),
after one warm-up step: seconds and CPU seconds a step, median. Run it once per tree, in turns.

    .venv/bin/python ops/bench/packing.py --rows 2 [--steps 2]

times `train_step` on gsm8k's shapes, a model of Qwen2.5-0.5B's width with 2 layers, SDPA:
each micro-batch's documents in one packed row against the rows laid out for a dense mask
(trainer/batch.py `packed_rows`), in turns (`time_rows`).

    .venv/bin/python ops/bench/packing.py --layout 64 300 600 [--tree DIR]

times the layout itself (`packed_rows`, hidden 896) on one micro-batch of that many documents of
50-300 positions (short SFT documents under a GPU's token budget), best of 3.
"""

from __future__ import annotations

import argparse
import random
import sys
from dataclasses import replace
from pathlib import Path

SHAPES = {  # name: (prompts, group size, prompt lengths, completion lengths, cut share, mbs, mbt, hidden)
    "demo": (4, 4, (30, 45), (4, 24), 0.0, 8, 0, 576),
    "gsm8k": (32, 8, (100, 300), (50, 512), 1 / 8, 8, 8192, 896),
    "gsm8k-mbs64": (32, 8, (100, 300), (50, 512), 1 / 8, 64, 8192, 896),
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


def measure(name: str, share: bool) -> tuple[int, int, int, int, int, int | None]:
    """(positions through the model, sequence positions, row positions, a dense mask's pairs,
    micro-batches, varlen's pairs), the packed rows as the trainer lays them out for SDPA
    (`dense_rows`, where the tree has it); varlen's None in a tree without it."""
    from trainer.batch import micro_batches

    *_, mbs, mbt, hidden = SHAPES[name]
    groups = groups_of(name)
    how = dict(micro_batch_size=mbs, micro_batch_tokens=mbt, share_prompts=share, hidden_size=hidden)
    try:
        batches, _, _ = micro_batches(groups, **how, dense_rows=True)
    except TypeError:  # a tree from before packed rows: one row a micro-batch
        batches, _, _ = micro_batches(groups, **how)
    inputs = [mb.input_ids if mb.packed is None else mb.packed.ids for mb in batches]
    through = sum(x.numel() for x in inputs)
    pairs = sum(x.shape[0] * x.shape[1] ** 2 for x in inputs)
    own = sum(int(mb.attention_mask.sum()) if mb.packed is None else int((mb.packed.segments >= 0).sum())
              for mb in batches)
    rows = sum(len(g.prompt_ids) + len(c.ids) - 1 for g in groups for c in g.completions)
    return through, own, rows, pairs, len(batches), varlen_pairs(groups, how)


def varlen_pairs(groups: list, how: dict) -> int | None:
    """The (query, key) pairs varlen attention computes over the step's micro-batches laid out for
    it (one packed row each): a sequence of n queries over m keys, end-aligned causal, n m - n (n - 1) / 2."""
    try:
        from trainer.varlen import layout
    except ImportError:
        return None
    from trainer.batch import micro_batches

    batches, _, _ = micro_batches(groups, **how, dense_rows=False)
    total = 0
    for mb in batches:
        v = layout(mb.packed.docs.numpy(), mb.packed.segments.numpy())
        n, m = (v.cu_q[1:] - v.cu_q[:-1]).long(), (v.cu_k[1:] - v.cu_k[:-1]).long()
        total += int((n * m - n * (n - 1) // 2).sum())
    return total


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


def time_rows(layers: int, steps: int) -> None:
    """`train_step` on gsm8k-shaped groups (4 prompts x 8 completions, prompts of 192 tokens,
    completions of 321: ops/bench/trainer_gpu.py's grpo512) on a random model of Qwen2.5-0.5B's
    width (hidden 896, 14 heads, 2 KV heads, intermediate 4864) with `layers` layers and a 2,048-token
    vocabulary (the body's cost, not the head's), float32, SDPA, two threads, micro-batches of up to
    8,192 packed tokens (micro_batch_size uncapped): each micro-batch's documents in one packed row
    against in the rows `packed_rows` lays out for a dense mask, in turns, after a warm-up step each."""
    import statistics
    import time

    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    import trainer.batch
    from common.config import GrpoLoss
    from trainer.step import GrpoOptions, train_step

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from trainer_gpu import LAYOUTS, synthetic_groups

    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = Qwen2Config(hidden_size=896, num_hidden_layers=layers, num_attention_heads=14, num_key_value_heads=2,
                         intermediate_size=4864, vocab_size=2048, max_position_embeddings=4096,
                         tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    groups = synthetic_groups(replace(LAYOUTS["grpo512"], groups=4), vocab=2048)
    how = GrpoOptions(loss=GrpoLoss(), temperature=1.0, estimator="grpo", overlong="none", overlong_penalty=0.0,
                      micro_batch_size=4096, micro_batch_tokens=8192, updates=1, max_grad_norm=1.0)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    laid_out = trainer.batch.packed_rows
    for side in ("one row", "rows", "one row", "rows"):
        shapes: list[tuple[int, int]] = []

        def rows(sizes: list[int], hidden_size: int = 0, one: bool = side == "one row",
                 shapes: list[tuple[int, int]] = shapes) -> list[tuple[int, int]]:
            placed = laid_out(sizes, 0 if one else hidden_size)
            shapes.append((1 + max(r for r, _ in placed), max(o + n for (_, o), n in zip(placed, sizes, strict=True))))
            return placed

        trainer.batch.packed_rows = rows
        train_step(model, optimizer, groups, how=how)  # a warm-up
        seconds = []
        for _ in range(steps):
            start = time.perf_counter()
            stats = train_step(model, optimizer, groups, how=how)
            seconds.append(time.perf_counter() - start)
        last = shapes[-len(shapes) // (steps + 1):]  # the last step's micro-batches
        print(f"{side:8} step {statistics.median(seconds):6.2f} s (median of {steps}), {stats.tokens_forward} "
              f"sequence positions, micro-batches (rows x length) {last}", flush=True)
    trainer.batch.packed_rows = laid_out


def time_layout(counts: list[int]) -> None:
    import time

    from trainer.batch import packed_rows

    rng = random.Random(0)
    for n in counts:
        sizes = [rng.randint(50, 300) for _ in range(n)]
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            placed = packed_rows(sizes, 896)
            best = min(best, time.perf_counter() - start)
        print(f"{n:5d} documents, {sum(sizes):7d} positions: {1 + max(r for r, _ in placed):3d} rows, "
              f"laid out in {best:.3f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parents[2],
                        help="the checkout whose trainer is measured")
    parser.add_argument("--time", type=Path, help="time train_step with the model in this directory")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rows", type=int, metavar="LAYERS",
                        help="time train_step on gsm8k's shapes with one packed row against packed rows, "
                             "on a model of Qwen2.5-0.5B's width with this many layers")
    parser.add_argument("--layout", type=int, nargs="+", metavar="DOCUMENTS",
                        help="time packed_rows on one micro-batch of this many documents (each count given)")
    args = parser.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    if args.layout:
        return time_layout(args.layout)
    if args.rows:
        return time_rows(args.rows, args.steps)
    if args.time:
        return time_steps(args.time, args.steps)
    import trainer.batch


    print(f"tree {args.tree} (trainer.batch from {trainer.batch.__file__})")
    print(f"{'shapes':10} {'share_prompts':13} {'through':>8} {'sequences':>9} {'ratio':>6} {'rows':>7} "
          f"{'pairs (M)':>9} {'micro-batches':>13} {'varlen pairs (M)':>16}")
    for name in SHAPES:
        for share in (True, False):
            through, own, rows, pairs, n, vpairs = measure(name, share)
            print(f"{name:10} {str(share):13} {through:8d} {own:9d} {through / own:6.2f} {rows:7d} "
                  f"{pairs / 1e6:9.1f} {n:13d} {'-' if vpairs is None else f'{vpairs / 1e6:.1f}':>16}")


if __name__ == "__main__":
    main()
