"""Ablation of the off-policy corrections: reward and held-out pass@1 by correction and staleness.

    python ops/bench/offpolicy_ablation.py [--steps 40] [--staleness 1 4] \
        [--corrections behaviour_clip decoupled token_mask] [--out runs/offpolicy-ablation] \
        [--env NAME=VALUE ...] [--label TEXT]

Each run is the shipped Procfile under ops/honcho, as `./ops/run` starts it (ops/bench/shipped.py:
redis, producer, one generator, trainer; no evaluator) on the demo configuration
(`configs/demo.toml`: the default model on the arithmetic task, every seed 0), with
`rollout.max_staleness` and `trainer.correction` set, in its own directory under --out with its
own Redis port, stopped by `trainer.max_steps = --steps`. The trainer state is saved only at the
end (`state_every = --steps`), so no run pays for an optimizer save the others skip. After a run,
its final checkpoint is scored here on the evaluator's held-out problems (eval.seed, eval.prompts,
greedy pass@1, as evaluator/jobs.py does).

Each finished run appends one JSON line to --out/results.jsonl (reward over the last 10 steps,
pass@1, mean staleness, mismatch, masked share, seconds) and the Markdown table of every line so
far is rewritten to --out/table.md, so a cut-short ablation keeps what finished. A run already
in results.jsonl is not run again (rerun the command to finish an interrupted ablation).

`--env` sets more of the runs' configuration (ROLLOUTS_GENERATOR__ENGINE=hf,
ROLLOUTS_GENERATOR__INFLIGHT_UPDATES=true, ...), and `--label` names that variant in the results
(a run is known by staleness, correction and label), so variants can share one --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

LAST = 10  # reward is averaged over the last this many steps


def run_pipeline(*, staleness: int, correction: str, steps: int, tmp: Path, extra: list[str] = ()) -> list[dict]:
    """The trainer's metrics of one honcho run."""
    from common.audit import read_steps
    from ops.bench.shipped import honcho_command, process_env

    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    # The shipped Procfile (ops/bench/shipped.py), without the evaluator: ops/redis-last keeps Redis
    # up while the generator finishes its prompts at the last step.
    honcho = honcho_command(tmp, env={
        "ROLLOUTS_CONFIG": str(ROOT / "configs" / "demo.toml"), "ROLLOUTS_OUTPUT_DIR": str(tmp / "run"),
        "ROLLOUTS_TRAINER__MAX_STEPS": str(steps), "ROLLOUTS_TRAINER__STATE_EVERY": str(steps),
        "ROLLOUTS_ROLLOUT__MAX_STALENESS": str(staleness), "ROLLOUTS_TRAINER__LOSS__CORRECTION": correction,
        "ROLLOUTS_EVAL__EVERY": "0", **dict(e.split("=", 1) for e in extra)},
        processes=("redis", "producer", "generator", "trainer"))
    env = process_env()
    with open(tmp / "honcho.log", "w") as log:
        proc = subprocess.Popen(honcho, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            proc.wait()
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    rows = read_steps(tmp / "run" / "metrics.jsonl")
    assert len(rows) == steps, f"expected {steps} trainer steps, got {len(rows)}: see {tmp / 'honcho.log'}"
    return rows


def pass_at_1(checkpoint: Path) -> float:
    """Greedy pass@1 of `checkpoint` on the evaluator's held-out arithmetic problems (the demo's eval section)."""
    from common.config import load_config
    from common.messages import PromptTask
    from engines.hf_engine import HFEngine
    from tasks import arithmetic

    cfg = load_config(ROOT / "configs" / "demo.toml", env={})
    engine = HFEngine(str(checkpoint), dtype=cfg.model.dtype)
    problems = [arithmetic.problem(seed=cfg.eval.seed, index=i, max_operand=cfg.task.max_operand, ops=cfg.task.ops)
                for i in range(cfg.eval.prompts)]
    tasks = [PromptTask(id=f"eval:{i}", messages=[{"role": "user", "content": p.question}], text=None,
                        meta={"answer": p.answer}, n=1, admitted_at=0) for i, p in enumerate(problems)]
    greedy = engine.greedy([engine.prompt_ids(t) for t in tasks], max_new_tokens=cfg.rollout.max_new_tokens)
    hits = [arithmetic.reward(prompt=t.messages[0]["content"], completion=engine.decode(ids), completion_ids=ids,
                              meta=t.meta)["correct"] == 1.0 for ids, t in zip(greedy, tasks, strict=True)]
    return sum(hits) / len(hits)


def summary(rows: list[dict], *, staleness: int, correction: str, seconds: float, pass1: float,
            label: str = "") -> dict:
    last = rows[-LAST:]

    def mean(key: str, of: list[dict]) -> float:
        values = [r[key] for r in of if r.get(key) is not None]
        assert values, f"no step logged {key!r}: has the metric been renamed? (metrics.jsonl keys: {sorted(of[0])})"
        return sum(values) / len(values)

    return {"max_staleness": staleness, "correction": correction, "label": label, "steps": len(rows),
            "reward_last10": mean("reward", last), "accuracy_last10": mean("accuracy", last),
            "reward_first10": mean("reward", rows[:LAST]), "pass@1": pass1,
            "staleness_mean": mean("staleness/mean", rows), "mismatch_mean": mean("mismatch/abs_log_ratio_mean", rows),
            "mismatch_max": max(r.get("mismatch/abs_log_ratio_max", 0.0) for r in rows),
            "masked": mean("mismatch/masked", rows), "clip_region": mean("clip_ratio/region_mean", rows),
            "seconds": round(seconds, 1)}


def table(results: list[dict]) -> str:
    head = ("| max_staleness | correction | variant | steps | reward (last 10) | reward (first 10) | held-out pass@1 | "
            "staleness mean | mismatch mean / max | masked | clipped | minutes |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for x in results:
        lines.append(f"| {x['max_staleness']} | {x['correction']} | {x.get('label', '')} | {x['steps']} | "
                     f"{x['reward_last10']:.3f} | "
                     f"{x['reward_first10']:.3f} | {x['pass@1']:.3f} | {x['staleness_mean']:.2f} | "
                     f"{x['mismatch_mean']:.4f} / {x['mismatch_max']:.3f} | {x['masked']:.4f} | "
                     f"{x['clip_region']:.4f} | {x['seconds'] / 60:.1f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--staleness", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--corrections", nargs="+", default=["behaviour_clip", "decoupled", "token_mask"])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "offpolicy-ablation")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="more settings of every run")
    ap.add_argument("--label", default="", help="the variant's name in the results")
    args = ap.parse_args()
    assert args.steps >= LAST, f"--steps must be >= {LAST}"
    for item in args.env:
        assert "=" in item and item.startswith("ROLLOUTS_"), f"--env {item!r}: expected ROLLOUTS_NAME=VALUE"
    args.out = args.out.resolve()  # honcho runs in each run's directory: paths relative to here would not hold
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.jsonl"
    results = [json.loads(x) for x in results_file.read_text().splitlines()] if results_file.is_file() else []
    done = {(x["max_staleness"], x["correction"], x.get("label", "")) for x in results}
    for staleness in args.staleness:
        for correction in args.corrections:
            if (staleness, correction, args.label) in done:
                continue
            t0 = time.monotonic()
            tmp = args.out / (f"s{staleness}-{correction}" + (f"-{args.label}" if args.label else ""))
            rows = run_pipeline(staleness=staleness, correction=correction, steps=args.steps, tmp=tmp,
                                extra=args.env)
            final = tmp / "run" / "checkpoints" / f"step_{args.steps}"
            x = summary(rows, staleness=staleness, correction=correction, seconds=time.monotonic() - t0,
                        pass1=pass_at_1(final), label=args.label)
            results.append(x)
            with open(results_file, "a") as f:
                f.write(json.dumps(x) + "\n")
            (args.out / "table.md").write_text(table(results))
            print(json.dumps(x), flush=True)
            for heavy in ("trainer_state", "checkpoints"):  # gigabytes each; metrics.jsonl stays
                shutil.rmtree(tmp / "run" / heavy, ignore_errors=True)
    print(table(results))


if __name__ == "__main__":
    main()
