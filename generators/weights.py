"""Following the weights stream, and checking a new version's files before it is loaded.

`Watcher` learns of each published version the moment it is announced: a thread of its own
blocks on the weights stream (XREAD BLOCK, on a connection of its own from the client's pool)
and keeps the newest announcement. Anything may ask it, from any thread and as often as it
likes, at the cost of reading an attribute:
    watcher.latest            the newest Announcement (payload, its version, when it was seen), or None
    watcher.wait(seq, s)      block up to `s` seconds for an announcement after number `seq`
A watcher that starts late begins with `weights:latest` (what a late starter loads), read in the
same transaction as the stream's last entry id, so nothing announced in between is missed.

`check` does what must come before a version is loaded, in a worker thread: decode the payload,
then verify every file against its published checksum (or fetch it from the trainer's checkpoint
server, checked on arrival). The generator starts it as soon as a version is announced, while its
engine is still finishing the prompts in flight, so the load itself waits for nothing but the
copy into the model.
"""

from __future__ import annotations

import itertools
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import redis
import trio

from common.checkpoint_server import fetch_checkpoint
from common.checkpoints import CheckpointError, pin_checkpoint, verify_dir
from common.keys import PAYLOAD, Keys
from common.messages import MessageError, WeightVersion, decode_weights
from generators.transfer import Receiver

BLOCK_MS = 1000  # each XREAD blocks this long at most, so that stop() is heard within it
RECEIVE_WAIT_S = 60.0  # a broadcast still arriving when its version is announced is waited for this long at most


@dataclass(frozen=True)
class Announcement:
    """One version as announced on the weights stream."""

    seq: int  # 1, 2, ... in the order this watcher saw them
    blob: bytes  # the WeightVersion payload as published
    version: int | None  # its version; None when the payload does not decode
    seen_at: float  # time.time() when this watcher read it


class Watcher:
    """The newest weight version announced, learned by blocking on the weights stream."""

    def __init__(self, r: redis.Redis, keys: Keys, *, block_ms: int = BLOCK_MS) -> None:
        self._r, self._keys, self._block_ms = r, keys, block_ms
        self.latest: Announcement | None = None
        self._changed = threading.Condition()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None  # what ended the thread, if anything did

    # ------------------------------------------------------------------ asking it

    def wait(self, after: int, timeout: float) -> Announcement | None:
        """The newest announcement if its number is above `after`, waiting up to `timeout`
        seconds for one; None when none came."""
        with self._changed:
            self._changed.wait_for(lambda: self.latest is not None and self.latest.seq > after or self._stop.is_set(),
                                   timeout=timeout)
            latest = self.latest
        return latest if latest is not None and latest.seq > after else None

    # ------------------------------------------------------------------ running it

    def start(self) -> Watcher:
        """Read `weights:latest` (and the stream's last id) now, then follow the stream in a thread."""
        last_id = self._begin()
        self._thread = threading.Thread(target=self._follow, args=(last_id,), name="weights-watcher", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (within one XREAD's block)."""
        self._stop.set()
        with self._changed:
            self._changed.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=self._block_ms / 1000 + 5)

    def __enter__(self) -> Watcher:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _begin(self) -> bytes:
        with self._r.pipeline(transaction=True) as pipe:
            pipe.get(self._keys.weights_latest)
            pipe.xrevrange(self._keys.weights, count=1)
            blob, last = pipe.execute()
        if blob is not None:
            self._announce(blob)
        return last[0][0] if last else b"0-0"

    def _follow(self, last_id: bytes) -> None:
        try:
            while not self._stop.is_set():
                try:
                    got = self._r.xread({self._keys.weights: last_id}, count=100, block=self._block_ms)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    # Redis restarting, or a block longer than the client's socket timeout: read
                    # again from the same id (nothing announced meanwhile is missed)
                    self._stop.wait(0.2)
                    continue
                for _stream, entries in got or []:
                    for entry_id, fields in entries:
                        last_id = entry_id
                        if PAYLOAD in fields:
                            self._announce(fields[PAYLOAD])
        except BaseException as err:  # kept for whoever asks; the generator reports it
            self.error = err
            raise

    def _announce(self, blob: bytes) -> None:
        try:
            version: int | None = decode_weights(blob).version
        except MessageError:
            version = None
        with self._changed:
            seq = self.latest.seq + 1 if self.latest is not None else 1
            self.latest = Announcement(seq=seq, blob=blob, version=version, seen_at=time.time())
            self._changed.notify_all()


# ---------------------------------------------------------------------- checking a version


@dataclass(eq=False)
class Checked:
    """A payload decoded and its files verified (or fetched), or the reason it is refused."""

    blob: bytes
    done: trio.Event = field(default_factory=trio.Event)
    wv: WeightVersion | None = None
    path: str = ""  # where the verified files are
    pinned: Path | None = None  # hard links to them, which the trainer's pruning leaves (`path`)
    claimed: bool = False  # the engine loop is loading it: it removes the pin itself
    error: str = ""  # why it is refused; "" when it may be loaded
    seconds: float = 0.0  # spent verifying (or fetching)
    staged: float | None = None  # seconds the engine spent reading the files ahead (`stage`); None: it did not
    tensors: dict | None = None  # the weights as received over the trainer's broadcast: loaded instead of `path`


_PINS = itertools.count()  # each check pins in a directory of its own: two checks never share one


def unpin(checked: Checked | None) -> None:
    """Remove the pin of a check that is done and that the engine loop is not loading (a check still
    pinning, or being loaded, is left: the loader removes its own)."""
    if checked is not None and checked.pinned is not None and checked.done.is_set() and not checked.claimed:
        shutil.rmtree(checked.pinned, ignore_errors=True)
        checked.pinned = None


async def check(checked: Checked, *, weights_url: str = "", fetch_dir: Path | None = None,
                pin_root: Path | None = None, receiver: Receiver | None = None,
                stage: Callable[[str], bool] | None = None) -> Checked:
    """Decode `checked.blob` and verify its files (in a worker thread), filling `checked` in and
    setting `checked.done`; a payload that does not decode or files that fail their checksums
    leave the reason in `checked.error`. With `pin_root`, the files of a checkpoint on a shared
    disk are pinned in a directory of this check's own under it first
    (common/checkpoints.py:pin_checkpoint) and loaded from the pin (see unpin). With `receiver`, a
    version it received over the trainer's broadcast (its fingerprints checked on arrival) is taken
    from it instead: no file is read. With `stage` (an engine's, engines/hf_engine.py), the files
    verified are handed to it to read ahead, in a worker thread too, before `checked.done` is set."""
    t0 = time.perf_counter()
    staged_s: float | None = None
    staging_s = 0.0
    try:
        wv = checked.wv = decode_weights(checked.blob)
        if receiver is not None and wv.transfer_digest:
            checked.tensors = await trio.to_thread.run_sync(
                partial(receiver.take, wv.version, wv.transfer_digest, RECEIVE_WAIT_S), abandon_on_cancel=True)
        if checked.tensors is not None:
            pass
        elif weights_url:  # no shared disk: fetched from the trainer's host, checked on arrival
            path = await trio.to_thread.run_sync(partial(fetch_checkpoint, weights_url, wv, dest_root=fetch_dir))
            checked.path = str(path)
        else:
            if pin_root is not None:
                checked.pinned = await trio.to_thread.run_sync(partial(
                    pin_checkpoint, wv.path, wv.checksums, pin_root / f"v{wv.version}-{next(_PINS)}"))
            path = str(checked.pinned or wv.path)
            await trio.to_thread.run_sync(verify_dir, path, wv.checksums)
            checked.path = path
        if stage is not None and checked.path:
            t1 = time.perf_counter()
            read_ahead = await trio.to_thread.run_sync(stage, checked.path)
            staging_s = time.perf_counter() - t1
            staged_s = staging_s if read_ahead else None
    except (MessageError, CheckpointError) as err:
        checked.error = str(err)
    except BaseException as err:  # not a refusal: it ends the generator, as it did before
        checked.error = f"{type(err).__name__}: {err}"
        raise
    finally:
        checked.seconds = time.perf_counter() - t0 - staging_s
        checked.staged = staged_s
        checked.done.set()
    return checked
