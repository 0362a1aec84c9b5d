"""The order test files go to pytest-xdist's workers in (tests/harness/schedule.py): the longest
first, each file's tests together and in their order, and only files that exist named."""

from __future__ import annotations

import subprocess
import sys

from tests.harness.processes import ROOT
from tests.harness.schedule import SECONDS


def test_every_file_the_schedule_names_exists():
    gone = [name for name in SECONDS if not (ROOT / name).is_file()]
    assert not gone, f"tests/harness/schedule.py's SECONDS names test files that are not there: {gone}"


def collected(*args: str) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-n", "0", "-p", "no:cacheprovider",
                           *args], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_the_longest_files_are_collected_first_each_whole_and_in_its_order():
    """Three files given shortest first: the default suite's collection puts test_supervision (about
    90 s here) before test_e2e (about 45 s) before test_messages (not named: short), each file's tests
    in the order written, and the slow checks' collection puts test_readme (its slow runs) first."""
    files = ["tests/test_messages.py", "tests/test_e2e.py", "tests/test_supervision.py"]
    ids = collected(*files)
    assert [i.split("::")[0] for i in ids] == sorted((i.split("::")[0] for i in ids),
                                                     key=lambda f: [files[2], files[1], files[0]].index(f)), ids
    alone = collected(files[0])
    assert [i for i in ids if i.startswith(files[0])] == alone  # the file's own order
    slow = collected("-m", "slow", "tests/test_moe.py", "tests/test_readme.py")
    assert slow[0].startswith("tests/test_readme.py::") and slow[-1].startswith("tests/test_moe.py::"), slow
