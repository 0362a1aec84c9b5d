"""`rollouts`: the operator's command: `prepare-model`, `status`, `plot`, `record`, `replay`,
`serve-checkpoints`, `check`, `view`."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import ConfigError, add_config_flags, load_config

if TYPE_CHECKING:
    from common.progress import TrainerProgress, TrainerStatus


def _trainer_line(trainer: TrainerProgress, status: TrainerStatus | None, now: float) -> str:
    line = (f"trainer    step {trainer.step}  version {trainer.version}  "
            # groups acknowledged: trained and in a saved trainer state
            f"trained+saved {trainer.groups_trained}  dropped stale {trainer.groups_dropped_stale}")
    if status is not None:
        line += (f"\n           last step {status.last_step_s:.1f}s "
                 f"(waiting for data {status.last_wait_s / max(status.last_step_s, 1e-9):.0%})  "
                 f"{status.tokens_per_s:.0f} tok/s  "
                 f"staleness {status.staleness_mean:.1f} mean / {status.staleness_max:.0f} max  "
                 f"updated {now - status.updated_at:.0f}s ago")
    return line


def _generator_lines(r, keys, now: float) -> list[str]:
    """Live generators from their heartbeats; dead ones (heartbeat expired) from the consumers of
    the prompts stream, with the prompts they still hold until another generator reclaims them."""
    from common.heartbeats import read_heartbeats
    from common.keys import GENERATORS_GROUP
    from common.quarantine import read_quarantines

    lines = []
    beats = read_heartbeats(r, keys)
    for name, g in beats.items():
        troubles = [f"{label} {n}" for n, label in (
            (g.reward_errors, "reward errors"), (g.dropped_zero_variance, "dropped (zero variance)"),
            (g.weights_refused, "weights refused"), (g.teacher_errors, "teacher errors")) if n]
        lines.append(f"generator  {name}  {g.engine}  v{g.version}  {g.tokens_per_s:.1f} tok/s  "
                     f"in flight {g.in_flight}  heartbeat {now - g.last_seen:.0f}s ago"
                     + "".join(f"  {t}" for t in troubles))
    for name, q in sorted(read_quarantines(r, keys).items()):
        lines.append(f"generator  {name}  QUARANTINED: {q.line()}")
    consumers = r.xinfo_consumers(keys.prompts, GENERATORS_GROUP) if r.exists(keys.prompts) else []
    for c in consumers:
        name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
        if name not in beats:
            lines.append(f"generator  {name}  DEAD (no heartbeat; last read {c['idle'] / 1000:.0f}s ago)  "
                         f"holds {c['pending']} prompts")
    return lines


def status_lines(r, run: str) -> list[str]:
    """What `rollouts status` prints: the run's state as Redis holds it."""
    from common.deadletters import count_dead_letters
    from common.evals import read_evals
    from common.keys import GENERATORS_GROUP, TRAINER_GROUP, Keys
    from common.metrics import latest_step, status_line
    from common.progress import read_producer, read_status, read_trainer
    from common.streams import group_backlog

    keys = Keys(run)
    producer = read_producer(r, keys)
    prompts_pending, prompts_waiting = group_backlog(r, keys.prompts, GENERATORS_GROUP)
    samples_pending, samples_waiting = group_backlog(r, keys.samples, TRAINER_GROUP)
    now = time.time()
    lines = [
        f"run {run}",
        f"producer   admitted {producer.admitted}  skipped rows {producer.rows_skipped}  "
        + "  ".join(f"{name} at {p.epoch}:{p.offset}" for name, p in producer.sources.items()),
        f"prompts    waiting {prompts_waiting}  in flight {prompts_pending}  "
        f"dead {count_dead_letters(r, keys.prompts_dead)}",
        f"samples    stream {r.xlen(keys.samples)}  waiting {samples_waiting}  unacknowledged {samples_pending}  "
        f"dead {count_dead_letters(r, keys.samples_dead)}",
        _trainer_line(read_trainer(r, keys), read_status(r, keys), now),
    ]
    last = latest_step(r, keys)
    if last is not None:
        lines.append(status_line(last))
    evals = read_evals(r, keys)
    if evals:
        newest = evals[max(evals)]
        lines.append(f"eval       v{newest.version}  {newest.summary(sep='  ')}  "
                     f"({len(evals)} checkpoints evaluated)")
    return lines + _generator_lines(r, keys, now)


PROCESSES = """\
processes of a run (each reads the same config: --config FILE ..., ROLLOUTS_* variables,
--section.field VALUE flags; `python -m trainer --help` lists every field):
  ./ops/run                           all of them on this machine (honcho and the Procfile)
  redis-server --appendonly yes ...   the meeting point; every process takes redis_url
  python -m producers                 admits prompts from the run's sources
  python -m generators [--id ID]      samples and scores groups (start any number, anywhere)
  torchrun --nproc-per-node N -m trainer
                                      GRPO/SFT steps, publishes weights (--nnodes for several hosts)
  python -m evaluator [--burst]       scores published checkpoints (RQ worker, eval.every > 0)
"""


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollouts", description="Operate a rollouts run.", epilog=PROCESSES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare-model", help="convert the built-in default model into the cache (once)")
    prep.add_argument("--force", action="store_true", help="convert again even if present")
    prep.add_argument("--unless-configured", action="store_true",
                      help="do nothing when the run's config names a model.path of its own (./ops/run)")
    prep.set_defaults(overrides=add_config_flags(prep))
    st = sub.add_parser("status", help="the run's state, read from Redis")
    st.set_defaults(overrides=add_config_flags(st))
    st.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    pl = sub.add_parser("plot", help="PNG charts of a run's per-step metrics")
    pl.set_defaults(overrides=add_config_flags(pl))  # the config's output_dir holds metrics.jsonl
    pl.add_argument("--metrics", help="a metrics.jsonl file (instead of the config's)")
    pl.add_argument("--out", help="PNG to write (default: metrics.png beside the metrics)")
    pl.add_argument("--title", default="", help="title above the charts")
    rec = sub.add_parser("record", help="write a run's streams to a file (msgpack), entries in order")
    rec.set_defaults(overrides=add_config_flags(rec))
    rec.add_argument("--stream", action="append", choices=["samples", "prompts", "weights"],
                     help="stream to record (repeat for several; default: samples)")
    rec.add_argument("--out", required=True, help="recording file to write")
    rec.add_argument("--until-idle", type=float, metavar="SECONDS",
                     help="stop once no new entry came for SECONDS (default: until Ctrl-C)")
    sv = sub.add_parser("serve-checkpoints", help="serve the run's published checkpoints over HTTP, read-only "
                        "(for generators without shared storage: generator.weights_url)")
    sv.add_argument("--bind", default="127.0.0.1:8100", metavar="HOST:PORT", help="address to listen on")
    sv.set_defaults(overrides=add_config_flags(sv))
    rp = sub.add_parser("replay", help="write a recording into the streams of a fresh run")
    rp.add_argument("file", help="recording made by `rollouts record`")
    rp.set_defaults(overrides=add_config_flags(rp))  # the config names the run to write into
    rp.add_argument("--pace", choices=["full", "recorded"], default="full",
                    help="full speed, or spaced as recorded")
    rp.add_argument("--stream", action="append", choices=["samples", "prompts", "weights"],
                    help="replay only this stream of the file (repeat for several; default: all)")
    # Its flags are the checks process's own (`rollouts check --help` prints them): main passes them on.
    sub.add_parser("check", help="before a long run: sample a few groups (and play episodes) as the generators "
                   "do and say whether the trainer's log-probs, the rewards and the chat template agree with them, "
                   "and the trainer's memory per rank (exit 0 or 1)")
    # Its flags too are its own process's (`rollouts view --help`): main passes them on.
    sub.add_parser("view", help="a local web page over the run's sample groups, token by token, coloured by "
                   "advantage or behaviour log-prob (the samples stream, or a recording), until Ctrl-C")
    return parser


def check_command(argv: list[str], env: dict[str, str]) -> None:
    """`rollouts check`: run as its own process (`python -m checks`, the same arguments), which
    opens an engine and the trainer's model as the run's processes do; common imports neither."""
    # The libraries' notices kept off its report, as ./ops/run keeps them off the console (a
    # variable you set yourself wins).
    quiet = {"VLLM_LOGGING_LEVEL": "ERROR", "TORCH_CPP_LOG_LEVEL": "ERROR", "TRANSFORMERS_VERBOSITY": "error",
             "PYTHONWARNINGS": "ignore::DeprecationWarning,ignore::FutureWarning"}
    try:
        sys.exit(subprocess.run([sys.executable, "-m", "checks", *argv], env={**quiet, **env}).returncode)
    except KeyboardInterrupt:  # Ctrl-C reached the check too (one process group): it says so itself
        sys.exit(130)


def view_command(argv: list[str], env: dict[str, str]) -> None:
    """`rollouts view`: becomes the viewer's process (`python -m viewer`, the same arguments), which
    serves its page until Ctrl-C; common imports no package above it."""
    os.execve(sys.executable, [sys.executable, "-m", "viewer", *argv], env)


def dotenv(path: Path) -> dict[str, str]:
    """The variables of an env file as honcho reads it (`.env`: KEY=VALUE lines, # comments,
    optional quotes); {} if there is none."""
    if not path.is_file():
        return {}
    out = {}
    for line in path.read_text().splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and key and not key.startswith("#"):
            value = value.strip()
            if len(value) >= 2 and value[0] == value[-1] and value[0] in "'\"":
                value = value[1:-1]
            out[key.strip().removeprefix("export ").strip()] = value
    return out


def plot_command(metrics: Path, *, out: str | None, title: str) -> None:
    """`rollouts plot`: the charts of a metrics file (and the evaluations beside it) as a PNG."""
    from common.evals import read_evals_file
    from common.metrics import read_metrics
    from common.plot import plot

    if not metrics.is_file():
        sys.exit(f"rollouts: no metrics file at {metrics}")
    try:
        rows = read_metrics(metrics)
    except ValueError as err:
        sys.exit(f"rollouts: {err}")
    evals = [e for e in read_evals_file(metrics.with_name("evals.jsonl"))  # the evaluator's, beside ours
             if e.skipped is None]
    print(plot(rows, out or metrics.with_name("metrics.png"), title=title, evals=evals))


def serve_checkpoints(config, *, bind: str) -> None:
    """`rollouts serve-checkpoints`: answer GETs for the run's published files until stopped."""
    from common.checkpoint_server import CheckpointServer
    from common.keys import Keys
    from common.streams import connect

    host, _, port = bind.rpartition(":")
    server = CheckpointServer((host, int(port)), r=connect(config.redis_url, wait_s=2.0), keys=Keys(config.run))
    print(f"rollouts: serving run {config.run!r}'s published checkpoints on http://{bind}", flush=True)
    server.serve_forever()


def prepare_model_command(args: argparse.Namespace, env: dict[str, str]) -> None:
    """Convert the built-in model into the cache, once; with --unless-configured, only where the
    run's config leaves model.path empty (a run of your own model needs no conversion)."""
    from common.models import prepare_default_model

    if args.unless_configured:
        try:
            path = load_config(args.config, env=env, overrides=args.overrides(args)).model.path
        except ConfigError as err:
            sys.exit(f"rollouts: {err}")
        if path:
            print(f"model.path is {path}: the default model is not needed")
            return
    print(prepare_default_model(force=args.force))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    # Run from the checkout without --config, the command sees the run the processes see: honcho
    # gives them `.env` (the Redis URL, the config file); the environment, where set, still wins.
    if argv[:1] in (["check"], ["view"]):
        given = any(a == "--config" or a.startswith("--config=") for a in argv)
        env = dict(os.environ) if given else {**dotenv(Path(".env")), **os.environ}
        return check_command(argv[1:], env) if argv[0] == "check" else view_command(argv[1:], env)
    args = parser().parse_args(argv)
    env = dict(os.environ) if getattr(args, "config", None) else {**dotenv(Path(".env")), **os.environ}
    if args.command == "prepare-model":
        return prepare_model_command(args, env)

    try:
        config = load_config(args.config, env=env, overrides=args.overrides(args)) \
            if args.command != "plot" or not args.metrics else None
    except ConfigError as err:
        sys.exit(f"rollouts: {err}")

    if args.command == "plot":
        return plot_command(Path(args.metrics) if args.metrics else config.metrics_path, out=args.out,
                            title=args.title)

    import redis

    from common.streams import connect, lost_redis, no_permission, redacted

    try:  # a refused password or ACL permission, or Redis away: one line, not a traceback
        if args.command == "serve-checkpoints":
            return serve_checkpoints(config, bind=args.bind)
        if args.command in ("record", "replay"):
            from common.recording import record_command, replay_command

            record_command(config, streams=args.stream or ["samples"], out=Path(args.out),
                           until_idle_s=args.until_idle) if args.command == "record" \
                else replay_command(config, path=Path(args.file), pace=args.pace, only=args.stream)
            return
        r = connect(config.redis_url, wait_s=2.0)
        while True:
            out = "\n".join(status_lines(r, config.run))
            print(("\033[H\033[J" if args.watch else "") + out, flush=True)
            if not args.watch:
                return
            time.sleep(args.watch)
    except redis.exceptions.AuthenticationError as err:
        sys.exit(lost_redis("rollouts", config.redis_url, err))
    except redis.exceptions.NoPermissionError as err:
        sys.exit(no_permission("rollouts", config.redis_url, err))
    except redis.exceptions.ConnectionError as err:
        sys.exit(f"rollouts: cannot reach Redis at {redacted(config.redis_url)} ({err})")


if __name__ == "__main__":
    main()
