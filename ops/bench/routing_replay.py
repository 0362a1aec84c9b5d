"""The train-inference mismatch of a mixture-of-experts model with routing replay and without it.

    .venv/bin/python ops/bench/routing_replay.py [--prompts 8] [--rows fp32 bf16 ties routers stale]

The model is the tests' tiny random Qwen3-MoE (ops/lib/models.py `tiny_moe`: 2 layers, each
routing every token to 2 of 4 experts). Each row runs `rollouts check` on the arithmetic task with
the HF engine (the engine that records the routed experts), 4 completions of at most 32 tokens a
prompt at temperature 1, and reads its `routing` line: the mean |log pi_trainer - log pi_behaviour|
over the sampled tokens with the experts that sampled them replayed in the trainer's forward, and
with the trainer routing itself, and at how many (position, MoE layer) pairs the trainer's own
top-k differs from the recorded one. The rows:

- fp32:    the engine samples with the trainer's weights, both in float32;
- bf16:    the same in bfloat16 (engine and trainer);
- ties:    routers drawn at transformers' init (std 0.02: router logits near ties), bfloat16;
- routers: the engine's routers perturbed (noise of 0.2 x their std: N(0, 0.1) on std 0.5), float32;
- stale:   every engine weight perturbed by noise of 0.02 x its tensor's std (a stale generator), float32.

Everything in a temporary directory; prints a markdown table and each row's routing line.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

ROWS = {
    "fp32": "the trainer's weights, float32",
    "bf16": "the trainer's weights, bfloat16 (engine and trainer)",
    "ties": "routers near ties (drawn N(0, 0.02)), bfloat16",
    "routers": "the engine's routers perturbed (`--engine-model`: N(0, 0.1) added to router weights of std 0.5)",
    "stale": "every engine weight perturbed by 2% of its tensor's std (`--engine-model`: a stale generator)",
}
ROUTING = re.compile(r"mean \|log-ratio\| (\S+) with routing replay, (\S+) without .* replaced at (\d+) of (\d+) ")


def moved(src: Path, dst: Path, *, seed: int, scale: float, routers_only: bool) -> Path:
    """`src` with noise of `scale` times each tensor's std added to its router weights
    (`routers_only`) or to every weight."""
    import shutil

    import torch

    from common.routing import routers
    from trainer.checkpoints import load_model

    model = load_model(src)
    g = torch.Generator().manual_seed(seed)
    params = [m.weight for m in routers(model)] if routers_only else list(model.parameters())
    with torch.no_grad():
        for p in params:
            p.add_(scale * p.std() * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst, safe_serialization=True)
    for f in src.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, dst / f.name)
    return dst


def check(model: Path, *, dtype: str, prompts: int, engine_model: Path | None, cwd: Path) -> str:
    """`rollouts check`'s routing line for the tiny MoE at `dtype`, its engine on `engine_model`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_") or k == "ROLLOUTS_CACHE"}
    args = [sys.executable, "-m", "common.cli", "check", "--prompts", str(prompts), "--model.path", str(model),
            "--model.dtype", dtype, "--task.name", "arithmetic", "--generator.engine", "hf",
            "--generator.routing_replay", "--rollout.group_size", "4", "--rollout.max_new_tokens", "32",
            "--output_dir", str(cwd / "out")]
    if engine_model is not None:
        args += ["--engine-model", str(engine_model)]
    done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    line = next((x for x in done.stdout.splitlines() if x.startswith("routing ")), None)
    if done.returncode != 0 or line is None:
        raise SystemExit(f"rollouts check failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=8, help="prompts each check samples")
    ap.add_argument("--rows", nargs="+", choices=list(ROWS), default=list(ROWS))
    args = ap.parse_args()

    from common.tiny import build_tiny_model
    from ops.lib.models import tiny_moe

    with tempfile.TemporaryDirectory(prefix="routing-replay-") as tmp:
        tmp = Path(tmp)
        dense = build_tiny_model(tmp / "dense")
        moe = tiny_moe(dense, tmp / "moe")
        setups = {
            "fp32": lambda: (moe, "float32", None),
            "bf16": lambda: (moe, "bfloat16", None),
            "ties": lambda: (tiny_moe(dense, tmp / "ties", router_std=0.02), "bfloat16", None),
            "routers": lambda: (moe, "float32", moved(moe, tmp / "routers", seed=1, scale=0.2, routers_only=True)),
            "stale": lambda: (moe, "float32", moved(moe, tmp / "stale", seed=1, scale=0.02, routers_only=False)),
        }
        rows = []
        for name in args.rows:
            model, dtype, engine_model = setups[name]()
            line = check(model, dtype=dtype, prompts=args.prompts, engine_model=engine_model, cwd=tmp)
            print(f"{name}: {line}", flush=True)
            found = ROUTING.search(line)
            rows.append(f"| {ROWS[name]} | {float(found[1]):.2e} | {float(found[2]):.2e} | {found[3]} of {found[4]} |")
    print("\n| sampler | with replay | without | experts replaced |\n| --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
