import json
import subprocess
import sys

from common.plot import panel_series, read_evals, smooth


def test_moving_average_by_hand():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_plot_writes_a_png_of_the_runs_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({
        "step": s, "reward/mean": s / 10, "accuracy": s / 10, "completions/mean_length": 10 + s,
        "completions/max_length": 20, "staleness/mean": 1.0, "staleness/max": 1, "clip_ratio": 0.01,
        "tokens_per_s": 70.0, "time/train": 12.0, "time/wait_data": 0.5, "time/publish": 1.0}) + "\n"
        for s in range(1, 8)))
    # The evaluator's results beside them, out of order and with one pruned checkpoint.
    (tmp_path / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"step": 6, "version": 6, "eval/pass@1": 0.5}, {"step": 3, "version": 3, "eval/pass@1": 0.25},
        {"step": 4, "version": 4, "eval/skipped": "checkpoint pruned before its evaluation ran"}]))
    out = tmp_path / "run.png"
    done = subprocess.run([sys.executable, "-m", "common.cli", "plot", "--metrics", str(metrics), "--out", str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 20_000


def test_plot_of_an_empty_run_says_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    done = subprocess.run([sys.executable, "-m", "common.cli", "plot", "--metrics", str(tmp_path / "metrics.jsonl")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "no metrics yet" in done.stderr


def test_panels_draw_evaluations_at_their_step_and_generator_throughput():
    rows = [{"step": 1, "tokens_per_s": 70.0, "generators/tokens_per_s": 40.0, "accuracy": None},
            {"step": 2, "tokens_per_s": 72.0, "generators/tokens_per_s": 44.0, "accuracy": 0.5}]
    evals = [{"step": 2, "eval/pass@1": 0.25}]
    panels = panel_series(rows, evals)
    assert panels["Held-out evaluation"] == [("greedy pass@1", [2], [0.25])]
    assert panels["Throughput"] == [("trainer", [1, 2], [70.0, 72.0]), ("generators (sum)", [1, 2], [40.0, 44.0])]
    assert panels["Reward"] == [("accuracy", [2], [0.5])]  # None is "not reported", not zero
    assert panels["Staleness"] == []


def test_read_evals_orders_by_step_and_leaves_out_skipped(tmp_path):
    path = tmp_path / "evals.jsonl"
    assert read_evals(path) == []
    path.write_text('{"step": 4, "eval/pass@1": 0.5}\n{"step": 2, "eval/skipped": "pruned"}\n'
                    '{"step": 1, "eval/pass@1": 0.0}\n')
    assert [e["step"] for e in read_evals(path)] == [1, 4]
