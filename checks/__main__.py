"""`rollouts check [--config FILE ...] [--section.field VALUE ...] [--prompts N]`: draw a few
prompts from the run's sources, sample and score their groups (or play their episodes) as a
generator does, recompute each token's log-prob as the trainer does, compare each episode with the
chat template applied to its whole conversation, measure the trainer's memory, print the settings
the trainer would resolve on this host's device (activation checkpointing, with why), and say whether
they agree (exit 0) or what is wrong (exit 1)."""

import argparse
import sys

from common.config import Config
from common.process import run_process


def flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--prompts", type=int, default=4, metavar="N", help="prompts to sample (default: 4)")
    parser.add_argument("--engine-model", metavar="PATH",
                        help="sample with the weights at PATH (e.g. a checkpoint your generators run on) "
                             "instead of model.path; the trainer's side stays on model.path")
    parser.add_argument("--engine-temperature", type=float, metavar="T",
                        help="sample at temperature T (e.g. what an engine outside the config forces) "
                             "instead of rollout.temperature; the trainer's side stays at rollout.temperature")
    parser.add_argument("--trainer-ranks", type=int, default=1, metavar="N",
                        help="the trainer's ranks (torchrun --nproc-per-node): its memory per rank counts 1/N of "
                             "the weights and optimizer state, which FSDP2 shards (default: 1)")


def main(config: Config, args: argparse.Namespace) -> None:
    from checks.check import run  # imports torch and transformers

    sys.exit(run(config, prompts=args.prompts, engine_model=args.engine_model,
                 engine_temperature=args.engine_temperature, ranks=args.trainer_ranks))


if __name__ == "__main__":
    run_process("rollouts check", main, prog="rollouts check", doc=__doc__, extra=flags)
