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
    ("Held-out evaluation", [("eval/pass@1", "greedy pass@1")], "per problem", False),
    ("Completion length", [("completions/mean_length", "mean"), ("completions/max_length", "max")], "tokens",
     True),
    ("Staleness", [("staleness/mean", "mean"), ("staleness/max", "max")], "versions behind", False),
    ("Policy update", [("clip_ratio", "clip ratio"), ("kl", "kl"), ("entropy", "entropy")], "", True),
    ("Throughput", [("tokens_per_s", "trainer"), ("generators/tokens_per_s", "generators (sum)")], "tokens/s",
     True),
    ("Step time", [("time/train", "train"), ("time/wait_data", "wait for data"), ("time/publish", "publish")],
     "seconds", True),
    ("Groups not trained", [("groups/dropped_stale", "dropped stale"), ("groups/dead", "dead-lettered"),
                            ("groups/duplicate", "duplicate")], "per step", False),
]
STYLES = ["-", "--", ":"]  # series that coincide (reward = accuracy) stay distinguishable


def read_evals(path: str | Path) -> list[dict]:
    """The evaluator's scored checkpoints (evals.jsonl), oldest step first; [] if none yet."""
    path = Path(path)
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sorted((r for r in rows if "eval/pass@1" in r), key=lambda r: r["step"])


EVAL_PANEL = "Held-out evaluation"  # drawn from the evaluator's results, at the step each scored


def panel_series(rows: list[dict], evals: list[dict]) -> dict[str, list[tuple[str, list, list]]]:
    """Per panel, the (label, steps, values) of each series that has any values."""
    out: dict[str, list[tuple[str, list, list]]] = {}
    for name, series, _, _ in PANELS:
        source = evals if name == EVAL_PANEL else rows
        out[name] = []
        for key, label in series:
            pts = [(r["step"], r[key]) for r in source if r.get(key) is not None]
            if pts:
                out[name].append((label, [s for s, _ in pts], [v for _, v in pts]))
    return out


def plot(rows: list[dict], out: str | Path, *, title: str = "", window: int = 10,
         evals: list[dict] | None = None) -> Path:
    """Write a grid of charts for `rows` (and the evaluator's `evals`, at the step of the checkpoint
    each scored) to `out` (PNG): faint raw values under bold trailing moving averages, except for
    panels whose raw values are the point (staleness, evaluations, counts)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    drawn = panel_series(rows, evals or [])
    fig, axes = plt.subplots(2, 4, figsize=(20, 8), constrained_layout=True)
    for ax, (name, _, ylabel, smoothed) in zip(axes.flat, PANELS, strict=True):
        for i, (label, xs, ys) in enumerate(drawn[name]):
            style = {"color": f"C{i}", "linestyle": STYLES[i % len(STYLES)], "label": label}
            if smoothed:
                ax.plot(xs, ys, color=style["color"], alpha=0.25, linewidth=1)
                ax.plot(xs, smooth(list(ys), window), linewidth=2, **style)
            elif name == EVAL_PANEL:
                ax.plot(xs, ys, marker="o", linewidth=2, **style)
                ax.set_ylim(-0.05, 1.05)
            else:
                ax.step(xs, ys, where="mid", linewidth=2, **style)
        ax.set_title(name)
        ax.set_xlabel("trainer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if drawn[name]:
            ax.legend(loc="best", fontsize=9)
        else:
            what = "no evaluations (eval.every = 0?)" if name == EVAL_PANEL else "not recorded"
            ax.text(0.5, 0.5, what, ha="center", va="center", transform=ax.transAxes, color="grey")
    fig.suptitle(title or f"{len(rows)} steps (bold: {window}-step moving average)")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
