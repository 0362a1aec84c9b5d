"""Checkpoints: publishing weights with the acknowledgement of the groups they hold, and resuming from them.

A checkpoint is a complete HF directory of safetensors (the tokenizer files copied from the
initial model), written under a temporary name and renamed to `checkpoints/step_N`; the trainer
state saved beside it (optimizer, scheduler, RNG: trainer/state.py) is what a restart needs besides.

Delivery. Groups are acknowledged, and added to the `trained` sorted set, in the same transaction
that publishes the checkpoint holding their update, and only with a saved trainer state; the
samples stream is then trimmed of what every consumer group (recorders included) has acknowledged
(common/trim.py). A restarted trainer loads the newest saved state (or published checkpoint),
continues from its step, and first re-reads its own pending entries in stream order
(trainer/samples.py), so it trains on what an uninterrupted run would have and ends with the same
weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import redis
import torch

from common.checkpoints import (
    ADAPTER_FILE,
    ADAPTER_FORMAT,
    FULL_FORMAT,
    WEIGHTS_FILE,
    checksum_dir,
    is_adapter_dir,
    prune_steps,
    verify_dir,
    write_safetensors,
)
from common.config import LoraConfig
from common.keys import TRAINER_GROUP, Keys
from common.messages import WeightVersion
from common.progress import (
    GoneBack,
    add_gone_back,
    count_trained,
    read_trainer,
    settle,
    write_state_step,
    write_step,
)
from common.streams import announce_weights, latest_weights
from common.trim import trim_acknowledged
from trainer.devices import Placement
from trainer.loading import (  # load_model: tools too
    load_model,
    placed_model,
    safetensors_only,
    sharded_from_meta,
    with_attention,
)
from trainer.lora import (
    adapter_state_dict,
    adapter_tensors,
    apply_lora,
    copy_adapters,
    hf_model,
    initial_adapters,
    is_lora,
    merged_state_dict,
    scale_of,
    write_adapter_config,
)
from trainer.parallel import full_state_dict, gather, is_main, parallelize, say, world_size
from trainer.schedule import build_scheduler
from trainer.state import load_state, save_state, state_dir
from trainer.transfer import Sender

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")


def place(model: torch.nn.Module, where: Placement) -> torch.nn.Module:
    """`model` on its device, sharded under torchrun, computing in `where.dtype` (trainer/parallel.py)."""
    return parallelize(model, device=where.device, compute_dtype=where.dtype,
                       activation_checkpointing=where.activation_checkpointing, compile_blocks=where.compile)


def adapted_model(path: Path, where: Placement, lora: LoraConfig, *, adapter: Path | None = None) -> torch.nn.Module:
    """The model of checkpoint `path` with LoRA adapters (`lora`), placed as `where` says. Under
    torchrun with several ranks it is built on `meta`, adapted there, sharded, and each rank reads
    only its own shards of the frozen base weights, as placed_model does the full model
    (trainer/loading.py); in one process the whole base model is loaded, adapted, then placed. The
    adapters are those published in `adapter` (peft's format), else their initial values drawn from
    rank 0's torch seed (lora.initial_adapters): the same on every rank and at every world size."""
    seed = gather(torch.initial_seed())[0]  # rank 0's; the trainer seeds every rank alike anyway

    def adapt(model: torch.nn.Module) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
        # attention as placed_model's (trainer.attention: flex_attention's packed BlockMask on CUDA)
        model = apply_lora(with_attention(model, where), rank=lora.rank, alpha=lora.alpha, dropout=lora.dropout,
                           target_modules=lora.target_modules)
        return model, adapter_tensors(model, adapter) if adapter is not None else initial_adapters(model, seed=seed)

    if world_size() > 1:
        safetensors_only(path)
        return sharded_from_meta(path, where, adapt=adapt)
    model, adapters = adapt(load_model(path, where.weights_dtype))
    copy_adapters(model, adapters)
    return place(model, where)


def adamw(params: list[torch.nn.Parameter], *, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """The trainer's optimizer. AdamW's fused kernel (the HF Trainer's default, torchtitan's option)
    where it takes the parameters (floating, on the CPU or a CUDA device, plain or FSDP2's DTensor
    shards): one pass over them instead of a dozen, 0.07 s a step against 0.48 s for the default
    model on one CPU thread (docs/benchmarks.md, section 13)."""
    fused = bool(params) and all(p.device.type in ("cpu", "cuda") and p.dtype.is_floating_point for p in params)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused)


# --------------------------------------------------------------------------- writing checkpoints


def copy_tokenizer_files(source: Path, dest: Path) -> None:
    """Copy what `dest` lacks from `source` (tokenizer, chat template), weights excepted."""
    for f in source.iterdir():
        if f.is_file() and not f.name.startswith(".") and not f.name.endswith(WEIGHT_SUFFIXES) \
                and not (dest / f.name).exists():
            shutil.copy2(f, dest / f.name)


def in_dtype(state_dict: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """`state_dict` on the CPU with its floating tensors in `dtype` (None: as they are); tensors
    shared before (tied embeddings) are shared after, and one already there is not copied."""
    done: dict[tuple[int, tuple[int, ...]], torch.Tensor] = {}
    out = {}
    for k, v in state_dict.items():
        key = (v.data_ptr(), tuple(v.shape))
        if key not in done:
            done[key] = v.detach().to("cpu", dtype=dtype if dtype is not None and v.is_floating_point() else v.dtype)
        out[k] = done[key]
    return out


def save_checkpoint(model: torch.nn.Module, *, checkpoint_dir: Path, step: int, source_dir: Path,
                    state_dict: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None) -> Path:
    """Write `checkpoint_dir/step_{step}` as a complete HF directory: temporary name, then rename.

    `state_dict`: the gathered weights of a sharded model; None saves the model's own. `dtype`:
    the weights' dtype on disk (and config.json's), None: as they are (the master weights').
    """
    return write_checkpoint(model, checkpoint_dir=checkpoint_dir, step=step, source_dir=source_dir,
                            state_dict=state_dict, dtype=dtype)[0]


def checkpoint_tensors(model: torch.nn.Module, state_dict: dict[str, torch.Tensor] | None,
                       dtype: torch.dtype | None, *, adapter: bool = False) -> dict[str, torch.Tensor]:
    """The tensors a checkpoint of `model` holds (`state_dict`: its gathered weights when sharded),
    under the checkpoint's names, on the CPU in `dtype`: what is written, and what is broadcast.
    `adapter` (an adapted model, trainer.lora.publish = "adapter"): the adapter alone, peft's names."""
    state_dict = model.state_dict() if state_dict is None else state_dict
    if adapter:
        assert is_lora(model), "an adapter is published only from a model with LoRA adapters"
        return in_dtype(adapter_state_dict(state_dict), dtype)
    if is_lora(model):  # merged full weights under the base model's names: every engine loads them as they are
        state_dict = merged_state_dict(state_dict, scale=scale_of(model))
    return hf_tensors(hf_model(model), state_dict, dtype)


def write_checkpoint(model: torch.nn.Module, *, checkpoint_dir: Path, step: int, source_dir: Path,
                     state_dict: dict[str, torch.Tensor] | None = None, dtype: torch.dtype | None = None,
                     timing: dict[str, float] | None = None, tensors: dict[str, torch.Tensor] | None = None,
                     adapter: bool = False) -> tuple[Path, dict[str, str]]:
    """`save_checkpoint`, also returning the checksum of every file in the directory: the weights'
    hashed as they are written (common.checkpoints.write_safetensors), never read back.
    `timing`, if given, gets write_safetensors' "write" and "checksum" seconds. `tensors`: what
    checkpoint_tensors gave for these weights already. `adapter`: the directory holds the LoRA
    adapter alone, in peft's format (adapter_model.safetensors, adapter_config.json naming
    `source_dir` as its base model), in place of the complete HF directory."""
    tmp = checkpoint_dir / f".step_{step}.tmp"
    final = checkpoint_dir / f"step_{step}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    hf = hf_model(model)
    if tensors is None:
        tensors = checkpoint_tensors(model, state_dict, dtype, adapter=adapter)
    if adapter:
        sums = {ADAPTER_FILE: write_safetensors(tmp / ADAPTER_FILE, tensors, timing=timing)}
        write_adapter_config(model, tmp, base_model=str(source_dir))
        return _rename(tmp, final), checksum_dir(final, known=sums)
    sums = {WEIGHTS_FILE: write_safetensors(tmp / WEIGHTS_FILE, tensors, timing=timing)}
    floating = {t.dtype for t in tensors.values() if t.is_floating_point()}
    hf.config.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["architectures"] = [type(hf).__name__]
    if len(floating) == 1:  # the dtype the engines load it in unless told otherwise
        config["dtype"] = str(floating.pop()).removeprefix("torch.")
    (tmp / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if hf.can_generate() and getattr(hf, "generation_config", None) is not None:
        hf.generation_config.save_pretrained(tmp)
    copy_tokenizer_files(source_dir, tmp)
    return _rename(tmp, final), checksum_dir(final, known=sums)


def _rename(tmp: Path, final: Path) -> Path:
    """`tmp` renamed `final`, the resolved path."""
    if final.exists():  # written by a run that crashed before publishing it, or by one before a restart
        shutil.rmtree(final)
    os.rename(tmp, final)
    return final.resolve()


def hf_tensors(hf: torch.nn.Module, state_dict: dict[str, torch.Tensor],
               dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    """What save_pretrained would write of `state_dict`: tied aliases dropped (the lm_head that
    shares the embedding), names as the checkpoint format has them; on the CPU, floating tensors
    in `dtype` (None: as they are; a tensor already there is not copied)."""
    from transformers.modeling_utils import remove_tied_weights_from_state_dict, revert_weight_conversion

    state = dict(state_dict)
    for key in getattr(hf, "_keys_to_ignore_on_save", None) or []:
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, hf)
    with unsharded_class_names(hf):
        state = revert_weight_conversion(hf, state)
    return in_dtype(state, dtype)


@contextlib.contextmanager
def unsharded_class_names(hf: torch.nn.Module):
    """`hf`'s FSDP2-sharded submodels (`fully_shard` makes each an `FSDP<Class>`) under their own
    classes while inside: transformers finds the names a model's checkpoint has (Qwen2-VL's
    `model.layers`, `visual`, where the module has `model.language_model.layers`, `model.visual`)
    by each submodel's class name, which a sharded one would not match, and would write the
    module's names instead."""
    from torch.distributed.fsdp import FSDPModule

    sharded = [(m, type(m)) for m in hf.modules() if isinstance(m, FSDPModule)]
    try:
        for m, cls in sharded:
            m.__class__ = next(c for c in cls.__mro__ if not issubclass(c, FSDPModule))
        yield
    finally:
        for m, cls in sharded:
            m.__class__ = cls


def remove_unfinished(checkpoint_dir: Path) -> None:
    """Delete checkpoints half-written by a trainer that was killed (their temporary names)."""
    for tmp in checkpoint_dir.glob(".step_*.tmp"):
        shutil.rmtree(tmp, ignore_errors=True)


EVALUATING = "evaluating"  # beside the step_N directories: the checkpoints held for a queued evaluation
HELD_FOR_EVAL = 2  # checkpoints held so at most (older ones go: their evaluations are reported skipped)


def hold_for_eval(wv: WeightVersion, *, keep: int = HELD_FOR_EVAL) -> WeightVersion:
    """`wv` with its files hard-linked into `evaluating/step_N` beside it (copied where the
    filesystem cannot link), for the evaluation queued on it: pruning the checkpoint no longer
    pulls it from under an evaluator that is slower than the trainer's `keep_checkpoints`
    publishes. A link costs no disk until the checkpoint itself is pruned; the newest `keep`
    held stay (and none past `wv`, from before a restart from an older state)."""
    src = Path(wv.path)
    root = src.parent / EVALUATING
    held, tmp = root / src.name, root / f".{src.name}.tmp"
    for old in root.glob(".step_*.tmp"):
        shutil.rmtree(old, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in src.iterdir():
        try:
            os.link(f, tmp / f.name)
        except OSError:
            shutil.copy2(f, tmp / f.name)
    shutil.rmtree(held, ignore_errors=True)
    os.rename(tmp, held)
    prune_steps(root, keep=keep, newest=wv.version)
    return replace(wv, path=str(held))


def publish(r: redis.Redis, keys: Keys, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            scheduler: torch.optim.lr_scheduler.LRScheduler, *, step: int, checkpoint_dir: Path,
            state_root: Path, source_dir: Path, keep: int, save_state_now: bool, entry_ids: list[bytes],
            group_ids: list[str], dedup_window: int, dtype: torch.dtype | None = None,
            timing: dict[str, float] | None = None, gone_back: GoneBack | None = None,
            sender: Sender | None = None, adapter: bool = False) -> WeightVersion | None:
    """Checkpoint and trainer state on disk, then in one transaction: announce it and
    acknowledge the groups it holds (every rank's: `entry_ids` and `group_ids` are global).

    Every rank takes part (gathering the weights, writing its state shards); rank 0 writes the
    checkpoint (its weights in `dtype`, None: the master weights') and talks to Redis, and alone
    returns the WeightVersion. `timing`, if given, gets the seconds of the weights' "write" and,
    of them, the "checksum" (write_safetensors). `gone_back`: the trainer's last start below a
    version it had published: the announcement says so, and is created no earlier than it.
    `sender` (rank 0's, trainer.weight_transfer): the weights also go over its collective to the
    generators listening, beside the write; the announcement names their digest. `adapter`
    (trainer.lora.publish = "adapter"): the version is the LoRA adapter alone, announced as such
    (format "lora_adapter"), on disk only. The trainer's publishes beside the next step take the
    same stages in two threads (trainer/publishing.py): `published_tensors` (and `begin_state`) in
    the step's, `write_state`, `write_weights` and `announce_version` beside the next step.
    """
    tensors = published_tensors(model, dtype, adapter=adapter, sender=sender)
    written = write_weights(model, tensors, step=step, checkpoint_dir=checkpoint_dir, source_dir=source_dir,
                            keep=keep, timing=timing, sender=sender, adapter=adapter) if is_main() else None
    assert save_state_now or not entry_ids, "groups are acknowledged only with a saved trainer state"
    if save_state_now:
        save_state(model, optimizer, scheduler, step=step, state_root=state_root, keep=keep)
    if written is None:
        return None
    return announce_version(r, keys, written, step=step, state_saved=save_state_now, entry_ids=entry_ids,
                            group_ids=group_ids, dedup_window=dedup_window, gone_back=gone_back, adapter=adapter)


class Written(NamedTuple):
    """A checkpoint's files as written: where, each file's checksum, and the broadcast's digest ("": none)."""

    path: Path
    checksums: dict[str, str]
    digest: str


def published_tensors(model: torch.nn.Module, dtype: torch.dtype | None, *, adapter: bool = False,
                      sender: Sender | None = None) -> dict[str, torch.Tensor]:
    """The weights a version of `model` publishes (checkpoint_tensors): gathered from every rank (a
    collective under torchrun), rank 0's in `dtype` on the CPU; {} on the other ranks. Where the
    model's own weights are on the CPU in `dtype` (one process) they are the parameters themselves."""
    assert sender is None or not adapter, "an adapter is published on disk only (trainer.weight_transfer = 'disk')"
    weights = full_state_dict(model)
    return checkpoint_tensors(model, weights, dtype, adapter=adapter) if is_main() else {}


def write_weights(model: torch.nn.Module, tensors: dict[str, torch.Tensor], *, step: int, checkpoint_dir: Path,
                  source_dir: Path, keep: int, timing: dict[str, float] | None = None, sender: Sender | None = None,
                  adapter: bool = False) -> Written:
    """Rank 0's checkpoint of `step` from `tensors` (published_tensors), the oldest checkpoint
    removed first, and, with a `sender`, the broadcast beside the write. Reads of `model` its
    config alone (config.json, the generation config, an adapter's config)."""
    # Room first: the oldest checkpoint goes before the new one is written (the newest stay, so
    # every generator still finds the version it was told of). The disk then needs room for
    # `keep` checkpoints, not one more, and the new file reuses the pages the old one held:
    # the default model's weights took 0.1 s to write so, 0.6 s into fresh pages (a 2-core VM).
    prune_steps(checkpoint_dir, keep=keep - 1, newest=step - 1, spare=source_dir)
    sending = sender.start(tensors, version=step) if sender is not None else None
    try:
        path, sums = write_checkpoint(model, checkpoint_dir=checkpoint_dir, step=step, source_dir=source_dir,
                                      timing=timing, tensors=tensors, adapter=adapter)
    finally:  # bounded by the transfer's timeout; a failed broadcast is "" (the files serve)
        digest = sending.result() if sending is not None else ""
    return Written(path=path, checksums=sums, digest=digest)


def announce_version(r: redis.Redis, keys: Keys, written: Written, *, step: int, state_saved: bool,
                     entry_ids: list[bytes], group_ids: list[str], dedup_window: int,
                     gone_back: GoneBack | None = None, adapter: bool = False) -> WeightVersion:
    """Rank 0, once `written` is on disk (and, with `state_saved`, the trainer state of `step`): in
    one transaction announce the version and record the step, and acknowledge the groups it holds;
    then trim the samples stream of what every consumer group has acknowledged."""
    gone = gone_back or GoneBack(step=0, upto=0, at=0.0)
    wv = WeightVersion(version=step, step=step, path=str(written.path), checksums=written.checksums,
                       format=ADAPTER_FORMAT if adapter else FULL_FORMAT,
                       created_at=max(time.time(), gone.at), gone_back_step=gone.step, gone_back_at=gone.at,
                       transfer_digest=written.digest)
    pipe = r.pipeline(transaction=True)
    announce_weights(pipe, keys, wv)
    write_step(pipe, keys, step=step, version=step, state_step=step if state_saved else None)
    acknowledge(pipe, keys, step=step, entry_ids=entry_ids, group_ids=group_ids, dedup_window=dedup_window)
    pipe.execute()
    trim_acknowledged(r, keys.samples)  # what every group has acknowledged; nothing of ours is pending
    return wv


def announce_state(r: redis.Redis, keys: Keys, *, step: int, entry_ids: list[bytes], group_ids: list[str],
                   dedup_window: int) -> None:
    """Rank 0, once the trainer state of `step` is on disk and its version announced (by
    `announce_version`, without it): in one transaction record the saved state's step and
    acknowledge the groups it holds; then trim the samples stream. The trainer's step and version
    are left as they are: later versions may have been announced meanwhile."""
    pipe = r.pipeline(transaction=True)
    write_state_step(pipe, keys, step)
    acknowledge(pipe, keys, step=step, entry_ids=entry_ids, group_ids=group_ids, dedup_window=dedup_window)
    pipe.execute()
    trim_acknowledged(r, keys.samples)


def acknowledge(pipe: redis.client.Pipeline, keys: Keys, *, step: int, entry_ids: list[bytes], group_ids: list[str],
                dedup_window: int) -> None:
    """Into `pipe`: the groups of `entry_ids` trained (acknowledged, remembered as trained at `step`
    for `dedup_window` steps, settled) and counted."""
    if entry_ids:
        pipe.xack(keys.samples, TRAINER_GROUP, *entry_ids)
        pipe.zadd(keys.trained, dict.fromkeys(group_ids, step))
        pipe.zremrangebyscore(keys.trained, "-inf", f"({step - dedup_window}")
        settle(pipe, keys, group_ids, dropped=False)
    count_trained(pipe, keys, len(group_ids))


# --------------------------------------------------------------------------- the trainer's progress, and resume


def resume_point(r: redis.Redis, keys: Keys, *, source_dir: Path, state_root: Path) -> tuple[int, Path]:
    """The step to go on from, and the weights to load for it."""
    progress = read_trainer(r, keys)
    step, state_step = progress.step, progress.state_step
    acknowledged = state_step > 0 or progress.groups_trained > 0
    latest = latest_weights(r, keys) if step > 0 else None
    if state_step > 0 and state_dir(state_root, state_step).is_dir():
        # The newest saved state holds the weights too: every group trained after it is still
        # pending and is re-trained, in order, reproducing the versions published since.
        return state_step, source_dir
    # Published weights hold groups still pending when no state was saved yet (state_every >
    # sync_every): nothing acknowledged, so the initial model is the state to re-train them from.
    if latest is not None and acknowledged:
        verify_dir(latest.path, latest.checksums)
        return latest.step, Path(latest.path)
    if step > 0:
        say(f"trainer: run {keys.run!r} reached step {step} but saved no trainer state; "
            "re-training its groups from the initial model")
    return 0, source_dir


def going_back(r: redis.Redis, keys: Keys, *, step: int, upto: int) -> GoneBack:
    """A start at `step` below the published `upto`, timed after every announcement so far (their
    created_at never go back, whatever this host's clock says), so that what it publishes from
    now on is told from what it published before under the same numbers."""
    newest = latest_weights(r, keys)
    return GoneBack(step=step, upto=upto, at=max(time.time(), newest.created_at if newest else 0.0) + 1e-3)


def resume(r: redis.Redis, keys: Keys, *, where: Placement, source_dir: Path, state_root: Path, lr: float,
           weight_decay: float, lr_schedule: str, warmup_steps: int, total_steps: int,
           lora: LoraConfig | None = None
           ) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler, int]:
    """The model (placed and sharded as `where` says), its AdamW and lr schedule, and the step they
    are at: where this run's newest saved trainer state or published checkpoint left off, else the
    initial model at step 0. With `lora` (rank > 0) the model carries adapters and AdamW trains
    them alone. Rank 0 records the step in the trainer hash as both steps done and published version,
    and, where the run had published past it, the highest version it had (`version_max`)."""
    step, weights = resume_point(r, keys, source_dir=source_dir, state_root=state_root)
    adapted = lora is not None and lora.rank > 0
    if adapted:  # trainer.lora.publish = "adapter": the published adapter onto the base model
        published_adapter = is_adapter_dir(weights)
        model = adapted_model(source_dir if published_adapter else weights, where, lora,
                              adapter=weights if published_adapter else None)
    elif is_adapter_dir(weights):
        raise ValueError(f"trainer: run {keys.run!r} resumes from the LoRA adapter {weights}, but trainer.lora.rank "
                         "is 0: resume it with its [trainer.lora] settings")
    if is_main():  # the newest published weights (the initial ones are 0); going back, the highest published
        had = read_trainer(r, keys)
        above = max(had.version_max, had.version)
        pipe = r.pipeline(transaction=True)
        write_step(pipe, keys, step=step, version=step, version_max=above if above > step else None)
        if above > step:  # the versions above `step` will mean other weights: from when on, recorded
            add_gone_back(pipe, keys, going_back(r, keys, step=step, upto=above))
        pipe.execute()
    if not adapted:  # on its device (FSDP2 under torchrun), each rank reading only its own shards
        model = placed_model(weights, where)
    trained = [p for p in model.parameters() if p.requires_grad]  # all of them, or LoRA's adapters
    optimizer = adamw(trained, lr=lr, weight_decay=weight_decay)
    scheduler = build_scheduler(optimizer, schedule=lr_schedule, warmup_steps=warmup_steps, total_steps=total_steps)
    if step > 0:
        state = state_dir(state_root, step)
        if state.is_dir():
            load_state(model, optimizer, scheduler, path=state)
            say(f"trainer: resuming at step {step} from its trainer state {state}")
        else:
            say(f"trainer: resuming at step {step} from {weights}; no trainer state at {state}, "
                "so AdamW and the lr schedule start fresh")
    return model, optimizer, scheduler, step
