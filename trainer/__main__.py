"""`python -m trainer [--config FILE ...] [--section.field VALUE ...]`: GRPO steps on the run's sample
groups, publishing weights."""

import argparse

from common.config import Config, ConfigError
from common.process import EXIT_CONFIG, Stop, exit_at_once, run_process


def main(config: Config, args: argparse.Namespace) -> None:
    from trainer.losses import loss_function  # imports torch

    try:
        loss_function(config.trainer.loss)  # a custom loss that does not load
    except ValueError as err:
        raise ConfigError(str(err)) from None

    from common.models import ModelError, resolve_model_path

    try:
        resolve_model_path(config.model.path)  # not on disk, nor in the hub's cache
    except ModelError as err:
        raise Stop(str(err), EXIT_CONFIG) from None

    from trainer.main import run  # imports torch and transformers
    from trainer.publishing import PublishFailed

    try:
        run(config)
        exit_at_once()  # stopped or done, everything saved
    except ModelError as err:  # no such model, or a model directory with pickled weights only
        raise Stop(str(err), EXIT_CONFIG) from None
    except PublishFailed as err:  # a full disk: nothing announced, the saved state resumable
        raise Stop(str(err)) from None


if __name__ == "__main__":
    run_process("trainer", main, prog="python -m trainer", doc=__doc__)
