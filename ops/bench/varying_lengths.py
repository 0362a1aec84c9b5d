"""The trainer's step, step by step, on groups whose lengths change from step to step as a run's do.

    python3 ops/bench/varying_lengths.py [--shape qwen2.5-0.5b] [--dtype float32] [--steps 6] \\
        [--attention sdpa flex_attention] [--out DIR]
    python3 ops/bench/varying_lengths.py --dry-run      # a tiny shape on the CPU (the default suite runs it)

`ops/bench/trainer_gpu.py` times steps of one fixed layout after untimed warm-up steps, so a cost
paid once per new shape (torch.compile's kernels: flex attention builds them for each sequence
length it meets, and for short queries takes another path) is hidden there. Here every step draws
new lengths (4 groups of 4 completions, prompts of 20-60 tokens, completions of 5-120, the demo's
scale), nothing is warmed up, and each step's seconds are printed as it ends: the first steps show
what a run pays before its steady state. Each `--attention` runs in turn on a fresh model of
`--shape` (trainer_gpu.py's shapes, random weights) placed as the trainer places it, with
configs/demo.toml's options, `--dtype` as model.dtype. `--max-seconds` stops between steps.
Writes varying_lengths.json under `--out`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench import trainer_gpu as tg  # noqa: E402 - the shapes, the model as the trainer places it

DEMO = ROOT / "configs" / "demo.toml"


def groups(step: int, *, vocab: int) -> list[Any]:
    """Step `step`'s groups: lengths drawn anew each step (seeded by the step)."""
    import numpy as np

    from common.messages import Completion, SampleGroup

    rng = np.random.default_rng(step)
    out = []
    for g in range(4):
        completions = []
        for i in range(4):
            n = int(rng.integers(5, 121))
            completions.append(Completion(ids=rng.integers(0, vocab, n, dtype=np.int64),
                                          logprobs=-rng.uniform(0.5, 6.0, n).astype(np.float32),
                                          reward=float(i % 2 == 0), rewards={}, finish="stop", text=""))
        prompt = rng.integers(0, vocab, int(rng.integers(20, 61)), dtype=np.int64)
        out.append(SampleGroup(id=f"vary:{step}:{g}", prompt_id=f"vary:{step}:{g}", version=0, generator="bench",
                               engine="hf", prompt_ids=prompt, completions=completions))
    return out


def run(attention: str, *, shape: str, dtype: str, steps: int, deadline: float, device: Any) -> dict:
    """One attention's steps: {attention, seconds (one a step), losses, stopped (by the deadline)}."""
    import torch

    from common.config import load_config
    from trainer.checkpoints import adamw
    from trainer.devices import DTYPES, Placement
    from trainer.step import GrpoOptions, train_step

    config = load_config(DEMO, env={}, overrides={"trainer": {"attention": attention}, "model": {"dtype": dtype}})
    cfg = config.trainer
    where = Placement(device=device, dtype=DTYPES[dtype], master_fp32=cfg.master_fp32,
                      activation_checkpointing=cfg.activation_checkpointing is True,  # "auto" taken as off here
                      attention=cfg.attention)
    torch.manual_seed(0)
    model = tg.build_model(tg.SHAPES[shape], where)
    how = GrpoOptions.of(cfg, config.rollout)
    optimizer = adamw([p for p in model.parameters() if p.requires_grad], lr=cfg.lr, weight_decay=cfg.weight_decay)
    out: dict = {"attention": attention, "implementation": model.config._attn_implementation, "seconds": [],
                 "losses": [], "stopped": False}
    for step in range(steps):
        if time.monotonic() > deadline:
            out["stopped"] = True
            break
        batch = groups(step, vocab=tg.SHAPES[shape].vocab)
        t = time.monotonic()
        stats = train_step(model, optimizer, batch, how=how, step=step)
        if device.type == "cuda":
            torch.cuda.synchronize()
        out["seconds"].append(time.monotonic() - t)
        out["losses"].append(stats.loss)
        print(f"varying_lengths: {attention} ({out['implementation']}), {dtype}, step {step}: "
              f"{out['seconds'][-1]:.2f} s", flush=True)
    del model, optimizer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="varying_lengths.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny-qwen2 on the CPU, sdpa: the plumbing, no figures")
    p.add_argument("--shape", choices=sorted(tg.SHAPES), default="qwen2.5-0.5b")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="model.dtype (the demo's: float32)")
    p.add_argument("--attention", nargs="+", choices=["sdpa", "flex_attention", "varlen"], default=None,
                   help="default: sdpa, varlen and flex_attention on CUDA, sdpa elsewhere")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--max-seconds", type=float, default=150.0)
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "varying_lengths")
    args = p.parse_args(argv)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if args.dry_run:
        args.shape, args.steps = "tiny-qwen2", min(args.steps, 3)
    attentions = args.attention or (["sdpa", "varlen", "flex_attention"] if device.type == "cuda" else ["sdpa"])
    deadline = time.monotonic() + args.max_seconds
    runs = [run(a, shape=args.shape, dtype=args.dtype, steps=args.steps, deadline=deadline, device=device)
            for a in attentions]
    args.out.mkdir(parents=True, exist_ok=True)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    data = {"device": device_name, "torch": torch.__version__, "shape": args.shape, "dtype": args.dtype, "runs": runs}
    (args.out / "varying_lengths.json").write_text(json.dumps(data, indent=1))
    for r in runs:
        print(f"varying_lengths: {r['attention']}: " + ", ".join(f"{s:.2f}" for s in r["seconds"]) + " s a step"
              + (" (stopped by --max-seconds)" if r["stopped"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
