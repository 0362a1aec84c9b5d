"""What a trainer-state save costs the step: in it, and beside the next step.

    .venv/bin/python ops/bench/state_save.py [--model DIR] [--saves 4]

The model (default: the built-in one) in float32 with AdamW's moments, one torch thread, saved
`--saves` times each way into a temporary directory: in the step (`trainer.state.save_state`:
dcp's write, fsynced, then the rename), and as a save beside the next step takes it
(trainer.publish_in_background): the step's share (`begin_state` and `staged`, the copy into the
host buffer the first save makes and the others reuse) and the writer thread's `write_state`.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, help="a checkpoint directory (default: the built-in model)")
    ap.add_argument("--saves", type=int, default=4)
    args = ap.parse_args()

    import torch
    from transformers import AutoModelForCausalLM

    from common.models import prepare_default_model
    from trainer.schedule import build_scheduler
    from trainer.state import begin_state, save_state, staged, write_state

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(args.model or prepare_default_model(), dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()  # AdamW's moments exist
    sched = build_scheduler(opt, schedule="constant", warmup_steps=0, total_steps=0)
    root, buffer = Path(tempfile.mkdtemp(prefix="rollouts-state-")), None
    try:
        for n in range(1, args.saves + 1):
            t = time.monotonic()
            save_state(model, opt, sched, step=n, state_root=root, keep=2)
            in_step = time.monotonic() - t
            t = time.monotonic()
            state, tmp = begin_state(model, opt, sched, step=1000 + n, state_root=root)
            state, buffer = staged(state, buffer, cuda=False)
            share = time.monotonic() - t
            t = time.monotonic()
            write_state(state, tmp=tmp, step=1000 + n, state_root=root, keep=2)
            written = time.monotonic() - t
            size = sum(f.stat().st_size for f in (root / f"step_{1000 + n}").iterdir()) / 2**20
            print(f"save {n}: in the step {in_step:.2f} s | beside: the step's share {share:.2f} s, the writer "
                  f"thread's write {written:.2f} s | {size:.0f} MiB", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
