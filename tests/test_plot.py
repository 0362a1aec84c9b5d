import json
import subprocess
import sys

from common.plot import smooth


def test_moving_average_by_hand():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_plot_writes_a_png_of_the_runs_metrics(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({
        "step": s, "reward/mean": s / 10, "accuracy": s / 10, "completions/mean_length": 10 + s,
        "completions/max_length": 20, "staleness/mean": 1.0, "staleness/max": 1, "clip_ratio": 0.01,
        "tokens_per_s": 70.0, "time/train": 12.0, "time/wait_data": 0.5, "time/publish": 1.0}) + "\n"
        for s in range(1, 8)))
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
