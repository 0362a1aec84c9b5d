"""`rollouts plot`: PNG charts of a run's per-step metrics (metrics.jsonl)."""

from __future__ import annotations

from pathlib import Path

from common.evals import EvalResult
from common.metrics import NAMES, POLICY_NAMES, StepMetrics

COMPONENTS = "reward_components"  # one series per reward component: rewards/<component>/mean


def smooth(xs: list[float], window: int) -> list[float]:
    """Trailing moving average over `window` steps (the first points average what exists)."""
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= window:
            total -= xs[i - window]
        out.append(total / min(i + 1, window))
    return out


# Series are labelled with the names the metrics are logged under (TRL's where TRL has one).
PANELS = [  # (title, [(StepMetrics field, or "pass@1" of an EvalResult; label)], y label, smoothed)
    ("Reward", [("reward_mean", NAMES["reward_mean"]), ("accuracy", NAMES["accuracy"]),
                (COMPONENTS, "rewards/<component>/mean")], "per completion", True),
    ("Held-out evaluation", [("pass@1", "eval/pass@1 (greedy)")], "per problem", False),
    ("Completion length", [("mean_length", NAMES["mean_length"]), ("max_length", NAMES["max_length"])], "tokens",
     True),
    ("Staleness", [("staleness_mean", NAMES["staleness_mean"]), ("staleness_max", NAMES["staleness_max"])],
     "versions behind", False),
    ("Policy update", [("policy.clip_region", POLICY_NAMES["clip_region"]), ("policy.kl", POLICY_NAMES["kl"]),
                       ("entropy", NAMES["entropy"]), ("clipped_ratio", NAMES["clipped_ratio"])], "", True),
    ("Throughput", [("tokens_per_s", NAMES["tokens_per_s"]), ("generators_tokens_per_s",
                                                             NAMES["generators_tokens_per_s"])], "tokens/s", True),
    ("Step time", [("time_train", NAMES["time_train"]), ("time_wait_data", NAMES["time_wait_data"]),
                   ("time_publish", NAMES["time_publish"])], "seconds", True),
    ("Groups not trained", [("dropped_stale", NAMES["dropped_stale"]), ("dead", NAMES["dead"]),
                            ("duplicate", NAMES["duplicate"])], "per step", False),
]
STYLES = ["-", "--", ":"]  # series that coincide (reward = accuracy) stay distinguishable


EVAL_PANEL = "Held-out evaluation"  # drawn from the evaluator's results, at the step each scored


def value(row: StepMetrics | EvalResult, key: str) -> float | None:
    """The metric `key` names in a step ("policy.kl": a field of its policy stats) or an evaluation
    ("pass@1"); None where the row has none."""
    if isinstance(row, EvalResult):
        return row.pass_at.get(int(key.removeprefix("pass@")))
    head, _, rest = key.partition(".")
    got = getattr(row, head)
    if head == COMPONENTS:
        return got[rest][0] if rest in got else None
    return got if not rest or got is None else getattr(got, rest)


def _expand(series: list[tuple[str, str]], rows: list) -> list[tuple[str, str]]:
    """The series, with the reward components' placeholder replaced by one per component seen."""
    out = []
    for key, label in series:
        if key == COMPONENTS:
            seen = sorted({name for r in rows for name in r.reward_components})
            out += [(f"{COMPONENTS}.{name}", f"rewards/{name}/mean") for name in seen]
        else:
            out.append((key, label))
    return out


def panel_series(rows: list[StepMetrics], evals: list[EvalResult]) -> dict[str, list[tuple[str, list, list]]]:
    """Per panel, the (label, steps, values) of each series that has any values."""
    out: dict[str, list[tuple[str, list, list]]] = {}
    for name, series, _, _ in PANELS:
        source = evals if name == EVAL_PANEL else rows
        out[name] = []
        for key, label in _expand(series, source):
            pts = [(r.step, v) for r in source if (v := value(r, key)) is not None]
            if pts:
                out[name].append((label, [s for s, _ in pts], [v for _, v in pts]))
    return out


def plot(rows: list[StepMetrics], out: str | Path, *, title: str = "", window: int = 10,
         evals: list[EvalResult] | None = None) -> Path:
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
