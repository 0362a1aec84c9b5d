"""Cost of Redis's `appendfsync always` against `everysec` for the pipeline's kind of write.

`python ops/bench/fsync_cost.py [N]`: starts redis-server (append-only) with each setting, twice,
and times N rounds of what the pipeline does per group: an XADD, then a MULTI of XADD + XACK +
HINCRBY (2 KB payloads), from one client. Prints transactions per second for each.
"""

import shutil
import socket
import subprocess
import sys
import tempfile
import time

import redis


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rate(mode: str, n: int) -> float:
    data, port = tempfile.mkdtemp(), free_port()
    server = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--appendonly", "yes",
                               "--appendfsync", mode, "--dir", data, "--save", ""], stdout=subprocess.DEVNULL)
    r = redis.Redis(port=port)
    for _ in range(200):
        try:
            r.ping()
            break
        except redis.exceptions.ConnectionError:
            time.sleep(0.05)
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
