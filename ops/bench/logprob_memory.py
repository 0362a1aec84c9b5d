"""Peak memory of one trainer step at a long sequence length: full logits against chunked log-probs.

    .venv/bin/python ops/bench/logprob_memory.py [--model DIR] [--seq 2048] [--batch 2] [--trees OLD NEW]

One GRPO step (`trainer.step.train_step`: 1 update, entropy, AdamW) on one group of `--batch`
completions of `--seq` tokens in all, run in a fresh process per code tree given (PYTHONPATH set
to it), so each tree's `train_step` is measured as it is. The figure is the process's peak
resident memory (ru_maxrss) during the step minus before it (model, optimizer state allocated by
a warm-up step on a short group first, so AdamW's moments are not counted). Without --trees it
measures the working tree only. On a CPU the allocator returns large blocks to the OS, so the
peak RSS growth is the step's peak working memory to within a few MB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(model_dir: str, seq: int, batch: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from common.messages import Completion, SampleGroup
    from trainer.grpo import LossOptions
    from trainer.step import train_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    vocab = model.config.vocab_size
    opt = torch.optim.AdamW(model.parameters(), lr=1e-6)

    def group(prompt_len: int, done_len: int) -> SampleGroup:
        gen = torch.Generator().manual_seed(prompt_len)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        done = [Completion(ids=torch.randint(0, vocab, (done_len,), generator=gen).tolist(), logprobs=[-2.0] * done_len,
                           reward=float(i % 2), rewards={}, finish="stop", text="") for i in range(batch)]
        return SampleGroup(id=f"g{prompt_len}", prompt_id="p", prompt_ids=prompt, version=0, generator="bench",
                           engine="hf", completions=done)

    args = dict(loss=LossOptions(), ref_model=None, temperature=1.0, estimator="grpo", overlong="none",
                overlong_penalty=0.0, micro_batch_size=batch, micro_batch_tokens=0, updates=1,
                recompute_old_logp=False, max_grad_norm=1.0)
    train_step(model, opt, [group(8, 8)], **args)  # warm-up: AdamW's state
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    train_step(model, opt, [group(seq // 4, seq - seq // 4)], **args)
    seconds = time.monotonic() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_growth_mib": (peak - before) / 1024, "rss_before_mib": before / 1024,
                      "step_s": round(seconds, 1), "vocab": vocab}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache/rollouts/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--batch", type=int, default=2, help="sequences in the step (one micro-batch)")
    ap.add_argument("--trees", nargs="*", default=[str(ROOT)], help="code trees to measure, in turn")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.worker:
        worker(a.model, a.seq, a.batch)
        return
    logits_mib = a.batch * a.seq * 4 / 2**20  # per vocabulary entry; times V below
    for tree in a.trees:
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "2"}
        out = subprocess.run([sys.executable, __file__, "--worker", "--model", a.model, "--seq", str(a.seq),
                              "--batch", str(a.batch)], env=env, cwd=tree, capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{tree}: batch {a.batch} x {a.seq} tokens: step peak +{got['peak_growth_mib']:.0f} MiB "
              f"(one float32 logits tensor: {logits_mib * got['vocab']:.0f} MiB), {got['step_s']} s", flush=True)


if __name__ == "__main__":
    main()
