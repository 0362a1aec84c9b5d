"""rollouts against TRL's synchronous GRPOTrainer on the same job: held-out accuracy against time, and steps per minute.

    .venv/bin/python ops/bench/vs_trl.py --minutes 10 [--sides trl rollouts] [--engine auto|hf]
        [--keep-every 5] [--eval-prompts 128] [--env NAME=VALUE ...] [--json FILE] [--png FILE]
    .venv/bin/python ops/bench/vs_trl.py --steps 12 [--skip 2] ...      (steps per minute only)

The job, on both sides, is the demo's (`configs/demo.toml`, read here, so a change to the demo is
a change to both sides) on 2-digit addition (`ROLLOUTS_TASK__MAX_OPERAND=99
ROLLOUTS_TASK__OPS='["+"]'`), with `--env` applied to it (e.g. `ROLLOUTS_TRAINER__LR=2e-5` sets
both sides' learning rate): the default model (SmolLM2-135M-Instruct, from its local directory: no
model hub), the task's problems minus the evaluator's held-out split (`eval.holdout`: TRL trains on
none of them either), the chat template over one user message, reward 1 for the right number,
`rollout.prompts_per_step` prompts x `rollout.group_size` completions per optimizer step, at most
`rollout.max_new_tokens` new tokens at `rollout.temperature`, `trainer.lr` constant, AdamW with
`trainer.weight_decay`, gradients clipped to `trainer.max_grad_norm`, the clip range of
`[trainer.loss]`, its KL coefficient, the token-mean loss (TRL's `loss_type = "dapo"`: the step's
per-token losses summed over its trained-token count, as rollouts' `loss_agg = "token_mean"`),
`model.dtype` (float32, or bfloat16 computing with float32 master weights: TRL's `bf16 = True`,
autocast on the CPU, as rollouts' trainer; both sides sample in it too) on 2 CPU threads in all:

    trl:      `trl.GRPOTrainer` (generation with HF `generate`, synchronous: generate, score,
              train, then generate again), torch on 2 threads;
    rollouts: `honcho start` of the project's Procfile on configs/demo.toml with the job above
              (redis, producer, one generator, trainer; with `--steps` also the evaluator, as
              ops/bench/end_to_end.py runs it), the generator's and trainer's threads as that config
              sets them, the generator's engine as `./ops/run` picks it (vLLM, installed here; or
              `--engine`);
    rollouts-hf: the same with the generator on HF `generate`, TRL's engine.

TRL is not a dependency of the project: the bench installs it into its own virtualenv (`--venv`,
`pip install trl==1.16.*` by default, or the newest that installs) that sees the project's
virtualenv through a .pth file, so torch and transformers are the very same and pip adds only
what TRL needs beyond them (minutes the first time); the project's virtualenv is never written.
The sides run one after the other (never at once: they would share the two cores), TRL first.

`--minutes N` (time to accuracy): each side runs N minutes from its launch and is then stopped
(not before its `--min-steps`-th step, default 0). TRL saves the model every `--keep-every` steps
(or, with `--keep-seconds S`, at its first step S, 2S, ... seconds after launch; and at its stop);
the seconds its saves took are taken out of its clock, so its curve is what it would be without
them. rollouts publishes every step as it always does; the bench keeps every `--keep-every`-th
published checkpoint (with `--keep-seconds S`, the newest one at S, 2S, ... seconds after launch,
and the last at the stop; hard links, out of the trainer's pruning) and its time is when the
trainer's step line came. `--device cuda` trains TRL's side on the GPU (rollouts' processes take
the GPU wherever CUDA is: ops/gpu_learn.py runs this bench on a GPU host); `--trl-python PATH`
runs TRL's side with an interpreter that already imports TRL (on PYTHONPATH, say) instead of
`--venv`. Neither side runs
an evaluator meanwhile. Afterwards, with nothing else running, the model both start from (their
point at 0 s) and every kept checkpoint of both sides are scored by the evaluator's own code
(evaluator/jobs.py `evaluate`, with the engine and dtype the demo's evaluator uses) on the same
`--eval-prompts` held-out problems, greedy pass@1. Prints accuracy
against seconds since launch for both, then the time each side needed to reach the other's final
accuracy, and last the ratio TRL / rollouts (each rollouts side) of the time to reach TRL's final
accuracy.

`--steps N` (throughput): each side runs N optimizer steps; steps per minute are timed from each
side's first step to its last (start-up, model loading and the first batch of samples not
counted), "median s/step" is over the steps after `--skip`. Prints the ratio rollouts / TRL of
steps per minute on its last line.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

THREADS = 2  # the machine's two cores: TRL's torch threads; rollouts' as configs/demo.toml splits them
TASK_ENV = {"ROLLOUTS_TASK__MAX_OPERAND": "99", "ROLLOUTS_TASK__OPS": '["+"]'}  # 2-digit addition


# --------------------------------------------------------------------------- the job


def job_config(extra: dict[str, str]):
    """The demo's config on 2-digit addition with `extra` (ROLLOUTS_... variables) on top."""
    from common.config import load_config

    return load_config(ROOT / "configs" / "demo.toml", env={**TASK_ENV, **extra})


def trl_job(config) -> dict:
    """What TRL's side needs of the job, from the config both sides share; an error names a setting
    TRL has no counterpart for."""
    loss = config.trainer.loss
    assert loss.type == "grpo" and loss.loss_agg == "token_mean", (
        f"TRL's side runs loss_type 'dapo' = rollouts' grpo with loss_agg token_mean, not {loss.type} / "
        f"{loss.loss_agg}")
    assert config.trainer.lr_schedule == "constant" and not config.trainer.warmup_steps, \
        "TRL's side runs a constant learning rate without warm-up"
    assert config.model.dtype in ("float32", "bfloat16"), \
        f"TRL's side runs float32 or bfloat16, not {config.model.dtype}"
    (source,) = config.sources
    return {"bf16": config.model.dtype == "bfloat16", "prompts": config.rollout.prompts_per_step,
            "group": config.rollout.group_size,
            "new_tokens": config.rollout.max_new_tokens, "temperature": config.rollout.temperature,
            "lr": config.trainer.lr, "weight_decay": config.trainer.weight_decay,
            "max_grad_norm": config.trainer.max_grad_norm, "clip_low": loss.clip_low, "clip_high": loss.clip_high,
            "kl": loss.kl_coef, "source": source.model_dump(mode="json"), "seed": config.task.seed,
            "holdout": config.eval.holdout}


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


def trl_worker(out: Path, job: dict, *, steps: int, minutes: float, keep_every: int, model_dir: str,
               device: str = "cpu", min_steps: int = 0, keep_seconds: float = 0) -> None:
    """Train with `trl.GRPOTrainer` on `device` for `steps` optimizer steps, or until `minutes`
    have passed since this process began and `min_steps` are done (saving the model every
    `keep_every` steps, or at the first step past each `keep_seconds` mark, and at the stop),
    writing one JSON line per step (its end in seconds since this process began, its mean reward
    and mean completion length) and one per save (its step, directory and the seconds it took)."""
    t0 = time.monotonic()
    import torch
    import trl
    from datasets import Dataset
    from transformers import TrainerCallback

    from common.config import source_config
    from tasks.arithmetic import reward
    from tasks.rows import held_out, synthetic_prompt

    torch.set_num_threads(THREADS)
    source = source_config(**job["source"])
    # With `minutes`, more steps than a run can take (20 a second: a GPU's are well under 1 s, a
    # CPU's over 1 s), so that the time, never max_steps, ends it, with the save at its stop.
    budget = steps or int(minutes * 60 * 20)
    want = budget * job["prompts"]  # one pass at most
    problems = []
    for i in itertools.count():
        p = synthetic_prompt(source, seed=job["seed"], index=i, prompt_id=str(i))
        if not held_out(p, job["holdout"]):
            problems.append(p)
        if len(problems) == want:
            break
    data = Dataset.from_dict({"prompt": [p.messages for p in problems],
                              "answer": [p.meta["answer"] for p in problems]})

    def correct(completions, answer, **_) -> list[float]:
        return [reward(prompt="", completion=c[0]["content"], completion_ids=[], meta={"answer": a})["correct"]
                for c, a in zip(completions, answer, strict=True)]

    log = out.open("w")

    def write(**record) -> None:
        log.write(json.dumps(record) + "\n")
        log.flush()

    class Record(TrainerCallback):
        ended = 0.0
        mark = keep_seconds  # the next keep_seconds mark

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "reward" in logs:
                write(step=state.global_step, t=self.ended, reward=logs["reward"],
                      length=logs.get("completions/mean_length"))

        def on_step_end(self, args, state, control, **kw):
            self.ended = time.monotonic() - t0
            if keep_seconds and self.ended >= self.mark:
                control.should_save = True
                self.mark = (self.ended // keep_seconds + 1) * keep_seconds
            if minutes and self.ended >= minutes * 60 and state.global_step >= min_steps:
                control.should_save = control.should_training_stop = True

        def on_save(self, args, state, control, **kw):
            write(saved=state.global_step, dir=str(Path(args.output_dir) / f"checkpoint-{state.global_step}"),
                  t=self.ended, save_s=time.monotonic() - t0 - self.ended)

    config = trl.GRPOConfig(
        output_dir=str(out.parent / "trl-out"), max_steps=budget,
        per_device_train_batch_size=job["prompts"] * job["group"], gradient_accumulation_steps=1,
        num_generations=job["group"], max_completion_length=job["new_tokens"], temperature=job["temperature"],
        learning_rate=job["lr"], lr_scheduler_type="constant", warmup_steps=0, weight_decay=job["weight_decay"],
        max_grad_norm=job["max_grad_norm"], beta=job["kl"], epsilon=job["clip_low"], epsilon_high=job["clip_high"],
        loss_type="dapo", scale_rewards="group", num_iterations=1, use_vllm=False, use_cpu=device == "cpu",
        bf16=job["bf16"], fp16=False, logging_steps=1, report_to=[], seed=0, shuffle_dataset=False, disable_tqdm=True,
        dataloader_num_workers=0, save_strategy="steps" if minutes and not keep_seconds else "no",
        save_steps=keep_every,
        save_only_model=True)
    trainer = trl.GRPOTrainer(model=model_dir, reward_funcs=correct, args=config, train_dataset=data,
                              callbacks=[Record()])
    print(f"trl {trl.__version__}, torch {torch.__version__} on {device} ({torch.get_num_threads()} threads)",
          flush=True)
    trainer.train()
    log.close()


def run_trl(py: Path, job: dict, *, steps: int, minutes: float, keep_every: int, model_dir: Path,
            tmp: Path, device: str = "cpu", min_steps: int = 0,
            keep_seconds: float = 0) -> tuple[float, list[dict], list[dict]]:
    """(launch time, per-step records, saves) of TRL's run in `py`; times on the monotonic clock,
    a save's `t` with the seconds of the saves before it taken out."""
    tmp.mkdir(parents=True)
    out = tmp / "trl.jsonl"
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))  # and the caller's
    env = {**os.environ, "PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
           "OMP_NUM_THREADS": str(THREADS), "PYTHONWARNINGS": "ignore"}
    launched = time.monotonic()
    with open(tmp / "trl.log", "w") as log:
        argv = [str(py), __file__, "--trl-worker", str(out), "--job", json.dumps(job), "--steps", str(steps),
                "--minutes", str(minutes), "--keep-every", str(keep_every), "--model-dir", str(model_dir),
                "--device", device, "--min-steps", str(min_steps), "--keep-seconds", str(keep_seconds)]
        rc = subprocess.run(argv, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    tail = (tmp / "trl.log").read_text()[-4000:]
    assert rc == 0, f"TRL's run failed ({rc}):\n{tail}"
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    records = [x for x in lines if "step" in x]
    assert records and (minutes or len(records) == steps), f"TRL logged {len(records)} of {steps} steps:\n{tail}"
    saves, saving = [], 0.0
    for x in (x for x in lines if "saved" in x):
        saves.append({"step": x["saved"], "t": launched + x["t"] - saving, "path": x["dir"], "save_s": x["save_s"]})
        saving += x["save_s"]
    # A step's time, too, leaves out the saves before it.
    took = [(x["t"], x["save_s"]) for x in lines if "saved" in x]
    return launched, [{**r, "t": launched + r["t"] - sum(s for t, s in took if t < r["t"])} for r in records], saves


# --------------------------------------------------------------------------- rollouts' side


def rollouts_env(engine: str, extra: dict[str, str]) -> dict[str, str]:
    """The variables that make the demo's config the job (the list quoted: honcho's .env parser
    drops double quotes inside an unquoted value)."""
    quoted = {k: f"'{v}'" if v.startswith("[") else v for k, v in {**TASK_ENV, **extra}.items()}
    return {**quoted, "ROLLOUTS_GENERATOR__ENGINE": engine}


def run_rollouts(*, steps: int, tmp: Path, engine: str, extra: dict[str, str]) -> tuple[float, list[dict]]:
    """(launch time, per-step records) of `honcho start` on the demo config with the job above."""
    from ops.bench.end_to_end import run_pipeline

    launched = time.monotonic()
    arrivals, metrics = run_pipeline(generators=1, steps=steps, tmp=tmp, env=rollouts_env(engine, extra))
    return launched, [{"step": m["step"], "t": t, "reward": m["reward"], "metrics": m}
                      for t, m in zip(arrivals, metrics, strict=True)]


def run_rollouts_for(*, minutes: float, keep_every: int, tmp: Path, engine: str, extra: dict[str, str],
                     min_steps: int = 0, keep_seconds: float = 0) -> tuple[float, list[dict], list[dict]]:
    """(launch time, per-step records, kept checkpoints) of `honcho start` of the Procfile's
    redis, producer, generator and trainer on the job, stopped (Ctrl-C) `minutes` after launch
    once `min_steps` steps are done. Every `keep_every`-th published checkpoint is hard-linked out
    of the trainer's pruning; with `keep_seconds`, the newest one at each `keep_seconds` mark
    after launch, and the last one at the stop."""
    from common.audit import read_steps
    from ops.bench.end_to_end import TRAINER_STEP, honcho_run
    from ops.bench.shipped import process_env

    run, kept = tmp / "run", tmp / "kept"
    # eval.every: the producer keeps the held-out split out of training only while evaluation is
    # on; no version reaches this one, and no evaluator runs beside the sides.
    honcho = honcho_run(tmp, env={**rollouts_env(engine, extra), "ROLLOUTS_EVAL__EVERY": "1000000000",
                                  "ROLLOUTS_TRAINER__MAX_STEPS": "0"}, evaluator=False)
    stop, stopping = threading.Event(), threading.Event()
    arrivals: dict[int, float] = {}

    def link(d: Path, into: Path = kept) -> None:  # hard links of checkpoint d in `into`, whole or not at all
        part = into / f".{d.name}"
        shutil.rmtree(part, ignore_errors=True)
        part.mkdir(parents=True)
        try:
            for f in d.iterdir():
                os.link(f, part / f.name)
        except FileNotFoundError:  # pruned meanwhile
            shutil.rmtree(part, ignore_errors=True)
            print(f"  rollouts: {d.name} was pruned before it could be kept", flush=True)
            return
        part.rename(into / d.name)

    # With keep_seconds, each checkpoint is hard-linked into arrived/ once its step line is read and
    # its directory is whole, so the trainer's pruning cannot take the one a mark or the stop then
    # keeps: after the stop is decided it may still publish a few steps (not counted), and
    # keep_checkpoints of those would prune the last counted one. The trainer renames step_N into
    # place while it trains step N+1 (trainer.publish_in_background) and before it publishes N+1,
    # so by step N+1's line step_N is there; the last counted one, by the trainer's exit.
    arrived = tmp / "arrived"
    lock = threading.Lock()
    unlinked: list[int] = []  # steps whose line came and whose checkpoint is not linked yet

    def arrive(step: int | None = None) -> None:
        with lock:
            if step is not None:
                unlinked.append(step)
            for n in list(unlinked):
                if (d := run / "checkpoints" / f"step_{n}").is_dir():
                    link(d, into=arrived)
                    unlinked.remove(n)

    def newest() -> Path | None:  # the newest checkpoint whose step line came before the stop
        done = [d for d in arrived.glob("step_*") if int(d.name.split("_")[1]) in arrivals]
        return max(done, key=lambda d: int(d.name.split("_")[1]), default=None)

    def keep_newest() -> None:  # the newest arrived one into kept/; the older arrived links go
        with lock:
            if (d := newest()) and not (kept / d.name).exists():
                link(d)
            for old in arrived.glob("step_*"):
                if d is None or int(old.name.split("_")[1]) < int(d.name.split("_")[1]):
                    shutil.rmtree(old, ignore_errors=True)

    def keep() -> None:  # the trainer renames a complete step_N into place, then publishes it
        mark = keep_seconds
        while not stop.wait(0.2):
            if keep_seconds:
                arrive()
                if time.monotonic() - launched >= mark:
                    keep_newest()
                    mark = ((time.monotonic() - launched) // keep_seconds + 1) * keep_seconds
                continue
            for d in (run / "checkpoints").glob("step_*"):
                if not (int(d.name.split("_")[1]) % keep_every or (kept / d.name).exists()):
                    link(d)

    watcher = threading.Thread(target=keep, daemon=True)
    launched = time.monotonic()

    def stop_when_due(proc: subprocess.Popen) -> None:  # Ctrl-C once the time is up and min_steps done
        while not stop.wait(0.2):
            if time.monotonic() - launched >= minutes * 60 and len(arrivals) >= min_steps:
                stopping.set()
                proc.send_signal(signal.SIGINT)
                return

    with open(tmp / "honcho.log", "w") as log:
        proc = subprocess.Popen(honcho, cwd=tmp, env=process_env(), stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True)
        watcher.start()
        timer = threading.Thread(target=stop_when_due, args=(proc,), daemon=True)
        timer.start()
        try:
            for line in proc.stdout:
                log.write(line)
                late = stopping.is_set() or (time.monotonic() - launched >= minutes * 60 and len(arrivals) >= min_steps)
                if (m := TRAINER_STEP.search(line)) and not late:
                    arrivals[int(m.group(1))] = time.monotonic()
                    if keep_seconds:
                        arrive(int(m.group(1)))
                    print(f"  rollouts {arrivals[int(m.group(1))] - launched:5.0f} s: {line.rstrip()}", flush=True)
            proc.wait(timeout=120)
        finally:
            stop.set()
            timer.join()
            watcher.join()
            if keep_seconds:
                arrive()  # the last counted step's, written by the trainer's exit
                keep_newest()  # the last one, at the stop
                shutil.rmtree(arrived, ignore_errors=True)
            if proc.poll() is None:
                proc.kill()
    metrics = {m["step"]: m for m in read_steps(run / "metrics.jsonl")}
    assert arrivals, f"no trainer step in {minutes} minutes:\n{(tmp / 'honcho.log').read_text()[-4000:]}"
    records = [{"step": n, "t": t, "reward": metrics[n]["reward"], "length": metrics[n].get("completions/mean_length"),
                "metrics": metrics[n]} for n, t in sorted(arrivals.items())]
    checkpoints = [{"step": n, "t": arrivals[n], "path": str(kept / f"step_{n}")}
                   for n in sorted(arrivals) if (kept / f"step_{n}").is_dir()]
    # The run's own checkpoints and trainer states (1.6 GB each for the default model) are not
    # scored: only the kept links are, and the disk may not hold three sides' worth.
    for d in (run / "checkpoints", run / "trainer_state"):
        shutil.rmtree(d, ignore_errors=True)
    return launched, records, checkpoints


# --------------------------------------------------------------------------- scoring


def score(checkpoints: list[dict], config, *, prompts: int) -> list[float]:
    """Greedy held-out pass@1 of each checkpoint, by the evaluator's own code and engine, on the
    same `prompts` problems of the run's held-out split."""
    from dataclasses import replace

    from common.checkpoints import checksum_dir
    from common.evals import eval_request
    from evaluator import jobs

    jobs.CHUNK = prompts  # one batch per checkpoint: nothing here asks the job to stop midway
    out = []
    for i, c in enumerate(checkpoints, start=1):  # versions unique across both sides: each is loaded
        wv = SimpleNamespace(version=i, step=c["step"], path=c["path"], checksums=checksum_dir(c["path"]))
        req = replace(eval_request(config, wv), prompts=prompts, pass_k=0, evals_path="")
        result = jobs.evaluate(req)
        print(f"  {c['side']:8} step {c['step']:4} at {c['s']:5.0f} s: pass@1 {result.pass_at[1]:.3f} "
              f"on {result.prompts} problems ({result.seconds:.1f} s)", flush=True)
        out.append(result.pass_at[1])
    return out


def curves(checkpoints: list[dict], scores: list[float], *, start: float) -> dict[str, list[dict]]:
    """Each side's held-out pass@1 against seconds since its launch ({side: [{"step", "s", "pass@1"}]}),
    from its scored checkpoints, each side's first point the model both started from; printed too."""
    points: dict[str, list[dict]] = {}
    for c, acc in zip(checkpoints, scores, strict=True):
        points.setdefault(c["side"], [{"step": 0, "s": 0.0, "pass@1": start}]).append(
            {"step": c["step"], "s": c["s"], "pass@1": acc})
    print("held-out pass@1 against seconds since launch:")
    for side, ps in points.items():
        print(f"  {side}: " + " ".join(f"({p['s']:.0f} s, step {p['step']}, {p['pass@1']:.3f})" for p in ps))
    return points


def first_reaching(points: list[dict], accuracy: float) -> float | None:
    """Seconds since launch of the first checkpoint at `accuracy` or above; None if none is."""
    return next((p["s"] for p in points if p["pass@1"] >= accuracy - 1e-9), None)


def time_to_accuracy(points: dict[str, list[dict]]) -> dict:
    """Each side's final accuracy, the time each side needed to reach each side's final accuracy
    ({target: {side: seconds or None}}), and for each rollouts side the ratio TRL / it of the time
    to reach TRL's final accuracy (None: it did not within the run)."""
    final = {side: ps[-1]["pass@1"] for side, ps in points.items()}
    reach = {target: {side: first_reaching(ps, final[target]) for side, ps in points.items()} for target in points}
    ratio = {}
    if "trl" in points:
        trl_s = reach["trl"]["trl"]
        ratio = {side: trl_s / s if s else None for side, s in reach["trl"].items() if side != "trl"}
    return {"final": final, "reach": reach, "ratio": ratio}


def time_mode(args, config, extra: dict[str, str], model_dir: Path, py: Path | None, tmp: Path,
              progress: Callable[[dict], None] | None = None) -> dict:
    """Each of `args.sides` for `args.minutes` from its launch, one after the other, then every kept
    checkpoint scored; `progress` (if given) gets {"steps", "checkpoints"} after each side."""
    checkpoints: list[dict] = []
    steps: dict[str, list[dict]] = {}
    how = {"min_steps": args.min_steps, "keep_seconds": args.keep_seconds}
    for side in args.sides:
        print(f"--- {side}: {args.minutes} minutes", flush=True)
        if side == "trl":
            launched, records, kept = run_trl(py, trl_job(config), steps=0, minutes=args.minutes,
                                              keep_every=args.keep_every, model_dir=model_dir, tmp=tmp / "trl",
                                              device=args.device, **how)
        else:
            launched, records, kept = run_rollouts_for(minutes=args.minutes, keep_every=args.keep_every,
                                                       tmp=tmp / side, engine=engine_of(side, args), extra=extra,
                                                       **how)
        steps[side] = [{"step": r["step"], "s": round(r["t"] - launched, 1), "reward": r["reward"],
                        "length": r.get("length")} for r in records]
        print(f"{side}: {len(records)} steps, the last {records[-1]['t'] - launched:.0f} s after launch; "
              f"{len(kept)} checkpoints kept", flush=True)
        checkpoints += [{**c, "side": side, "s": round(c["t"] - launched, 1)} for c in kept]
        if progress:
            progress({"steps": steps, "checkpoints": checkpoints})
    # The model both sides start from, at their launch.
    checkpoints.insert(0, {"side": "start", "step": 0, "s": 0.0, "path": str(model_dir)})
    print(f"--- scoring {len(checkpoints)} checkpoints on {args.eval_prompts} held-out problems", flush=True)
    scores = score(checkpoints, config, prompts=args.eval_prompts)
    points = curves(checkpoints[1:], scores[1:], start=scores[0])
    result = {"minutes": args.minutes, "eval_prompts": args.eval_prompts, "points": points, "steps": steps,
              **time_to_accuracy(points)}
    for target, by_side in result["reach"].items():
        print(f"time to {target}'s final accuracy ({result['final'][target]:.3f}): " + ", ".join(
            f"{side} " + (f"{s:.0f} s" if s is not None else f"not within {args.minutes} min")
            for side, s in by_side.items()))
    for side, ratio in result["ratio"].items():
        print(f"TRL / {side}, time to TRL's final accuracy: "
              + (f"{ratio:.2f}" if ratio else f"{side} did not reach it within {args.minutes} min"))
    return result


def engine_of(side: str, args) -> str:
    return "hf" if side == "rollouts-hf" else args.engine


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.6))
    for side, ps in result["points"].items():
        ax.plot([p["s"] / 60 for p in ps], [p["pass@1"] for p in ps], marker="o", label=side)
    ax.set_xlabel("minutes since launch")
    ax.set_ylabel(f"held-out pass@1 ({result['eval_prompts']} problems)")
    ax.set_ylim(0, 1)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


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


def steps_mode(args, config, extra: dict[str, str], model_dir: Path, py: Path | None, tmp: Path) -> dict:
    rates, runs = {}, {}
    for side in args.sides:
        print(f"--- {side}: {args.steps} steps", flush=True)
        if side == "trl":
            launched, records, _ = run_trl(py, trl_job(config), steps=args.steps, minutes=0, keep_every=1,
                                           model_dir=model_dir, tmp=tmp / "trl")
        else:
            launched, records = run_rollouts(steps=args.steps, tmp=tmp / side, engine=engine_of(side, args),
                                             extra=extra)
        rates[side] = summary(side, launched, records, skip=args.skip)
        runs[side] = [{"step": r["step"], "s": r["t"] - launched, "reward": r["reward"]} for r in records]
    if "trl" in rates:
        for side in (s for s in rates if s != "trl"):
            print(f"{side} / TRL steps per minute: {rates[side] / rates['trl']:.2f}")
    return runs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--minutes", type=float, default=0, help="time to accuracy: minutes per side from launch")
    how.add_argument("--steps", type=int, default=0, help="throughput: optimizer steps per side")
    ap.add_argument("--skip", type=int, default=2, help="steps left out of the median s/step (--steps)")
    ap.add_argument("--keep-every", type=int, default=5, help="keep every this many steps' checkpoint (--minutes)")
    ap.add_argument("--keep-seconds", type=float, default=0,
                    help="instead, keep the newest checkpoint every this many seconds from launch, and the last")
    ap.add_argument("--min-steps", type=int, default=0, help="stop a side (--minutes) not before this many steps")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="TRL's side trains on this")
    ap.add_argument("--trl-python", type=Path, help="an interpreter that imports TRL (default: --venv's)")
    ap.add_argument("--eval-prompts", type=int, default=128, help="held-out problems a checkpoint is scored on")
    ap.add_argument("--sides", nargs="+", choices=["trl", "rollouts", "rollouts-hf"], default=["trl", "rollouts"],
                    help="rollouts: its generator on --engine; rollouts-hf: on HF generate, as TRL's")
    ap.add_argument("--venv", type=Path, default=ROOT / "runs" / "trl-venv", help="TRL's virtualenv")
    ap.add_argument("--trl", default="trl==1.16.*", help="pip requirement of TRL")
    ap.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"],
                    help="rollouts' generator engine (auto: vLLM where installed, as ./ops/run)")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE",
                    help="more of the job's config (both sides), as environment variables")
    ap.add_argument("--work", type=Path, help="keep each side's logs, metrics and checkpoints here (emptied first; "
                    "default: a temporary directory, removed)")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--png", type=Path, help="plot accuracy against time here (--minutes)")
    ap.add_argument("--trl-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--job", help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_worker is not None:
        trl_worker(args.trl_worker, json.loads(args.job), steps=args.steps, minutes=args.minutes,
                   keep_every=args.keep_every, model_dir=args.model_dir, device=args.device,
                   min_steps=args.min_steps, keep_seconds=args.keep_seconds)
        return
    if not (args.minutes or args.steps):
        ap.error("give --minutes N (time to accuracy) or --steps N (throughput)")
    if args.steps:
        assert args.steps >= args.skip + 2, "--steps must leave at least two steps after --skip"
    bad = [e for e in args.env if "=" not in e or not e.startswith("ROLLOUTS_")]
    assert not bad, f"--env takes ROLLOUTS_...=VALUE, got {bad}"
    extra = dict(e.split("=", 1) for e in args.env)
    config = job_config(extra)
    from common.models import resolve_model_path

    model_dir = resolve_model_path(config.model.path)
    py = (args.trl_python or trl_python(args.venv, args.trl)) if "trl" in args.sides else None
    tmp = args.work or Path(tempfile.mkdtemp(prefix="rollouts-vs-trl-"))
    if args.work:
        shutil.rmtree(args.work, ignore_errors=True)
    try:
        result = (time_mode if args.minutes else steps_mode)(args, config, extra, model_dir, py, tmp)
    finally:
        if not args.work:
            shutil.rmtree(tmp, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    if args.png and args.minutes:
        plot(result, args.png)


if __name__ == "__main__":
    main()
