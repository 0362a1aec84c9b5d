"""`rollouts plot`: PNG charts of a run's per-step metrics (metrics.jsonl)."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(path: str | Path) -> list[dict]:
    """The run's per-step metrics, one dict per line of the trainer's JSONL file."""
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    if not rows:
        raise ValueError(f"{path}: no metrics yet (the trainer writes one line per step)")
    return rows


def smooth(xs: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` steps (the first points average what exists)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= window:
            total -= xs[i - window]
        out.append(total / min(i + 1, window))
    return out


PANELS = [  # (title, [(metric, label)], y label, smoothed)
    ("Reward", [("reward/mean", "reward mean"), ("accuracy", "accuracy")], "per completion", True),
    ("Completion length", [("completions/mean_length", "mean"), ("completions/max_length", "max")], "tokens",
     True),
    ("Staleness", [("staleness/mean", "mean"), ("staleness/max", "max")], "versions behind", False),
    ("Policy update", [("clip_ratio", "clip ratio"), ("kl", "kl"), ("entropy", "entropy")], "", True),
    ("Trainer throughput", [("tokens_per_s", "tokens/s")], "tokens/s", True),
    ("Step time", [("time/train", "train"), ("time/wait_data", "wait for data"), ("time/publish", "publish")],
     "seconds", True),
]
STYLES = ["-", "--", ":"]  # series that coincide (reward = accuracy) stay distinguishable


def plot(rows: list[dict], out: str | Path, *, title: str = "", window: int = 10) -> Path:
    """Write a grid of charts for `rows` to `out` (PNG): faint raw values under bold trailing
    moving averages, except for panels whose raw values are the point (staleness)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(15, 8), constrained_layout=True)
    for ax, (name, series, ylabel, smoothed) in zip(axes.flat, PANELS, strict=True):
        drawn = False
        for i, (key, label) in enumerate(series):
            pts = [(s, r[key]) for s, r in zip(steps, rows, strict=True) if r.get(key) is not None]
            if not pts:
                continue
            xs, ys = zip(*pts, strict=True)
            style = {"color": f"C{i}", "linestyle": STYLES[i % len(STYLES)], "label": label}
            if smoothed:
                ax.plot(xs, ys, color=style["color"], alpha=0.25, linewidth=1)
                ax.plot(xs, smooth(list(ys), window), linewidth=2, **style)
            else:
                ax.step(xs, ys, where="mid", linewidth=2, **style)
            drawn = True
        ax.set_title(name)
        ax.set_xlabel("trainer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn:
            ax.legend(loc="best", fontsize=9)
        else:
            ax.text(0.5, 0.5, "not recorded", ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.suptitle(title or f"{len(rows)} steps (bold: {window}-step moving average)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
