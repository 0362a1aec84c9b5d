"""Cost of Redis's `appendfsync always` against `everysec` for the pipeline's kind of write.

`python ops/bench/fsync_cost.py [N]`: starts redis-server (append-only) with each setting, twice,
and times N rounds of what the pipeline does per group: an XADD, then a MULTI of XADD + XACK +
HINCRBY (2 KB payloads), from one client. Prints transactions per second for each.
"""

import shutil
import sys
import tempfile
import time
from pathlib import Path

import redis

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.localredis import free_port, start_redis  # noqa: E402


def rate(mode: str, n: int) -> float:
    data, port = tempfile.mkdtemp(), free_port()
    server = start_redis(Path(data), port, "--appendfsync", mode)
    r = redis.Redis(port=port)
    r.xgroup_create("s", "g", id="0", mkstream=True)
    blob = b"x" * 2000
    t0 = time.perf_counter()
    for _ in range(n):
        eid = r.xadd("s", {"m": blob})
        pipe = r.pipeline(transaction=True)
        pipe.xadd("t", {"m": blob})
        pipe.xack("s", "g", eid)
        pipe.hincrby("h", "c", 1)
        pipe.execute()
    seconds = time.perf_counter() - t0
    server.terminate()
    server.wait()
    shutil.rmtree(data)
    return n / seconds


if __name__ == "__main__":
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 3000
    for mode in ("everysec", "always", "everysec", "always"):
        print(f"appendfsync {mode:<8}: {rate(mode, n):7.0f} transactions/s", flush=True)
