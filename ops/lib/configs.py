"""A run's config file, as the tests and benchmarks write it: common.tiny's TINY_RUN with the
tables a caller changes, or (base={}) only the fields it names."""

from __future__ import annotations

from pathlib import Path

from common.tiny import tiny_run_config


def write_config(path: Path, *, run: str, output_dir: str | Path | None = None,
                 model: str | Path | dict[str, object] | None = None,
                 redis_url: str | None = None, base: dict[str, dict[str, object]] | None = None,
                 **tables: dict[str, object]) -> dict[str, str]:
    """Write the run's TOML to `path` (see common.tiny.tiny_run_config); returns the environment
    that points a process at it."""
    path.write_text(tiny_run_config(run=run, output_dir=output_dir, model=model, redis_url=redis_url, base=base,
                                    **tables))
    return {"ROLLOUTS_CONFIG": str(path)}
