"""trainer.compile on the CPU: the demo's trainer step with each transformer block compiled, against
the eager blocks, and what the compiling costs.

    .venv/bin/python ops/bench/compile_cpu.py [--model DIR] [--steps 12]

Two copies of `--model` (default: the built-in SmolLM2-135M-Instruct) in float32, one with
trainer/parallel.py `compile_each_block` (what `trainer.compile = true` does), each with the
trainer's AdamW, take `trainer.step.train_step` on the same groups of the demo's shapes (4 prompts
of 30-45 tokens, 4 completions of 4-24 each, the model's own behaviour log-probs; configs/demo.toml's
loss options), step by step in alternating order (the machine's load drifts). Prints each side's
step seconds, the median of the steps after the first four (by then the compiled side has built its
graphs: once for the first lengths, once more dynamic), and the seconds the compiled side spent
above the eager one in those first four: the compiling, cold (inductor's cache in a fresh
directory); with `--warm`, the machine's own cache (TORCHINDUCTOR_CACHE_DIR, else
/tmp/torchinductor_$USER), as a restarted trainer finds the graphs it compiled before.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

SETTLING = 4  # the steps the compiled side compiles in


def main() -> None:
    from common.config import GrpoLoss
    from common.messages import decode_group
    from common.models import default_model_dir
    from ops.bench.trainer_efficiency import PER_STEP, encoded_groups
    from trainer.checkpoints import adamw, load_model
    from trainer.parallel import compile_each_block
    from trainer.step import GrpoOptions, train_step

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: the built-in model)")
    ap.add_argument("--steps", type=int, default=12, help=f"steps a side, the first {SETTLING} compiling")
    ap.add_argument("--warm", action="store_true", help="inductor's cache as found (default: a fresh one)")
    args = ap.parse_args()
    cache = None if args.warm else tempfile.TemporaryDirectory(prefix="compile-cpu-")
    if cache is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache.name  # read when inductor first compiles
    assert args.steps > SETTLING, f"--steps must be above {SETTLING}: the first {SETTLING} compile"
    model_dir = args.model or default_model_dir()
    torch.manual_seed(0)
    groups = [decode_group(b) for b in encoded_groups(model_dir, PER_STEP * args.steps)]  # the demo's shapes
    how = GrpoOptions(loss=GrpoLoss(clip_high=0.28), temperature=0.8, estimator="grpo", overlong="none",
                      overlong_penalty=0.0, micro_batch_size=8, micro_batch_tokens=0, updates=1, max_grad_norm=1.0,
                      max_new_tokens=24)
    sides = {}
    for name in ("eager", "compiled"):
        model = load_model(model_dir)
        if name == "compiled":
            compile_each_block(model)
        sides[name] = (model, adamw(list(model.parameters()), lr=5e-6, weight_decay=0.0), [])
    for k in range(args.steps):
        for name in ("eager", "compiled") if k % 2 else ("compiled", "eager"):
            model, optimizer, seconds = sides[name]
            t0 = time.perf_counter()
            train_step(model, optimizer, groups[PER_STEP * k:PER_STEP * (k + 1)], how=how, step=k)
            seconds.append(time.perf_counter() - t0)
    medians = {name: statistics.median(s[SETTLING:]) for name, (_, _, s) in sides.items()}
    for name, (_, _, seconds) in sides.items():
        steps = " ".join(f"{s:.2f}" for s in seconds)
        print(f"{name:9s} {steps}   median after {SETTLING}: {medians[name]:.3f} s")
    eager, compiled = sides["eager"][2], sides["compiled"][2]
    print(f"compile_cpu: compiled/eager step {medians['compiled'] / medians['eager']:.2f}; compiling cost "
          f"{sum(compiled[:SETTLING]) - sum(eager[:SETTLING]):.1f} s over the first {SETTLING} steps; "
          f"{'warm' if args.warm else 'cold'} cache; {torch.get_num_threads()} threads, torch {torch.__version__}")


if __name__ == "__main__":
    main()
