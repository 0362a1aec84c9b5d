"""The order the test files reach pytest-xdist's workers in: the longest first.

Under `--dist loadscope` (pyproject.toml) a worker takes a whole file at a time, and with
`--no-loadscope-reorder` (`in_collection_order`) xdist hands the files out in the order collected,
which `longest_first` sets from SECONDS: about how long each file's tests take (the default suite's
and the slow checks' apart, as `-m` selects them). The longest start first and both workers
end on short ones, where xdist's own order (the files with the most tests first) left a file of one
or two whole runs, minutes long, to start last on one worker while the other had nothing left.
A file SECONDS does not name counts as short, its test count breaking ties as in xdist's order.
The figures only order the files: a stale one makes the run less even, it changes no test.
"""

from __future__ import annotations

import pytest

# Seconds of each file's tests, (default suite, slow checks), files of 10 s or more. The slow checks'
# and the longest default tests': a fresh clone's `.ci/run` at cb66d6d (its --durations=30, 2026-11-27,
# the 2-core CPU VM, alone); the other default files': every test's time in a `pytest -n 2` of
# 4b75bc5 on the same VM with other tests beside it (2026-11-27), scaled to that run's 15.5 minutes.
# tests/test_schedule.py checks that each file named here exists.
SECONDS: dict[str, tuple[float, float]] = {
    "tests/test_readme.py": (73, 495),
    "tests/test_faults.py": (90, 226),
    "tests/test_slurm.py": (0, 222),
    "tests/test_shutdown.py": (92, 80),
    "tests/test_default_model.py": (0, 160),
    "tests/test_distill_bench.py": (0, 116),
    "tests/test_stalls.py": (95, 0),
    "tests/test_trainer.py": (94, 0),
    "tests/test_supervision.py": (91, 0),
    "tests/test_recording.py": (83, 0),
    "tests/test_vs_trl_bench.py": (0, 81),
    "tests/test_episodes.py": (78, 0),
    "tests/test_teacher_vllm.py": (2, 75),
    "tests/test_generator.py": (72, 0),
    "tests/test_gpu_check.py": (70, 0),
    "tests/test_engines.py": (70, 0),
    "tests/test_security.py": (69, 0),
    "tests/test_check.py": (68, 0),
    "tests/test_chaos.py": (0, 66),
    "tests/test_server_engine.py": (2, 62),
    "tests/test_gpu_learn.py": (29, 33),
    "tests/test_trainer_fsdp.py": (57, 0),
    "tests/test_evaluator.py": (54, 0),
    "tests/test_moe.py": (0, 52),
    "tests/test_trainer_loading.py": (37, 14),
    "tests/test_fuzz.py": (51, 0),
    "tests/test_trainer_resume.py": (47, 0),
    "tests/test_served_judges.py": (8, 38),
    "tests/test_quarantine.py": (43, 0),
    "tests/test_e2e.py": (46, 0),
    "tests/test_teacher.py": (9, 27),
    "tests/test_precision.py": (11, 23),
    "tests/test_docs.py": (32, 0),
    "tests/test_verifiers_tasksets.py": (27, 0),
    "tests/test_view.py": (26, 0),
    "tests/test_transfer.py": (39, 0),
    "tests/test_trim.py": (25, 0),
    "tests/test_sft.py": (25, 0),
    "tests/test_plot.py": (20, 0),
    "tests/test_models_hub.py": (20, 0),
    "tests/test_config.py": (17, 0),
    "tests/test_trl_rewards.py": (17, 0),
    "tests/test_lora.py": (15, 0),
    "tests/test_lora_adapter.py": (14, 0),
    "tests/test_data.py": (13, 0),
    "tests/test_netns.py": (13, 0),
    "tests/test_scored_run.py": (0, 13),
    "tests/test_inflight.py": (12, 0),
    "tests/test_weight_sync.py": (12, 0),
    "tests/test_status.py": (12, 0),
    "tests/test_scoring.py": (11, 0),
    "tests/test_scale_bench.py": (11, 0),
}


def _weight(module: str, items: list[pytest.Item]) -> float:
    default, slow = SECONDS.get(module, (0.0, 0.0))
    marked = [item.get_closest_marker("slow") is not None for item in items]
    return default * (not all(marked)) + slow * any(marked)


def in_collection_order(config: pytest.Config) -> None:
    """xdist's `--no-loadscope-reorder`, set here rather than in pyproject.toml's addopts (ops/bootstrap
    reinstalls the project when pyproject.toml changes): the files go out as `longest_first` leaves them."""
    if hasattr(config.option, "loadscopereorder"):  # pytest-xdist loaded
        config.option.loadscopereorder = False


def longest_first(items: list[pytest.Item]) -> None:
    """Reorder `items` in place, file by file (each file's tests keep their order), the files with
    the most SECONDS first."""
    by_file: dict[str, list[pytest.Item]] = {}
    for item in items:
        by_file.setdefault(item.nodeid.split("::", 1)[0], []).append(item)
    order = sorted(by_file, key=lambda m: (-_weight(m, by_file[m]), -len(by_file[m])))
    items[:] = [item for m in order for item in by_file[m]]
