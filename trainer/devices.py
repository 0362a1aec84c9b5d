"""Where the trainer's tensors live: one device per process, decided here and nowhere else.

Under torchrun on a machine with CUDA each rank takes `cuda:LOCAL_RANK` (one GPU per rank); a
single process takes `cuda` (the current device) when CUDA exists; otherwise the CPU. The model,
the reference model, every tensor a step builds (inputs, targets, masks, behaviour log-probs,
advantages) and the buffers of the collectives live on it; what comes back to Python (stats,
counts) is read off with `.item()` / `.tolist()`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, fields, is_dataclass, replace
from typing import TypeVar

import torch

from common.config import ConfigError

T = TypeVar("T")


def trainer_device() -> torch.device:
    """This process's device: cuda:LOCAL_RANK under torchrun, cuda alone, else cpu. Makes it CUDA's
    current device, so that NCCL and any `device="cuda"` land on the same GPU."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
    assert index < torch.cuda.device_count(), (
        f"LOCAL_RANK {index} but only {torch.cuda.device_count()} GPU(s) visible: start at most one rank per GPU "
        "(torchrun --nproc-per-node <= GPUs, or set CUDA_VISIBLE_DEVICES)")
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


def backend_device(backend: str) -> torch.device:
    """The device a collective's buffers must be on for a process group of `backend`: NCCL takes
    CUDA tensors only (of the rank's current GPU), gloo CPU tensors."""
    if backend == "nccl":
        return torch.device("cuda")  # the current device: trainer_device() set it
    assert backend == "gloo", f"unknown process group backend {backend!r}: expected nccl or gloo"
    return torch.device("cpu")


ATTENTIONS = ("auto", "sdpa", "flex_attention", "varlen")


def resolve_attention(device: torch.device, attention: str = "sdpa", dtype: torch.dtype = torch.float32) -> str:
    """`trainer.attention` for a trainer computing in `dtype` on `device`: "sdpa", "flex_attention" or
    "varlen". "auto": "varlen" where its flash kernel computes (CUDA, bf16 or fp16) and matches the
    reference on this device (trainer/varlen.py `flash_failure`, checked once), else "sdpa".
    "flex_attention" on CUDA only: its BlockMask (trainer/logprobs.py `Packed.attention`) computes
    only the blocks each document sees, in kernels compiled for each new shape; eager flex
    attention has no backward on the CPU. "varlen" anywhere: the flash kernel where it computes,
    elsewhere SDPA a sequence at a time; refused on CUDA in bf16 or fp16 where the kernel fails
    its check."""
    if attention not in ATTENTIONS:
        raise ValueError(f"trainer.attention must be one of {', '.join(ATTENTIONS)}, got {attention!r}")
    if attention == "flex_attention" and device.type != "cuda":
        raise ConfigError(f"trainer.attention = 'flex_attention' needs CUDA; this trainer runs on {device.type}: "
                          "use 'sdpa'")
    if attention in ("sdpa", "flex_attention"):
        return attention
    from trainer.varlen import FLASH_DTYPES, flash_failure

    failure = flash_failure(device, dtype)
    if attention == "auto":
        return "sdpa" if failure else "varlen"
    if failure and device.type == "cuda" and dtype in FLASH_DTYPES:
        raise ConfigError(f"trainer.attention = 'varlen': {failure}; use 'sdpa'")
    return "varlen"


def attention_implementation(device: torch.device, attention: str = "sdpa",
                             dtype: torch.dtype = torch.float32) -> str | None:
    """The attention implementation the trainer's models compute with (`resolve_attention`'s choice;
    None: the model's own, SDPA where transformers has it, with the dense mask of a packed
    micro-batch)."""
    from trainer.varlen import VARLEN

    chosen = resolve_attention(device, attention, dtype)
    return {"sdpa": None, "flex_attention": "flex_attention", "varlen": VARLEN}[chosen]


def model_device(model: torch.nn.Module) -> torch.device:
    """The device the model computes on (that of its first parameter; sharded ones hold their
    local shard there)."""
    p = next(model.parameters())
    return p.to_local().device if hasattr(p, "to_local") else p.device


def to_device(batch: T, device: torch.device) -> T:
    """A dataclass of tensors (a micro-batch) with every tensor field on `device`, those of its
    dataclass fields (a micro-batch's packed layout) too."""
    moved = {}
    for f in fields(batch):
        value = getattr(batch, f.name)
        if isinstance(value, torch.Tensor):
            moved[f.name] = value.to(device, non_blocking=True)
        elif is_dataclass(value) and not isinstance(value, type):
            moved[f.name] = to_device(value, device)
    return replace(batch, **moved)


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class Placement:
    """Where and in what precision the trainer's models live (from `model.dtype` and the trainer's
    `master_fp32` and `activation_checkpointing`)."""

    device: torch.device
    dtype: torch.dtype  # model.dtype: forward and backward run in it; checkpoints are published in it
    master_fp32: bool  # keep float32 weights and AdamW state under a lower dtype (mixed precision)
    activation_checkpointing: bool = False  # recompute each block's activations in the backward pass
    attention: str = "sdpa"  # trainer.attention resolved (resolve_attention): what packed micro-batches compute with
    compile: bool = False  # trainer.compile: each transformer block torch.compile'd (trainer/parallel.py)

    def __post_init__(self) -> None:
        assert isinstance(self.activation_checkpointing, bool), (
            f"Placement.activation_checkpointing must be resolved to true or false (trainer/memory.py `choose` "
            f"resolves 'auto'), got {self.activation_checkpointing!r}")

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the trained weights (and so AdamW's moments) are held in."""
        return torch.float32 if self.master_fp32 else self.dtype


def placement(*, dtype: str, master_fp32: bool, activation_checkpointing: bool,
              attention: str = "sdpa", compile: bool = False) -> Placement:
    """This process's placement: its device (trainer_device) and the config's precision and attention."""
    assert dtype in DTYPES, f"model.dtype must be one of {sorted(DTYPES)}, got {dtype!r}"
    device = trainer_device()
    attention = resolve_attention(device, attention, DTYPES[dtype])  # refused here, before any model is read
    return Placement(device=device, dtype=DTYPES[dtype], master_fp32=master_fp32,
                     activation_checkpointing=activation_checkpointing, attention=attention, compile=compile)
