"""The coordination benchmark (ops/bench/scale.py) at a tiny size, checked for what a user reads in
it: every logical generator wrote groups, every admitted prompt is accounted for exactly once
(streams and acknowledgements, common/audit.py), and the prompts of the generator it killed were
taken over by the others and finished."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.harness.processes import ROOT, process_env


def test_scale_bench_at_four_generators(tmp_path, tiny_model):
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "ops" / "bench" / "scale.py"), "--generators", "4", "--processes", "2",
         "--seconds", "3", "--sample-s", "0.5", "--claim-idle-s", "2", "--idle-s", "1", "--model", str(tiny_model),
         "--out", str(out)],
        cwd=tmp_path, env=process_env({}), capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    [x] = json.loads(out.read_text())["results"]
    print(f"phases (s): {x['phases_s']}")

    written = x["groups_per_generator"]
    assert len(written) == 4 and all(n > 0 for n in written.values()), written
    assert x["groups"] > 0 and x["fairness"]["min"] >= 0

    acc = x["accounting"]
    assert x["unaccounted"] == [], x["unaccounted"]  # nothing lost, nothing admitted or written twice
    assert acc["duplicate"] == 0 and acc["admitted"] == acc["prompt_entries"] > 0, acc
    assert acc["trained"] > 0, acc

    # What the killed generator held was claimed by another and finished: its group trained or
    # waiting in the samples stream, or given up for a reason the run counts (a group the trainer
    # found too stale: it was sampled after the claim idle time, while the trainer stepped on).
    reclaim = x["reclaim"]
    assert reclaim["prompts"] >= 1, reclaim
    assert reclaim["completed"] == reclaim["prompts"] == len(reclaim["fates"]), reclaim
    assert set(reclaim["fates"].values()) <= {"trained", "in_samples", "dropped"}, reclaim
    dropped = sum(f == "dropped" for f in reclaim["fates"].values())
    assert reclaim["groups_written"] == reclaim["prompts"] - dropped, reclaim
    assert dropped <= reclaim["accounting_then"]["dropped"], reclaim
