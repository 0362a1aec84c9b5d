"""On-policy distillation from a teacher against reward-only RL, from the same start: held-out pass@1
against time.

    .venv/bin/python ops/bench/distill.py --minutes 5 --teacher-minutes 10 [--teacher DIR]
        [--sides rl distill] [--distill-weight 1.0] [--keep-seconds 60] [--eval-prompts 128]
        [--engine auto|hf] [--env NAME=VALUE ...] [--work DIR] [--json FILE]
    .venv/bin/python ops/bench/distill.py --dry-run --model DIR     (the plumbing, on a tiny model)

The job is ops/bench/vs_trl.py's: the demo's config (`configs/demo.toml`) on 2-digit addition, the
default model (SmolLM2-135M-Instruct), with `--env` on top. The teacher is that model after an RL
run of ours on the same job: `--teacher DIR` names one (a checkpoint directory), else the bench
first trains it for `--teacher-minutes` and keeps its last checkpoint. Then, one after the other,
each side runs `--minutes` from its launch (vs_trl.py's `run_rollouts_for`: redis, producer, one
generator, trainer; the newest checkpoint kept every `--keep-seconds`, and the last):

    rl:      the job as it is: the reward (1 for the right number) alone;
    distill: the same with `[teacher] path` = the teacher and `distill_weight`: every sampled token's
             advantage is the group's reward advantage minus distill_weight x (log pi_behaviour -
             log pi_teacher) (docs/training.md, "On-policy distillation from a teacher").

Afterwards, with nothing else running, the start, the teacher and every kept checkpoint are scored
by the evaluator's own code on the same `--eval-prompts` held-out problems (greedy pass@1), and the
last line gives each side's final held-out pass@1.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

_spec = importlib.util.spec_from_file_location("vs_trl", ROOT / "ops" / "bench" / "vs_trl.py")
vs_trl = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vs_trl)

SIDES = ("rl", "distill")
# --dry-run: the plumbing on a tiny model in about half a minute a run (no figures)
DRY_ENV = {"ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "8", "ROLLOUTS_TRAINER__STATE_EVERY": "0"}


def side_env(side: str, teacher: Path, distill_weight: float) -> dict[str, str]:
    """The ROLLOUTS_... variables a side adds to the job."""
    if side == "rl":
        return {}
    if side == "distill":
        return {"ROLLOUTS_TEACHER__PATH": str(teacher), "ROLLOUTS_TEACHER__DISTILL_WEIGHT": str(distill_weight)}
    raise ValueError(f"side {side!r} is not one of {', '.join(SIDES)}")


def train_teacher(*, minutes: float, tmp: Path, engine: str, extra: dict[str, str]) -> Path:
    """The job's model after `minutes` of reward-only RL on the job: its last kept checkpoint."""
    print(f"--- teacher: {minutes} minutes of RL on the job", flush=True)
    _, records, kept = vs_trl.run_rollouts_for(minutes=minutes, keep_every=0, tmp=tmp, engine=engine, extra=extra,
                                               keep_seconds=minutes * 60)
    assert kept, f"the teacher's run kept no checkpoint in {minutes} minutes ({len(records)} steps)"
    print(f"teacher: step {kept[-1]['step']} of {len(records)}", flush=True)
    return Path(kept[-1]["path"])


def final_table(points: dict[str, list[dict]]) -> str:
    """One line per scored run: its last point's held-out pass@1, step and seconds since launch."""
    return "\n".join(f"  {side:8} pass@1 {ps[-1]['pass@1']:.3f} (step {ps[-1]['step']}, {ps[-1]['s']:.0f} s)"
                     for side, ps in points.items())


def run(args) -> dict:
    extra = {**(DRY_ENV if args.dry_run else {}), **dict(e.split("=", 1) for e in args.env)}
    if args.model:
        extra["ROLLOUTS_MODEL__PATH"] = str(args.model)
    config = vs_trl.job_config(extra)
    from common.models import resolve_model_path

    start = resolve_model_path(config.model.path)
    tmp = args.work or Path(tempfile.mkdtemp(prefix="rollouts-distill-"))
    if args.work:
        shutil.rmtree(args.work, ignore_errors=True)
    try:
        teacher = args.teacher or train_teacher(minutes=args.teacher_minutes, tmp=tmp / "teacher", engine=args.engine,
                                                extra=extra)
        checkpoints = [{"side": "start", "step": 0, "s": 0.0, "path": str(start)},
                       {"side": "teacher", "step": 0, "s": 0.0, "path": str(teacher)}]
        steps = {}
        for side in args.sides:
            print(f"--- {side}: {args.minutes} minutes", flush=True)
            launched, records, kept = vs_trl.run_rollouts_for(
                minutes=args.minutes, keep_every=0, tmp=tmp / side, engine=args.engine,
                extra={**extra, **side_env(side, teacher, args.distill_weight)}, keep_seconds=args.keep_seconds)
            steps[side] = [{"step": r["step"], "s": round(r["t"] - launched, 1), "reward": r["reward"],
                            "teacher_kl": r["metrics"].get("teacher_kl")} for r in records]
            print(f"{side}: {len(records)} steps; {len(kept)} checkpoints kept", flush=True)
            checkpoints += [{**c, "side": side, "s": round(c["t"] - launched, 1)} for c in kept]
        print(f"--- scoring {len(checkpoints)} checkpoints on {args.eval_prompts} held-out problems", flush=True)
        scores = vs_trl.score(checkpoints, config, prompts=args.eval_prompts)
    finally:
        if not args.work:
            shutil.rmtree(tmp, ignore_errors=True)
    points = {"teacher": [{"step": 0, "s": 0.0, "pass@1": scores[1]}],
              **vs_trl.curves(checkpoints[2:], scores[2:], start=scores[0])}
    print(f"final held-out pass@1 on {args.eval_prompts} problems (start {scores[0]:.3f}):\n" + final_table(points))
    return {"minutes": args.minutes, "eval_prompts": args.eval_prompts, "start": scores[0], "points": points,
            "steps": steps, "distill_weight": args.distill_weight}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=5, help="minutes per side from its launch")
    ap.add_argument("--teacher", type=Path, help="the teacher's checkpoint directory (default: trained first)")
    ap.add_argument("--teacher-minutes", type=float, default=10, help="minutes of RL that train the teacher")
    ap.add_argument("--sides", nargs="+", choices=SIDES, default=list(SIDES))
    ap.add_argument("--distill-weight", type=float, default=1.0, help="[teacher] distill_weight of the distill side")
    ap.add_argument("--keep-seconds", type=float, default=60,
                    help="keep the newest checkpoint this often, and the last")
    ap.add_argument("--eval-prompts", type=int, default=128, help="held-out problems each checkpoint is scored on")
    ap.add_argument("--engine", default="auto", choices=["auto", "vllm", "hf"], help="the generators' engine")
    ap.add_argument("--model", type=Path, help="the job's model instead of the default (--dry-run: a tiny one)")
    ap.add_argument("--env", nargs="*", default=[], metavar="NAME=VALUE", help="more of the job's config")
    ap.add_argument("--dry-run", action="store_true", help="short new-token budget, no trainer state: the plumbing")
    ap.add_argument("--work", type=Path, help="keep the runs' logs and checkpoints here (emptied first)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    bad = [e for e in args.env if "=" not in e or not e.startswith("ROLLOUTS_")]
    if bad:
        ap.error(f"--env takes ROLLOUTS_...=VALUE, got {bad}")
    if args.dry_run and not args.model:
        ap.error("--dry-run needs --model (a tiny model directory)")
    result = run(args)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
