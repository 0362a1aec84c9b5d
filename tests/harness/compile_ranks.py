"""The trainer's steps on a model opened as a Placement says, with and without trainer.compile,
each rank training its share of the groups under torchrun (FSDP2 on gloo), or in one process:

    torchrun --nproc-per-node N -m tests.harness.compile_ranks MODEL OUT_DIR sdpa|varlen on|off

where the last word is activation checkpointing. Rank 0 writes OUT_DIR/compared.json: how far
the compiled run's full weights are from the eager run's, how far the eager steps moved them,
and the graphs each rank's compiled run built."""

from __future__ import annotations

import json
import sys
from dataclasses import replace
from pathlib import Path

import torch

LR = 0.05  # SGD: an update proportional to the gradient (AdamW's would turn a rounding-sized gradient's sign into lr)
STEPS = 2


def trained(model_dir: Path, where, groups) -> tuple[dict, dict, int]:
    """(the full weights after STEPS trainer steps of the model opened as `where` says, the weights
    before, the graphs torch.compile built meanwhile)."""
    from torch._dynamo.utils import counters

    from common.config import GrpoLoss
    from tests.test_packing import options
    from trainer.loading import placed_model
    from trainer.parallel import full_state_dict
    from trainer.step import train_step

    def weights() -> dict:
        full = full_state_dict(model)  # None: not sharded
        return {k: v.detach().clone() for k, v in (model.state_dict() if full is None else full).items()}

    torch.manual_seed(0)
    torch._dynamo.reset()
    model = placed_model(model_dir, where)
    before = weights()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    graphs = counters["stats"]["unique_graphs"]
    for step in range(STEPS):
        train_step(model, opt, groups, how=options(GrpoLoss(), pack=True), step=step)
    return weights(), before, counters["stats"]["unique_graphs"] - graphs


def compared(model_dir: Path, *, attention: str, checkpointing: bool, rank: int = 0, world: int = 1) -> dict:
    """The compiled run against the eager one, each rank training every `world`-th group."""
    from transformers import AutoModelForCausalLM

    from tests.test_packing import SHAPES, groups_of
    from trainer.devices import Placement
    from trainer.parallel import gather

    # micro-batches of 14 to 19 positions: the blocks see lengths that vary within a step
    groups = groups_of(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), SHAPES)[rank::world]
    eager = Placement(device=torch.device("cpu"), dtype=torch.float32, master_fp32=True,
                      activation_checkpointing=checkpointing, attention=attention)
    w_eager, before, eager_graphs = trained(model_dir, eager, groups)
    w_compiled, _, compiled_graphs = trained(model_dir, replace(eager, compile=True), groups)
    graphs = gather([eager_graphs, compiled_graphs])
    if rank != 0:
        return {}
    return {"names_same": sorted(w_compiled) == sorted(w_eager),
            "diff": max((w_compiled[k] - w_eager[k]).abs().max().item() for k in w_eager),
            "moved": max((w_eager[k] - before[k]).abs().max().item() for k in w_eager),
            "eager_graphs": [g[0] for g in graphs], "compiled_graphs": [g[1] for g in graphs]}


def main() -> None:
    from trainer.parallel import finish, init_distributed

    model_dir, out, attention, checkpointing = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3], sys.argv[4] == "on"
    rank, world = init_distributed()
    found = compared(model_dir, attention=attention, checkpointing=checkpointing, rank=rank, world=world)
    if rank == 0:
        out.mkdir(parents=True, exist_ok=True)
        (out / "compared.json").write_text(json.dumps(found))
    finish()


if __name__ == "__main__":
    main()
