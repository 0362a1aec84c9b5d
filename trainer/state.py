"""Trainer state for resume, saved with torch.distributed.checkpoint beside each published checkpoint.

`trainer_state/step_N` (beside `checkpoints/`, in the output directory) holds what the
safetensors weights do not: the optimizer's moments, the scheduler's position, the step and the
RNG state (and the model again, so that a restart needs nothing else). It is written under a
temporary name and renamed before the checkpoint it belongs to is announced, so every published
version has its state on disk.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from common.checkpoints import prune_steps
from trainer.parallel import barrier, is_main

# dcp says so on every call when no process group is up; a single process is what we mean.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def state_dir(state_root: Path, step: int) -> Path:
    return state_root / f"step_{step}"


def _stateful(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              scheduler: torch.optim.lr_scheduler.LRScheduler, step: int) -> dict:
    # frozen parameters (LoRA's base model) are the published weights' business, not the state's
    model_sd, optim_sd = get_state_dict(model, optimizer, options=StateDictOptions(ignore_frozen_params=True))
    return {"model": model_sd, "optim": optim_sd, "scheduler": scheduler.state_dict(), "step": step,
            "rng": {"torch": torch.get_rng_state()}}


def save_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, *, step: int, state_root: Path,
               keep: int) -> Path:
    """Write the trainer state of `step` (temporary name, then rename); keep the newest `keep`.

    Every rank takes part (each writes its shards); rank 0 renames and prunes.
    """
    final = state_dir(state_root, step)
    tmp = final.parent / f".step_{step}.tmp"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    dcp.save(_stateful(model, optimizer, scheduler, step), checkpoint_id=tmp)
    barrier()
    if is_main():
        if final.exists():  # from a run that crashed before publishing it, or one before a restart
            shutil.rmtree(final)
        tmp.rename(final)
        prune_states(state_root, keep=keep, newest=step)
    barrier()
    return final


def prune_states(root: Path, *, keep: int, newest: int | None = None) -> None:
    """Delete half-written states, and the older states as `prune_steps` says."""
    for tmp in root.glob(".step_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)
    prune_steps(root, keep=keep, newest=newest)


def load_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               scheduler: torch.optim.lr_scheduler.LRScheduler, *, path: Path) -> int:
    """Restore model, optimizer, scheduler and RNG from `path` in place; return the saved step."""
    state = _stateful(model, optimizer, scheduler, step=-1)
    dcp.load(state, checkpoint_id=path)
    frozen = any(not p.requires_grad for p in model.parameters())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=StateDictOptions(ignore_frozen_params=True, strict=not frozen))
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"]["torch"])
    assert state["step"] >= 0, f"trainer state {path} has no step"
    return int(state["step"])
