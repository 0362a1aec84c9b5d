"""One trainer rank loading a checkpoint as the trainer does (`placed`) or as it did before
trainer/loading.py (`whole`: the whole model on the host, then placed), saying what it cost:

    torchrun --nproc-per-node N -m tests.harness.load_rank CHECKPOINT placed|whole OUT_DIR WARM_UP_MODEL

Each rank writes OUT_DIR/rank{R}.json: the peak growth of its anonymous resident memory (sampled
every 2 ms from /proc/self/status; file-backed pages of a memory-mapped checkpoint are the page
cache's, shared by the host's ranks) and of its whole resident set (ru_maxrss). Rank 0 also writes
OUT_DIR/weights.json: the model's full state dict against the checkpoint's tensors (in the
model's dtype), name by name. WARM_UP_MODEL, a small model of the same kind, is loaded first, so
that what the modules that loading imports cost is not counted.
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
from pathlib import Path

import torch

from trainer import loading
from trainer.devices import Placement, trainer_device
from trainer.parallel import finish, full_state_dict, init_distributed, is_main, parallelize


def anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon")


def main() -> None:
    path, how, out, warm = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    init_distributed()
    device = trainer_device()
    where = Placement(device=device, dtype=torch.float32, master_fp32=True)
    loading.placed_model(warm, where)  # the code paths once, on a small model
    loading.load_model(warm, torch.float32)
    base_anon, base_rss = anon_bytes(), resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak, done = {"anon": base_anon}, threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak["anon"] = max(peak["anon"], anon_bytes())
            done.wait(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    if how == "whole":
        model = parallelize(loading.load_model(path, where.weights_dtype), device=device)
    else:
        model = loading.placed_model(path, where)
    done.set()
    sampler.join()
    peak["anon"] = max(peak["anon"], anon_bytes())
    rss = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_rss) * 1024
    out.mkdir(parents=True, exist_ok=True)
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    cuda = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
    (out / f"rank{rank}.json").write_text(json.dumps({"anon": peak["anon"] - base_anon, "rss": rss, "cuda": cuda}))
    full = full_state_dict(model) or {k: v.detach().cpu() for k, v in model.state_dict().items()}
    if is_main():
        from safetensors.torch import load_file

        want = load_file(path / "model.safetensors")
        same = {k: bool(k in full and torch.equal(v.to(torch.float32), full[k].cpu())) for k, v in want.items()}
        (out / "weights.json").write_text(json.dumps({"same": same, "model": sorted(full)}))
    finish()  # as the trainer does: a rank leaving with the group still open can abort in gloo's threads
    # Everything this rank reports is written. Leave without the interpreter's teardown: gloo's threads
    # can still abort the process at exit after the group is destroyed ("terminate called without an
    # active exception", seen once in a fresh-clone run with another test beside it).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
