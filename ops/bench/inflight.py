"""Seconds from a new weight version's announcement until the engine samples with it: drain vs
in-flight weight updates (generator.inflight_updates), with completions of mixed lengths.

    .venv/bin/python ops/bench/inflight.py [--engine hf|vllm] [--model default|tiny|PATH] [--versions 6] [--median 16]

The engine is driven as the generator's engine loop drives it (generators/main.py): as many
prompts of 4 completions each in the engine as one step advances (`engine.max_running`: the HF
engine's `batch_prompts` 4, vLLM's 4 requests of 4 sequences; the generator holds the rest back,
where new weights reach them before they start), a new prompt added as one finishes, one thread.
One prompt in four asks for 8 x `--median` new tokens, the others for `--median` (the eos is
switched off: every completion runs to its budget, so lengths are exactly 1x and 8x the median).
A thread announces a new version at a random moment (1-4 s after the last was loaded); the
checkpoint is the model's own directory (reloading it costs what reloading a new one does). Then:

    drain     no prompt joins; the engine steps until nothing is in flight; then it loads
    inflight  the running step yields at the next token (Engine.step's `yield_when`; a vLLM step
              is one token of each sequence); it loads at once, and the unfinished completions go
              on under the new weights (vLLM: preempted, prefilled again from their tokens so far)

and the figures, medians over versions, are: wait (announcement -> load starts), reload, and total
(announcement -> the first token sampled with the new version), plus the completion tokens per
second each mode kept up over the whole run (in-flight pays a prefill again for each interrupted
completion). Where a checkpoint comes from, and how a generator hears of it, is
ops/bench/weight_sync.py's business; this measures what the engine loop adds.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def run_mode(engine, *, inflight: bool, versions: int, median: int, seed: int) -> dict[str, float]:
    """Drive `engine` until `versions` announced versions are sampled with; the mode's figures."""
    from common.messages import PromptTask
    from engines.base import SamplingSettings
    from tasks.arithmetic import problem

    rng = random.Random(seed)
    short = SamplingSettings(n=4, max_new_tokens=median, temperature=1.0)
    long = SamplingSettings(n=4, max_new_tokens=8 * median, temperature=1.0)
    announced = threading.Event()
    marks: dict[str, float] = {}
    waits, reloads, totals = [], [], []
    running, added, tokens = 0, 0, 0

    def announcer() -> None:
        time.sleep(rng.uniform(1.0, 4.0))
        marks["announced"] = time.perf_counter()
        announced.set()

    def yield_when() -> bool:  # asked after each sampled token
        if "loaded" in marks and "first" not in marks:
            marks["first"] = time.perf_counter()
        return inflight and announced.is_set()

    threading.Thread(target=announcer, daemon=True).start()
    t0 = time.perf_counter()
    while len(totals) < versions:
        if announced.is_set() and (inflight or not engine.has_unfinished()):
            start = time.perf_counter()
            engine.load_weights(engine.path, version=engine.version + 1)
            marks["loaded"] = time.perf_counter()
            waits.append(start - marks["announced"])
            reloads.append(marks["loaded"] - start)
            announced.clear()
        while running < engine.max_running and not announced.is_set():  # drain: nothing joins
            p = problem(seed=seed, index=added, max_operand=50, ops=["+", "-"])
            task = PromptTask(id=f"r{added}", messages=[{"role": "user", "content": p.question}], text=None,
                              meta={}, n=4, admitted_at=0)
            engine.add(task.id, engine.prompt_ids(task), long if added % 4 == 0 else short)
            added, running = added + 1, running + 1
        for done in engine.step(yield_when=yield_when):
            running -= 1
            tokens += sum(len(s.ids) for s in done.samples)
        if engine.name == "vllm" and "loaded" in marks and "first" not in marks:
            marks["first"] = time.perf_counter()  # a vLLM step samples a token of each running sequence
        if "first" in marks:
            totals.append(marks["first"] - marks.pop("announced"))
            marks.clear()
            threading.Thread(target=announcer, daemon=True).start()
    return {"wait": statistics.median(waits), "reload": statistics.median(reloads),
            "total": statistics.median(totals), "total_max": max(totals),
            "tokens_per_s": tokens / (time.perf_counter() - t0)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--model", default="default", help="default (SmolLM2-135M-Instruct), tiny, or a model directory")
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--median", type=int, default=16, help="new tokens of most completions; 1 in 4 prompts gets 8x")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()

    import torch

    from engines.choice import open_engine

    torch.set_num_threads(args.threads)
    if args.model == "tiny":
        import tempfile

        from common.tiny import build_tiny_model

        path = build_tiny_model(Path(tempfile.mkdtemp()) / "tiny")
    elif args.model == "default":
        from common.config import ModelConfig
        from common.models import resolve_model_path

        path = resolve_model_path(ModelConfig().path)
    else:
        path = Path(args.model)
    if args.engine == "hf":
        engine = open_engine("hf", path, seed=0, max_batch=4)
        engine.eos_ids = [engine.model.config.vocab_size + 1]  # never sampled: every completion runs to its budget
    else:
        engine = open_engine("vllm", path, seed=0, max_num_seqs=16, threads=args.threads)
        engine.max_running = 4  # requests of 4 sequences: the engine's 16
        params = engine._params

        def to_budget(sampling):  # every completion runs to its budget
            p = params(sampling)
            p.ignore_eos = True
            return p

        engine._params = to_budget
    print(f"{args.engine} engine, model {path}, median {args.median} tokens (1 prompt in 4: {8 * args.median}), "
          f"{engine.max_running} prompts x 4 in the engine, {args.threads} thread(s)", flush=True)
    rows = {}
    for mode in ("drain", "inflight"):
        rows[mode] = run_mode(engine, inflight=mode == "inflight", versions=args.versions, median=args.median,
                              seed=1)
        while engine.has_unfinished():
            engine.step()
        f = rows[mode]
        print(f"{mode:9s} wait {f['wait']:.2f} s  reload {f['reload']:.2f} s  total {f['total']:.2f} s "
              f"(max {f['total_max']:.2f})  {f['tokens_per_s']:.0f} completion tok/s", flush=True)
    print(f"in-flight / drain: total {rows['inflight']['total'] / rows['drain']['total']:.2f}x, "
          f"tokens/s {rows['inflight']['tokens_per_s'] / rows['drain']['tokens_per_s']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
