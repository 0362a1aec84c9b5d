"""One evaluation of configs/gsm8k.toml's shape on each engine: the evaluator's own code (the job's
`evaluate`, engine loading included), HF transformers against vLLM, one after the other.

    .venv/bin/python ops/bench/eval_engines.py [--config configs/gsm8k.toml] [--prompts 16]
        [--pass-k 4] [--max-new-tokens 128] [--engines hf vllm] [--threads 2]

The config's [eval] and [rollout] as written, scaled to what a CPU can do (`--prompts`,
`--pass-k`, `--max-new-tokens` replace eval.prompts, eval.pass_k and rollout.max_new_tokens: the
config asks 256 x pass@4 at 512 tokens), with two substitutions where this machine has no hub:
the built-in model (SmolLM2-135M-Instruct, `rollouts prepare-model`) for model.path, and a local
file of GSM8K-shaped problems (question, answer ending "#### N", about GSM8K's prompt length) for
each [[eval.sources]]. model.dtype stays the config's; on a CPU without bf16 matrix units use
`--dtype float32`. Prints, per engine: seconds to open the engine, seconds for the evaluation
(greedy pass@1 and pass@k), completion tokens per second, and pass@1 (the built-in model's
arithmetic, the same on both engines up to sampling).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

QUESTION = ("Natalia sold clips to {a} of her friends in April, and then she sold {b} more clips in May than "
            "in April. Each clip costs 2 dollars, and she kept a record of every sale in her notebook. "
            "How many clips did Natalia sell altogether in April and May?")


def gsm8k_shaped(path: Path, n: int) -> Path:
    """`n` GSM8K-shaped problems as JSON lines (question, worked answer ending in "#### N")."""
    rows = []
    for i in range(n):
        a, b = 12 + 7 * i, 3 + i % 9
        rows.append({"question": QUESTION.format(a=a, b=b),
                     "answer": f"In May she sold {a} + {b} = {a + b}.\nAltogether {a} + {a + b} = "
                               f"{2 * a + b}.\n#### {2 * a + b}"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs/gsm8k.toml"))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--pass-k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    ap.add_argument("--dtype", default=None, help="model.dtype instead of the config's")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (HF) and generator.threads (vLLM)")
    args = ap.parse_args()

    import torch

    from common.checkpoints import checksum_dir
    from common.config import ModelConfig, load_config
    from common.evals import eval_request
    from common.messages import WeightVersion
    from common.models import resolve_model_path
    from evaluator import jobs

    torch.set_num_threads(args.threads)
    model = resolve_model_path(ModelConfig().path)
    data = gsm8k_shaped(Path(tempfile.mkdtemp()) / "gsm8k_test.jsonl", args.prompts)
    base = load_config(args.config, env={})
    sources = [{**s.model_dump(), "path": str(data), "format": "json", "subset": ""}
               for s in base.eval.sources]
    model_fields = {"path": str(model), **({"dtype": args.dtype} if args.dtype else {})}
    wv = WeightVersion(version=1, step=1, path=str(model), format="safetensors", checksums=checksum_dir(model),
                       created_at=time.time())
    print(f"{args.config}: {len(sources)} eval source(s) of {args.prompts} problems, pass@1 greedy and "
          f"pass@{args.pass_k}, {args.max_new_tokens} new tokens, model {model}", flush=True)
    for name in args.engines:
        config = load_config(args.config, env={}, overrides={
            "model": model_fields, "rollout": {"max_new_tokens": args.max_new_tokens},
            "generator": {"threads": args.threads},
            "eval": {"engine": name, "prompts": args.prompts, "pass_k": args.pass_k, "sources": sources}})
        req = eval_request(config, wv)
        t0 = time.perf_counter()
        engine = jobs.engine_for(req)
        opened = time.perf_counter() - t0
        counted = count_tokens(engine)
        t1 = time.perf_counter()
        result = jobs.evaluate(req)
        seconds = time.perf_counter() - t1
        print(f"{name:5s} {config.model.dtype}: open {opened:.1f} s, evaluate {seconds:.1f} s "
              f"({counted['tokens'] / seconds:.0f} completion tok/s, {counted['tokens']} tokens), "
              f"pass@1 {result.pass_at[1]:.3f}, pass@{args.pass_k} {result.pass_at.get(args.pass_k, 0):.3f}",
              flush=True)
        jobs._ENGINE.clear()
        del engine


def count_tokens(engine) -> dict[str, int]:
    """Count the completion tokens the engine's greedy and sample calls return."""
    counted = {"tokens": 0}
    greedy, sample = engine.greedy, engine.sample

    def counting_greedy(prompts, **kw):
        out = greedy(prompts, **kw)
        counted["tokens"] += sum(len(ids) for ids in out)
        return out

    def counting_sample(prompts, sampling):
        out = sample(prompts, sampling)
        counted["tokens"] += sum(len(s.ids) for group in out for s in group)
        return out

    engine.greedy, engine.sample = counting_greedy, counting_sample
    return counted


if __name__ == "__main__":
    main()
