"""One trainer rank loading a checkpoint as the trainer does (`placed`) or as it did before
trainer/loading.py (`whole`: the whole model on the host, then placed), saying what it cost; with
LoRA adapters (rank 8 on q, k, v, o) likewise (`lora`: trainer/checkpoints.py `adapted_model`;
`lora-whole`: the whole base model on the host, adapted, then placed), their initial values drawn
from torch seed 1234, or those of the published adapter in ADAPTER_DIR:

    torchrun --nproc-per-node N -m tests.harness.load_rank CHECKPOINT placed|whole|lora|lora-whole OUT_DIR \
        WARM_UP_MODEL [ADAPTER_DIR]

Each rank writes OUT_DIR/rank{R}.json: the peak growth of its anonymous resident memory (sampled
every 2 ms from /proc/self/status; file-backed pages of a memory-mapped checkpoint are the page
cache's, shared by the host's ranks) and of its whole resident set (ru_maxrss). Rank 0 also writes
OUT_DIR/weights.json: the model's full state dict against the checkpoint's tensors (in the
model's dtype), name by name (an adapted model's base weights under the base model's names),
and, with LoRA, OUT_DIR/adapters.safetensors: the whole adapters under the adapted model's names.
WARM_UP_MODEL, a small model of the same kind, is loaded first, so
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

from common.config import LoraConfig
from trainer import loading
from trainer.checkpoints import adapted_model
from trainer.devices import Placement, trainer_device
from trainer.lora import apply_lora, copy_adapters, initial_adapters
from trainer.parallel import finish, full_state_dict, init_distributed, is_main, parallelize

LORA = LoraConfig(rank=8, alpha=16.0)


def anon_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("/proc/self/status has no RssAnon")


def main() -> None:
    path, how, out, warm = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
    adapter = Path(sys.argv[5]) if len(sys.argv) > 5 else None
    init_distributed()
    torch.manual_seed(1234)  # as the trainer seeds every rank (trainer.seed)
    device = trainer_device()
    where = Placement(device=device, dtype=torch.float32, master_fp32=True)
    loading.placed_model(warm, where)  # the code paths once, on a small model
    loading.load_model(warm, torch.float32)
    if how.startswith("lora"):
        adapted_model(warm, where, LORA)
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
    elif how == "lora":
        model = adapted_model(path, where, LORA, adapter=adapter)
    elif how == "lora-whole":  # before: every rank adapts the whole base model, then shards it
        model = apply_lora(loading.load_model(path, where.weights_dtype), rank=LORA.rank, alpha=LORA.alpha,
                           dropout=LORA.dropout, target_modules=LORA.target_modules)
        copy_adapters(model, initial_adapters(model, seed=1234))
        model = parallelize(model, device=device)
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
        from safetensors.torch import load_file, save_file

        if how.startswith("lora"):
            save_file({k: v.contiguous() for k, v in full.items() if ".lora_" in k}, out / "adapters.safetensors")
            full = {k.removeprefix("base_model.model.").replace(".base_layer.", "."): v for k, v in full.items()
                    if ".lora_" not in k}
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
