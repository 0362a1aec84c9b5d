"""Where a process's time went, from a py-spy recording in collapsed-stack ("raw") form.

    .venv/bin/py-spy record -p PID --format raw --threads -o FILE ...   (or a benchmark's --profile FILE)
    .venv/bin/python ops/bench/spy_summary.py FILE [--top 15]

Prints each thread's share of the samples (py-spy samples only threads that are running, not
idle ones), then the functions with the largest inclusive share (samples with the function
anywhere on the stack), per thread. Prints the busiest thread's share on its last line.
"""

from __future__ import annotations

import argparse
import re
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"^(?P<fn>.+?) \((?P<file>[^:()]+):\d+\)$")


def load(path: Path) -> list[tuple[list[str], int]]:
    """(frames from the thread down to the leaf, samples) per collapsed stack."""
    out = []
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if stack:
            out.append((stack.split(";"), int(count)))
    return out


def thread_name(frames: list[str]) -> str:
    """The thread frame as a stable name: 'engine_0', 'MainThread', 'trio worker', ... (ids dropped)."""
    head = frames[0]
    name = head.split(":", 1)[1].strip() if ":" in head else head
    return re.sub(r"\s*\(\d+\)", "", re.sub(r"[-_]\d+$", "", name)) or head


def function(frame: str) -> str:
    m = FRAME.match(frame)
    if not m:
        return frame
    parts = Path(m["file"]).parts
    return f"{m['fn']} ({'/'.join(parts[-2:])})"


def summarize(path: Path, *, top: int = 15) -> tuple[str, float]:
    stacks = load(path)
    total = sum(n for _, n in stacks)
    assert total, f"{path}: no samples"
    by_thread: Counter[str] = Counter()
    inclusive: dict[str, Counter[str]] = {}
    for frames, n in stacks:
        t = thread_name(frames)
        by_thread[t] += n
        for fn in {function(f) for f in frames[1:]}:
            inclusive.setdefault(t, Counter())[fn] += n
    print(f"{total} samples while running")
    for t, n in by_thread.most_common():
        print(f"  thread {t}: {n / total:.1%}")
    for t, _ in by_thread.most_common(3):
        print(f"\n{t}: inclusive share of all samples")
        for fn, n in inclusive[t].most_common(top):
            print(f"  {n / total:6.1%}  {fn}")
    busiest, n = by_thread.most_common(1)[0]
    return busiest, n / total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("file", type=Path)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    busiest, share = summarize(args.file, top=args.top)
    print(f"\nbusiest thread {busiest}: {share:.1%} of the samples")


if __name__ == "__main__":
    main()
