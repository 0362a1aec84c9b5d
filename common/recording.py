"""Record a run's streams to a file, and replay such a file into the streams of another run.

A recording is a sequence of MessagePack objects:
  1. the header: {"format": "rollouts-recording", "version": 1, "run", "streams" (names, e.g.
     ["samples"]), "created" (unix seconds), "model" (what the payloads need: the config's
     model.path and the checksums of its files; None when unknown)}
  2. one entry per stream entry, in stream order (across streams, in id order):
     [stream name, entry id, payload], the payload being the entry's `keys.PAYLOAD` field
  3. the end mark: {"end": number of entries}
A file that does not start with the header, or stops before the end mark, is refused.

The recorder reads as its own consumer group on each stream (`recorder` by default), so the
trimming of acknowledged entries (common/trim.py) waits for it; it acknowledges what it has
written, and removes its group when it stops (so a finished recorder holds nothing back).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import msgpack
import redis

from common.keys import PAYLOAD, Keys
from common.streams import ensure_group, entry_key

FORMAT = "rollouts-recording"
VERSION = 1
STREAMS = ("samples", "prompts", "weights")  # what can be recorded: Keys properties of these names
RECORDER_GROUP = "recorder"
BLOCK_MS = 500


class RecordingError(ValueError):
    """A file that is not a complete recording, or a replay the target run cannot take."""


@dataclass(frozen=True)
class Header:
    run: str  # the run the streams were recorded from
    streams: list[str]  # stream names (from STREAMS) the file holds
    created: float  # unix seconds when recording started
    model: dict[str, Any] | None  # {"path", "checksums"}: the model the payloads were made with


@dataclass(frozen=True)
class Entry:
    stream: str  # one of the header's streams
    id: str  # the entry's id in the recorded run ("ms-seq": its time of writing in ms)
    payload: bytes  # the entry's PAYLOAD field, as written


def stream_key(keys: Keys, name: str) -> str:
    if name not in STREAMS:
        raise RecordingError(f"stream {name!r}: expected one of {STREAMS}")
    return getattr(keys, name)


# --------------------------------------------------------------------------- the file


def write_header(f: BinaryIO, header: Header) -> None:
    f.write(msgpack.packb({"format": FORMAT, "version": VERSION, "run": header.run, "streams": header.streams,
                           "created": header.created, "model": header.model}, use_bin_type=True))


def write_entry(f: BinaryIO, entry: Entry) -> None:
    f.write(msgpack.packb([entry.stream, entry.id, entry.payload], use_bin_type=True))


def write_end(f: BinaryIO, count: int) -> None:
    f.write(msgpack.packb({"end": count}, use_bin_type=True))


def read_recording(path: str | Path) -> tuple[Header, list[Entry]]:
    """The header and entries of a complete recording; RecordingError says what is wrong otherwise."""
    path = Path(path)
    if not path.is_file():
        raise RecordingError(f"{path}: no such file")
    data = path.read_bytes()
    unpacker = msgpack.Unpacker(raw=False, max_buffer_size=max(len(data), 1), strict_map_key=True)
    unpacker.feed(data)
    objects = _objects(unpacker, size=len(data), path=path)
    first = next(objects, None)
    if not (isinstance(first, dict) and first.get("format") == FORMAT):
        raise RecordingError(f"{path}: not a rollouts recording (no {FORMAT!r} header)")
    if first.get("version") != VERSION:
        raise RecordingError(f"{path}: recording format version {first.get('version')!r}, expected {VERSION}")
    streams = first.get("streams")
    if not (isinstance(streams, list) and streams and all(s in STREAMS for s in streams)):
        raise RecordingError(f"{path}: header streams {streams!r} are not a list of {STREAMS}")
    header = Header(run=str(first.get("run")), streams=streams, created=float(first.get("created") or 0),
                    model=first.get("model"))
    entries = []
    for obj in objects:
        if isinstance(obj, dict) and "end" in obj:
            if obj["end"] != len(entries):
                raise RecordingError(f"{path}: end mark says {obj['end']} entries, file has {len(entries)}")
            if next(objects, None) is not None:
                raise RecordingError(f"{path}: data after the end mark")
            return header, entries
        if not (isinstance(obj, list) and len(obj) == 3 and obj[0] in streams and isinstance(obj[1], str)
                and isinstance(obj[2], bytes)):
            raise RecordingError(f"{path}: entry {len(entries)} is not [stream, id, payload]: {str(obj)[:80]}")
        entries.append(Entry(stream=obj[0], id=obj[1], payload=obj[2]))
    raise RecordingError(f"{path}: truncated after {len(entries)} entries (no end mark): "
                         "the recorder did not finish")


def _objects(unpacker: msgpack.Unpacker, *, size: int, path: Path) -> Iterator[Any]:
    try:
        yield from unpacker
    except (msgpack.UnpackException, ValueError) as err:
        raise RecordingError(f"{path}: not MessagePack ({type(err).__name__}: {err})") from None
    if unpacker.tell() != size:
        raise RecordingError(f"{path}: truncated in the middle of an entry ({unpacker.tell()} of {size} bytes "
                             "read whole)")


# --------------------------------------------------------------------------- record


def record(r: redis.Redis, keys: Keys, *, streams: list[str], out: Path, model: dict[str, Any] | None,
           until_idle_s: float | None, group: str = RECORDER_GROUP,
           stop: Callable[[], bool] = lambda: False) -> int:
    """Write the streams' entries to `out` (from the first one still in each stream, then as they
    come) until `stop()` or, with `until_idle_s`, until no new entry came for that long. Returns
    the number of entries written. The file appears under its name only once complete."""
    names = {stream_key(keys, s): s for s in streams}
    for key in names:
        ensure_group(r, key, group)
    consumer = f"{os.uname().nodename}:{os.getpid()}"
    tmp = out.with_name(f".{out.name}.part")
    out.parent.mkdir(parents=True, exist_ok=True)
    count, last_new = 0, time.monotonic()
    with open(tmp, "wb") as f:
        write_header(f, Header(run=keys.run, streams=list(streams), created=time.time(), model=model))
        cursor = "0"  # this consumer's pending entries first (none for a fresh one), then new ones
        while not stop():
            reply = r.xreadgroup(group, consumer, {k: cursor for k in names}, count=256,
                                 block=None if cursor == "0" else BLOCK_MS)
            got = sorted(((entry_key(eid), names[_str(key)], eid, fields)
                          for key, entries in reply or [] for eid, fields in entries if fields is not None),
                         key=lambda e: e[0])
            if cursor == "0" and not got:
                cursor = ">"
                continue
            for _, name, eid, fields in got:
                if PAYLOAD in fields:  # an entry without one is no message; nothing to replay
                    write_entry(f, Entry(stream=name, id=_str(eid), payload=fields[PAYLOAD]))
                    count += 1
            f.flush()
            pipe = r.pipeline(transaction=False)
            for _, name, eid, _ in got:
                pipe.xack(stream_key(keys, name), group, eid)
            pipe.execute()
            if got:
                last_new = time.monotonic()
            elif until_idle_s is not None and time.monotonic() - last_new >= until_idle_s:
                break
        write_end(f, count)
    tmp.rename(out)
    for key in names:
        r.xgroup_destroy(key, group)  # a finished recorder holds back no trimming
    return count


def _str(x: bytes | str) -> str:
    return x.decode() if isinstance(x, bytes) else x


# --------------------------------------------------------------------------- replay


def replay(r: redis.Redis, keys: Keys, path: str | Path, *, pace: str = "full", only: list[str] | None = None,
           sleep: Callable[[float], None] = time.sleep) -> int:
    """Write the recording's entries (of the streams in `only`, default all), in order, into the
    streams of run `keys.run` (new ids); with pace "recorded", spaced as they were recorded.
    Those streams of the run must be empty."""
    if pace not in ("full", "recorded"):
        raise RecordingError(f"pace {pace!r}: expected 'full' or 'recorded'")
    header, entries = read_recording(path)
    missing = sorted(set(only or []) - set(header.streams))
    if missing:
        raise RecordingError(f"{path}: holds the streams {header.streams}, not {missing}")
    wanted = only or header.streams
    entries = [e for e in entries if e.stream in wanted]
    for name in wanted:
        key = stream_key(keys, name)
        if r.exists(key) and r.xlen(key):
            raise RecordingError(f"run {keys.run!r} already has {r.xlen(key)} entries in its {name} stream: "
                                 "replay into a fresh run (another run name)")
    previous_ms = None
    for entry in entries:
        ms = entry_key(entry.id)[0]
        if pace == "recorded" and previous_ms is not None and ms > previous_ms:
            sleep((ms - previous_ms) / 1000)
        previous_ms = ms
        r.xadd(stream_key(keys, entry.stream), {PAYLOAD: entry.payload})
    return len(entries)


# --------------------------------------------------------------------------- the commands


def model_identity(model_path: str) -> dict[str, Any] | None:
    """What a recording's payloads need: the model's path and the checksums of its files."""
    from common.checkpoints import checksum_dir
    from common.models import ModelError, resolve_model_path

    try:
        path = resolve_model_path(model_path)
    except ModelError:
        return None
    return {"path": model_path, "checksums": checksum_dir(path)}


def record_command(config, *, streams: list[str], out: Path, until_idle_s: float | None) -> None:
    """`rollouts record`: the first Ctrl-C/SIGTERM finishes the file, a second exits at once."""
    import signal
    import sys

    from common.streams import connect

    stopping = []

    def on_signal(signum: int, frame: object) -> None:
        if stopping:
            raise SystemExit(130)
        stopping.append(signum)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    r = connect(config.redis_url)
    count = record(r, Keys(config.run), streams=streams, out=out, model=model_identity(config.model.path),
                   until_idle_s=until_idle_s, stop=lambda: bool(stopping))
    print(f"rollouts: recorded {count} entries of run {config.run!r} ({', '.join(streams)}) to {out}",
          file=sys.stderr)


def replay_command(config, *, path: Path, pace: str, only: list[str] | None) -> None:
    import sys

    from common.streams import connect

    r = connect(config.redis_url)
    try:
        count = replay(r, Keys(config.run), path, pace=pace, only=only)
    except RecordingError as err:
        sys.exit(f"rollouts: {err}")
    print(f"rollouts: replayed {count} entries of {path} into run {config.run!r}", file=sys.stderr)
