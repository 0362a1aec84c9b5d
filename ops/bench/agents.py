"""Reward over the first steps of the calculator environment against the plain arithmetic task.

    .venv/bin/python ops/bench/agents.py [--steps 30] [--prompts-per-step 4] [--runs calculator plain]
                                         [--out docs/benchmark-agents.json]

Two runs of the shipped Procfile's redis, producer, one generator and trainer (ops/bench/shipped.py)
on `configs/calculator.toml` (the default model; arithmetic with operands up to 10000): with the source's calculator
environment (multi-turn episodes, `<calc>...</calc>` tool calls) and without it (the same prompts,
one completion each, the arithmetic reward), side by side (each gets a share of the cores; the
rewards by step do not depend on it). Each stops at `trainer.max_steps = --steps`;
`--prompts-per-step` overrides the config's. Prints each run's reward by step and the mean reward
over the first and last ten steps, and writes them as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))



def start(config_text: str, *, steps: int, prompts_per_step: int, micro_batch_size: int, tmp: Path
          ) -> subprocess.Popen:
    """A run of `config_text` in `tmp` under the shipped Procfile (ops/bench/shipped.py: as
    `./ops/run` starts it; no evaluator), started."""
    from ops.bench.shipped import honcho_command, process_env

    tmp.mkdir(parents=True)
    (tmp / "run.toml").write_text(config_text)
    honcho = honcho_command(tmp, env={
        "ROLLOUTS_CONFIG": str(tmp / "run.toml"), "ROLLOUTS_OUTPUT_DIR": str(tmp / "run"),
        "ROLLOUTS_TRAINER__MAX_STEPS": str(steps), "ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP": str(prompts_per_step),
        "ROLLOUTS_TRAINER__MICRO_BATCH_SIZE": str(micro_batch_size)},
        processes=("redis", "producer", "generator", "trainer"))
    log = open(tmp / "honcho.log", "w")  # noqa: SIM115 - honcho owns it
    return subprocess.Popen(honcho, cwd=tmp, env=process_env(), stdout=log, stderr=subprocess.STDOUT)


def metrics_of(tmp: Path) -> list[dict]:
    from common.audit import read_steps

    return read_steps(tmp / "run" / "metrics.jsonl")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--prompts-per-step", type=int, default=4)
    ap.add_argument("--micro-batch-size", type=int, default=8, help="trainer rows per forward/backward (memory)")
    ap.add_argument("--runs", nargs="+", choices=["calculator", "plain"], default=["calculator", "plain"])
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmark-agents.json")
    args = ap.parse_args()
    calculator = (ROOT / "configs" / "calculator.toml").read_text()
    plain = calculator.replace('environment = "envs.calculator"', 'environment = ""')
    assert plain != calculator, "configs/calculator.toml no longer names envs.calculator"
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-agents-"))
    out = {}
    runs = {name: start(text, steps=args.steps, prompts_per_step=args.prompts_per_step,
                        micro_batch_size=args.micro_batch_size, tmp=tmp / name)
            for name, text in (("calculator", calculator), ("plain", plain)) if name in args.runs}
    try:
        for proc in runs.values():
            proc.wait()
    finally:
        for proc in runs.values():
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=60)
    for name in runs:
        metrics = metrics_of(tmp / name)
        assert len(metrics) == args.steps, f"{name}: {len(metrics)} steps of {args.steps}:\n" + \
            (tmp / name / "honcho.log").read_text()[-4000:]
        rewards = [m["reward/mean"] for m in metrics]
        out[name] = {"reward": rewards, "length": [m["completions/mean_length"] for m in metrics],
                     "first10": sum(rewards[:10]) / len(rewards[:10]),
                     "last10": sum(rewards[-10:]) / len(rewards[-10:]),
                     "step_s": sum(m["time/step"] for m in metrics) / len(metrics)}
        print(f"{name}: reward by step {' '.join(f'{x:.2f}' for x in rewards)}; mean first 10 "
              f"{out[name]['first10']:.3f}, last 10 {out[name]['last10']:.3f}", flush=True)
    shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
