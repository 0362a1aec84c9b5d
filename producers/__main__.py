"""`python -m producers [--config FILE ...] [--section.field VALUE ...]`: admit prompts onto the run's
prompts stream."""

import argparse

from common.config import Config
from common.process import Stop, run_process


def main(config: Config, args: argparse.Namespace) -> None:
    from producers.data import DataError
    from producers.main import ProducerError, run

    try:
        run(config)
    except (ProducerError, DataError) as err:
        raise Stop(str(err)) from None


if __name__ == "__main__":
    run_process("producer", main, prog="python -m producers", doc=__doc__)
