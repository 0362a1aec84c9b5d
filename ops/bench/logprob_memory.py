"""Peak memory of one trainer step at a long sequence length: full logits against chunked log-probs.

    .venv/bin/python ops/bench/logprob_memory.py [--model DIR | --shape LAYERS,HIDDEN,VOCAB] [--seq 2048]
        [--batch 2] [--trees OLD NEW]

One GRPO step (`trainer.step.train_step`: 1 update, entropy, AdamW) on one group of `--batch`
completions of `--seq` tokens in all, run in a fresh process per code tree given (PYTHONPATH set
to it), so each tree's `train_step` is measured as it is. The figure is the process's peak
resident memory (ru_maxrss) during the step minus before it (model, optimizer state allocated by
a warm-up step on a short group first, so AdamW's moments are not counted). `--shape` builds a
randomly initialised Llama of that many layers, hidden size and vocabulary instead (the values
do not change the memory; e.g. 4,896,151936 has Qwen2.5-0.5B's width and vocabulary with a
sixth of its layers, so the vocabulary's share shows as it does on the real model's head). Without --trees it
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


def worker(model_dir: str, seq: int, batch: int, chunk_tokens: int) -> None:
    import inspect

    import torch
    from transformers import AutoModelForCausalLM

    from common.config import GrpoLoss as LossOptions
    from common.messages import Completion, SampleGroup
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
                max_grad_norm=1.0)
    if chunk_tokens and "chunk_tokens" in inspect.signature(train_step).parameters:  # a tree with chunking
        args["chunk_tokens"] = chunk_tokens
    if "how" in inspect.signature(train_step).parameters:  # a tree whose options are one record
        from trainer.step import GrpoOptions

        args = dict(ref_model=args.pop("ref_model"), how=GrpoOptions(  # 0: GrpoOptions' own (the config's)
            **args, **({"chunk_tokens": chunk_tokens} if chunk_tokens else {})))
    train_step(model, opt, [group(8, 8)], **args)  # warm-up: AdamW's state
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    train_step(model, opt, [group(seq // 4, seq - seq // 4)], **args)
    seconds = time.monotonic() - t0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"peak_growth_mib": (peak - before) / 1024, "rss_before_mib": before / 1024,
                      "step_s": round(seconds, 1), "vocab": vocab}))


def build(shape: str) -> str:
    """A random Llama of `shape` (LAYERS,HIDDEN,VOCAB) saved to a temporary directory."""
    import tempfile

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, vocab = (int(x) for x in shape.split(","))
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 4 + hidden // 2,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=2,
                      max_position_embeddings=32768, tie_word_embeddings=True)
    out = tempfile.mkdtemp(prefix="logprob-memory-")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=str(Path.home() / ".cache/rollouts/models/SmolLM2-135M-Instruct"))
    ap.add_argument("--seq", type=int, default=2048, help="tokens per sequence (prompt + completion)")
    ap.add_argument("--batch", type=int, default=2, help="sequences in the step (one micro-batch, one group: >= 2)")
    ap.add_argument("--trees", nargs="*", default=[str(ROOT)], help="code trees to measure, in turn")
    ap.add_argument("--chunk-tokens", type=int, default=0,
                    help="trainer.logits_chunk_tokens for trees that chunk (0: their default)")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--shape", default="", help="LAYERS,HIDDEN,VOCAB of a random Llama to use instead of --model")
    a = ap.parse_args()
    if a.shape and not a.worker:
        a.model = build(a.shape)
    if a.worker:
        worker(a.model, a.seq, a.batch, a.chunk_tokens)
        return
    logits_mib = a.batch * a.seq * 4 / 2**20  # per vocabulary entry; times V below
    for tree in a.trees:
        env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "2"}
        argv = [sys.executable, __file__, "--worker", "--model", a.model, "--seq", str(a.seq), "--batch", str(a.batch),
                "--chunk-tokens", str(a.chunk_tokens)]
        out = subprocess.run(argv, env=env, cwd=tree, capture_output=True, text=True, check=True)
        got = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{tree}: {a.shape or a.model}: batch {a.batch} x {a.seq} tokens, chunk {a.chunk_tokens or 'default'}: "
              f"step peak +{got['peak_growth_mib']:.0f} MiB "
              f"(one float32 logits tensor: {logits_mib * got['vocab']:.0f} MiB), {got['step_s']} s", flush=True)


if __name__ == "__main__":
    main()
