"""Reward over the first steps of the calculator environment against the plain arithmetic task.

    .venv/bin/python ops/bench/agents.py [--steps 30] [--out docs/benchmark-agents.json]

Two honcho runs of redis, producer, one generator and the trainer on `configs/calculator.toml`
(the default model; arithmetic with operands up to 10000): with the source's calculator
environment (multi-turn episodes, `<calc>...</calc>` tool calls) and without it (the same prompts,
one completion each, the arithmetic reward). Each stops at `trainer.max_steps = --steps`. Prints
each run's reward by step and the mean reward over the first and last ten steps, and writes them
as JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PY = sys.executable


def run(config_text: str, *, steps: int, tmp: Path) -> list[dict]:
    """The trainer's metrics of one honcho run of `config_text`."""
    from tests.conftest import free_port

    tmp.mkdir(parents=True)
    port = free_port()
    (tmp / "run.toml").write_text(config_text)
    (tmp / "Procfile").write_text("\n".join([
        "redis: mkdir -p redis && exec redis-server --port ${REDIS_PORT} --bind 127.0.0.1 --appendonly yes "
        "--dir redis --save ''",
        f"producer: exec {PY} -m producers",
        f"generator: exec {PY} -m generators",
        f"trainer: exec {PY} -m trainer",
    ]) + "\n")
    (tmp / ".env").write_text("\n".join([
        f"REDIS_PORT={port}", f"ROLLOUTS_REDIS_URL=redis://127.0.0.1:{port}/0",
        f"ROLLOUTS_CONFIG={tmp / 'run.toml'}", f"ROLLOUTS_OUTPUT_DIR={tmp / 'run'}",
        f"ROLLOUTS_TRAINER__MAX_STEPS={steps}", f"PYTHONPATH={ROOT}",
        "PYTHONUNBUFFERED=1", "TOKENIZERS_PARALLELISM=false", "HF_HUB_OFFLINE=1",
    ]) + "\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    honcho = [shutil.which("honcho") or "honcho", "start", "-f", str(tmp / "Procfile"), "-e", str(tmp / ".env"),
              "-d", str(tmp)]
    with open(tmp / "honcho.log", "w") as log:
        subprocess.run(honcho, cwd=tmp, env=env, stdout=log, stderr=subprocess.STDOUT, check=False)
    metrics_file = tmp / "run" / "metrics.jsonl"
    metrics = [json.loads(x) for x in metrics_file.read_text().splitlines()] if metrics_file.is_file() else []
    assert len(metrics) == steps, f"expected {steps} steps:\n{(tmp / 'honcho.log').read_text()[-4000:]}"
    return metrics


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--out", type=Path, default=ROOT / "docs" / "benchmark-agents.json")
    args = ap.parse_args()
    calculator = (ROOT / "configs" / "calculator.toml").read_text()
    plain = calculator.replace('environment = "envs.calculator"', 'environment = ""')
    assert plain != calculator, "configs/calculator.toml no longer names envs.calculator"
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-agents-"))
    out = {}
    try:
        for name, text in (("calculator", calculator), ("plain", plain)):
            metrics = run(text, steps=args.steps, tmp=tmp / name)
            rewards = [m["reward/mean"] for m in metrics]
            out[name] = {"reward": rewards, "length": [m["completions/mean_length"] for m in metrics],
                         "first10": sum(rewards[:10]) / len(rewards[:10]),
                         "last10": sum(rewards[-10:]) / len(rewards[-10:]),
                         "step_s": sum(m["time/step"] for m in metrics) / len(metrics)}
            print(f"{name}: reward by step {' '.join(f'{x:.2f}' for x in rewards)}; mean first 10 "
                  f"{out[name]['first10']:.3f}, last 10 {out[name]['last10']:.3f}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
