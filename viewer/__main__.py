"""`rollouts view [--config FILE ...] [--port N] [--recording FILE] [--metrics FILE] [--history DIR]`:
serve a local page over the run's sample groups (its samples stream and the history of every group
it trained, or a recording), each completion's tokens coloured by advantage or behaviour log-prob,
until Ctrl-C."""

import argparse
import signal
import socket
import sys
from pathlib import Path

from common.config import Config
from common.process import Stop, run_process

PORT = 8200  # the first port tried without --port; the next ones while it is taken
PORTS_TRIED = 50


def flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--port", type=int, help=f"port to serve on (default: the first free one from {PORT})")
    parser.add_argument("--host", default="127.0.0.1",
                        help="address to bind (default: 127.0.0.1, this machine only; the page has no login)")
    parser.add_argument("--recording", metavar="FILE",
                        help="show the groups of a recording (`rollouts record`) instead of the samples stream")
    parser.add_argument("--metrics", metavar="FILE",
                        help="the trainer's metrics.jsonl, for the steps (default: the config's output_dir's)")
    parser.add_argument("--history", metavar="DIR",
                        help="the trainer's history of trained groups (default: the config's output_dir/history)")
    parser.add_argument("--newest", type=int, default=1000, metavar="N",
                        help="entries of the samples stream read, newest first (default: 1000)")


def tokenizer_of(config: Config, recorded: dict | None):
    """The run's tokenizer (model.path; for a recording, the model it names where model.path has
    none); None, said once, where neither loads: tokens are then shown by id."""
    from transformers import AutoTokenizer

    from common.models import ModelError, resolve_model_path

    tried = []
    for path in [config.model.path, *([recorded["path"]] if recorded and recorded.get("path") else [])]:
        try:
            return AutoTokenizer.from_pretrained(resolve_model_path(path))
        except (ModelError, OSError, ValueError) as err:
            tried.append(f"{path or 'the default model'}: {str(err).splitlines()[0]}")
    print(f"rollouts view: no tokenizer ({'; '.join(tried)}): tokens are shown by id", file=sys.stderr, flush=True)
    return None


def listening(host: str, port: int | None) -> socket.socket:
    """A socket listening on `host`:`port`; without a port, on the first free one from PORT (as
    Jupyter does: a second viewer, or another run's, takes the next)."""
    tried = [port] if port is not None else range(PORT, PORT + PORTS_TRIED)
    for p in tried:
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a port just let go is free
        try:
            sock.bind((host, p))
        except OSError as err:
            sock.close()
            why = err.strerror
            continue
        sock.listen(128)
        return sock
    ports = f"{tried[0]}" if len(tried) == 1 else f"{tried[0]}-{tried[-1]}"
    raise Stop(f"cannot listen on {host}:{ports} ({why}): pick another --port")


def main(config: Config, args: argparse.Namespace) -> None:
    import redis
    import uvicorn

    from common.history import history_dir
    from common.keys import Keys
    from common.recording import RecordingError, read_recording
    from common.streams import connect, redacted
    from viewer.app import make_app
    from viewer.groups import Advantages, from_recording, from_stream

    how = Advantages(estimator=config.trainer.advantage, overlong=config.trainer.overlong,
                     overlong_penalty=config.trainer.overlong_penalty, objective=config.trainer.objective)
    if args.recording:
        try:
            header, _ = read_recording(args.recording)
            loaded = from_recording(Path(args.recording), limits=config.limits)
        except RecordingError as err:
            raise Stop(str(err)) from None
        load, run, recorded, history = (lambda: loaded), header.run, header.model, None
    else:
        try:
            r = connect(config.redis_url, wait_s=2.0, retry_s=5.0)
        except redis.exceptions.AuthenticationError:
            raise  # run_process says what to put in redis_url
        except redis.exceptions.ConnectionError as err:
            raise Stop(f"cannot reach Redis at {redacted(config.redis_url)} ({err}); "
                       "--recording FILE shows a recording without it") from None
        keys = Keys(config.run)
        load, run, recorded = (lambda: from_stream(r, keys, newest=args.newest, limits=config.limits)), config.run, None
        load()  # Redis reachable, the run's stream readable: said now, not on the first request
        history = Path(args.history) if args.history else history_dir(config.output_dir)
    metrics = Path(args.metrics) if args.metrics else config.metrics_path
    app = make_app(load=load, tokenizer=tokenizer_of(config, recorded), how=how, metrics=metrics, run=run,
                   history=history)

    sock = listening(args.host, args.port)  # before the address is printed: a request sent at once waits

    def stopped(signum: int, frame: object) -> None:  # uvicorn hands the signal back once it has stopped
        print("rollouts view: stopped", file=sys.stderr, flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGINT, stopped)
    signal.signal(signal.SIGTERM, stopped)
    host = f"[{args.host}]" if ":" in args.host else args.host
    print(f"rollouts view: run {run!r} at http://{host}:{sock.getsockname()[1]}/ (Ctrl-C stops)", flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="warning")).run(sockets=[sock])


if __name__ == "__main__":
    run_process("rollouts view", main, prog="rollouts view", doc=__doc__, extra=flags)
