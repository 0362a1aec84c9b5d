"""Trainer tokens/s consuming a replayed samples stream against a bare loop over the same groups in memory.

    .venv/bin/python ops/bench/trainer_efficiency.py [--model DIR] [--steps 4] [--world 1 2]

The groups are made once (demo-like shapes: 4 prompts x 4 completions per step, prompts of 30-45
tokens, completions of 4-24, behaviour log-probs from the model itself) and written to a file.
For each world size two processes train on exactly them, one thread per rank:

    bare:   this script's worker (`torchrun --nproc-per-node W` at W > 1): the model sharded as the
            trainer shards it, then `trainer.step.train_step` over the groups held in memory,
            each rank on its share of each step's groups;
    stream: the real trainer (`python -m trainer`, or `torchrun --nproc-per-node W -m trainer`)
            reading the same groups from a real redis-server's samples stream (publishing weights
            only after its last step).

The machine is shared and its load drifts, so the two live side by side and take turns, step by
step, in alternating order: a trainer step runs from the moment its groups are written to the
stream (it sits blocked on XREADGROUP until then) to the arrival of its step line (reading,
decoding, training, metrics); a bare step between a `go` and a `done` passed through Redis. The
first step of each side is a warm-up (AdamW allocates its state) and is not counted. The trainer
then takes one more step on groups already waiting in the stream: its own `time/wait_data` over
that step is the wait-for-data fraction of a replayed stream. CPU seconds of each side's process
tree (from /proc) are printed too: they move much less with the neighbours' load than seconds.

Prints the ratio stream/bare at the largest world size on its last line.

    .venv/bin/python ops/bench/trainer_efficiency.py --compute [--trees OLD .] [--threads 1] [--correction decoupled]

instead measures the step against its compute limit, per code tree in turns (a fresh process
each, that tree's `trainer` imported): its seconds and CPU seconds, the FLOPs of its matrix
products (recorded with a dispatch mode; the head's apart), the same products timed alone on
the same threads, padding, and a profile split (matmuls, attention, AdamW, the rest).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

PER_STEP = 4  # groups per step (the demo's prompts_per_step)
GROUP = 4  # completions per group (the demo's group_size)


# --------------------------------------------------------------------------- the groups


def encoded_groups(model_dir: Path, count: int, *, seed: int = 0) -> list[bytes]:
    """`count` encoded harness groups (ops/lib/groups.py's make_group) of demo-like shapes: random
    tokens whose behaviour log-probs are the model's own."""
    import torch
    from transformers import AutoModelForCausalLM

    from common.messages import encode
    from ops.lib.groups import make_group

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    rng = random.Random(seed)
    return [encode(make_group(model, f"bench:0:{g}", version=0, rng=rng,
                              shape=(rng.randint(30, 45), [rng.randint(4, 24) for _ in range(GROUP)])))
            for g in range(count)]


def count_tokens(blobs: list[bytes]) -> int:
    """Prompt + completion tokens through the model, summed over completions (as tokens_per_s counts)."""
    from common.messages import decode_group

    groups = [decode_group(b) for b in blobs]
    return sum(len(g.prompt_ids) + len(c.ids) - 1 for g in groups for c in g.completions)


# --------------------------------------------------------------------------- the bare loop (worker)


def bare_worker(groups_file: Path, *, redis_url: str, steps: int, lr: float) -> None:
    """Train on the groups in memory, sharded as the trainer does, one step per `go` popped from Redis."""
    import msgpack
    import redis
    import torch

    from common.config import GrpoLoss as LossOptions
    from common.messages import decode_group
    from trainer.checkpoints import adamw
    from trainer.devices import trainer_device
    from trainer.loading import load_model
    from trainer.parallel import finish, init_distributed, parallelize
    from trainer.step import GrpoOptions, train_step

    rank, world = init_distributed()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    r = redis.Redis.from_url(redis_url)
    blobs, model_dir = msgpack.unpackb(groups_file.read_bytes(), raw=False)
    groups = [decode_group(b) for b in blobs]
    model = parallelize(load_model(Path(model_dir)), device=trainer_device())
    optimizer = adamw(list(model.parameters()), lr=lr, weight_decay=0.0)  # the trainer's
    share = PER_STEP // world
    r.rpush(BARE_READY, rank)
    for s in range(steps):
        while r.blpop([bare_go(rank)], timeout=1) is None:  # the parent's turn signal: nothing runs meanwhile
            pass
        mine = groups[s * PER_STEP + rank * share:s * PER_STEP + (rank + 1) * share]
        train_step(model, optimizer, mine, how=GrpoOptions(loss=LossOptions(), temperature=1.0, estimator="grpo",
                                                           overlong="none", overlong_penalty=0.0, micro_batch_size=8,
                                                           micro_batch_tokens=0, updates=1, max_grad_norm=1.0))
        r.rpush(BARE_DONE, rank)
    finish()


BARE_READY, BARE_DONE = "bench:bare:ready", "bench:bare:done"


def pop(r, key: str, *, proc: subprocess.Popen, log: Path, timeout_s: float = 900) -> None:
    """Wait for an item on the list `key` while `proc` lives (redis-py's socket timeout is 5 s: poll)."""
    deadline = time.monotonic() + timeout_s
    while r.blpop([key], timeout=1) is None:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"bare loop exited {proc.poll()} or timed out:\n{log.read_text()[-4000:]}")


def bare_go(rank: int) -> str:
    return f"bench:bare:go:{rank}"


def launcher(world: int) -> list[str]:
    return [sys.executable] if world == 1 else [sys.executable, "-m", "torch.distributed.run",
                                                "--standalone", f"--nproc-per-node={world}"]


def clean_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
    return env


# --------------------------------------------------------------------------- both sides, step by step


def run_world(blobs: list[bytes], groups_file: Path, *, model_dir: Path, world: int, steps: int, lr: float,
              tmp: Path) -> tuple[list[tuple[float, float]], list[tuple[float, float]], list[dict]]:
    """((seconds, CPU seconds) per bare step, the same per stream step, the trainer's metrics) at
    world size `world`. CPU seconds are those of each side's whole process tree (every rank).

    Both processes live side by side and take turns: the trainer's step k starts when its groups
    are written to the stream (it sits blocked on XREADGROUP until then) and ends when its step line
    arrives; the bare loop's step k runs between a `go` and its `done`. The order alternates every
    step so that drift in the machine's load falls on both sides alike. The trainer takes one more
    step, on groups already waiting in the stream, for its wait-for-data fraction.
    """
    import redis
    from proc_cpu import cpu_seconds

    from common.audit import read_steps
    from common.keys import PAYLOAD, Keys
    from common.localredis import free_port, start_redis

    tmp.mkdir(parents=True)
    port = free_port()
    server = start_redis(tmp / "redis", port)
    url = f"redis://127.0.0.1:{port}/0"
    r = redis.Redis.from_url(url)
    env = clean_env()
    env.update(ROLLOUTS_RUN="bench", ROLLOUTS_REDIS_URL=url, ROLLOUTS_MODEL__PATH=str(model_dir),
               ROLLOUTS_OUTPUT_DIR=str(tmp / "out"), ROLLOUTS_ROLLOUT__PROMPTS_PER_STEP=str(PER_STEP),
               ROLLOUTS_ROLLOUT__GROUP_SIZE=str(GROUP), ROLLOUTS_ROLLOUT__MAX_STALENESS="1000",
               ROLLOUTS_ROLLOUT__TEMPERATURE="1.0", ROLLOUTS_TRAINER__MAX_STEPS=str(steps + 1),
               ROLLOUTS_TRAINER__SYNC_EVERY="1000", ROLLOUTS_TRAINER__LR=str(lr), ROLLOUTS_TRAINER__THREADS="1",
               ROLLOUTS_TRAINER__MICRO_BATCH_SIZE="8")
    trainer = subprocess.Popen([*launcher(world), "-m", "trainer"], cwd=tmp, env=env, stdout=subprocess.PIPE,
                               stderr=open(tmp / "trainer.err", "wb"), text=True)  # noqa: SIM115 - the child owns it
    bare = subprocess.Popen([*launcher(world), __file__, "--bare-worker", str(groups_file), "--redis-url", url,
                             "--steps", str(steps), "--lr", str(lr)], env=clean_env(),
                            stdout=open(tmp / "bare.log", "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115
    samples = Keys("bench").samples

    def trainer_line(prefix: str) -> str:
        for line in trainer.stdout:
            if line.startswith(prefix):
                return line
        raise RuntimeError(f"trainer exited {trainer.wait()}:\n{(tmp / 'trainer.err').read_text()[-4000:]}")

    def stream_step(k: int, extra: int = 0) -> tuple[float, float]:
        cpu0 = cpu_seconds(trainer.pid)
        t0 = time.monotonic()
        with r.pipeline(transaction=False) as pipe:
            for b in blobs[k * PER_STEP:(k + 1 + extra) * PER_STEP]:
                pipe.xadd(samples, {PAYLOAD: b})
            pipe.execute()
        trainer_line("step ")
        return time.monotonic() - t0, cpu_seconds(trainer.pid) - cpu0

    def bare_step() -> tuple[float, float]:
        cpu0 = cpu_seconds(bare.pid)
        t0 = time.monotonic()
        for rank in range(world):
            r.rpush(bare_go(rank), 1)
        for _ in range(world):
            pop(r, BARE_DONE, proc=bare, log=tmp / "bare.log")
        return time.monotonic() - t0, cpu_seconds(bare.pid) - cpu0

    try:
        trainer_line("trainer: run ")  # loaded, about to read the stream
        for _ in range(world):
            pop(r, BARE_READY, proc=bare, log=tmp / "bare.log")
        bare_s, stream_s = [], []
        for k in range(steps):
            last = k == steps - 1
            if (steps - 1 - k) % 2 == 0:  # the last step goes stream first: its extra step follows at once
                stream_s.append(stream_step(k, extra=1 if last else 0))
                if last:
                    trainer_line("step ")
                bare_s.append(bare_step())
            else:
                bare_s.append(bare_step())
                stream_s.append(stream_step(k))
        assert trainer.wait(timeout=600) == 0, (tmp / "trainer.err").read_text()[-4000:]
        assert bare.wait(timeout=600) == 0, (tmp / "bare.log").read_text()[-4000:]
        metrics = read_steps(tmp / "out" / "metrics.jsonl")
    finally:
        for p in (trainer, bare):
            if p.poll() is None:
                p.kill()
        server.terminate()
        server.wait(timeout=10)
    return bare_s, stream_s, metrics


# --------------------------------------------------------------------------- the compute limit (--compute)


def record_matmuls(fn) -> list[tuple[str, tuple, tuple]]:
    """Run `fn()` and return the (op, shape A, shape B) of every matrix product it made (aten mm,
    addmm, bmm: the linear layers forward and backward, the head, its recomputation)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Matmuls(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.seen: list[tuple[str, tuple, tuple]] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = str(func.overloadpacket).removeprefix("aten.")
            if name in ("mm", "addmm", "bmm"):
                a, b = args[1:3] if name == "addmm" else args[:2]
                self.seen.append((name, tuple(a.shape), tuple(b.shape)))
            return func(*args, **(kwargs or {}))

    with Matmuls() as rec:
        fn()
    return rec.seen


def matmul_flops(op: str, a: tuple, b: tuple) -> int:
    return 2 * a[0] * a[1] * a[2] * b[2] if op == "bmm" else 2 * a[0] * a[1] * b[1]


def bare_matmul_s(shapes: list[tuple[str, tuple, tuple]], *, clock, reps: int = 3) -> float:
    """Seconds on `clock` the same matrix products take alone (fresh float32 operands, best of
    `reps` per distinct shape, times its count), on the threads torch has now."""
    from collections import Counter

    import torch

    total = 0.0
    for (op, a, b), n in Counter(shapes).items():
        x, y = torch.randn(a), torch.randn(b)
        fn = torch.bmm if op == "bmm" else torch.mm
        fn(x, y)
        best = float("inf")
        for _ in range(reps):
            t0 = clock()
            fn(x, y)
            best = min(best, clock() - t0)
        total += best * n
    return total


def compute_worker(groups_file: Path, *, steps: int, threads: int, out: Path,
                   correction: str = "behaviour_clip") -> None:
    """In the tree $BENCH_TREE: `steps` timed trainer steps on the groups (the demo's loss
    options with `correction`, micro-batches of 8) after a warm-up, then one step under the matmul recorder and one
    under torch's profiler (neither timed). Writes its figures as JSON to `out`."""
    sys.path.insert(0, os.environ["BENCH_TREE"])  # that tree's trainer, not this file's
    import msgpack
    import torch
    from torch.profiler import profile

    from common.config import GrpoLoss as LossOptions
    from common.messages import decode_group
    from trainer.batch import micro_batches
    from trainer.checkpoints import load_model
    from trainer.step import GrpoOptions, train_step

    torch.manual_seed(0)
    torch.set_num_threads(threads)
    blobs, model_dir = msgpack.unpackb(groups_file.read_bytes(), raw=False)
    groups = [decode_group(b) for b in blobs]
    model = load_model(Path(model_dir))
    import trainer.checkpoints as tree  # that tree's optimizer (a tree before `adamw`: AdamW's default)
    optimizer = (tree.adamw(list(model.parameters()), lr=5e-6, weight_decay=0.0) if hasattr(tree, "adamw")
                 else torch.optim.AdamW(model.parameters(), lr=5e-6, weight_decay=0.0))

    def step(k: int) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        train_step(model, optimizer, groups[k * PER_STEP:(k + 1) * PER_STEP], how=GrpoOptions(
            loss=LossOptions(clip_high=0.28, correction=correction), temperature=0.8, estimator="grpo", overlong="none",
            overlong_penalty=0.0,
            micro_batch_size=8, micro_batch_tokens=0, updates=1, max_grad_norm=1.0, max_new_tokens=24))
        return time.perf_counter() - t0, time.process_time() - c0

    step(0)  # warm-up: AdamW allocates its state
    timed = [step(1 + k % (len(groups) // PER_STEP - 1)) for k in range(steps)]
    shapes = record_matmuls(lambda: step(1))
    with profile() as prof:
        profiled_s = step(1)[0]
    by_op = {e.key: e.self_cpu_time_total / 1e6 for e in prof.key_averages()}
    mm_s = sum(v for k, v in by_op.items() if k in ("aten::mm", "aten::addmm", "aten::bmm"))
    attention_s = sum(v for k, v in by_op.items() if "scaled_dot_product" in k)
    optimizer_s = sum(v for k, v in by_op.items() if k.startswith("aten::_foreach") or k in (
        "aten::addcdiv_", "aten::addcmul_", "aten::lerp_", "aten::sqrt", "aten::_fused_adamw_"))
    shared = {"share_prompts": True} if "share_prompts" in inspect.signature(micro_batches).parameters else {}
    batches, _, _ = micro_batches(groups[PER_STEP:2 * PER_STEP], micro_batch_size=8, **shared)
    packed = [mb.packed for mb in batches if getattr(mb, "packed", None) is not None]  # trees with share_prompts
    vocab = model.get_output_embeddings().weight.shape[0]
    head = [s for s in shapes if vocab in s[1] or vocab in s[2]]
    out.write_text(json.dumps({
        "step_s": [w for w, _ in timed], "step_cpu_s": [c for _, c in timed],
        "flops": sum(matmul_flops(*s) for s in shapes), "head_flops": sum(matmul_flops(*s) for s in head),
        "bare_matmul_s": bare_matmul_s(shapes, clock=time.perf_counter),
        "bare_matmul_cpu_s": bare_matmul_s(shapes, clock=time.process_time),
        "profiled_s": profiled_s, "mm_s": mm_s, "attention_s": attention_s, "optimizer_s": optimizer_s,
        "positions": sum(p.ids.numel() for p in packed) if packed else sum(mb.input_ids.numel() for mb in batches),
        "filled": sum(int((p.segments >= 0).sum()) for p in packed) if packed else None,
        "tokens": sum(int(mb.attention_mask.sum()) for mb in batches),
        "trained": sum(int(mb.mask.sum()) for mb in batches)}))


def compute(trees: list[str], *, model_dir: Path, steps: int, threads: int, rounds: int,
            correction: str = "behaviour_clip") -> None:
    """Each tree's trainer step against the bare matrix products of the same shapes, in turns
    (A B, B A, ...): achieved FLOP/s, the compute limit, where the rest goes."""
    import msgpack

    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    try:
        groups_file = tmp / "groups.msgpack"
        groups_file.write_bytes(msgpack.packb([encoded_groups(model_dir, 3 * PER_STEP), str(model_dir)],
                                              use_bin_type=True))
        results: dict[str, list[dict]] = {t: [] for t in trees}
        for n in range(rounds):
            for tree in trees if n % 2 == 0 else trees[::-1]:
                env = {**clean_env(), "PYTHONPATH": tree, "BENCH_TREE": tree, "OMP_NUM_THREADS": str(threads)}
                out = tmp / "out.json"
                subprocess.run([sys.executable, __file__, "--compute-worker", str(groups_file), "--steps", str(steps),
                                "--threads", str(threads), "--out", str(out), "--correction", correction],
                               env=env, cwd=tree, check=True,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                results[tree].append(json.loads(out.read_text()))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"model {model_dir.name}; {PER_STEP} groups x {GROUP} completions a step, micro-batches of 8, "
          f"correction {correction}, "
          f"{threads} thread(s); {rounds} rounds x {steps} timed steps per tree, in turns")
    medians, cpu_medians = {}, {}
    for tree, runs in results.items():
        r0 = runs[0]
        step_s = statistics.median(s for r in runs for s in r["step_s"])
        bare_s = statistics.median(r["bare_matmul_s"] for r in runs)
        prof = statistics.median(r["profiled_s"] for r in runs)
        share = {k: statistics.median(r[k] / r["profiled_s"] for r in runs) for k in ("mm_s", "attention_s",
                                                                                       "optimizer_s")}
        medians[tree] = step_s
        print(f"\n{tree}")
        filled = r0.get("filled") or r0["tokens"]  # packed: prompts once; else the rows' tokens
        print(f"  positions through the model {r0['positions']} (filled {filled}, padding "
              f"{1 - filled / r0['positions']:.1%}; the rows' tokens {r0['tokens']}); trained tokens {r0['trained']}")
        print(f"  matmul FLOPs per step {r0['flops'] / 1e9:.1f} G (the head {r0['head_flops'] / 1e9:.1f} G); "
              f"step {step_s:.2f} s (median) = {r0['flops'] / step_s / 1e9:.1f} GFLOP/s achieved")
        per_run = ", ".join(f"{r['bare_matmul_s'] / statistics.median(r['step_s']):.3f}" for r in runs)
        print(f"  the same matmuls alone: {bare_s:.2f} s = {r0['flops'] / bare_s / 1e9:.1f} GFLOP/s: "
              f"step / compute limit {bare_s / step_s:.3f} (per run: {per_run})")
        cpu_s = statistics.median(s for r in runs for s in r["step_cpu_s"])
        bare_cpu = statistics.median(r["bare_matmul_cpu_s"] for r in runs)
        print(f"  over CPU seconds (what the neighbours' load moves least): step {cpu_s:.2f}, the matmuls alone "
              f"{bare_cpu:.2f}: {bare_cpu / cpu_s:.3f} of the compute limit, "
              f"{r0['flops'] / cpu_s / 1e9:.1f} GFLOP per CPU second")
        cpu_medians[tree] = cpu_s
        print(f"  profiled step {prof:.2f} s: matmuls {share['mm_s']:.1%}, attention {share['attention_s']:.1%}, "
              f"AdamW's arithmetic {share['optimizer_s']:.1%}, the rest (elementwise, log-softmax, "
              f"autograd) {1 - sum(share.values()):.1%}")
    if len(trees) == 2:
        a, b = trees
        print(f"\nstep time {b} / {a}: {medians[b] / medians[a]:.3f} (over CPU seconds "
              f"{cpu_medians[b] / cpu_medians[a]:.3f})")


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="", help="HF checkpoint dir ('' = the default model)")
    ap.add_argument("--steps", type=int, default=4, help="steps per side, the first one a warm-up")
    ap.add_argument("--world", type=int, nargs="+", default=[1, 2], help="world sizes (trainer ranks)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--compute", action="store_true",
                    help="instead: a step's achieved FLOP/s against the bare matmuls of its shapes (--trees)")
    ap.add_argument("--trees", nargs="+", default=[str(ROOT)], help="--compute: code trees to measure, in turns")
    ap.add_argument("--threads", type=int, default=1, help="--compute: torch threads")
    ap.add_argument("--rounds", type=int, default=2, help="--compute: turns per tree")
    ap.add_argument("--correction", default="behaviour_clip",
                    help="--compute: [trainer.loss.correction]'s type (decoupled, token_mask, ...: a proximal pass)")
    ap.add_argument("--bare-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--compute-worker", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.bare_worker is not None:
        bare_worker(args.bare_worker, redis_url=args.redis_url, steps=args.steps, lr=args.lr)
        return
    if args.compute_worker is not None:
        compute_worker(args.compute_worker, steps=args.steps, threads=args.threads, out=args.out,
                       correction=args.correction)
        return
    if args.compute:
        from common.models import resolve_model_path

        compute([str(Path(t).resolve()) for t in args.trees], model_dir=resolve_model_path(args.model),
                steps=args.steps, threads=args.threads, rounds=args.rounds, correction=args.correction)
        return
    assert args.steps >= 2, "--steps must be >= 2: the first step is a warm-up"
    assert all(PER_STEP % w == 0 for w in args.world), f"world sizes must divide {PER_STEP}"

    import msgpack

    from common.models import resolve_model_path

    model_dir = resolve_model_path(args.model)
    blobs = encoded_groups(model_dir, (args.steps + 1) * PER_STEP)  # + the trainer's extra step
    tokens = count_tokens(blobs[PER_STEP:args.steps * PER_STEP])  # the measured steps: not the warm-up
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    groups_file = tmp / "groups.msgpack"
    groups_file.write_bytes(msgpack.packb([blobs, str(model_dir)], use_bin_type=True))
    print(f"model {model_dir.name}; {args.steps} steps x {PER_STEP} groups x {GROUP} completions per side, "
          f"the first a warm-up; {tokens} tokens in the {args.steps - 1} measured steps; 1 thread per rank")
    ratios = {}
    try:
        for world in args.world:
            bare, stream, metrics = run_world(blobs, groups_file, model_dir=model_dir, world=world,
                                              steps=args.steps, lr=args.lr, tmp=tmp / f"w{world}")
            bare, stream = bare[1:], stream[1:]  # the warm-up step is not counted
            bare_s, stream_s = sum(s for s, _ in bare), sum(s for s, _ in stream)
            bare_cpu, stream_cpu = sum(c for _, c in bare), sum(c for _, c in stream)
            measured = metrics[1:args.steps]
            train_s = sum(m["time/train"] for m in measured)
            tail = metrics[args.steps]  # on groups already in the stream when it began
            ratios[world] = bare_s / stream_s
            print(f"\nworld size {world}")
            print(f"  bare loop:   {tokens / bare_s:7.1f} tokens/s  ({bare_s:.2f} s, {bare_cpu:.2f} CPU s; steps "
                  f"{', '.join(f'{s:.2f}' for s, _ in bare)})")
            print(f"  from stream: {tokens / stream_s:7.1f} tokens/s  ({stream_s:.2f} s, {stream_cpu:.2f} CPU s; steps "
                  f"{', '.join(f'{s:.2f}' for s, _ in stream)}; in train_step {train_s:.2f} s, "
                  f"outside it {stream_s - train_s:.2f} s = {(stream_s - train_s) / stream_s:.1%})")
            tail_s = tail["time/step"] - tail["time/publish"]
            print(f"  wait-for-data fraction on a filled stream: {tail['time/wait_data'] / tail_s:.4f} "
                  f"({tail['time/wait_data']:.3f} s of a {tail_s:.2f} s step, its publish not counted)")
            paired = sorted(b / x for (b, _), (x, _) in zip(bare, stream, strict=True))
            print(f"  ratio stream/bare: {ratios[world]:.3f} (per step: {', '.join(f'{x:.3f}' for x in paired)}, "
                  f"median {statistics.median(paired):.3f}); over CPU seconds: {bare_cpu / stream_cpu:.3f}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print("\nsummary: " + ", ".join(f"world {w} {v:.3f}" for w, v in ratios.items()))
    last = args.world[-1]
    print(f"trainer ratio stream/bare (world size {last}): {ratios[last]:.3f}")


if __name__ == "__main__":
    main()
