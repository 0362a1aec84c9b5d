"""A generator's end of the trainer's weights broadcast (trainer.weight_transfer = "gloo" or "nccl";
the protocol is in common/transfer.py).

`Receiver` runs in a thread of its own: it says in Redis that it listens (every LISTENING_S), reads
the trainer's offers, and for each one naming it joins that epoch's group (a new epoch: a new
group), receives the buckets, checks every bucket's fingerprint against the offer's, and keeps the
newest version received. When that version is announced, the weights check asks
`take(version, digest)` for it, waiting for a receive still under way, and loads it from memory;
anything else (nothing received, a failed or refused transfer, another digest) is None, and the
generator reads the files as without a broadcast.
"""

from __future__ import annotations

import contextlib
import datetime
import sys
import threading
import time

import redis
import torch

from common.keys import PAYLOAD, Keys
from common.messages import MessageError
from common.transfer import (
    LISTENING_S,
    Offer,
    address_towards,
    broadcast,
    bucket_fingerprint,
    close_group,
    decode_offer,
    open_group,
    say_listening,
    stop_listening,
    unpack,
)

BLOCK_MS = 1000  # each XREAD blocks this long at most, so that stop() is heard within it
OFFERS_LOOKED_AT = 16  # a take finds its offer among this many newest (one is posted a publish)


def stream_id(entry_id: bytes) -> tuple[int, int]:
    """A stream entry id ("ms-seq") as numbers, to compare."""
    ms, _, seq = entry_id.decode().partition("-")
    return int(ms), int(seq or 0)


class TransferRefused(Exception):
    """What arrived does not match what the offer says was sent."""


class Receiver:
    """This generator's membership, its end of the current epoch's group, and the newest version received."""

    def __init__(self, r: redis.Redis, keys: Keys, *, generator_id: str, name: str = "") -> None:
        self._r, self._keys, self.id, self.name = r, keys, generator_id, name or f"generator {generator_id}"
        self._cond = threading.Condition()
        self._held: tuple[int, str, dict[str, torch.Tensor]] | None = None  # (version, digest, tensors)
        self._busy: tuple[int, str] | None = None  # the (version, digest) being received now
        self._last: bytes | None = None  # the id of the newest offer the thread has read and done with
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._met: tuple[str, int, int] | None = None  # (host, port, epoch) of the group it is in
        self._group = None
        self._store = None
        self.received = 0  # versions received and verified
        self.failed = 0  # versions whose transfer failed or was refused (loaded from the files instead)
        self.last_error = ""
        self.error: BaseException | None = None  # what ended the thread, if anything did

    # ------------------------------------------------------------------ asking it

    def take(self, version: int, digest: str, timeout: float) -> dict[str, torch.Tensor] | None:
        """The tensors of `version` as broadcast with `digest`, waiting up to `timeout` seconds for
        this thread to have read its offer and ended its receive; None when they were not received
        (or were refused). The version is announced once the trainer's end of the broadcast is done,
        and gloo broadcasts along a tree: a generator fed by another may not have read the offer yet,
        and waits for that read (one XREAD, which the offer wakes), not for nothing. An offer from
        before this thread started (or gone from the stream) is not waited for."""
        offered = self._offer_id(version, digest)

        def settled() -> bool:
            gone = self._thread is None or not self._thread.is_alive() or self._stop.is_set()
            read = offered is None or (self._last is not None and stream_id(self._last) >= stream_id(offered))
            return gone or (read and self._busy != (version, digest))

        with self._cond:
            self._cond.wait_for(settled, timeout=timeout)
            held = self._held
            if held is None or held[:2] != (version, digest):
                return None
            self._held = None
            return held[2]

    def _offer_id(self, version: int, digest: str) -> bytes | None:
        """The stream id of the newest offer of `version` with `digest` among the last few, or None."""
        try:
            entries = self._r.xrevrange(self._keys.transfer_offers, count=OFFERS_LOOKED_AT)
        except redis.exceptions.RedisError:
            return None
        for entry_id, fields in entries:
            with contextlib.suppress(MessageError):
                offer = decode_offer(fields.get(PAYLOAD, b""))
                if (offer.version, offer.digest) == (version, digest):
                    return entry_id
        return None

    # ------------------------------------------------------------------ running it

    def start(self) -> Receiver:
        last = self._r.xrevrange(self._keys.transfer_offers, count=1)
        self._last = last[0][0] if last else b"0-0"  # offers up to here came before this generator listened
        self._thread = threading.Thread(target=self._follow, args=(self._last,),
                                        name="weights-receiver", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """End the thread (within one XREAD's block, or a receive's timeout) and stop listening."""
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=BLOCK_MS / 1000 + 5)
        with contextlib.suppress(redis.exceptions.RedisError):
            stop_listening(self._r, self._keys, self.id)
        self._leave()

    def _follow(self, last_id: bytes) -> None:
        said = 0.0
        try:
            while not self._stop.is_set():
                try:
                    if time.time() - said >= LISTENING_S:
                        say_listening(self._r, self._keys, self.id)
                        said = time.time()
                    got = self._r.xread({self._keys.transfer_offers: last_id}, count=100, block=BLOCK_MS)
                except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError):
                    self._stop.wait(0.2)  # Redis restarting: read again from the same id
                    continue
                entries = [e for _stream, es in got or [] for e in es]
                if not entries:
                    continue
                last_id = entries[-1][0]
                # The trainer posts an offer only after the one before has ended: the newest is the live one.
                offer = self._decode(entries[-1][1].get(PAYLOAD, b""))
                if offer is not None and self.id in offer.members:
                    self._receive(offer)
                    said = 0.0  # say so again at once: a failed epoch took it off the list
                with self._cond:
                    self._last = last_id
                    self._cond.notify_all()
        except BaseException as err:  # kept for whoever asks; the generator reports it
            self.error = err
            raise
        finally:
            with self._cond:  # a take waiting on this thread hears that it ended
                self._cond.notify_all()

    def _decode(self, blob: bytes) -> Offer | None:
        try:
            return decode_offer(blob)
        except MessageError as err:
            self._note_failure(None, f"an offer that does not decode ({err})")
            return None

    def _receive(self, offer: Offer) -> None:
        with self._cond:
            self._busy = (offer.version, offer.digest)
        t0 = time.perf_counter()
        try:
            buckets = self._broadcast_into(offer)
            for i, (b, (_n, sent)) in enumerate(zip(buckets, offer.buckets, strict=True)):
                got = bucket_fingerprint(b)
                if got != sent:
                    raise TransferRefused(f"bucket {i} arrived as {got}, sent as {sent}")
            tensors = unpack(buckets, offer.slots)
            with self._cond:
                self._held = (offer.version, offer.digest, tensors)
            self.received += 1
            print(f"{self.name}: received weights version {offer.version} over {offer.backend} "
                  f"({sum(n for n, _ in offer.buckets) / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f} s, "
                  "fingerprints match)", flush=True)
        except TransferRefused as err:
            self._note_failure(offer, f"refused: {err}")
        except Exception as err:  # noqa: BLE001 - the trainer or the group gone, a timeout: the files serve
            self._leave()
            self._note_failure(offer, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        finally:
            with self._cond:
                self._busy = None
                self._cond.notify_all()

    def _broadcast_into(self, offer: Offer) -> list[torch.Tensor]:
        """The offer's buckets as received (on the CPU), meeting its group first if it is a new one."""
        device = torch.device("cuda", torch.cuda.current_device()) if offer.backend == "nccl" else None
        if self._met != (offer.host, offer.port, offer.epoch):
            self._leave()
            timeout = datetime.timedelta(seconds=offer.timeout_s)
            if self._store is None or self._met is None or self._met[:2] != (offer.host, offer.port):
                self._store = torch.distributed.TCPStore(offer.host, offer.port, is_master=False, timeout=timeout)
            self._group = open_group(self._store, backend=offer.backend, epoch=offer.epoch,
                                     rank=offer.members.index(self.id) + 1, size=len(offer.members) + 1,
                                     timeout_s=offer.timeout_s, address=address_towards(offer.host, offer.port),
                                     device=device)
            self._met = (offer.host, offer.port, offer.epoch)
        buckets = [torch.empty(n, dtype=torch.uint8, device=device) for n, _ in offer.buckets]
        for b in buckets:
            broadcast(self._group, b, timeout_s=offer.timeout_s)
        return [b.cpu() for b in buckets]

    def _leave(self) -> None:
        if self._group is not None:
            close_group(self._group)
        self._group, self._met = None, None

    def _note_failure(self, offer: Offer | None, why: str) -> None:
        self.failed += 1
        self.last_error = why
        what = f"weights version {offer.version} over {offer.backend}" if offer else "the weights broadcast"
        print(f"{self.name}: {what} failed ({why}); that version is loaded from the files", file=sys.stderr,
              flush=True)
