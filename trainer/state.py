"""Trainer state for resume, saved with torch.distributed.checkpoint beside each published checkpoint.

`trainer_state/step_N` (beside `checkpoints/`, in the output directory) holds what the
safetensors weights do not: the optimizer's moments, the scheduler's position, the step and the
RNG state (and the model again, so that a restart needs nothing else). It is written under a
temporary name and renamed before the checkpoint it belongs to is announced, so every published
version has its state on disk.
"""

from __future__ import annotations

import copy
import shutil
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict
from torch.distributed.checkpoint.api import CheckpointException
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
    state, tmp = begin_state(model, optimizer, scheduler, step=step, state_root=state_root)
    final = write_state(state, tmp=tmp, step=step, state_root=state_root, keep=keep)
    barrier()
    return final


def begin_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                scheduler: torch.optim.lr_scheduler.LRScheduler, *, step: int, state_root: Path) -> tuple[dict, Path]:
    """Every rank: the trainer state of `step` to write, and the temporary directory it goes in
    (emptied by rank 0 before any rank writes: a collective). The model's and the optimizer's
    tensors in it are their own, not copies: they must not change until `write_state` is done,
    unless `staged` copied them (the scheduler's position and the RNG's are copies)."""
    tmp = state_root / f".step_{step}.tmp"
    if is_main():
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.parent.mkdir(parents=True, exist_ok=True)
    barrier()
    state = _stateful(model, optimizer, scheduler, step)
    state["scheduler"] = copy.deepcopy(state["scheduler"])
    return state, tmp


def staged(state: dict, buffer: dict | None, *, cuda: bool) -> tuple[dict, dict]:
    """`state` (begin_state's) with its model's and optimizer's tensors copied into host memory, so
    that the steps after it may change them while it is written: into `buffer`, the copy a save
    before made (None, or a state of another shape: made now, pinned where they are on a GPU:
    `cuda`). Returns (the staged state, its buffer for the next save). dcp's own helpers, as its
    async_save stages with them: a DTensor's shard is copied as such."""
    tensors = {"model": state["model"], "optim": state["optim"]}
    if buffer is not None:
        try:
            copied = _copy_state_dict(tensors, buffer, non_blocking=cuda, type_check=False)
        except CompanionMismatch:
            buffer = None
    if buffer is None:
        buffer = _create_cpu_state_dict(tensors, pin_memory=cuda)
        copied = _copy_state_dict(tensors, buffer, non_blocking=cuda, type_check=False)
    if cuda:
        torch.cuda.synchronize()  # the copies are read by the writer thread
    return {**state, **copied}, buffer


def write_state(state: dict, *, tmp: Path, step: int, state_root: Path, keep: int,
                group: dist.ProcessGroup | None = None) -> Path:
    """Every rank writes its shards of `state` (begin_state) into `tmp`; rank 0, once all have
    (dcp's save ends with a collective over `group`, None: the default one), renames it to the
    state of `step` and prunes the older. A rank's failure, a full disk most often, is raised on
    every rank as the OSError it was (dcp wraps it)."""
    try:
        dcp.save(state, checkpoint_id=tmp, process_group=group)
    except CheckpointException as err:
        raise failure_of(err) from err
    final = state_dir(state_root, step)
    if is_main():
        if final.exists():  # from a run that crashed before publishing it, or one before a restart
            shutil.rmtree(final)
        tmp.rename(final)
        prune_states(state_root, keep=keep, newest=step)
    return final


def failure_of(err: CheckpointException) -> BaseException:
    """The first failing rank's own exception inside dcp's CheckpointException (itself no OSError,
    so a full disk would not read as one); the CheckpointException if it holds none."""
    for failed, _trace in err.failures.values():
        return failed
    return err


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
