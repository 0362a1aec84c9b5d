"""rollouts against TRL's synchronous GRPOTrainer on the same job: steps per minute and reward against time.

    .venv/bin/python ops/bench/vs_trl.py [--steps 12] [--skip 2] [--sides trl rollouts] [--venv runs/trl-venv]
        [--env NAME=VALUE ...]

The job, on both sides: the default model (SmolLM2-135M-Instruct, from its local directory: no
model hub), 2-digit addition from tasks/arithmetic.py (operands 0-99, "+", seed 0, the chat
template over one user message, reward 1 for the right number), 4 prompts x 4 completions per
optimizer step, at most 24 new tokens at temperature 0.8, lr 5e-6 constant, AdamW without weight
decay, gradients clipped to norm 1, clip range [0.8, 1.28], no KL term, the token-mean loss (TRL's
`loss_type = "dapo"`: the step's per-token losses summed over its trained-token count, as
rollouts' `loss_agg = "token_mean"`), float32 on 2 CPU threads in all:

    trl:      `trl.GRPOTrainer` (generation with HF `generate`, synchronous: generate, score,
              train, then generate again), torch on 2 threads;
    rollouts: `honcho start` of the project's Procfile on configs/demo.toml with the task above
              (ops/bench/end_to_end.py's harness: redis, producer, one generator, trainer,
              evaluator), the generator's and trainer's threads as that config sets them, the
              generator's engine as `./ops/run` picks it (vLLM, installed here) or `--engine hf`
              for HF `generate` on both sides; `--env` sets more of its config (e.g.
              `ROLLOUTS_TRAINER__THREADS=2`) for a variant.

TRL is not a dependency of the project: the bench installs it into its own virtualenv (`--venv`,
`pip install trl==1.16.*` by default, or the newest that installs) that sees the project's
virtualenv through a .pth file, so torch and transformers are the very same and pip adds only
what TRL needs beyond them (minutes the first time); the project's virtualenv is never written.

The sides run one after the other (never at once: they would share the two cores), TRL first.
Steps per minute are timed from each side's first optimizer step to its last (start-up, model
loading and the first batch of samples not counted); "median s/step" is over the steps after
`--skip`. Reward is the mean over the step's 16 completions, printed against the seconds since
the side was launched. Prints the ratio rollouts / TRL of steps per minute on its last line.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PROMPTS, GROUP, NEW_TOKENS, TEMPERATURE, LR, THREADS = 4, 4, 24, 0.8, 5e-6, 2
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # configs/demo.toml's
TASK = {"max_operand": 99, "ops": ["+"], "seed": 0}


# --------------------------------------------------------------------------- TRL's virtualenv


def trl_python(venv: Path, spec: str) -> Path:
    """The interpreter of `venv` with TRL importable: created beside the project's virtualenv
    (a .pth file adds the project's site-packages after its own) and `spec` pip-installed into
    it, else the newest TRL that installs."""
    py = venv / "bin" / "python"
    if py.is_file() and _imports_trl(py):
        return py
    import site

    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    own = subprocess.run([str(py), "-c", "import site; print(site.getsitepackages()[0])"], check=True,
                         capture_output=True, text=True).stdout.strip()
    (Path(own) / "_rollouts_project.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    for want in (spec, "trl"):
        print(f"installing {want} into {venv} (the project's torch and transformers are reused)", flush=True)
        if subprocess.run([str(py), "-m", "pip", "install", "--quiet", want]).returncode == 0 and _imports_trl(py):
            return py
    raise SystemExit(f"could not install TRL into {venv}: see pip's output above")


def _imports_trl(py: Path) -> bool:
    return subprocess.run([str(py), "-c", "import trl"], capture_output=True).returncode == 0


# --------------------------------------------------------------------------- TRL's side (in its venv)


def trl_worker(out: Path, *, steps: int, model_dir: str) -> None:
    """Train with `trl.GRPOTrainer` for `steps` optimizer steps, writing one JSON line per step:
    its end (seconds since this process began) and its mean reward."""
    t0 = time.monotonic()
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from tasks.arithmetic import problem, reward

    torch.set_num_threads(THREADS)
    problems = [problem(index=i, **TASK) for i in range(steps * PROMPTS * 2)]
    data = Dataset.from_dict({"prompt": [[{"role": "user", "content": p.question}] for p in problems],
                              "answer": [p.answer for p in problems]})

    def correct(completions, answer, **_) -> list[float]:
        return [reward(prompt="", completion=c[0]["content"], completion_ids=[], meta={"answer": a})["correct"]
                for c, a in zip(completions, answer, strict=True)]

    log = out.open("w")

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                log.write(json.dumps({"step": state.global_step, "t": time.monotonic() - t0,
                                      "reward": logs["reward"]}) + "\n")
                log.flush()

    config = trl.GRPOConfig(
        output_dir=str(out.parent / "trl-out"), max_steps=steps, per_device_train_batch_size=PROMPTS * GROUP,
        gradient_accumulation_steps=1, num_generations=GROUP, max_completion_length=NEW_TOKENS,
        temperature=TEMPERATURE, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, beta=0.0, epsilon=CLIP_LOW, epsilon_high=CLIP_HIGH, loss_type="dapo",
        scale_rewards="group", num_iterations=1, use_vllm=False, use_cpu=True, bf16=False, fp16=False,
        logging_steps=1, save_strategy="no", report_to=[], seed=0, shuffle_dataset=False, disable_tqdm=True,
        dataloader_num_workers=0)
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=correct, args=config, train_dataset=data,
                              callbacks=[Record()])
    print(f"trl {trl.__version__}, torch {torch.__version__} on {torch.get_num_threads()} threads", flush=True)
    trainer.train()
    log.close()


def run_trl(py: Path, *, steps: int, model_dir: Path, tmp: Path) -> tuple[float, list[dict]]:
    """(launch time, per-step records with `t` on the monotonic clock) of TRL's run in `py`."""
    tmp.mkdir(parents=True)
    out = tmp / "trl.jsonl"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(THREADS), "PYTHONWARNINGS": "ignore"}
    launched = time.monotonic()
    with open(tmp / "trl.log", "w") as log:
        argv = [str(py), __file__, "--trl-worker", str(out), "--steps", str(steps), "--model-dir", str(model_dir)]
        rc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    assert rc == 0, f"TRL's run failed ({rc}):\n{(tmp / 'trl.log').read_text()[-4000:]}"
    records = [json.loads(x) for x in out.read_text().splitlines()]
    tail = (tmp / "trl.log").read_text()[-3000:]
    assert len(records) == steps, f"TRL logged {len(records)} of {steps} steps:\n{tail}"
    return launched, [{**r, "t": launched + r["t"]} for r in records]


# --------------------------------------------------------------------------- rollouts' side


def run_rollouts(*, steps: int, tmp: Path, engine: str, extra: dict[str, str]) -> tuple[float, list[dict]]:
    """(launch time, per-step records) of `honcho start` on the demo config with the task above
    (and the `extra` environment)."""
    from ops.bench.end_to_end import run_pipeline

    # The list is quoted: honcho's .env parser drops double quotes inside an unquoted value.
    env = {"ROLLOUTS_TASK__MAX_OPERAND": str(TASK["max_operand"]), "ROLLOUTS_TASK__OPS": f"'{json.dumps(TASK['ops'])}'",
           "ROLLOUTS_TASK__SEED": str(TASK["seed"]), "ROLLOUTS_ROLLOUT__TEMPERATURE": str(TEMPERATURE),
           "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": str(NEW_TOKENS), "ROLLOUTS_ROLLOUT__GROUP_SIZE": str(GROUP),
           "ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP": str(PROMPTS), "ROLLOUTS_TRAINER__LR": str(LR),
           "ROLLOUTS_TRAINER__LOSS__CLIP_LOW": str(CLIP_LOW), "ROLLOUTS_TRAINER__LOSS__CLIP_HIGH": str(CLIP_HIGH),
           "ROLLOUTS_TRAINER__LOSS__LOSS_AGG": "token_mean", "ROLLOUTS_TRAINER__LOSS__KL_COEF": "0",
           "ROLLOUTS_GENERATOR__ENGINE": engine, **extra}
    launched = time.monotonic()
    arrivals, metrics = run_pipeline(generators=1, steps=steps, tmp=tmp, env=env)
    return launched, [{"step": m["step"], "t": t, "reward": m["reward"], "metrics": m}
                      for t, m in zip(arrivals, metrics, strict=True)]


# --------------------------------------------------------------------------- main


def summary(name: str, launched: float, records: list[dict], *, skip: int) -> float:
    """Print one side's figures; return its steps per minute."""
    times = [r["t"] for r in records]
    rate = 60 * (len(times) - 1) / (times[-1] - times[0])
    gaps = [b - a for a, b in zip(times[skip:], times[skip + 1:], strict=False)] or [times[-1] - times[0]]
    rewards = [r["reward"] for r in records]
    print(f"{name}: {rate:.2f} steps/min, median {statistics.median(gaps):.1f} s/step over steps {skip + 2}-"
          f"{len(times)}, first step {times[0] - launched:.0f} s after launch, "
          f"mean reward {statistics.mean(rewards):.3f}")
    print("  (s since launch, reward): " + " ".join(f"({r['t'] - launched:.0f}, {r['reward']:.2f})" for r in records))
    return rate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=12, help="optimizer steps per side")
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the median s/step")
    ap.add_argument("--sides", nargs="+", choices=["trl", "rollouts"], default=["trl", "rollouts"])
    ap.add_argument("--venv", type=Path, default=ROOT / "runs" / "trl-venv", help="TRL's virtualenv")
    ap.add_argument("--trl", default="trl==1.16.*", help="pip requirement of TRL")
    ap.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"],
                    help="rollouts' generator engine (auto: vLLM where installed, as ./ops/run)")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="more of rollouts' config for its side, as environment variables")
    ap.add_argument("--json", type=Path, help="write both sides' records here")
    ap.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker is not None:
        trl_worker(args.trl_worker, steps=args.steps, model_dir=args.model_dir)
        return
    assert args.steps >= args.skip + 2, "--steps must leave at least two steps after --skip"
    bad = [e for e in args.env if "=" not in e or not e.startswith("ROLLOUTS_")]
    assert not bad, f"--env takes ROLLOUTS_...=VALUE, got {bad}"
    extra = dict(e.split("=", 1) for e in args.env)
    from common.models import resolve_model_path

    model_dir = resolve_model_path("")
    py = trl_python(args.venv, args.trl) if "trl" in args.sides else None
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-vs-trl-"))
    rates, runs = {}, {}
    try:
        for side in args.sides:
            print(f"--- {side}: {args.steps} steps", flush=True)
            if side == "trl":
                launched, records = run_trl(py, steps=args.steps, model_dir=model_dir, tmp=tmp / "trl")
            else:
                launched, records = run_rollouts(steps=args.steps, tmp=tmp / "rollouts", engine=args.engine,
                                                 extra=extra)
            rates[side] = summary(side, launched, records, skip=args.skip)
            runs[side] = [{"step": r["step"], "s": r["t"] - launched, "reward": r["reward"]} for r in records]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    if len(rates) == 2:
        print(f"rollouts / TRL steps per minute: {rates['rollouts'] / rates['trl']:.2f}")


if __name__ == "__main__":
    main()
