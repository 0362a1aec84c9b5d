"""`rollouts`: the operator's command: `prepare-model`, `status`, `plot`, `record`, `replay`."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from common.config import ConfigError, load_config


def _group_info(r, stream: str, group: str) -> dict:
    """Pending and not-yet-delivered counts of `group` on `stream` (zeros if absent)."""
    if not r.exists(stream):
        return {"length": 0, "pending": 0, "lag": 0}
    info = {g["name"].decode(): g for g in r.xinfo_groups(stream)}.get(group, {})
    return {"length": r.xlen(stream), "pending": info.get("pending", 0), "lag": info.get("lag") or 0}


def _trainer_line(trainer: dict[str, str], status: dict[str, str], now: float) -> str:
    line = (f"trainer    step {trainer.get('step', 0)}  version {trainer.get('version', 0)}  "
            # groups acknowledged: trained and in a saved trainer state
            f"trained+saved {trainer.get('groups_trained', 0)}  dropped stale {trainer.get('groups_dropped_stale', 0)}")
    if "last_step_s" in status:
        trainer = status
        step_s, wait_s = float(status["last_step_s"]), float(status.get("last_wait_s", 0))
        line += (f"\n           last step {step_s:.1f}s (waiting for data {wait_s / max(step_s, 1e-9):.0%})  "
                 f"{float(trainer.get('tokens_per_s', 0)):.0f} tok/s  "
                 f"staleness {float(trainer.get('staleness_mean', 0)):.1f} mean / "
                 f"{float(trainer.get('staleness_max', 0)):.0f} max  "
                 f"updated {now - float(trainer.get('updated_at', now)):.0f}s ago")
    return line


def _generator_lines(r, keys, now: float) -> list[str]:
    """Live generators from their heartbeats; dead ones (heartbeat expired) from the consumers of
    the prompts stream, with the prompts they still hold until another generator reclaims them."""
    from common.keys import GENERATORS_GROUP

    lines, alive = [], set()
    for key in sorted(r.scan_iter(match=keys.generator_pattern)):
        g = {k.decode(): v.decode() for k, v in r.hgetall(key).items()}
        if not g:
            continue
        name = key.decode().removeprefix(keys.generator(""))
        alive.add(name)
        seen = now - float(g.get("last_seen", now))
        troubles = [f"{label} {g[field]}" for field, label in (
            ("reward_errors", "reward errors"), ("dropped_zero_variance", "dropped (zero variance)"),
            ("weights_refused", "weights refused")) if g.get(field, "0") != "0"]
        lines.append(f"generator  {name}  {g.get('engine', '?')}  v{g.get('version', '?')}  "
                     f"{float(g.get('tokens_per_s', 0)):.1f} tok/s  in flight {g.get('in_flight', 0)}  "
                     f"heartbeat {seen:.0f}s ago" + "".join(f"  {t}" for t in troubles))
    consumers = r.xinfo_consumers(keys.prompts, GENERATORS_GROUP) if r.exists(keys.prompts) else []
    for c in consumers:
        name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
        if name not in alive:
            lines.append(f"generator  {name}  DEAD (no heartbeat; last read {c['idle'] / 1000:.0f}s ago)  "
                         f"holds {c['pending']} prompts")
    return lines


def status_lines(r, run: str) -> list[str]:
    """What `rollouts status` prints: the run's state as Redis holds it."""
    from common.keys import GENERATORS_GROUP, TRAINER_GROUP, Keys

    keys = Keys(run)

    def h(key: str) -> dict[str, str]:
        return {k.decode(): v.decode() for k, v in r.hgetall(key).items()}

    producer, trainer = h(keys.producer), h(keys.trainer)
    prompts = _group_info(r, keys.prompts, GENERATORS_GROUP)
    samples = _group_info(r, keys.samples, TRAINER_GROUP)
    now = time.time()
    lines = [
        f"run {run}",
        f"producer   admitted {producer.get('admitted', 0)}  skipped rows {producer.get('rows_skipped', 0)}  "
        + "  ".join(f"{k.removesuffix(':offset')} at {producer.get(k[:-7] + ':epoch', 0)}:{v}"
                    for k, v in sorted(producer.items()) if k.endswith(":offset")),
        f"prompts    waiting {prompts['lag']}  in flight {prompts['pending']}  dead {r.xlen(keys.prompts_dead)}",
        f"samples    stream {samples['length']}  waiting {samples['lag']}  unacknowledged {samples['pending']}  "
        f"dead {r.xlen(keys.samples_dead)}",
        _trainer_line(trainer, h(keys.trainer_status), now),
    ]
    evals = {int(v): json.loads(res) for v, res in r.hgetall(keys.evals).items()}
    if evals:
        newest = evals[max(evals)]
        scores = "  ".join(f"{k[5:]} {v:.3f}" for k, v in newest.items() if k.startswith("eval/pass"))
        lines.append(f"eval       v{newest['version']}  {scores or newest.get('eval/skipped', '')}  "
                     f"({len(evals)} checkpoints evaluated)")
    return lines + _generator_lines(r, keys, now)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollouts", description="Operate a rollouts run.")
    sub = parser.add_subparsers(dest="command", required=True)
    prep = sub.add_parser("prepare-model", help="convert the built-in default model into the cache (once)")
    prep.add_argument("--force", action="store_true", help="convert again even if present")
    st = sub.add_parser("status", help="the run's state, read from Redis")
    st.add_argument("--config", help="TOML file (default: $ROLLOUTS_CONFIG or ./rollouts.toml)")
    st.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    pl = sub.add_parser("plot", help="PNG charts of a run's per-step metrics")
    pl.add_argument("--config", help="TOML file whose output_dir holds metrics.jsonl")
    pl.add_argument("--metrics", help="a metrics.jsonl file (instead of the config's)")
    pl.add_argument("--out", help="PNG to write (default: metrics.png beside the metrics)")
    pl.add_argument("--title", default="", help="title above the charts")
    rec = sub.add_parser("record", help="write a run's streams to a file (msgpack), entries in order")
    rec.add_argument("--config", help="TOML file (default: $ROLLOUTS_CONFIG or ./rollouts.toml)")
    rec.add_argument("--stream", action="append", choices=["samples", "prompts", "weights"],
                     help="stream to record (repeat for several; default: samples)")
    rec.add_argument("--out", required=True, help="recording file to write")
    rec.add_argument("--until-idle", type=float, metavar="SECONDS",
                     help="stop once no new entry came for SECONDS (default: until Ctrl-C)")
    rp = sub.add_parser("replay", help="write a recording into the streams of a fresh run")
    rp.add_argument("file", help="recording made by `rollouts record`")
    rp.add_argument("--config", help="TOML file naming the run to write into")
    rp.add_argument("--pace", choices=["full", "recorded"], default="full",
                    help="full speed, or spaced as recorded")
    rp.add_argument("--stream", action="append", choices=["samples", "prompts", "weights"],
                    help="replay only this stream of the file (repeat for several; default: all)")
    args = parser.parse_args(argv)

    if args.command == "prepare-model":
        from common.models import prepare_default_model

        print(prepare_default_model(force=args.force))
        return

    try:
        config = load_config(args.config) if args.command != "plot" or not args.metrics else None
    except ConfigError as err:
        sys.exit(f"rollouts: {err}")

    if args.command == "plot":
        from common.plot import plot, read_evals, read_metrics

        metrics = Path(args.metrics) if args.metrics else config.metrics_path
        if not metrics.is_file():
            sys.exit(f"rollouts: no metrics file at {metrics}")
        try:
            rows = read_metrics(metrics)
        except ValueError as err:
            sys.exit(f"rollouts: {err}")
        evals = read_evals(metrics.with_name("evals.jsonl"))  # the evaluator's, beside the trainer's
        print(plot(rows, args.out or metrics.with_name("metrics.png"), title=args.title, evals=evals))
        return

    import redis

    from common.streams import connect, lost_redis, no_permission, redacted

    try:  # a refused password or ACL permission, or Redis away: one line, not a traceback
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
