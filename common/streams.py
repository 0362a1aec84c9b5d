"""Redis plumbing every process shares: connecting, consumer groups, weight versions (dead letters:
common/deadletters.py)."""

from __future__ import annotations

import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis
from redis.backoff import ExponentialBackoff, NoBackoff
from redis.retry import Retry

from common.keys import PAYLOAD, WEIGHTS_MAXLEN, Keys
from common.messages import WeightVersion, decode_weights, encode

RETRY_CAP_S = 1.0  # longest pause between two tries of a command while Redis is away
WAIT_SAID_AFTER_S = 3.0  # a process still waiting for Redis this long after starting says so, once


def connect(url: str, *, wait_s: float = 180.0, retry_s: float = 120.0, process: str | None = None) -> redis.Redis:
    """A client for `url`, waiting up to `wait_s` for the server to accept connections (saying so
    once after a few seconds). `process`: the process that waits (producer, generator, trainer,
    evaluator): a SIGTERM or SIGINT while it waits stops it at once, status 0 (stopped_at_once:
    it holds nothing yet); None leaves the caller's signal handling as it is.

    Processes started together by honcho may come up before Redis does, and a trainer started by
    hand beside `./ops/run ... &` (README "GPUs") before that has installed and started anything. Later, every command
    that meets a lost connection (Redis restarting from its append-only file, a network blip) is
    tried again, reconnecting, for about `retry_s` seconds before the error reaches the process.
    A transaction whose reply was lost in the instant Redis died may so be applied twice: group
    ids (the trainer's `trained` set) catch a group written twice. A refused password or ACL user
    (redis.exceptions.AuthenticationError) is raised at once: waiting will not fix it.
    """
    client = redis.Redis.from_url(url, socket_keepalive=True, health_check_interval=30,
                                  retry=Retry(NoBackoff(), 0))  # the first contact waits below
    with stopped_at_once(process, "waiting for Redis"):
        return _first_contact(client, url, wait_s=wait_s, retry_s=retry_s, process=process)


def _first_contact(client: redis.Redis, url: str, *, wait_s: float, retry_s: float, process: str | None
                   ) -> redis.Redis:
    deadline, said = time.monotonic() + wait_s, False
    while True:
        try:
            client.ping()
            client.set_retry(Retry(ExponentialBackoff(cap=RETRY_CAP_S, base=0.05),
                                   retries=max(1, int(retry_s / RETRY_CAP_S)),
                                   supported_errors=(redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,
                                                     TimeoutError)))  # BusyLoadingError is a ConnectionError
            return client
        except redis.exceptions.AuthenticationError:  # a wrong or missing password: waiting will not fix it
            raise
        except redis.exceptions.BusyLoadingError:  # replaying its append-only file
            pass
        except redis.exceptions.ConnectionError:
            if time.monotonic() > deadline:
                raise
            if not said and time.monotonic() > deadline - wait_s + WAIT_SAID_AFTER_S:
                print(f"{process + ': ' if process else ''}waiting up to {wait_s:.0f} s for Redis at {redacted(url)}",
                      file=sys.stderr, flush=True)
                said = True
        time.sleep(0.2)


def ensure_group(r: redis.Redis, stream: str, group: str) -> None:
    """Create `group` on `stream` (and the stream) reading from the start, if absent."""
    try:
        r.xgroup_create(stream, group, id="0", mkstream=True)
    except redis.exceptions.ResponseError as err:
        if "BUSYGROUP" not in str(err):
            raise


def group_backlog(r: redis.Redis, stream: str, group: str) -> tuple[int, int]:
    """(pending, waiting) of consumer group `group` on `stream`: entries delivered and not yet
    acknowledged, and entries not yet delivered (all of them if nobody has read the stream).

    Waiting is XINFO GROUPS' `lag` when Redis knows it. Redis 7.0 forgets a group's read counter
    when it replays its append-only file (XCLAIM ... LASTID moves the group without it), and then
    knows the lag only once the group has read up to the last entry: there the entries past the
    last delivered id are counted.
    """
    if not r.exists(stream):
        return 0, 0
    info = {g["name"].decode(): g for g in r.xinfo_groups(stream)}.get(group)
    if info is None:
        return 0, r.xlen(stream)
    if info["lag"] is not None:
        return info["pending"], info["lag"]
    waiting, start = 0, info["last-delivered-id"]
    while entries := r.xrange(stream, min=b"(" + _as_bytes(start), count=1000):
        waiting += len(entries)
        start = entries[-1][0]
    return info["pending"], waiting


def entry_key(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as (milliseconds, sequence), for ordering ids as Redis does."""
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)


def _as_bytes(entry_id: bytes | str) -> bytes:
    return entry_id if isinstance(entry_id, bytes) else entry_id.encode()


def announce_weights(pipe: redis.client.Pipeline, keys: Keys, wv: WeightVersion) -> None:
    """Queue (on the caller's MULTI pipeline) the announcement of `wv`: appended to the capped
    weights stream (generators waiting on it wake) and set as `weights:latest` (a generator that
    starts late loads it), the two in the same transaction."""
    blob = encode(wv)
    pipe.xadd(keys.weights, {PAYLOAD: blob}, maxlen=WEIGHTS_MAXLEN, approximate=True)
    pipe.set(keys.weights_latest, blob)


def latest_weights(r: redis.Redis, keys: Keys) -> WeightVersion | None:
    """The newest announced weights (`announce_weights`), None before the first."""
    blob = r.get(keys.weights_latest)
    return None if blob is None else decode_weights(blob)


def announced_before(r: redis.Redis, keys: Keys, version: int, *, before: float) -> WeightVersion | None:
    """The newest announcement of `version` created before `before` that the capped weights stream
    still holds; None if none."""
    for _, fields in r.xrevrange(keys.weights, count=WEIGHTS_MAXLEN):
        wv = decode_weights(fields[PAYLOAD])
        if wv.version == version and wv.created_at < before:
            return wv
    return None


def redacted(url: str) -> str:
    """`url` with any password replaced, fit for logs."""
    scheme, sep, rest = url.partition("://")
    creds, at, host = rest.rpartition("@")
    if not at:
        return url
    user = creds.split(":", 1)[0]
    return f"{scheme}{sep}{user}:***@{host}"


def lost_redis(process: str, url: str, err: Exception) -> str:
    """The one-line message a process exits with when Redis goes away under it, or refuses its
    credentials (never the password itself)."""
    if isinstance(err, redis.exceptions.AuthenticationError):
        return (f"{process}: Redis at {redacted(url)} refused the credentials: {err} "
                "(put the password, or ACL user and password, in redis_url: "
                "redis://user:password@host:port/db)")
    return (f"{process}: lost Redis at {redacted(url)} ({err}); whatever was not acknowledged "
            "is still in its stream: start again to resume")


def no_permission(process: str, url: str, err: Exception) -> str:
    """The one-line message a process exits with when its ACL user may not run a command or touch
    a key it needs (redis.exceptions.NoPermissionError): Redis's words name what is missing."""
    said = str(err)
    # in a pipeline redis-py prefixes the command with all its arguments (payloads too): keep its
    # name and key
    piped = re.fullmatch(r"Command # \d+ \((\S+)( \S+)?.*?\) of pipeline caused error: (.*)", said, re.S)
    if piped:
        said = f"{piped[3]} ({piped[1]}{piped[2] or ''})"
    return (f"{process}: Redis at {redacted(url)} refused a command: {said} (the ACL user lacks that "
            "permission: give it the run's keys and commands, see docs/operations.md, 'Security')")



def stop_while_starting(process: str) -> None:
    """Until `process` installs its own stop handling (each does before it takes any work), a
    SIGTERM or SIGINT ends it at once with status 0: honcho stopping a run that a process is still
    starting in (imports, loading a model) is a clean stop, not a crash, since it holds nothing yet."""
    signal.signal(signal.SIGTERM, _stop(process, "starting"))
    signal.signal(signal.SIGINT, _stop(process, "starting"))


@contextmanager
def stopped_at_once(process: str | None, doing: str) -> Iterator[None]:
    """The start-up rule of every process, for a wait that holds nothing (Redis not there yet):
    within it, a SIGTERM or SIGINT ends `process` at once with status 0 and one line ("trainer:
    SIGINT while waiting for Redis: stopped"), whatever stop handling it has installed (that is
    back afterwards). None, or off the main thread (where no handler can be set): no change."""
    if process is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    before = {s: signal.signal(s, _stop(process, doing)) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def _stop(process: str, doing: str):
    def stop(signum: int, frame: object) -> None:
        print(f"{process}: {signal.Signals(signum).name} while {doing}: stopped", file=sys.stderr, flush=True)
        raise SystemExit(0)

    return stop
