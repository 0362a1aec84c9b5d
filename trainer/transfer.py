"""Rank 0's end of the weights broadcast (trainer.weight_transfer = "gloo" or "nccl"; the protocol is
in common/transfer.py): its TCP store, the group of the current epoch and who is in it.

`Sender.start(tensors, version)` broadcasts in a thread of its own, beside the checkpoint's write,
and `Sending.result()` waits for it: the digest the announcement carries, or "" when nobody
listens or the broadcast failed (the generators then read the files, as with "disk").
"""

from __future__ import annotations

import concurrent.futures
import datetime
import time

import redis
import torch

from common.config import TrainerConfig
from common.keys import PAYLOAD, Keys
from common.transfer import (
    OFFERS_MAXLEN,
    Offer,
    address_towards,
    broadcast,
    bucket_fingerprint,
    close_group,
    digest_of,
    encode_offer,
    layout,
    listening_members,
    open_group,
    pack,
    stop_listening,
)
from trainer.parallel import say


class Sending:
    """One broadcast under way."""

    def __init__(self, future: concurrent.futures.Future[str]) -> None:
        self._future = future

    def result(self) -> str:
        """The digest of what every member received, or "" (nobody listening, or it failed)."""
        return self._future.result()


class Sender:
    """The broadcast's TCP store, the current epoch's group and members, and the thread it sends in."""

    def __init__(self, r: redis.Redis, keys: Keys, cfg: TrainerConfig, *, device: torch.device) -> None:
        self.backend = cfg.weight_transfer
        if self.backend == "nccl" and device.type != "cuda":
            raise RuntimeError("trainer.weight_transfer = \"nccl\" needs the trainer on a GPU; on CPUs use \"gloo\"")
        self._r, self._keys, self._device = r, keys, device
        self.timeout_s, self._bucket_bytes = cfg.transfer_timeout_s, cfg.transfer_bucket_mb << 20
        conn = r.connection_pool.connection_kwargs
        self.host = cfg.transfer_host or address_towards(str(conn.get("host", "127.0.0.1")), int(conn.get("port", 0)))
        self._store = torch.distributed.TCPStore(self.host, cfg.transfer_port, is_master=True, wait_for_workers=False,
                                                 timeout=datetime.timedelta(seconds=self.timeout_s))
        self.port = self._store.port
        self.epoch = int(time.time())  # above any epoch of an earlier trainer on this run
        self._group = None
        self.members: list[str] = []
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="weights-broadcast")
        say(f"trainer: weights also go over {self.backend} from {self.host}:{self.port} to the generators that join")

    def listening(self) -> list[str]:
        """The generators whose receivers said they listen lately (common.transfer.listening_members)."""
        return listening_members(self._r, self._keys)

    def start(self, tensors: dict[str, torch.Tensor], *, version: int) -> Sending:
        """Broadcast `tensors` (the checkpoint's, on the CPU) as `version` in the sender's thread."""
        return Sending(self._pool.submit(self._send, tensors, version))

    def _send(self, tensors: dict[str, torch.Tensor], version: int) -> str:
        members = self.listening()
        if not members:
            self._close()
            return ""
        t0 = time.perf_counter()
        slots, sizes = layout(tensors, bucket_bytes=self._bucket_bytes)
        buckets = pack(tensors, slots, sizes)
        prints = [(int(b.numel()), bucket_fingerprint(b)) for b in buckets]
        digest = digest_of(slots, prints)
        if members != self.members or self._group is None:
            self._close()
            self.epoch, self.members = self.epoch + 1, members
        offer = Offer(version=version, epoch=self.epoch, members=members, host=self.host, port=self.port,
                      backend=self.backend, timeout_s=self.timeout_s, slots=slots, buckets=prints, digest=digest)
        self._r.xadd(self._keys.transfer_offers, {PAYLOAD: encode_offer(offer)}, maxlen=OFFERS_MAXLEN,
                     approximate=True)
        try:
            if self._group is None:
                self._group = open_group(self._store, backend=self.backend, epoch=self.epoch, rank=0,
                                         size=len(members) + 1, timeout_s=self.timeout_s, address=self.host,
                                         device=self._device if self.backend == "nccl" else None)
            for b in buckets:
                broadcast(self._group, b.to(self._device) if self.backend == "nccl" else b, timeout_s=self.timeout_s)
        except Exception as err:  # noqa: BLE001 - a member gone or too slow: they read the files
            say(f"trainer: broadcasting version {version} to {', '.join(members)} failed "
                f"({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}); they load it from the "
                "files, and the next publish meets those still listening")
            self._close()
            self.members = []
            stop_listening(self._r, self._keys, *members)  # the live ones say so again within LISTENING_S
            return ""
        nbytes = sum(sizes)
        say(f"trainer: version {version} broadcast over {self.backend} to {len(members)} generator(s), "
            f"{nbytes / 2**20:.1f} MiB in {time.perf_counter() - t0:.2f} s (epoch {self.epoch})")
        return digest

    def _close(self) -> None:
        if self._group is not None:
            close_group(self._group)
            self._group = None

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._close()
