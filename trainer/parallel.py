"""Data parallelism under torchrun: FSDP2 sharding, the few collectives the trainer needs, rank 0's console.

Started by `torchrun --nproc-per-node N -m trainer`, every rank joins a process group (gloo on
CPU, NCCL on GPU) and its model is sharded with `fully_shard` per transformer block, then the
root; the model code knows nothing of it. Started as plain `python -m trainer`, there is no
process group and every function here is the identity: a world of one.
"""

from __future__ import annotations

import functools
import os
import secrets
import socket
from pathlib import Path

import torch
import torch.distributed as dist

from trainer.devices import backend_device, trainer_device
from trainer.head import AUTOCAST_DTYPE


def init_distributed() -> tuple[int, int]:
    """(rank, world size); joins the process group when started by torchrun."""
    if "WORLD_SIZE" not in os.environ or dist.is_initialized():
        return (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
    device = trainer_device()  # cuda:LOCAL_RANK first: NCCL binds to the current device
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    return dist.get_rank(), dist.get_world_size()


def collective_device() -> torch.device:
    """Where the buffers of this process group's collectives live (CUDA for NCCL, CPU for gloo)."""
    return backend_device(dist.get_backend())


def distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if distributed() else 1


def is_main() -> bool:
    return not distributed() or dist.get_rank() == 0


def say(line: str) -> None:
    """Print `line` on rank 0 only: the console is rank 0's."""
    if is_main():
        print(line, flush=True)


def parallelize(model: torch.nn.Module, *, device: torch.device, compute_dtype: torch.dtype = torch.float32,
                activation_checkpointing: bool = False, compile_blocks: bool = False) -> torch.nn.Module:
    """Place `model` on `device` and, under torchrun, shard it over all ranks: each transformer block,
    then the root (FSDP2). The model's own dtype is that of its master weights (and so of AdamW's
    state); a lower `compute_dtype` runs forward and backward in it: FSDP2's MixedPrecisionPolicy
    (parameters gathered in `compute_dtype`, gradients reduced in float32) or, in a single
    process, autocast. With `activation_checkpointing` each block's activations are recomputed
    in the backward pass instead of kept. With `compile_blocks` each transformer block is
    torch.compile'd in place (`compile_each_block`), before it is sharded, as torchtitan orders them."""
    if activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if compile_blocks:
        compile_each_block(model)
    master = next(model.parameters()).dtype
    mixed = compute_dtype != master
    if not distributed():
        model.to(device)
        if mixed:
            autocast_forward(model, device_type=device.type, dtype=compute_dtype)
            # the trainer applies the head outside the model's forward, a chunk of positions at a
            # time (trainer/logprobs.py): in `compute_dtype` too, as the model's own forward and FSDP2's
            # gathered parameters compute it, never in the master weights' float32 (on a GPU
            # without TF32, a float32 head of a 150k-token vocabulary runs at a tenth of bf16's speed)
            head = model.get_output_embeddings()
            if head is not None:
                autocast_forward(head, device_type=device.type, dtype=compute_dtype)
        return model
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    # fully_shard moves each rank's shards (only) to the mesh's device.
    mesh = init_device_mesh(device.type, (world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32) if mixed \
        else MixedPrecisionPolicy()
    blocks = model.get_decoder().layers
    assert len(blocks) > 0, "model has no transformer blocks to shard"
    for block in [*vision_blocks(model), *blocks]:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the rest: embeddings, a vision tower's and connector's
    return model


def compile_each_block(model: torch.nn.Module, backend: str = "inductor") -> None:
    """torch.compile each transformer block of `model` in place (`Module.compile`: the block's call
    compiled, its parameters and state-dict names unchanged). The blocks share one code, so one
    compiled graph serves them all (recompiled once for lengths that vary, then dynamic).
    Activation checkpointing stays around each compiled call (transformers' checkpointing layer
    calls it); attention inside runs eager (trainer/varlen.py `attention`). Refused where torch's
    compiling is switched off (TORCH_COMPILE_DISABLE=1 in the environment), which would leave
    every block eager without a word."""
    if torch._dynamo.config.disable:
        from common.config import ConfigError

        raise ConfigError("trainer.compile = true, but torch.compile is disabled in this process "
                          f"(TORCH_COMPILE_DISABLE={os.environ.get('TORCH_COMPILE_DISABLE', '')!r} in its "
                          "environment): nothing would compile; unset it, or set trainer.compile = false")
    blocks = model.get_decoder().layers
    assert len(blocks) > 0, "model has no transformer blocks to compile"
    for block in blocks:
        block.compile(backend=backend)


def vision_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a vision-language model's vision tower (Idefics3 / SmolVLM:
    `encoder.layers`; Qwen2-VL: `blocks`), which FSDP shards one by one as the text model's; none
    for a text model."""
    from common.vision import is_vision_config

    if not is_vision_config(getattr(model, "config", None)):
        return []
    tower = model.get_encoder(modality="image")
    layers = getattr(getattr(tower, "encoder", None), "layers", None) or getattr(tower, "blocks", None)
    assert layers, f"{type(model).__name__}: no vision tower blocks to shard (encoder.layers or blocks)"
    return list(layers)


def autocast_forward(model: torch.nn.Module, *, device_type: str, dtype: torch.dtype) -> None:
    """Run `model`'s forward under autocast to `dtype` (a single process's mixed precision: float32
    weights and optimizer state, matmuls in `dtype`)."""
    forward = model.forward

    @functools.wraps(forward)
    def mixed_forward(*args, **kwargs):
        with torch.autocast(device_type=device_type, dtype=dtype):
            return forward(*args, **kwargs)

    setattr(mixed_forward, AUTOCAST_DTYPE, dtype)  # trainer/head.py computes the head in it
    model.forward = mixed_forward


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model's state dict on CPU (every rank takes part; None: not sharded, use the model)."""
    if not distributed():
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def all_sum(values: list[float]) -> list[float]:
    """Element-wise sums over the ranks."""
    if not distributed():
        return values
    t = torch.tensor(values, dtype=torch.float64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def all_max(value: int) -> int:
    if not distributed():
        return value
    t = torch.tensor([value], dtype=torch.int64, device=collective_device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is true on any (every rank must call it)."""
    return all_max(int(flag)) > 0


def gather(obj: object) -> list:
    """Every rank's `obj`, in rank order, on every rank."""
    if not distributed():
        return [obj]
    out: list = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def unshared(directories: list[Path]) -> str | None:
    """None when every rank sees each of `directories` as one and the same directory; else why not,
    in one line, the same on every rank (every rank must call it). Each rank writes its own shards
    of the trainer state into the output directory and rank 0 renames and prunes them; a rank
    that cannot see rank 0's files would leave its shards where resume never looks."""
    if not distributed():
        return None
    token = gather(secrets.token_hex(8))[0]  # rank 0's
    probes = [d / f".shared-{token}" for d in directories]
    if is_main():
        for probe in probes:
            probe.parent.mkdir(parents=True, exist_ok=True)
            probe.write_text(token)
    barrier()
    blind = [i for i, p in enumerate(probes) if not (p.is_file() and p.read_text() == token)]
    everyone = gather((socket.gethostname(), [str(d) for d in directories], blind))
    barrier()
    if is_main():
        for probe in probes:
            probe.unlink(missing_ok=True)
    host0, dirs0, _ = everyone[0]
    missing = [f"rank {rank} on {host} does not see in {dirs[i]} what rank 0 on {host0} wrote in {dirs0[i]}"
               for rank, (host, dirs, unseen) in enumerate(everyone) for i in unseen]
    if not missing:
        return None
    return (f"the trainer's ranks do not share one output directory: {'; '.join(missing)}. Every trainer "
            "rank needs the same output_dir (and checkpoint_dir) on storage all trainer hosts mount (NFS, "
            "Lustre, ...): each rank saves its shards of the trainer state there and resume reads them back")


@functools.cache
def writer_group() -> dist.ProcessGroup | None:
    """A gloo group of every rank for the collectives of the writer threads (the trainer state
    written beside the next step, trainer/publishing.py): collectives of two threads on one group
    would interleave. Made at its first call, which every rank makes at the same point (it is a
    collective); None without a process group."""
    return dist.new_group(backend="gloo") if distributed() else None


def barrier() -> None:
    if distributed():
        dist.barrier()


def finish() -> None:
    """Leave the process group (a barrier first: without it gloo sometimes aborts at exit)."""
    if distributed():
        dist.barrier()
        dist.destroy_process_group()
