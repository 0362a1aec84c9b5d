"""The trainer's model, built where it will live without a whole copy in host memory first.

Under torchrun each rank used to load the whole float32 model on the host and only then shard it:
8 ranks of an 8B model held about 256 GB of host memory at start-up. Here, as torchtitan and
prime-rl do, the model is built on PyTorch's `meta` device (no memory), its blocks and root
sharded (FSDP2), its storage allocated on the rank's device, and each parameter's local shard read
from the safetensors files: only the rows that rank holds (`safe_open(...).get_slice`), straight
into its shard. A single process on CUDA reads the checkpoint onto the GPU (transformers'
`device_map`), the host holding one tensor at a time; on the CPU the model is the host's memory
anyway and loads as before.

Non-persistent buffers (the rotary embedding's frequencies), which no checkpoint holds, are made
on the host as the model's own constructor makes them (accelerate's `init_empty_weights` keeps
buffers real) and copied to the device after allocation. A checkpoint that lacks one of the
model's parameters, or holds it in another shape, is refused by name (ModelError).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from pathlib import Path

import torch

from trainer.devices import Placement, attention_implementation
from trainer.parallel import distributed, parallelize

# Adapts a model built on `meta` (LoRA): the adapted model, and the whole tensors of the parameters
# it added, by their names in it (the checkpoint has none of them).
Adapt = Callable[[torch.nn.Module], tuple[torch.nn.Module, dict[str, torch.Tensor]]]


def checkpoint_files(path: Path) -> dict[str, Path]:
    """Each tensor name of the safetensors checkpoint at `path` -> the file that holds it."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return {name: path / file for name, file in json.loads(index.read_text())["weight_map"].items()}
    from safetensors import safe_open

    found = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            found.update(dict.fromkeys(f.keys(), file))
    return found


def load_model(path: Path, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    """The whole model in checkpoint directory `path`, in `dtype`, on the host, from its safetensors
    only (see safetensors_only)."""
    from common.vision import model_class

    safetensors_only(path)
    return model_class(path).from_pretrained(path, dtype=dtype, use_safetensors=True)


def with_attention(model: torch.nn.Module, where: Placement) -> torch.nn.Module:
    """`model` computing attention as the trainer does where `where` says (devices.attention_implementation)."""
    impl = attention_implementation(where.device, where.attention, where.dtype)
    if impl is not None:
        model.set_attn_implementation(impl)
    return model


def placed_model(path: Path, where: Placement) -> torch.nn.Module:
    """The model of checkpoint `path` in `where.weights_dtype`, placed as `where` says (sharded over
    the ranks under torchrun), each rank reading only its own shards."""
    if distributed():
        safetensors_only(path)
        return with_attention(sharded_from_meta(path, where), where)  # sharded as it is built
    if where.device.type == "cuda":
        from common.vision import model_class

        safetensors_only(path)
        model = model_class(path).from_pretrained(path, dtype=where.weights_dtype, use_safetensors=True,
                                                  device_map={"": where.device})
    else:
        model = load_model(path, where.weights_dtype)
    return parallelize(with_attention(model, where), device=where.device, compute_dtype=where.dtype,
                       activation_checkpointing=where.activation_checkpointing, compile_blocks=where.compile)


def safetensors_only(path: Path) -> None:
    """Refuse a checkpoint directory without safetensors: a pickled `pytorch_model.bin` can run
    code when loaded."""
    from common.models import ModelError

    if not any(Path(path).glob("*.safetensors")):
        found = ", ".join(sorted(p.name for p in Path(path).glob("*.bin"))) or "no weights"
        raise ModelError(f"model at {path}: no .safetensors weights ({found}); the trainer loads safetensors "
                         "only, never pickle: save the model with save_pretrained(..., safe_serialization=True)")


def sharded_from_meta(path: Path, where: Placement, *, adapt: Adapt | None = None) -> torch.nn.Module:
    """Build on `meta`, shard, allocate on the device, read each local shard from the files. With
    `adapt` (LoRA's, trainer/checkpoints.py `adapted_model`) the model built on `meta` is adapted
    before it is sharded, and the parameters it adds are read from the whole tensors it gives, as
    the base model's are from the files: each rank copies only its own rows."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig

    from common.vision import model_class

    config = AutoConfig.from_pretrained(path)
    with init_empty_weights(include_buffers=False):  # parameters on meta, buffers real (on the host)
        model = model_class(path).from_config(config, dtype=where.weights_dtype)  # a VLM's class for a VLM
    model.tie_weights()  # inside the context a tie registers a parameter of its own: tie them again here
    own = {id(p): name for name, p in model.named_parameters()}  # the checkpoint's name of each
    given: dict[str, torch.Tensor] = {}
    if adapt is not None:
        model, given = adapt(model)
    names = {name: own[id(p)] for name, p in model.named_parameters() if id(p) in own}  # adapter: base's
    buffers = {name: b.clone() for name, b in model.named_buffers()}
    model = parallelize(model, device=where.device, compute_dtype=where.dtype,
                        activation_checkpointing=where.activation_checkpointing, compile_blocks=where.compile)
    model.to_empty(device=where.device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            b.copy_(buffers[name])
        read_local_shards(model, path, names=names, given=given)
    return model


def read_local_shards(model: torch.nn.Module, path: Path, *, names: dict[str, str] | None = None,
                      given: dict[str, torch.Tensor] | None = None) -> None:
    """Copy into each parameter's local shard (a DTensor's, or the whole of a plain tensor) the rows
    that this rank holds of the checkpoint's tensor of the same name (or of the name `names` maps it
    to), or of the whole tensor `given` holds under its name (a checkpoint has no LoRA adapters)."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    from common.models import ModelError

    names, given = names or {}, given or {}
    files = checkpoint_files(path)
    missing = [names.get(name, name) for name, _ in model.named_parameters()
               if name not in given and names.get(name, name) not in files]
    converted: dict[str, torch.Tensor] = {}
    if missing:
        # A checkpoint in the layout transformers converts as it loads (an MoE's experts: one tensor
        # each on disk, fused in the model): the whole model read on the host, converted, once per
        # rank (the host memory this module otherwise saves), its tensors sliced as the files' are.
        from common.vision import model_class

        whole, info = model_class(path).from_pretrained(path, dtype=torch.float32, use_safetensors=True,
                                                        output_loading_info=True)
        if info["missing_keys"]:  # transformers would fill them with fresh values: a broken checkpoint
            missing = sorted(info["missing_keys"])
        else:
            converted = dict(whole.state_dict())
            missing = [name for name in missing if name not in converted]
        del whole
    if missing:
        raise ModelError(f"model at {path}: its checkpoint has no tensor {missing[0]!r} "
                         f"({len(missing)} of the model's parameters missing)")
    with contextlib.ExitStack() as files_open:
        opened = {file: files_open.enter_context(safe_open(str(file), framework="pt")) for file in set(files.values())}
        for own_name, p in model.named_parameters():  # a tied lm_head is the embedding's, named once
            name = names.get(own_name, own_name)
            whole = given[own_name] if own_name in given else converted.get(name)  # else read from the files
            piece = whole if whole is not None else opened[files[name]].get_slice(name)
            full = tuple(piece.shape) if whole is not None else tuple(piece.get_shape())
            if full != tuple(p.shape):
                raise ModelError(f"model at {path}: tensor {name!r} is {list(full)} in the checkpoint, "
                                 f"{list(p.shape)} in the model")
            if isinstance(p, DTensor):
                local = p.to_local()
                shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
                if local.numel() == 0:
                    continue
                rows = tuple(slice(o, o + n) for o, n in zip(offset, shape, strict=True))
                local.copy_(piece[rows].to(local.dtype))
            else:
                p.copy_(piece[:].to(p.dtype))
