"""`ops/chaos`, short: four random SIGKILLs (trainer, the evaluator, Redis, a generator) under the
shipped Procfile and honcho, then the audit."""

import subprocess
import sys

import pytest

from tests.harness.processes import ROOT


@pytest.mark.slow
def test_four_random_sigkills_under_the_shipped_procfile_lose_nothing_and_train_nothing_twice(tmp_path):
    out = subprocess.run([sys.executable, str(ROOT / "ops" / "chaos.py"), "--trials", "4", "--seed", "176",
                          "--dir", str(tmp_path / "chaos")], capture_output=True, text=True, timeout=900)
    lines = out.stdout.splitlines()
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    trials = [x for x in lines if x.startswith("trial ")]
    assert [x.split("SIGKILL ")[1].split()[0].split(".")[0] for x in trials] == [
        "trainer", "evaluator", "redis", "generator"]
    assert "audit: clean" in lines
    audit = next(x for x in lines if x.startswith("audit: admitted"))
    assert "duplicates 0; trained twice 0" in audit, audit
