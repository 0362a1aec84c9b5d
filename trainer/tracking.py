"""Where the trainer's per-step metrics (trainer/metrics.py) go: metrics.jsonl, the metrics stream,
the trainer-status hash (for `rollouts status`), and TensorBoard or Weights & Biases when
`trainer.report_to` names them.

The resolved config is logged with the run: `config.json` in the output directory (the Redis
password masked), the config of the W&B run, and a text entry in TensorBoard.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import redis

from common.config import Config
from common.keys import Keys
from common.metrics import StepMetrics, write_metrics
from common.progress import TrainerStatus, write_status
from common.streams import redacted


def resolved_config(config: Config) -> dict[str, Any]:
    """The config as the run uses it (defaults filled in), safe to write down: no password."""
    data = config.model_dump(mode="json")
    data["redis_url"] = redacted(config.redis_url)
    return data


def scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numeric, finite entries of `metrics` (what a chart can draw), a dict's as "name/key"."""
    flat = {f"{k}/{sub}": v for k, d in metrics.items() if isinstance(d, dict) for sub, v in d.items()}
    return {k: float(v) for k, v in {**metrics, **flat}.items()
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)}


class Tracker:
    """The run's metric sinks. Rank 0 owns one; `close()` flushes the external trackers."""

    def __init__(self, r: redis.Redis, config: Config) -> None:
        self.r, self.keys, self.path = r, Keys(config.run), config.metrics_path
        self.path.parent.mkdir(parents=True, exist_ok=True)
        resolved = resolved_config(config)
        (Path(config.output_dir) / "config.json").write_text(json.dumps(resolved, indent=2) + "\n")
        self.tensorboard = self.wandb = None
        report_to = config.trainer.report_to
        if "tensorboard" in report_to:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise RuntimeError("trainer.report_to names tensorboard, which is not installed: "
                                   "pip install tensorboard (or rollouts[tracking])") from err
            self.tensorboard = SummaryWriter(log_dir=str(Path(config.output_dir) / "tensorboard"))
            self.tensorboard.add_text("config", "```\n" + json.dumps(resolved, indent=2) + "\n```")
        if "wandb" in report_to:
            try:
                import wandb
            except ImportError as err:
                raise RuntimeError("trainer.report_to names wandb, which is not installed: "
                                   "pip install wandb (or rollouts[tracking])") from err
            # Resumes the same W&B run after a restart (id = the run name); WANDB_MODE=offline works.
            self.wandb = wandb.init(project=config.trainer.wandb_project, name=config.run, id=config.run,
                                    resume="allow", config=resolved, dir=config.output_dir)

    def log(self, m: StepMetrics) -> None:
        """Append one step's metrics everywhere, and its summary to the trainer-status hash."""
        metrics = m.entry()
        self.path.parent.mkdir(parents=True, exist_ok=True)  # the output directory may have been deleted
        with open(self.path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        status = TrainerStatus(last_step_s=m.time_step, last_wait_s=m.time_wait_data, staleness_mean=m.staleness_mean,
                               staleness_max=m.staleness_max, tokens_per_s=m.tokens_per_s)
        with self.r.pipeline(transaction=True) as pipe:
            write_metrics(pipe, self.keys, metrics)
            write_status(pipe, self.keys, status)
            pipe.execute()
        step = int(metrics["step"])
        numbers = scalars({k: v for k, v in metrics.items() if k != "step"})
        if self.tensorboard is not None:
            for name, value in numbers.items():
                self.tensorboard.add_scalar(name, value, global_step=step)
            self.tensorboard.flush()
        if self.wandb is not None:
            self.wandb.log(numbers, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
