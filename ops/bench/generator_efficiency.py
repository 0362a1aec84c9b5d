"""Tokens/s of a generator process fed from the prompts stream against the bare engine on the same prompts.

    .venv/bin/python ops/bench/generator_efficiency.py [--engine hf|vllm] [--model DIR] [--turns 6]

Both sides open the same engine (`engines.choice.open_for_settings`) on the same model with the same
settings: the demo's sampling (4 completions per prompt, temperature 0.8, at most 24 new tokens),
the HF engine's `batch_prompts` prompts per `generate` call, vLLM's scheduler holding every request,
one torch thread. The prompts are the arithmetic task's, the same on both sides.

    bare:      this process adds each turn's prompts to the engine and steps it until all are
               finished (the engine's own `generate` calls, nothing around them);
    generator: `python -m generators --id bench` (the real process: intake from the prompts
               stream, continuous batching, rewards in worker processes, one MULTI/EXEC per
               group onto the samples stream, heartbeats) against a real redis-server; a turn
               runs from writing its prompts to the prompts stream to the last of their groups
               appearing on the samples stream.

The machine is shared and its load drifts, so the two take turns of `--prompts` prompts each, in
alternating order, while the other sits idle (the generator blocked on XREADGROUP); the first
turn of each side is a warm-up and not counted. Tokens are the completions' sampled tokens. An
HF `generate` call runs until its longest sequence stops, so a turn's seconds depend little on
how many tokens it counts; tokens/s then varies with the sampled lengths, and seconds per turn on
the same prompts are printed beside it. `--profile FILE` records the generator with py-spy during
the measured turns (summarize with ops/bench/spy_summary.py). CPU seconds (the generator's and
its reward workers', from /proc; the bare side's own) are printed too: on a shared machine they
move much less with the neighbours' load than seconds do.

Prints the median over turns of the ratio generator/bare of tokens/s on its last line.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

N = 4  # completions per prompt (the demo's group_size)
TEMPERATURE = 0.8  # the demo's
MAX_NEW_TOKENS = 24  # the demo's
BATCH_PROMPTS = 4  # the demo's generator.batch_prompts: the HF engine's prompts per generate call


def prompts(count: int, *, start: int):
    """`count` arithmetic PromptTasks as the producer makes them, from index `start`."""
    from common.messages import PromptTask
    from tasks.arithmetic import problem

    out = []
    for i in range(start, start + count):
        p = problem(seed=0, index=i, max_operand=20, ops=["+", "-"])
        out.append(PromptTask(id=f"arithmetic:0:{i}", messages=[{"role": "user", "content": p.question}], text=None,
                              meta={"answer": p.answer, "source": "arithmetic"}, n=N, admitted_at=0))
    return out


def bare_turn(engine, tasks) -> tuple[float, int, float]:
    """(seconds, sampled tokens, CPU seconds) of the engine alone on `tasks`: add them all, step until done."""
    from engines.base import SamplingSettings

    sampling = SamplingSettings(n=N, max_new_tokens=MAX_NEW_TOKENS, temperature=TEMPERATURE)
    cpu0 = time.process_time()  # this process's: the engine runs here, nothing else does meanwhile
    t0 = time.monotonic()
    for t in tasks:
        engine.add(t.id, engine.prompt_ids(t), sampling)
    tokens = 0
    while engine.has_unfinished():
        for done in engine.step():
            tokens += sum(len(s.ids) for s in done.samples)
    return time.monotonic() - t0, tokens, time.process_time() - cpu0


def generator_turn(r, keys, tasks, *, proc: subprocess.Popen, log: Path) -> tuple[float, int, float]:
    """(seconds, sampled tokens, CPU seconds of the generator and its reward workers) from writing
    `tasks` to the prompts stream to their groups' arrival."""
    from proc_cpu import cpu_seconds

    from common.keys import PAYLOAD
    from common.messages import decode_group, encode

    before = r.xinfo_stream(keys.samples)["last-generated-id"] if r.exists(keys.samples) else b"0-0"
    cpu0 = cpu_seconds(proc.pid)
    t0 = time.monotonic()
    with r.pipeline(transaction=True) as pipe:  # as the producer admits them: one MULTI/EXEC
        for t in tasks:
            pipe.xadd(keys.prompts, {PAYLOAD: encode(t)})
        pipe.execute()
    while r.xlen(keys.samples) - len(r.xrange(keys.samples, min="-", max=before)) < len(tasks):
        if proc.poll() is not None:
            raise RuntimeError(f"generator exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        time.sleep(0.01)
    seconds = time.monotonic() - t0
    cpu = cpu_seconds(proc.pid) - cpu0
    new = r.xrange(keys.samples, min=f"({before.decode() if isinstance(before, bytes) else before}", max="+")
    groups = [decode_group(f[PAYLOAD]) for _, f in new]
    assert sorted(g.id for g in groups) == sorted(t.id for t in tasks), "groups of other prompts showed up"
    return seconds, sum(len(c.ids) for g in groups for c in g.completions), cpu


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["hf", "vllm"], default="hf")
    ap.add_argument("--model", default="", help="HF checkpoint dir ('' = the default model)")
    ap.add_argument("--prompts", type=int, default=8, help="prompts per turn")
    ap.add_argument("--turns", type=int, default=6, help="turns per side, the first one a warm-up")
    ap.add_argument("--max-in-flight", type=int, default=16, help="generator.max_in_flight")
    ap.add_argument("--profile", type=Path, help="also record the generator with py-spy (collapsed stacks) here")
    ap.add_argument("--log", type=Path, help="keep the generator's log here")
    args = ap.parse_args()
    assert args.turns >= 2, "--turns must be >= 2: the first turn is a warm-up"

    import redis
    import torch

    from common.config import load_config
    from common.keys import Keys
    from common.localredis import free_port, start_redis
    from common.models import resolve_model_path
    from engines.choice import open_for_settings

    model_dir = resolve_model_path(args.model)
    tmp = Path(tempfile.mkdtemp(prefix="rollouts-bench-"))
    port = free_port()
    server = start_redis(tmp / "redis", port)
    url = f"redis://127.0.0.1:{port}/0"
    config = tmp / "bench.toml"
    config.write_text(f"""run = "bench"
redis_url = "{url}"
output_dir = "{tmp / 'out'}"
[model]
path = "{model_dir}"
[rollout]
group_size = {N}
temperature = {TEMPERATURE}
max_new_tokens = {MAX_NEW_TOKENS}
[generator]
engine = "{args.engine}"
batch_prompts = {BATCH_PROMPTS}
max_in_flight = {args.max_in_flight}
threads = 1
""")
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1",
               ROLLOUTS_CONFIG=str(config))
    log = tmp / "generator.log"
    proc = subprocess.Popen([sys.executable, "-m", "generators", "--id", "bench"], cwd=tmp, env=env,
                            stdout=open(log, "wb"), stderr=subprocess.STDOUT)  # noqa: SIM115 - the child owns it
    try:
        r = redis.Redis.from_url(url)
        keys = Keys("bench")
        torch.set_num_threads(1)
        # the engine as the generator process opens it from the same [generator] table (open_engine_for)
        engine = open_for_settings(args.engine, model_dir, settings=load_config(str(config), env={}).generator,
                                   dtype="float32", seed=1, max_running=args.max_in_flight * N)
        deadline = time.monotonic() + 600
        while " engine on " not in log.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-4000:]
            time.sleep(0.2)
        print(f"model {model_dir.name}, engine {args.engine}; {args.turns} turns x {args.prompts} prompts x {N} "
              f"completions per side (the first a warm-up), temperature {TEMPERATURE}, "
              f"max_new_tokens {MAX_NEW_TOKENS}, 1 thread")
        bare, gen = [], []
        spy = None
        for k in range(args.turns):
            if k == 1 and args.profile is not None:  # the measured turns only
                spy = subprocess.Popen([str(Path(sys.executable).parent / "py-spy"), "record", "-p", str(proc.pid),
                                        "--rate", "50", "--format", "raw", "--threads", "--nonblocking",
                                        "-o", str(args.profile)], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
            tasks = prompts(args.prompts, start=k * args.prompts)
            sides = [("bare", lambda ts=tasks: bare_turn(engine, ts)),
                     ("generator", lambda ts=tasks: generator_turn(r, keys, ts, proc=proc, log=log))]
            for side, turn in sides if k % 2 == 0 else sides[::-1]:
                seconds, tokens, cpu = turn()
                (bare if side == "bare" else gen).append((seconds, tokens, cpu))
                print(f"  turn {k}{' (warm-up)' if k == 0 else ''} {side:9s} {tokens:5d} tokens in {seconds:6.2f} s"
                      f" = {tokens / seconds:6.1f} tokens/s; {cpu:6.2f} CPU s", flush=True)
        if spy is not None:
            spy.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
            spy.wait(timeout=60)
        proc.terminate()
        proc.wait(timeout=120)
        if args.log is not None:
            shutil.copy(log, args.log)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.terminate()
        server.wait(timeout=10)
        shutil.rmtree(tmp, ignore_errors=True)
    bare, gen = bare[1:], gen[1:]  # the warm-up turn is not counted
    bare_rate = sum(t for _, t, _ in bare) / sum(s for s, _, _ in bare)
    gen_rate = sum(t for _, t, _ in gen) / sum(s for s, _, _ in gen)
    # Each turn's two sides ran back to back on the same prompts: their ratio is the least
    # disturbed by the machine's load, and the median of those ratios the least by a spike.
    paired = sorted((gt / gs) / (bt / bs) for (bs, bt, _), (gs, gt, _) in zip(bare, gen, strict=True))
    per_turn = sorted(bs / gs for (bs, _, _), (gs, _, _) in zip(bare, gen, strict=True))
    cpu_per_token = (sum(c for _, _, c in bare) / sum(t for _, t, _ in bare)) / (
        sum(c for _, _, c in gen) / sum(t for _, t, _ in gen))
    cpu_per_turn = sum(c for _, _, c in bare) / sum(c for _, _, c in gen)
    print(f"bare engine: {bare_rate:7.1f} tokens/s over the measured turns")
    print(f"generator:   {gen_rate:7.1f} tokens/s over the measured turns (ratio {gen_rate / bare_rate:.3f})")
    print(f"per-turn ratios of tokens/s: {', '.join(f'{x:.3f}' for x in paired)}; "
          f"of seconds per turn (bare/generator): {', '.join(f'{x:.3f}' for x in per_turn)}")
    print(f"over CPU time: tokens per CPU second generator/bare {cpu_per_token:.3f}; "
          f"CPU seconds for the same prompts bare/generator {cpu_per_turn:.3f}")
    print(f"generator ratio generator/bare ({args.engine}, median of turns): {statistics.median(paired):.3f}")

if __name__ == "__main__":
    main()
