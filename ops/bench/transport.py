"""Sample groups per second through the samples stream, against raw blobs of the same size.

    .venv/bin/python ops/bench/transport.py [--tokens 512 4096] [--seconds 2] [--rounds 7]
                                            [--input arrays|lists] [--code DIR]

On one real redis-server (append-only on, as the Procfile starts it), one client moves groups of
8 completions of `--tokens` tokens each (a 32-token prompt, float32 log-probs, ~4 characters of
text per token) one at a time through the path a group takes:

    pipeline:  encode -> XADD -> XREADGROUP -> decode_group (with the trainer's vocab check)
               -> tensors (the trainer's micro_batches: rows, advantages, padded tensors) -> XACK
    raw:       the encoded bytes, as they are -> XADD -> XREADGROUP -> XACK

The group handed to `encode` holds numpy arrays of ids and log-probs, as the engines hand them
(`--input lists`: Python lists). `--code DIR` measures the codec and trainer of another checkout
(an older commit, say) with this script, so two versions can be compared in one sitting.

The raw side moves blobs of exactly the pipeline's payload size with the same redis-py commands,
so the ratio pipeline/raw is what the codec (and the trainer's tensor building) costs on top of
Redis. The same ratio is also given over CPU seconds (this client's, all threads, plus the
redis-server's own INFO cpu counters), which moves much less with the machine's load than
wall-clock rates do. The two sides alternate for
`--rounds` rounds of `--seconds` each (the machine is shared and its load drifts); the ratio is
the median over rounds of each round's pipeline/raw, and each side's median rate is printed. `redis-benchmark`
(C client, SET of the same size, one connection, no pipelining) is printed as a reference for
what the server itself sustains. Bytes per group on the wire are the server's own network
counters (INFO stats) divided by the groups moved: the payload plus the RESP framing, in and out.

Prints the ratio for the first `--tokens` size (512 by default) on its last line; "codec only"
ratios leave the tensors stage out of the pipeline's time.
"""

from __future__ import annotations

import argparse
import random
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

GROUP_SIZE = 8
PROMPT_TOKENS = 32
VOCAB = 49_152  # SmolLM2's
STAGES = ("encode", "xadd", "xreadgroup", "decode", "tensors", "xack")


def make_group(tokens: int, *, seed: int, arrays: bool = True):
    """A SampleGroup of GROUP_SIZE completions of `tokens` tokens each, contents random but realistic;
    ids and log-probs as numpy arrays (int32, float32), or lists where not `arrays`."""
    import numpy as np

    from common.messages import Completion, SampleGroup

    rng = random.Random(seed)

    def held(xs: list, dtype: str):
        return np.asarray(xs, dtype=dtype) if arrays else xs

    completions = [
        Completion(ids=held([rng.randrange(VOCAB) for _ in range(tokens)], "int32"),
                   logprobs=held([-rng.expovariate(1.0) for _ in range(tokens)], "float32"),
                   reward=float(i % 2), rewards={"correct": float(i % 2)}, finish="length",
                   text="".join(rng.choice("abcdefghij klmnop0123456789") for _ in range(4 * tokens)))
        for i in range(GROUP_SIZE)
    ]
    return SampleGroup(id=f"bench:0:{seed}", prompt_id=f"bench:0:{seed}",
                       prompt_ids=held([rng.randrange(VOCAB) for _ in range(PROMPT_TOKENS)], "int32"), version=3,
                       generator="g1", engine="hf", completions=completions,
                       timings={"generate": 1.0, "reward": 0.01})


def payload_parts(group) -> dict[str, int]:
    """Bytes of the payload's big parts: packed ids and log-probs, and the completions' text."""
    ids = 4 * (len(group.prompt_ids) + sum(len(c.ids) for c in group.completions))
    return {"token ids": ids, "log-probs": 4 * sum(len(c.logprobs) for c in group.completions),
            "text": sum(len(c.text.encode()) for c in group.completions)}


def net_bytes(r) -> int:
    info = r.info("stats")
    return int(info["total_net_input_bytes"]) + int(info["total_net_output_bytes"])


def cpu_seconds(r) -> float:
    """CPU seconds so far of this client process (all its threads) and of the redis-server."""
    info = r.info("cpu")
    return time.process_time() + float(info["used_cpu_user"]) + float(info["used_cpu_sys"])


def pipeline_round(r, group, *, stream: str, seconds: float) -> tuple[int, dict[str, float], int, float]:
    """(groups moved, seconds per stage, wire bytes, CPU seconds of client and server) of `seconds`
    of the full path, one group at a time."""
    from common.keys import PAYLOAD, TRAINER_GROUP
    from common.messages import decode_group, encode
    from trainer.batch import micro_batches

    spent = dict.fromkeys(STAGES, 0.0)
    moved, before, cpu = 0, net_bytes(r), cpu_seconds(r)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        blob = encode(group)
        t1 = time.perf_counter()
        r.xadd(stream, {PAYLOAD: blob})
        t2 = time.perf_counter()
        reply = r.xreadgroup(TRAINER_GROUP, "rank0", {stream: ">"}, count=1)
        t3 = time.perf_counter()
        entry_id, fields = reply[0][1][0]
        got = decode_group(fields[PAYLOAD], vocab_size=VOCAB)
        t4 = time.perf_counter()
        (batch,), _, _ = micro_batches([got], micro_batch_size=GROUP_SIZE)
        t5 = time.perf_counter()
        r.xack(stream, TRAINER_GROUP, entry_id)
        t6 = time.perf_counter()
        assert batch.input_ids.shape[0] == GROUP_SIZE
        for stage, a, b in zip(STAGES, (t0, t1, t2, t3, t4, t5), (t1, t2, t3, t4, t5, t6), strict=True):
            spent[stage] += b - a
        moved += 1
    cpu = cpu_seconds(r) - cpu
    return moved, spent, net_bytes(r) - before, cpu


def raw_round(r, blob: bytes, *, stream: str, seconds: float) -> tuple[int, dict[str, float], float]:
    """(blobs moved, seconds per stage, CPU seconds) of `seconds` of XADD -> XREADGROUP -> XACK, no codec."""
    from common.keys import PAYLOAD, TRAINER_GROUP

    spent = dict.fromkeys(("xadd", "xreadgroup", "xack"), 0.0)
    moved, cpu = 0, cpu_seconds(r)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        t0 = time.perf_counter()
        r.xadd(stream, {PAYLOAD: blob})
        t1 = time.perf_counter()
        reply = r.xreadgroup(TRAINER_GROUP, "rank0", {stream: ">"}, count=1)
        t2 = time.perf_counter()
        entry_id, fields = reply[0][1][0]
        assert len(fields[PAYLOAD]) == len(blob)
        r.xack(stream, TRAINER_GROUP, entry_id)
        t3 = time.perf_counter()
        spent["xadd"] += t1 - t0
        spent["xreadgroup"] += t2 - t1
        spent["xack"] += t3 - t2
        moved += 1
    return moved, spent, cpu_seconds(r) - cpu


def redis_benchmark(port: int, size: int, requests: int) -> float | None:
    """SET requests/s of `size`-byte values from redis-benchmark (one connection); None if absent."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return None
    out = subprocess.run([exe, "-p", str(port), "-t", "set", "-d", str(size), "-n", str(requests), "-c", "1",
                          "-P", "1", "-q"], capture_output=True, text=True, check=True).stdout
    m = re.findall(r"SET: ([\d.]+) requests per second", out.replace("\r", "\n"))
    return float(m[-1]) if m else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 4096], help="tokens per completion")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of one round of one side")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--input", choices=("arrays", "lists"), default="arrays",
                    help="what the group handed to encode holds: numpy arrays (as engines hand them) or lists")
    ap.add_argument("--code", type=Path, default=ROOT, help="checkout whose codec and trainer are measured")
    args = ap.parse_args()
    from common.localredis import free_port, start_redis  # this checkout's, whatever --code is

    sys.path.insert(0, str(args.code.resolve()))
    import torch

    torch.set_num_threads(1)  # as the demo's trainer runs (trainer.threads = 1)

    import redis

    from common.keys import TRAINER_GROUP
    from common.messages import encode
    from common.streams import ensure_group

    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    port = free_port()
    server = start_redis(tmp / "redis", port)
    ratios, codec_ratios, cpu_ratio = {}, {}, {}
    try:
        r = redis.Redis(port=port)
        import common.messages
        print(f"redis-server {r.info('server')['redis_version']} on 127.0.0.1:{port}, appendonly yes; "
              f"{GROUP_SIZE} completions per group, {args.rounds} rounds x {args.seconds:.0f} s per side; "
              f"input {args.input}; code {Path(common.messages.__file__).parents[1]}")
        for tokens in args.tokens:
            group = make_group(tokens, seed=tokens, arrays=args.input == "arrays")
            blob = encode(group)
            streams = {side: f"bench:{tokens}:{side}" for side in ("pipeline", "raw")}
            for s in streams.values():
                ensure_group(r, s, TRAINER_GROUP)
            pipe_rates, codec_rates, raw_rates, cpu_ratios = [], [], [], []
            spent = dict.fromkeys(STAGES, 0.0)
            raw_spent = dict.fromkeys(("xadd", "xreadgroup", "xack"), 0.0)
            total_moved = total_wire = raw_moved = 0
            for _ in range(args.rounds):
                moved, round_spent, wire, pipe_cpu = pipeline_round(r, group, stream=streams["pipeline"],
                                                                    seconds=args.seconds)
                pipe_per_cpu = moved / pipe_cpu
                pipe_rates.append(moved / sum(round_spent.values()))
                codec_rates.append(moved / (sum(round_spent.values()) - round_spent["tensors"]))
                total_moved += moved
                total_wire += wire
                for k, v in round_spent.items():
                    spent[k] += v
                moved, round_spent, raw_cpu = raw_round(r, blob, stream=streams["raw"], seconds=args.seconds)
                cpu_ratios.append(pipe_per_cpu / (moved / raw_cpu))
                raw_rates.append(moved / sum(round_spent.values()))
                raw_moved += moved
                for k, v in round_spent.items():
                    raw_spent[k] += v
                for s in streams.values():
                    r.xtrim(s, maxlen=0)  # keep the server's memory flat between rounds
            bench = redis_benchmark(port, len(blob), requests=max(200, int(2 * statistics.median(raw_rates))))
            pipe, raw = statistics.median(pipe_rates), statistics.median(raw_rates)
            # Each round's two sides ran back to back: their ratio is the least disturbed by the
            # machine's load, and the median of those ratios the least by a spike.
            paired = sorted(p / q for p, q in zip(pipe_rates, raw_rates, strict=True))
            ratios[tokens] = statistics.median(paired)
            codec_ratios[tokens] = statistics.median(p / q for p, q in zip(codec_rates, raw_rates, strict=True))
            cpu_ratio[tokens] = statistics.median(cpu_ratios)
            per_group_ms = {k: 1000 * v / total_moved for k, v in spent.items()}
            print(f"\n{tokens} tokens x {GROUP_SIZE}: payload {len(blob):,} bytes, "
                  f"on the wire {total_wire / total_moved:,.0f} bytes per group (in + out, RESP framing included)")
            print(f"  pipeline  {pipe:8.1f} groups/s  (rounds: {', '.join(f'{x:.1f}' for x in pipe_rates)})")
            print(f"  raw blobs {raw:8.1f} groups/s  (rounds: {', '.join(f'{x:.1f}' for x in raw_rates)})")
            if bench is not None:
                print(f"  redis-benchmark SET -d {len(blob)} -c 1: {bench:8.1f} requests/s "
                      "(reference: the server alone)")
            print("  pipeline ms per group: " + ", ".join(f"{k} {v:.3f}" for k, v in per_group_ms.items()))
            print("  raw ms per blob:       "
                  + ", ".join(f"{k} {1000 * v / raw_moved:.3f}" for k, v in raw_spent.items()))
            print("  payload parts: " + ", ".join(f"{k} {v:,}" for k, v in payload_parts(group).items()))
            print(f"  ratio pipeline/raw: {ratios[tokens]:.3f} "
                  f"(median of rounds: {', '.join(f'{x:.3f}' for x in paired)}); "
                  f"codec only (no tensors stage): {codec_ratios[tokens]:.3f}")
            print(f"  over CPU seconds (client + redis-server): {cpu_ratio[tokens]:.3f} "
                  f"(rounds: {', '.join(f'{x:.3f}' for x in sorted(cpu_ratios))})")
    finally:
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nsummary: " + ", ".join(f"{t} tokens {v:.3f} (codec only {codec_ratios[t]:.3f}, "
                                   f"over CPU seconds {cpu_ratio[t]:.3f})" for t, v in ratios.items()))
    first = args.tokens[0]
    print(f"transport ratio pipeline/raw ({first}-token groups): {ratios[first]:.3f}")


if __name__ == "__main__":
    main()
