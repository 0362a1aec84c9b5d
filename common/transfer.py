"""Weights over a collective (trainer.weight_transfer = "gloo" or "nccl"): what the trainer and the
generators share of it.

The trainer's rank 0 still writes every published checkpoint (resume, the evaluator, generators
that join late or fall out read it), and, beside that write, broadcasts the same tensors to the
generators that have joined its transfer group; a generator that received and verified them
loads them from memory when the version is announced, instead of verifying and reading the files.

Membership is in Redis (`Keys.transfer_members`: generator id -> when its receiver last said it is
listening). At a publish the trainer reads the members that are listening; when they differ from
its group's, it opens a new group (an *epoch*: a process group of 1 + members ranks over a TCP
store the trainer serves, keys under `epoch{N}/`). It then posts an `Offer` on
`Keys.transfer_offers` (the version, the epoch, its members in rank order, the tensors' layout in
buckets and each bucket's fingerprint) and broadcasts the buckets. Every step is bounded by the
offer's timeout: a member that does not join or stops receiving fails that epoch (the trainer
drops it, and the next publish opens a new group of the members still listening), never the
trainer. A member checks each bucket's fingerprint against the offer's before it keeps the
weights; whatever goes wrong on its side, it loads that version from the files as before.
"""

from __future__ import annotations

import datetime
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack
import xxhash

from common.keys import Keys
from common.messages import MessageError

if TYPE_CHECKING:
    import redis
    import torch

BACKENDS = ("gloo", "nccl")  # trainer.weight_transfer's collectives ("disk": none)
OFFERS_MAXLEN = 100  # the offers stream is capped to about this many entries
LISTENING_S = 5.0  # a receiver says it is listening this often (between offers)
SILENT_S = 3 * LISTENING_S  # a receiver silent this long has left (taken off the members)


# ---------------------------------------------------------------------- membership
# `Keys.transfer_members`: a hash, generator id -> the time (seconds since the epoch, as text) its
# receiver last said it listens. Generators write it; the trainer reads and prunes it.

def say_listening(r: redis.Redis, keys: Keys, member: str, *, now: float | None = None) -> None:
    """Generator `member`'s receiver listens (as of `now`, default: now)."""
    r.hset(keys.transfer_members, member, repr(time.time() if now is None else now))


def stop_listening(r: redis.Redis, keys: Keys, *members: str) -> None:
    """Take `members` off (a receiver stopping; the members of a group that failed, which say
    they listen again within LISTENING_S if they do)."""
    if members:
        r.hdel(keys.transfer_members, *members)


def listening_members(r: redis.Redis, keys: Keys) -> list[str]:
    """The generators whose receivers said they listen within SILENT_S, sorted; the ones silent
    for longer are taken off."""
    now = time.time()
    said = {k.decode(): float(v) for k, v in r.hgetall(keys.transfer_members).items()}
    gone = [g for g, t in said.items() if now - t > SILENT_S]
    stop_listening(r, keys, *gone)
    return sorted(g for g in said if g not in gone)


@dataclass(frozen=True)
class Slot:
    """Where one tensor lies in the buckets."""

    name: str
    dtype: str  # torch's name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    bucket: int
    offset: int  # bytes into the bucket
    nbytes: int


@dataclass(frozen=True)
class Offer:
    """One version's broadcast, as the trainer announces it to its group before sending."""

    version: int
    epoch: int  # the group it goes to; a new epoch is a new group
    members: list[str]  # generator ids, rank 1, 2, ... in that order (the trainer is rank 0)
    host: str  # the trainer's TCP store, where the group meets
    port: int
    backend: str  # "gloo" or "nccl"
    timeout_s: float  # every step of it (meeting, each bucket) is bounded by this
    slots: list[Slot]
    buckets: list[tuple[int, str]]  # (bytes, fingerprint) of each bucket, in sending order
    digest: str  # of the whole: WeightVersion.transfer_digest of the version it carries


def fingerprint(data: bytes | memoryview) -> str:
    return "xxh3_64:" + xxhash.xxh3_64_hexdigest(data)


def digest_of(slots: list[Slot], buckets: list[tuple[int, str]]) -> str:
    """One fingerprint of the layout and every bucket's: what an announcement names."""
    h = xxhash.xxh3_64()
    for s in slots:
        h.update(f"{s.name}|{s.dtype}|{s.shape}|{s.bucket}|{s.offset}|{s.nbytes};".encode())
    for n, f in buckets:
        h.update(f"{n}|{f};".encode())
    return "xxh3_64:" + h.hexdigest()


# --------------------------------------------------------------------------- buckets


def layout(tensors: dict[str, torch.Tensor], *, bucket_bytes: int) -> tuple[list[Slot], list[int]]:
    """Each tensor's place in buckets of about `bucket_bytes` (a larger tensor has one of its own),
    in the dict's order; and each bucket's size."""
    slots: list[Slot] = []
    sizes: list[int] = []
    for name, t in tensors.items():
        n = t.numel() * t.element_size()
        if not sizes or sizes[-1] and sizes[-1] + n > bucket_bytes:
            sizes.append(0)
        slots.append(Slot(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), len(sizes) - 1, sizes[-1], n))
        sizes[-1] += n
    return slots, sizes


def pack(tensors: dict[str, torch.Tensor], slots: list[Slot], sizes: list[int]) -> list[torch.Tensor]:
    """The buckets: flat uint8 CPU tensors holding the tensors' bytes as `slots` place them."""
    import torch

    buckets = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for s in slots:
        t = tensors[s.name].detach().to("cpu").contiguous()
        buckets[s.bucket][s.offset:s.offset + s.nbytes] = t.reshape(-1).view(torch.uint8)
    return buckets


def unpack(buckets: list[torch.Tensor], slots: list[Slot]) -> dict[str, torch.Tensor]:
    """The tensors, as views of the buckets (no copy)."""
    import torch

    return {s.name: buckets[s.bucket][s.offset:s.offset + s.nbytes].view(getattr(torch, s.dtype)).reshape(s.shape)
            for s in slots}


def bucket_fingerprint(bucket: torch.Tensor) -> str:
    return fingerprint(memoryview(bucket.cpu().numpy()))


# --------------------------------------------------------------------------- meeting


def address_towards(host: str, port: int) -> str:
    """This host's address on the route to `host` (no packet is sent): the one to offer a peer there."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port or 9))
            return s.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def open_group(store: Any, *, backend: str, epoch: int, rank: int, size: int, timeout_s: float, address: str,
               device: torch.device | None = None) -> Any:
    """This process's end of the epoch's process group (a group of its own, beside any default
    group under torchrun), meeting the others through `store` under `epoch{N}/`; raises when they
    have not all met within `timeout_s`. `address`: the interface gloo listens on."""
    import torch.distributed as dist

    prefixed = dist.PrefixStore(f"epoch{epoch}", store)
    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        opts = dist.ProcessGroupGloo._Options()
        opts._timeout = timeout
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
        return dist.ProcessGroupGloo(prefixed, rank, size, opts)
    if backend == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        group = dist.ProcessGroupNCCL(prefixed, rank, size, opts)
        if device is not None:  # NCCL meets lazily: meet now, so that a missing member fails here
            import torch

            group.allreduce([torch.zeros(1, device=device)]).wait()
        return group
    raise ValueError(f"weight transfer backend {backend!r}: expected one of {BACKENDS}")


def close_group(group: Any) -> None:
    """Let go of a group (aborting NCCL's communicators, which could otherwise hang)."""
    for name in ("abort", "shutdown"):
        fn = getattr(group, name, None)
        if fn is not None:
            try:
                fn()
                return
            except Exception:  # noqa: BLE001 - already broken: nothing more to do
                return


def broadcast(group: Any, bucket: torch.Tensor, *, timeout_s: float) -> None:
    """Broadcast `bucket` from rank 0 into every member's (in place), bounded by `timeout_s`."""
    import torch.distributed as dist

    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = 0, 0
    work = group.broadcast([bucket], opts)
    work.wait(datetime.timedelta(seconds=timeout_s))


# --------------------------------------------------------------------------- the wire


def encode_offer(o: Offer) -> bytes:
    return msgpack.packb({"version": o.version, "epoch": o.epoch, "members": o.members, "host": o.host,
                          "port": o.port, "backend": o.backend, "timeout_s": o.timeout_s,
                          "slots": [[s.name, s.dtype, list(s.shape), s.bucket, s.offset, s.nbytes] for s in o.slots],
                          "buckets": [list(b) for b in o.buckets], "digest": o.digest}, use_bin_type=True)


def decode_offer(blob: bytes) -> Offer:
    """An Offer, or MessageError naming what was wrong."""
    try:
        d = msgpack.unpackb(blob, raw=False)
        slots = [Slot(str(n), str(dt), tuple(int(x) for x in shape), int(b), int(off), int(nb))
                 for n, dt, shape, b, off, nb in d["slots"]]
        offer = Offer(version=int(d["version"]), epoch=int(d["epoch"]), members=[str(m) for m in d["members"]],
                      host=str(d["host"]), port=int(d["port"]), backend=str(d["backend"]),
                      timeout_s=float(d["timeout_s"]), slots=slots,
                      buckets=[(int(n), str(f)) for n, f in d["buckets"]], digest=str(d["digest"]))
    except Exception as err:  # noqa: BLE001 - any malformed payload is one refusal
        raise MessageError(f"transfer offer: {type(err).__name__}: {err}") from None
    if offer.backend not in BACKENDS:
        raise MessageError(f"transfer offer: backend {offer.backend!r} is not one of {BACKENDS}")
    if digest_of(offer.slots, offer.buckets) != offer.digest:
        raise MessageError("transfer offer: its digest does not match its layout and fingerprints")
    return offer
