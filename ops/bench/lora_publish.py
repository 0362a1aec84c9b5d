"""Publish size and weight-sync time, full fine-tuning vs LoRA, on the default model.

For each: the trainer's publish (state dict, LoRA's merge, safetensors written, checksums) and a
generator's sync (the HF engine loading the published checkpoint in place). LoRA's adapter alone
(what a vLLM LoRA request would load) is written too, for its size.

    .venv/bin/python ops/bench/lora_publish.py [--rank 16] [--repeat 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import torch


def size_mb(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(2)

    from common.checkpoints import checksum_dir
    from common.models import resolve_model_path
    from engines.hf_engine import HFEngine
    from trainer.checkpoints import load_model, save_checkpoint
    from trainer.lora import apply_lora

    source = resolve_model_path("")
    engine = HFEngine(source)
    with tempfile.TemporaryDirectory() as tmp:
        for name in ("full", "lora"):
            model = load_model(source)
            if name == "lora":
                model = apply_lora(model, rank=args.rank, alpha=2.0 * args.rank, dropout=0.0,
                                   target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
                with torch.no_grad():  # a trained adapter: B no longer zero
                    for n, p in model.named_parameters():
                        if "lora_B" in n:
                            p.normal_(0, 1e-3)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            publish, sync = [], []
            for i in range(args.repeat):
                t0 = time.perf_counter()
                path = save_checkpoint(model, checkpoint_dir=Path(tmp) / name, step=i + 1, source_dir=source)
                checksum_dir(path)
                publish.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                engine.load_weights(path, version=i + 1)
                sync.append(time.perf_counter() - t0)
            line = (f"{name:4s} trainable {trainable / 1e6:7.2f}M  published {size_mb(path):6.1f} MB  "
                    f"publish {min(publish):5.2f}s  sync (HF load_weights) {min(sync):5.2f}s")
            if name == "lora":
                adapter = Path(tmp) / "adapter"
                model.save_pretrained(adapter, safe_serialization=True)
                line += f"  adapter alone {size_mb(adapter):5.1f} MB"
            print(line, flush=True)


if __name__ == "__main__":
    main()
