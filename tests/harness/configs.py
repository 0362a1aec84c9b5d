"""A run's config file, as the tests write it: ops/lib/configs.py's, which the benchmarks use too."""

from ops.lib.configs import write_config  # noqa: F401 (the harness's)
