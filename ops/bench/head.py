"""The trainer's head over the loss's positions, timed: forward (log-probs and entropy) and backward.

    .venv/bin/python ops/bench/head.py [--trees OLD .] [--hidden 16] [--vocab 151936] [--positions 512]
        [--temperatures 1.0 0.8] [--rounds 3] [--repeats 4]

`trainer.logprobs._at_positions` (what `sequence_logprobs` runs once the body has given its
hidden states) on `--positions` positions of a random `--hidden` x `--vocab` head, in chunks of
`--chunk-tokens`, with the entropy, then the backward of the log-probs' sum: the V-wide float32
work of a step's head (the cast, the temperature, the log-softmax, the entropy, their backward,
the chunk's recompute) beside its two matmuls. A small `--hidden` leaves the matmuls small, so
the V-wide passes, memory-bound on a GPU, are most of what is timed. Each tree (`trainer`
imported from it: `git archive REV | tar -x -C /tmp/old`) runs in a fresh process, one thread,
the trees in turns over `--rounds`; each process reports the best of its `--repeats` after one
untimed, and the median over rounds is printed with the ratio to the first tree.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def worker(hidden: int, vocab: int, positions: int, chunk_tokens: int, temperatures: list[float],
           repeats: int) -> dict[str, float]:
    """Best seconds of forward + backward at each temperature, and the mean entropy and log-prob
    (the same inputs in every tree: the numbers must agree)."""
    import torch

    from trainer.logprobs import _at_positions

    torch.manual_seed(0)
    torch.set_num_threads(1)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    states = torch.randn(1, positions, hidden, requires_grad=True)
    targets, at = torch.randint(0, vocab, (1, positions)), torch.arange(positions)
    out: dict[str, float] = {}
    for t in temperatures:
        seconds = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            logp, ent = _at_positions(head, states, targets, at, temperature=t, top_k=0, top_p=1.0, entropy=True,
                                      chunk_tokens=chunk_tokens)
            logp.sum().backward()
            seconds.append(time.perf_counter() - start)
        out[f"{t:g}"] = min(seconds[1:])
        out[f"entropy {t:g}"], out[f"logp {t:g}"] = ent.mean().item(), logp.mean().item()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trees", nargs="+", default=[str(ROOT)], help="code trees to time, in turns")
    ap.add_argument("--hidden", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=151936, help="Qwen's vocabulary")
    ap.add_argument("--positions", type=int, default=512)
    ap.add_argument("--chunk-tokens", type=int, default=256)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[1.0, 0.8])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    sizes = (args.hidden, args.vocab, args.positions, args.chunk_tokens, args.temperatures, args.repeats)
    if args.worker:
        print(json.dumps(worker(*sizes)))
        return
    assert args.rounds >= 1 and args.repeats >= 1, "--rounds and --repeats must be >= 1"
    trees = [str(Path(t).resolve()) for t in args.trees]
    runs: dict[str, list[dict]] = {t: [] for t in trees}
    for n in range(args.rounds):
        for tree in trees if n % 2 == 0 else trees[::-1]:
            env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
            done = subprocess.run([sys.executable, __file__, "--worker", *sys.argv[1:]], env=env, cwd=tree,
                                  check=True, capture_output=True, text=True)
            runs[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"head {args.hidden} x {args.vocab}, {args.positions} positions in chunks of {args.chunk_tokens}, "
          f"one thread; forward with entropy + backward, best of {args.repeats}, median of {args.rounds} rounds")
    first = trees[0]
    for tree in trees:
        for t in args.temperatures:
            key = f"{t:g}"
            median = statistics.median(r[key] for r in runs[tree])
            base = statistics.median(r[key] for r in runs[first])
            print(f"{tree}  temperature {key}: {median:.3f} s ({median / base:.2f}x the first tree)  "
                  f"entropy {runs[tree][0]['entropy ' + key]:.6f}  log-prob {runs[tree][0]['logp ' + key]:.6f}")


if __name__ == "__main__":
    main()
