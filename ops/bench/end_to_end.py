"""Trainer steps per minute of the whole pipeline under honcho, with 1 and 2 generators, and its reward curve.

    .venv/bin/python ops/bench/end_to_end.py [--steps 10] [--generators 1 2] [--png docs/benchmark-reward.png]
        [--trees OLD .] [--env ROLLOUTS_TRAINER__THREADS=2]

Each run is `ops/honcho start -c generator=G` of the shipped Procfile, as `./ops/run` starts it
(ops/bench/shipped.py: redis, producer, generator x G, trainer, evaluator, under ops/respawn) on
the demo configuration (`configs/demo.toml`: the default model on the arithmetic task, seeds 0),
in a temporary directory with its own Redis port and output directory, stopped by
`trainer.max_steps = --steps` (honcho stops the rest when the trainer exits). Steps
per minute are timed from the arrival of the trainer's first step line to its last, so start-up
(loading models, the first batch of samples) is not counted; the demo saves its optimizer state
every 10 steps and that save falls inside a 10-step run, as it does in a long one. The trainer's
wait-for-data fraction is its `time/wait_data` over `time/step` for the same steps, and its publish
fraction `time/publish` over `time/step`.

Writes a PNG of each run's reward (mean over the step's completions) and accuracy against the
step. Prints the steps per minute with the most generators on its last line.
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

TRAINER_STEP = re.compile(r"\btrainer\.\d+\s*\| step\s+(\d+) \|")  # honcho's "08:20:36 trainer.1   | step    4 | ..."


def honcho_run(tmp: Path, *, env: dict[str, str], evaluator: bool = True) -> list[str]:
    """The command line of the shipped Procfile under ops/honcho, as `./ops/run` starts it
    (ops/bench/shipped.py; the evaluator only if asked), on the demo config in `tmp`, its own Redis
    on a free port, the run's output in tmp/run, `env` (config overrides, ROLLOUTS_SECTION__FIELD)
    for every process. Run it with shipped.process_env()."""
    from ops.bench.shipped import honcho_command

    tmp.mkdir(parents=True)
    return honcho_command(tmp, env={"ROLLOUTS_CONFIG": str(ROOT / "configs" / "demo.toml"),
                                    "ROLLOUTS_OUTPUT_DIR": str(tmp / "run"), **env},
                          processes=() if evaluator else ("redis", "producer", "generator", "trainer"))


def run_pipeline(*, generators: int, steps: int, tmp: Path,
                 env: dict[str, str] | None = None) -> tuple[list[float], list[dict]]:
    """(arrival time of each trainer step line, the trainer's metrics) of one honcho run; `env`:
    more variables for every process (config overrides, ROLLOUTS_SECTION__FIELD)."""
    from common.audit import read_steps
    from ops.bench.shipped import process_env

    honcho = honcho_run(tmp, env={"ROLLOUTS_TRAINER__MAX_STEPS": str(steps), **(env or {})}) + [
        "-c", f"generator={generators}"]
    env = process_env()
    arrivals = []
    with open(tmp / "honcho.log", "w") as log:
        proc = subprocess.Popen(honcho, cwd=tmp, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        try:
            for line in proc.stdout:
                log.write(line)
                log.flush()
                if TRAINER_STEP.search(line):  # honcho's "08:20:36 trainer.1   | step    4 | ..."
                    arrivals.append(time.monotonic())
                    print(f"  {generators} generator(s): {line.rstrip()}", flush=True)
            proc.wait(timeout=120)
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
    metrics_file = tmp / "run" / "metrics.jsonl"
    assert len(arrivals) == steps and metrics_file.is_file(), (
        f"expected {steps} trainer steps, saw {len(arrivals)}:\n{(tmp / 'honcho.log').read_text()[-4000:]}")
    return arrivals, read_steps(metrics_file)


def plot(runs: dict[int, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_r, ax_a) = plt.subplots(1, 2, figsize=(10, 3.6))
    for generators, metrics in runs.items():
        steps = [m["step"] for m in metrics]
        ax_r.plot(steps, [m["reward"] for m in metrics], marker="o", label=f"{generators} generator(s)")
        ax_a.plot(steps, [m["accuracy"] for m in metrics], marker="o", label=f"{generators} generator(s)")
    for ax, title in ((ax_r, "reward (mean of the step's completions)"), (ax_a, "accuracy")):
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("trainer step")
        ax.set_ylim(-0.05, 1.05)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("honcho start, configs/demo.toml (SmolLM2-135M, arithmetic, seeds 0), 2 CPU cores", fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--generators", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--png", type=Path, default=ROOT / "docs" / "benchmark-reward.png")
    ap.add_argument("--trees", nargs="+", default=[str(ROOT)],
                    help="code trees to run in turn (each with its own configs/demo.toml): before/after a change")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="more variables for every process, e.g. ROLLOUTS_TRAINER__THREADS=2")
    args = ap.parse_args()
    assert args.steps >= 2, "--steps must be >= 2: rates are timed from the first step line"
    extra = dict(kv.split("=", 1) for kv in args.env)

    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    rates, runs = {}, {}
    try:
        for n, tree in enumerate(Path(t).resolve() for t in args.trees):
            for generators in args.generators:
                env = {**extra, "PYTHONPATH": str(tree), "ROLLOUTS_CONFIG": str(tree / "configs" / "demo.toml")}
                arrivals, metrics = run_pipeline(generators=generators, steps=args.steps, env=env,
                                                 tmp=tmp / f"t{n}-g{generators}")
                rates[generators] = 60 * (len(arrivals) - 1) / (arrivals[-1] - arrivals[0])
                timed = metrics[1:]
                wait = sum(m["time/wait_data"] for m in timed) / sum(m["time/step"] for m in timed)
                publish = sum(m["time/publish"] for m in timed) / sum(m["time/step"] for m in timed)
                runs[generators] = metrics
                rewards = " ".join(f"{m['reward']:.2f}" for m in metrics)
                print(f"{tree}: {generators} generator(s): {rates[generators]:.2f} steps/min, wait-for-data "
                      f"fraction {wait:.3f}, publish fraction {publish:.3f}, reward by step {rewards}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    plot(runs, args.png)
    print(f"reward curve: {args.png}")
    print("summary: " + ", ".join(f"{g} generator(s) {v:.2f} steps/min" for g, v in rates.items()))
    most = max(args.generators)
    print(f"end-to-end steps per minute ({most} generators): {rates[most]:.2f}")


if __name__ == "__main__":
    main()
