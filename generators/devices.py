"""One GPU per generator on a multi-GPU node, with no hand configuration.

Each generator process leases a free GPU of its host through Redis (`SET NX` with a TTL that its
heartbeat renews) and sets `CUDA_VISIBLE_DEVICES` to it before CUDA is initialised. A generator
that dies frees its GPU when the lease expires; a clean exit frees it at once. A GPU already
pinned by the user (`CUDA_VISIBLE_DEVICES` naming one device) is left alone.
"""

from __future__ import annotations

import os
from pathlib import Path

import redis

from common.keys import Keys

# Renew the lease only while we still hold it; never take over another generator's.
_RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('EXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""


def host_gpus() -> list[str]:
    """The GPUs this process may use: those `CUDA_VISIBLE_DEVICES` lists, else every NVIDIA GPU
    the driver shows (counted without initialising CUDA, which would fix the visible set)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip() and d.strip() != "-1"]
    gpus = Path("/proc/driver/nvidia/gpus")
    return [str(i) for i in range(len(list(gpus.iterdir())))] if gpus.is_dir() else []


def lease_gpu(r: redis.Redis, keys: Keys, *, host: str, devices: list[str], owner: str,
              ttl_s: int) -> str | None:
    """Take the first of `devices` no live generator on `host` holds; None when all are taken."""
    for device in devices:
        if r.set(keys.gpu_lease(host, device), owner, nx=True, ex=ttl_s):
            return device
    return None


def renew_gpu(r: redis.Redis, keys: Keys, *, host: str, device: str, owner: str, ttl_s: int) -> bool:
    """Extend our lease; False if it expired and someone else holds the GPU now."""
    return bool(r.eval(_RENEW, 1, keys.gpu_lease(host, device), owner, ttl_s))


def release_gpu(r: redis.Redis, keys: Keys, *, host: str, device: str, owner: str) -> None:
    r.eval(_RELEASE, 1, keys.gpu_lease(host, device), owner)


def lease_server(r: redis.Redis, keys: Keys, *, url: str, owner: str, ttl_s: int) -> None:
    """Take the inference server at `url` for this generator (engine "openai"); RuntimeError when a
    live generator drives it already: its weight reloads would change the weights under the other's
    requests, and groups would be stamped with versions they were not sampled with."""
    key = keys.server_lease(url)
    if r.set(key, owner, nx=True, ex=ttl_s) or r.eval(_RENEW, 1, key, owner, ttl_s):
        return
    holder = r.get(key)
    raise RuntimeError(f"the server {url} is driven by generator {holder.decode() if holder else '?'}: one "
                       f"generator per server (start a server for each generator)")


def renew_server(r: redis.Redis, keys: Keys, *, url: str, owner: str, ttl_s: int) -> bool:
    return bool(r.eval(_RENEW, 1, keys.server_lease(url), owner, ttl_s))


def release_server(r: redis.Redis, keys: Keys, *, url: str, owner: str) -> None:
    r.eval(_RELEASE, 1, keys.server_lease(url), owner)


def pick_gpu(r: redis.Redis, keys: Keys, *, host: str, owner: str, ttl_s: int) -> str | None:
    """Lease a GPU and make it this process's only visible one; None where there is nothing to
    choose (no GPU, or the user pinned exactly one). Raises RuntimeError when every GPU of the
    host is leased: more generators than GPUs."""
    devices = host_gpus()
    if len(devices) <= 1:
        return None
    device = lease_gpu(r, keys, host=host, devices=devices, owner=owner, ttl_s=ttl_s)
    if device is None:
        raise RuntimeError(f"all {len(devices)} GPUs of {host} ({','.join(devices)}) are leased by other "
                           f"generators; start at most one generator per GPU, or pin one with CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = device
    return device
