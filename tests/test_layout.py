"""The code's shape: process packages side by side, never importing one another, and no import
cycle anywhere (a late import inside a function counts: it is a cycle all the same); readers of a
run's data see it through common/'s types only; test modules share the harness, never one another,
and ops/ imports nothing from tests/ (what both need lives below both, in common/ or ops/lib/)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.harness.processes import ROOT

PROCESSES = {"producers", "generators", "trainer", "evaluator"}
# What each shared package may import of ours: common stands alone, tasks is plain Python (the
# reward workers load it), engines sit on common.
SHARED = {"common": {"common"}, "tasks": {"tasks"}, "engines": {"engines", "common"},
          "envs": {"envs", "tasks"}}  # environments are plain Python too (the environment workers load them)
# Tools that play several processes' parts at once, outside a run: `checks` (`rollouts check`)
# samples as a generator and recomputes log-probs as the trainer, to compare the two, so it may
# import any package of ours; nothing imports it (common.cli starts it as its own process).
TOOLS = {"checks"}
# Readers of what a run wrote: `viewer` (`rollouts view`) shows the samples, the recordings and the
# metrics the processes write, all of them `common/` types read by `common/` functions, so it imports
# common and nothing else, and nothing imports it (common.cli starts it as its own process): a page
# that reached into the trainer would show what the trainer's code does today, not what the run wrote.
READERS = {"viewer": {"viewer", "common"}}
PACKAGES = PROCESSES | set(SHARED) | TOOLS | set(READERS)


def modules(root: Path) -> dict[str, Path]:
    """{dotted module name: file} of every module of our packages under `root`."""
    found = {}
    for package in sorted(PACKAGES):
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports(path: Path, name: str, known: set[str]) -> list[tuple[str, int]]:
    """(module of ours, line) for every import in the file, at any depth; `from a import b` is
    module a.b where that is a module, else a."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: resolve against this module's package
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for target in targets:
            if target.split(".")[0] in PACKAGES:
                out.append((target, node.lineno))
    return out


def layout_violations(root: Path) -> list[str]:
    """What breaks the layout under `root`: a process package importing another process package,
    a shared package importing outside what it may, and import cycles between modules."""
    found = modules(root)
    known = set(found)
    graph: dict[str, set[str]] = {}
    problems = []
    for name, path in found.items():
        own = name.split(".")[0]
        allowed = (PACKAGES - set(READERS)) if own in TOOLS else READERS.get(own) or SHARED.get(own, {own, *SHARED})
        graph[name] = set()
        for target, line in imports(path, name, known):
            top = target.split(".")[0]
            if top not in allowed:
                problems.append(f"{path.relative_to(root)}:{line}: {own} imports {target}")
            resolved = target
            while resolved not in known and "." in resolved:
                resolved = resolved.rpartition(".")[0]
            if resolved in known and resolved != name:
                graph[name].add(resolved)
    problems += [f"import cycle: {' -> '.join(cycle)}" for cycle in cycles(graph)]
    return problems


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle through each strongly connected component of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(_cycle_in(sorted(component), graph))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_in(component: list[str], graph: dict[str, set[str]]) -> list[str]:
    """A path from the component's first module back to itself, within the component."""
    inside, start = set(component), component[0]
    path, seen = [start], {start}
    while True:
        nxt = sorted(graph[path[-1]] & inside)
        back = [w for w in nxt if w == start]
        if back:
            return [*path, start]
        step = next((w for w in nxt if w not in seen), None)
        if step is None:  # dead end inside the component: go round from a module already seen
            step = nxt[0]
            return [*path[path.index(step):], step]
        path.append(step)
        seen.add(step)


def test_process_packages_import_no_other_and_nothing_imports_in_a_cycle():
    assert layout_violations(ROOT) == []


def write_tree(root: Path, files: dict[str, str]) -> Path:
    for package in PACKAGES:
        (root / package).mkdir(parents=True, exist_ok=True)
        (root / package / "__init__.py").write_text("")
    for name, text in files.items():
        (root / name).write_text(text)
    return root


def test_a_producer_importing_a_generator_is_caught(tmp_path):
    root = write_tree(tmp_path, {"producers/main.py": "import json\n\ndef f():\n    import generators\n",
                                 "generators/main.py": "from common import keys\nfrom tasks import gsm8k\n",
                                 "common/keys.py": "", "tasks/gsm8k.py": ""})
    assert layout_violations(root) == ["producers/main.py:4: producers imports generators"]


def test_shared_packages_may_not_reach_up_into_a_process(tmp_path):
    root = write_tree(tmp_path, {"common/config.py": "from trainer.main import run\n",
                                 "engines/hf.py": "from tasks import arithmetic\n", "tasks/arithmetic.py": "",
                                 "trainer/main.py": ""})
    assert layout_violations(root) == ["common/config.py:1: common imports trainer.main",
                                       "engines/hf.py:1: engines imports tasks.arithmetic"]


def test_an_import_cycle_is_caught_even_through_a_late_import(tmp_path):
    root = write_tree(tmp_path, {
        "engines/base.py": "def pick():\n    from engines.hf import HF\n",
        "engines/hf.py": "from engines.base import pick\n",
        "engines/vllm.py": "from .base import pick\n"})
    assert layout_violations(root) == ["import cycle: engines.base -> engines.hf -> engines.base"]


def test_the_check_may_import_any_package_and_nothing_may_import_it(tmp_path):
    root = write_tree(tmp_path, {"checks/check.py": "from generators import groups\nfrom trainer import step\n",
                                 "generators/groups.py": "", "trainer/step.py": "",
                                 "common/cli.py": "def main():\n    import checks.check\n",
                                 "trainer/main.py": "from checks import check\n"})
    assert layout_violations(root) == ["common/cli.py:2: common imports checks.check",
                                       "trainer/main.py:1: trainer imports checks.check"]


def test_the_viewer_reads_common_only_and_nothing_imports_it(tmp_path):
    root = write_tree(tmp_path, {"viewer/app.py": "from common.messages import decode_group\n"
                                                  "from trainer import batch\n",
                                 "common/messages.py": "", "trainer/batch.py": "",
                                 "common/cli.py": "def main():\n    import viewer.app\n",
                                 "checks/check.py": "from viewer import app\n"})
    assert layout_violations(root) == ["checks/check.py:1: checks imports viewer.app",
                                       "common/cli.py:2: common imports viewer.app",
                                       "viewer/app.py:2: viewer imports trainer.batch"]


def imported_names(path: Path) -> list[tuple[str, int]]:
    """(dotted name, line) of everything the file imports, at any depth: `from a import b` is a.b
    (a module or a name in one)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out += [(f"{node.module}.{alias.name}", node.lineno) for alias in node.names]
    return out


def found(root: Path, path: Path, pattern: str) -> list[str]:
    """'file:line: imports MODULE' for each import in `path` whose dotted name starts with `pattern`."""
    hits = {(line, m.group()) for name, line in imported_names(path) if (m := re.match(pattern, name))}
    return [f"{path.relative_to(root)}:{line}: imports {module}" for line, module in sorted(hits)]


def harness_violations(root: Path) -> list[str]:
    """A test module importing another test module (what they share is the harness's)."""
    return [hit for path in sorted((root / "tests").glob("test_*.py")) for hit in found(root, path, r"tests\.test_\w+")]


def ops_violations(root: Path) -> list[str]:
    """Anything under ops/ (a .py file, or a script run by python) importing anything of tests/, the
    harness included: a command of ops/ must run from a checkout without the tests. What a benchmark
    and a test both use lives below both (common/, ops/lib/)."""
    problems = []
    for path in sorted((root / "ops").rglob("*")):
        if path.suffix == ".py" or path.is_file() and b"python" in path.read_bytes()[:100].split(b"\n")[0]:
            problems += found(root, path, r"tests(?!\w)(\.\w+)?")
    return problems


def test_tests_share_the_harness_and_never_import_one_another():
    assert harness_violations(ROOT) == []


def test_ops_imports_nothing_from_the_tests():
    assert ops_violations(ROOT) == []


def test_a_test_importing_another_and_ops_importing_the_tests_are_caught(tmp_path):
    files = {"tests/test_a.py": "from tests.test_b import helper\nfrom tests.harness.groups import make_group\n",
             "tests/test_b.py": "def f():\n    import tests.test_a\n",
             "tests/test_c.py": "from tests import test_a\nfrom tests import reward_fixtures\n",
             "ops/bench/x.py": "from tests.conftest import free_port\nfrom tests.harness.servers import start_redis\n",
             "ops/bench/scale.py": "from tests.harness.processes import spawn\nfrom tests.test_a import helper\n",
             "ops/lib/processes.py": "from testsuite import x\nimport tests\n",
             "ops/tool": "#!/usr/bin/env python3\nfrom tests.test_a import helper\n",
             "ops/chaos.py": "def main():\n    import tests.harness.metrics\n    from tests import harness\n"}
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert harness_violations(tmp_path) == ["tests/test_a.py:1: imports tests.test_b",
                                            "tests/test_b.py:2: imports tests.test_a",
                                            "tests/test_c.py:1: imports tests.test_a"]
    assert ops_violations(tmp_path) == ["ops/bench/scale.py:1: imports tests.harness",
                                        "ops/bench/scale.py:2: imports tests.test_a",
                                        "ops/bench/x.py:1: imports tests.conftest",
                                        "ops/bench/x.py:2: imports tests.harness",
                                        "ops/chaos.py:2: imports tests.harness",
                                        "ops/chaos.py:3: imports tests.harness",
                                        "ops/lib/processes.py:2: imports tests",
                                        "ops/tool:2: imports tests.test_a"]
