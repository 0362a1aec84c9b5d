import json
import os
import subprocess
import sys
from dataclasses import replace

from common.evals import EvalResult, read_evals_file
from common.metrics import StepMetrics, read_metrics
from common.plot import panel_series, smooth
from tests.harness.metrics import STEP


def test_moving_average_by_hand():
    assert smooth([1.0, 3.0, 5.0, 7.0], 2) == [1.0, 2.0, 4.0, 6.0]


def test_a_step_entry_has_trl_names_and_reads_back():
    entry = STEP.entry()
    # the names TRL's GRPOTrainer logs the same things under
    assert {"reward": 0.1, "reward_std": 0.2, "loss": 0.1, "learning_rate": 1e-5, "completions/mean_length": 11.0,
            "completions/clipped_ratio": 0.25, "frac_reward_zero_std": 0.0, "entropy": 0.9, "kl": 0.0,
            "clip_ratio/high_mean": 0.01, "clip_ratio/region_mean": 0.01, "rewards/correct/mean": 0.1,
            "rewards/correct/std": 0.3, "rewards/format/mean": 0.5}.items() <= entry.items()
    assert StepMetrics.from_entry(json.loads(json.dumps(entry))) == STEP
    sft = replace(STEP, policy=None, sft_loss=2.5, reward_mean=None, reward_components={})
    assert "clip_ratio/low_mean" not in sft.entry() and sft.entry()["loss"] == 2.5 and sft.entry()["reward"] is None
    assert StepMetrics.from_entry(sft.entry()) == sft


def test_a_metrics_line_missing_a_metric_is_refused_naming_it(tmp_path):
    entry = STEP.entry()
    del entry["staleness/max"]
    path = tmp_path / "metrics.jsonl"
    path.write_text(json.dumps(STEP.entry()) + "\n" + json.dumps(entry) + "\n")
    try:
        read_metrics(path)
    except ValueError as err:
        assert "metrics.jsonl:2" in str(err) and "staleness/max" in str(err)
    else:
        raise AssertionError("a line without staleness/max was read")


def test_plot_writes_a_png_of_the_runs_metrics(tmp_path):
    from matplotlib.image import imread

    def plot(rewards: list[float], out) -> None:
        metrics = tmp_path / "metrics.jsonl"
        metrics.write_text("".join(json.dumps(replace(STEP, step=s, reward_mean=x).entry()) + "\n"
                                   for s, x in enumerate(rewards, start=1)))
        done = subprocess.run([sys.executable, "-m", "common.cli", "plot", "--metrics", str(metrics),
                               "--out", str(out)], capture_output=True, text=True)
        assert done.returncode == 0, done.stderr

    # The evaluator's results beside them, out of order and with one pruned checkpoint.
    (tmp_path / "evals.jsonl").write_text("".join(json.dumps(e) + "\n" for e in [
        {"step": 6, "version": 6, "eval/pass@1": 0.5}, {"step": 3, "version": 3, "eval/pass@1": 0.25},
        {"step": 4, "version": 4, "eval/skipped": "checkpoint pruned before its evaluation ran"}]))
    rising, falling = tmp_path / "rising.png", tmp_path / "falling.png"
    plot([s / 10 for s in range(1, 8)], rising)
    plot([1 - s / 10 for s in range(1, 8)], falling)
    image = imread(rising)  # a PNG that decodes: the 2 x 4 panels, 20 x 8 inches at 100 dpi
    assert image.shape[:2] == (800, 2000), image.shape
    assert (image[..., :3] < 0.9).any(axis=-1).mean() > 0.02, "next to nothing drawn"
    other = imread(falling)
    assert other.shape == image.shape and (other != image).any(axis=-1).mean() > 0.001, \
        "the chart does not change with the run's rewards"


def test_plot_of_an_empty_run_says_so(tmp_path):
    (tmp_path / "metrics.jsonl").write_text("")
    done = subprocess.run([sys.executable, "-m", "common.cli", "plot", "--metrics", str(tmp_path / "metrics.jsonl")],
                          capture_output=True, text=True)
    assert done.returncode != 0 and "no metrics yet" in done.stderr


def test_panels_draw_evaluations_at_their_step_and_generator_throughput():
    rows = [replace(STEP, step=1, tokens_per_s=70.0, generators_tokens_per_s=40.0, accuracy=None),
            replace(STEP, step=2, tokens_per_s=72.0, generators_tokens_per_s=44.0, accuracy=0.5)]
    evals = [EvalResult(step=2, version=2, prompts=4, pass_at={1: 0.25})]
    panels = panel_series(rows, evals)
    assert panels["Held-out evaluation"] == [("eval/pass@1 (greedy)", [2], [0.25])]
    assert panels["Throughput"] == [("tokens_per_s", [1, 2], [70.0, 72.0]),
                                    ("generators/tokens_per_s", [1, 2], [40.0, 44.0])]
    assert panels["Reward"][1] == ("accuracy", [2], [0.5])  # None is "not reported", not zero
    # a series per reward component, under the name it is logged as
    assert panels["Reward"][2:] == [("rewards/correct/mean", [1, 2], [0.1, 0.1]),
                                    ("rewards/format/mean", [1, 2], [0.5, 0.5])]
    assert panels["Policy update"][0] == ("clip_ratio/region_mean", [1, 2], [0.01, 0.01])
    assert [label for label, _, _ in panels["Staleness"]] == ["staleness/mean", "staleness/max"]
    assert panel_series([replace(r, policy=None) for r in rows], [])["Policy update"] == [
        ("entropy", [1, 2], [0.9, 0.9]), ("completions/clipped_ratio", [1, 2], [0.25, 0.25])]  # sft: no policy


def test_read_evals_orders_by_step(tmp_path):
    path = tmp_path / "evals.jsonl"
    assert read_evals_file(path) == []
    path.write_text('{"step": 4, "version": 4, "eval/pass@1": 0.5}\n'
                    '{"step": 2, "version": 2, "eval/skipped": "pruned"}\n'
                    '{"step": 1, "version": 1, "eval/pass@1": 0.0}\n')
    assert [(e.step, e.skipped) for e in read_evals_file(path)] == [(1, None), (2, "pruned"), (4, None)]


def test_the_readmes_plot_command_writes_the_chart_where_it_says(tmp_path):
    """README: `.venv/bin/rollouts plot --config configs/demo.toml` (writes `runs/demo/metrics.png`),
    run as written, in a checkout whose demo run has metrics."""
    import shutil
    from pathlib import Path

    from tests.harness.processes import ROOT

    rollouts = Path(sys.executable).parent / "rollouts"  # .venv/bin/rollouts
    assert rollouts.is_file(), f"{rollouts}: the project is not installed in this environment (pip install -e .)"
    shutil.copytree(ROOT / "configs", tmp_path / "configs")
    (tmp_path / "runs" / "demo").mkdir(parents=True)
    (tmp_path / "runs" / "demo" / "metrics.jsonl").write_text(
        "".join(json.dumps(replace(STEP, step=s).entry()) + "\n" for s in range(1, 4)))
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([str(rollouts), "plot", "--config", "configs/demo.toml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "runs" / "demo" / "metrics.png").is_file(), done.stdout
