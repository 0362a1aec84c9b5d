"""Operators a step dispatches, the trainer's and the bare loop's, counted on the CPU.

    python3 ops/bench/dispatches.py [--out DIR]        # gsm8k's step, 24 narrow layers: a few minutes
    python3 ops/bench/dispatches.py --dry-run          # tiny shapes (the default suite runs it)

On a GPU a small model's step is paced by its host launching kernels, not by the kernels: the
2026-11-29 H200 sitting (docs/gpu.md) found configs/gsm8k.toml's step 43 % busy, the bare loop's 38 %,
and the bare loop twice as fast with half as many micro-batches (2026-11-27: 27,416 -> 56,296
tokens/s from 8-row to 16-row micro-batches). Each ATen operator a step dispatches is at least one
pass through PyTorch's dispatcher on the host, and most are a kernel launch on a GPU; their count
depends on the model's layers, the micro-batching and the code, not on the widths, the vocabulary or
the device, so a CPU counts what a GPU's host would run. This script counts them
(`TorchDispatchMode`: every operator below autograd and autocast, in the forward, the backward and
the optimizer) for one step of each side of ops/bench/trainer_gpu.py (`train_step` with
configs/gsm8k.toml's options, the bare loop's forward, cross-entropy, backward and AdamW) on gsm8k's
layout (8 groups of 8 completions, rows of 512: the bench's `grpo512`), for the micro-batch
settings listed, on Qwen2.5-0.5B's 24 layers at narrow widths and a 4,096-token vocabulary (a
step a CPU takes in seconds; the counts are those of the real 151,936 tokens, which only make each
operator larger: at the dry run's layout they are equal, operator for operator). It also counts
the model's passes (its decoder's forward calls: each micro-batch's, and any pass without
gradients; checkpointing recomputes each block inside the backward, not the decoder's call).

The attention is the CPU's (`sdpa`); on a GPU the trainer's varlen attention replaces one operator
with another per layer and pass, so the counts stand within a few per cent.

Writes DIR/dispatches.json and DIR/dispatches.md and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.bench import trainer_gpu as bench  # noqa: E402

# Qwen2.5-0.5B's 24 layers and grouped heads, 64 wide, 4,096 tokens: the same operators a step, cheaply
NARROW = bench.Shape("qwen2", hidden=64, layers=24, heads=4, kv_heads=2, head_dim=16, intermediate=128,
                     vocab=4096, tied=True)
TINY = bench.SHAPES["tiny-qwen2"]


@dataclass(frozen=True)
class Row:
    """One micro-batch setting of the trainer (trainer.micro_batch_size, micro_batch_tokens,
    activation_checkpointing), the bare loop given the same."""

    label: str
    mb_size: int
    mb_tokens: int
    ac: bool


def default_rows(*, dry_run: bool) -> list[Row]:
    if dry_run:
        return [Row("8-row micro-batches", 4, 128, ac=True), Row("the same, checkpointing off", 4, 128, ac=False),
                Row("uncapped, 256 tokens", bench.UNCAPPED, 256, ac=False)]
    shipped = bench.SHIPPED
    return [Row("2026-11-27's: 8 completions, 8,192 tokens, checkpointing on", 8, 8192, ac=True),
            Row("2026-11-29's: the same, checkpointing off (an H200's auto)", 8, 8192, ac=False),
            Row("64 completions, 8,192 tokens, checkpointing off", 64, 8192, ac=False),
            Row(f"configs/gsm8k.toml's: {shipped['micro_batch_size']} completions, "
                f"{shipped['micro_batch_tokens']:,} tokens, checkpointing off",
                shipped["micro_batch_size"], shipped["micro_batch_tokens"], ac=False)]


class Counter:
    """Operators dispatched while entered (a TorchDispatchMode made on entry: torch is imported late)."""

    def __init__(self) -> None:
        self.ops: collections.Counter[str] = collections.Counter()

    def __enter__(self) -> Counter:
        from torch.utils._python_dispatch import TorchDispatchMode

        ops = self.ops

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                ops[str(func.overloadpacket)] += 1
                return func(*args, **(kwargs or {}))

        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)

    @property
    def total(self) -> int:
        return sum(self.ops.values())


def passes_of(model: Any) -> list[int]:
    """A one-item list counting the decoder's forward calls from now on."""
    calls = [0]

    def hook(*_: Any) -> None:
        calls[0] += 1

    model.get_decoder().register_forward_pre_hook(hook)
    return calls


def count_row(row: Row, *, shape: bench.Shape, layout: bench.Layout) -> dict:
    """One row: each side's operators and passes in a step, after one step not counted."""
    import torch

    from common.config import load_config
    from trainer.checkpoints import adamw
    from trainer.devices import DTYPES, Placement
    from trainer.step import GrpoOptions, train_step

    config = load_config(bench.GSM8K, env={}, overrides={"trainer": {
        "activation_checkpointing": row.ac, "micro_batch_tokens": row.mb_tokens, "micro_batch_size": row.mb_size}})
    cfg = config.trainer
    where = Placement(device=torch.device("cpu"), dtype=DTYPES[config.model.dtype], master_fp32=cfg.master_fp32,
                      activation_checkpointing=cfg.activation_checkpointing, attention=cfg.attention)
    model = bench.build_model(shape, where)
    groups = bench.synthetic_groups(layout, vocab=shape.vocab)
    how = GrpoOptions.of(cfg, config.rollout)
    trained = [p for p in model.parameters() if p.requires_grad]
    passes = passes_of(model)
    out: dict[str, Any] = {"row": asdict(row), "attention": model.config._attn_implementation}
    sides = {"trainer": lambda opt: train_step(model, opt, groups, how=how, step=0),
             "bare": lambda opt: bench.bare_step(model, opt, bench.bare_batches(
                 groups, mb_tokens=row.mb_tokens, mb_size=row.mb_size, device=torch.device("cpu")))}
    for side, step in sides.items():
        optimizer = adamw(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
        step(optimizer)  # AdamW's state made, the allocator warm
        passes[0] = 0
        started = time.perf_counter()
        with Counter() as counted:
            step(optimizer)
        out[side] = {"ops": counted.total, "passes": passes[0], "seconds": time.perf_counter() - started,
                     "top": counted.ops.most_common(12)}
    out["bare"]["micro_batches"] = len(bench.bare_batches(groups, mb_tokens=row.mb_tokens, mb_size=row.mb_size,
                                                          device=torch.device("cpu")))
    return out


HEADER = ("| micro-batches | trainer passes | trainer ops a step | bare micro-batches | bare ops a step |\n"
          "|---|---|---|---|---|")


def table(results: list[dict]) -> str:
    lines = [HEADER]
    for r in results:
        t, b = r["trainer"], r["bare"]
        lines.append(f"| {r['row']['label']} | {t['passes']} | {t['ops']:,} | {b['micro_batches']} | {b['ops']:,} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="dispatches.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes: the plumbing, in seconds")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "dispatches", help="where the JSON and table go")
    args = p.parse_args(argv)
    import torch

    torch.manual_seed(0)
    shape, layout = (TINY, bench.LAYOUTS["grpo-tiny"]) if args.dry_run else (NARROW, bench.LAYOUTS["grpo512"])
    results = []
    for row in default_rows(dry_run=args.dry_run):
        results.append(count_row(row, shape=shape, layout=layout))
        print(f"{row.label}: trainer {results[-1]['trainer']['ops']:,} ops in {results[-1]['trainer']['passes']} "
              f"passes, bare {results[-1]['bare']['ops']:,}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "dispatches.json").write_text(json.dumps(
        {"shape": asdict(shape), "layout": asdict(layout), "torch": torch.__version__, "rows": results}, indent=1))
    (args.out / "dispatches.md").write_text(table(results) + "\n")
    print(table(results))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
