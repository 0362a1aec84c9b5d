"""The docs against the repository: the README's counts of tests against the suite as pytest
collects it, the README short and linking every docs page, and every link and path the README and
docs/*.md name against the files there are.
A figure measured by a benchmark is not checked here (docs/benchmarks.md gives its command); a
count is, so that adding tests or moving a file cannot leave the docs saying what is no longer so."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.harness.marker_counts import PREFIX
from tests.harness.processes import ROOT

DOCS = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
CODE = re.compile(r"`([^`\s]+)`")
TOP = ("common", "tasks", "engines", "envs", "producers", "generators", "trainer", "evaluator", "ops",
       "tests", "docs", "configs")
SLACK = 50  # "over N tests" stays true as tests are added; past N + SLACK it says too little


def collected() -> dict[str, int]:
    """How many tests the whole suite holds ("total") and how many carry each marker, as pytest
    collects them (one collection: tests/harness/marker_counts.py; `-m ""` lifts pyproject's
    `-m 'not slow'`)."""
    out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                          "-m", "", "-p", "tests.harness.marker_counts", "tests"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    lines = [x for x in out.stdout.splitlines() if x.startswith(PREFIX)]
    assert out.returncode == 0 and len(lines) == 1, f"pytest --collect-only:\n{out.stdout[-3000:]}{out.stderr[-3000:]}"
    return json.loads(lines[0][len(PREFIX):])


def said(pattern: str, text: str, where: str) -> int:
    m = re.search(pattern, " ".join(text.split()))  # a sentence may be wrapped anywhere
    assert m, f"{where} no longer says {pattern!r}: say it again, or change this test with it"
    return int(m[1])


def test_the_readmes_test_counts_are_the_suites():
    text = (ROOT / "README.md").read_text()
    counts = collected()
    slow, gpu = counts.get("slow", 0), counts.get("gpu", 0)
    default = counts["total"] - slow
    over = said(r"over (\d+) tests, \d+ of them skipped without a GPU", text, "README 'Tests'")
    assert over < default <= over + SLACK, f"the README says over {over} tests; the default suite has {default}"
    assert said(r"over \d+ tests, (\d+) of them skipped without a GPU", text, "README 'Tests'") == gpu, \
        f"{gpu} tests are marked gpu"
    assert said(r"runs the (\d+) slow checks", text, "README 'Tests'") == slow, f"{slow} tests are marked slow"


README_LINES = 300  # a page or two: what it is, the two commands, what you see; the reference is in docs/


def test_the_readme_is_a_page_or_two_and_sends_the_reader_on_to_every_docs_page():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= README_LINES, \
        f"README.md has {len(text.splitlines())} lines: move reference into a docs/ page and link it"
    linked = {(ROOT / target.split("#")[0]).resolve() for target in LINK.findall(text)}
    unlinked = [str(d.relative_to(ROOT)) for d in DOCS if d.parent.name == "docs" and d.resolve() not in linked]
    assert not unlinked, f"docs pages the README does not link to: {unlinked}"


def references(doc: Path) -> list[tuple[str, Path]]:
    """What `doc` points at in the repository: its links (not to the web or to an anchor of its
    own), and code spans that name a file (an extension) or a folder (a trailing /) under one of
    the repository's own top-level folders."""
    text = doc.read_text()
    out = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        out.append((target, (doc.parent / target.split("#")[0]).resolve()))
    for span in CODE.findall(text):
        path = span.split("::")[0].rstrip(",.;:")
        file_or_folder = re.search(r"\.\w+$|/$", path)  # not a metric's name such as generators/alive
        if path.split("/")[0] in TOP and "/" in path and file_or_folder and not re.search(r"[*{}<>|$…]", path):
            out.append((span, ROOT / path))
    return out


@pytest.mark.parametrize("doc", DOCS, ids=[str(d.relative_to(ROOT)) for d in DOCS])
def test_every_file_a_doc_names_exists(doc):
    missing = [shown for shown, path in references(doc) if not path.exists()]
    assert not missing, f"{doc.relative_to(ROOT)} names files that do not exist: {missing}"


def named_tests(text: str) -> list[tuple[str, str, bool]]:
    """(file, test, cut short) for each `tests/test_x.py::test_name` in `text`; `test_x.py::` (the
    README's table, under tests/) and a bare `::test_name` (the file named before it on the line)
    count too. A name cut short ends in …"""
    out = []
    for line in text.splitlines():
        file = None
        for named, name, cut in re.findall(r"`(?:tests/)?(test_\w+\.py)?::(test_\w+)(…?)`", line):
            file = named or file
            if file:
                out.append((file, name, bool(cut)))
    return out


def test_every_test_a_doc_names_exists():
    missing = []
    for doc in DOCS:
        for file, name, cut in named_tests(doc.read_text()):
            path, rest = ROOT / "tests" / file, r"\w*" if cut else ""
            if not path.exists() or not re.search(rf"^def {name}{rest}\(", path.read_text(), re.M):
                missing.append(f"{doc.relative_to(ROOT)}: {file}::{name}{'…' if cut else ''}")
    assert not missing, f"tests named in the docs that no test file defines: {missing}"


def test_a_missing_file_and_a_missing_test_are_caught(tmp_path):
    doc = tmp_path / "doc.md"
    doc.write_text("[there](README.md) [gone](gone.md) [web](https://example.com) `tests/test_nope.py`"
                   " `tests/harness/processes.py::ROOT` `runs/demo/metrics.png`\n")
    (tmp_path / "README.md").write_text("")
    got = {shown for shown, path in references(doc) if not path.exists()}
    assert got == {"gone.md", "tests/test_nope.py"}, got
    line = "`tests/test_docs.py::test_every_test_a_doc_names_exists`, `::test_a_missing_…`, `test_x.py::test_y`"
    assert named_tests(line) == [("test_docs.py", "test_every_test_a_doc_names_exists", False),
                                 ("test_docs.py", "test_a_missing_", True), ("test_x.py", "test_y", False)]
