"""LoRA: the trainer trains low-rank adapters on the frozen model (peft) and publishes either merged
full weights (trainer.lora.publish = "merged"), so every engine loads a plain HF checkpoint as it
does without LoRA, or the adapter alone in peft's format ("adapter": `adapter_state_dict`,
`write_adapter_config`), which peft's PeftModel.from_pretrained and the HF engine load onto the base.

Only the adapter's parameters take gradients: AdamW holds state for them alone, and the trainer
state saves them alone (trainer/state.py skips frozen parameters). Publishing gathers the adapted
model's state dict and folds each adapter into its base weight, W + (B @ A) * alpha / rank, under
the base model's own parameter names.

The adapters start from values drawn from a seeded generator (initial_adapters), not from the
global RNG as peft draws them, so that ranks that adapt a model built on `meta` (whose adapters
peft leaves on `meta` too) start from the adapters one process starts from.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import torch

# What peft names the adapted model's parts: prefix of every key, the wrapped base layer, the adapter.
_PREFIX = "base_model.model."
_BASE = ".base_layer."
_ADAPTER = "default"


def apply_lora(model: torch.nn.Module, *, rank: int, alpha: float, dropout: float,
               target_modules: list[str]) -> torch.nn.Module:
    """`model` with LoRA adapters of `rank` on the modules named in `target_modules`; everything
    else frozen. B starts at zero, so the adapted model computes what `model` did. A
    vision-language model's adapters go on its text model only (`towers`: the vision tower and the
    connector are excluded, frozen as they are)."""
    from peft import LoraConfig, get_peft_model

    assert rank > 0, f"LoRA rank must be positive, got {rank}"
    left_out = towers(model)
    exclude = "(?:" + "|".join(re.escape(name) for name in left_out) + r")\..*" if left_out else None
    config = LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=list(target_modules),
                        exclude_modules=exclude, bias="none", task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config, adapter_name=_ADAPTER)
    except ValueError as err:  # e.g. no module matches target_modules
        from common.models import ModelError

        unmatched = "not found in the base model" in str(err) or "No modules were targeted" in str(err)
        why = (f" (a vision-language model's adapters go on its text model only, not on {', '.join(left_out)}: "
               "name modules of its text model)") if left_out and unmatched else ""
        raise ModelError(f"trainer.lora.target_modules: {err}{why}") from None


def towers(model: torch.nn.Module) -> list[str]:
    """The names of a vision-language model's parts beside its text model (Idefics3 / SmolVLM:
    `model.vision_model`, the vision tower, and `model.connector`; Qwen2-VL and Qwen2.5-VL:
    `model.visual`, whose blocks have their own `qkv`, `proj`, `fc1`, `fc2` or `gate_proj`,
    `up_proj`, `down_proj`), which LoRA leaves unadapted:
    vLLM adapts a VLM's text model only (its tower and connector adapters are an experimental
    option, off by default), so an adapter on them would be sampled without them; and the text
    model is what learns to answer. [] for a text model."""
    from common.vision import is_vision_config

    if not is_vision_config(getattr(model, "config", None)):
        return []
    text = model.get_decoder()
    for parent_name, parent in model.named_modules():
        if any(child is text for child in parent.children()):
            prefix = f"{parent_name}." if parent_name else ""
            return [f"{prefix}{name}" for name, child in parent.named_children() if child is not text]
    raise AssertionError(f"{type(model).__name__}: its text model is not among its modules")


def is_lora(model: torch.nn.Module) -> bool:
    return hasattr(model, "peft_config")


def hf_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers model to save a checkpoint with: the base of an adapted model, else the model."""
    return model.get_base_model() if is_lora(model) else model


def merged_state_dict(state: dict[str, torch.Tensor], *, scale: float) -> dict[str, torch.Tensor]:
    """An adapted model's state dict (`state`, peft's names) as the base model's, each adapted
    weight merged: W + (B @ A) * scale, scale = alpha / rank."""
    out = {}
    for key, value in state.items():
        if ".lora_" in key:
            continue
        if key.endswith(f"{_BASE}weight"):
            stem = key[: -len(f"{_BASE}weight")]
            a = state[f"{stem}.lora_A.{_ADAPTER}.weight"]  # (rank, in)
            b = state[f"{stem}.lora_B.{_ADAPTER}.weight"]  # (out, rank)
            value = (value.float() + (b.float() @ a.float()) * scale).to(value.dtype)
        out[key.removeprefix(_PREFIX).replace(_BASE, ".")] = value
    return out


def scale_of(model: torch.nn.Module) -> float:
    config = model.peft_config[_ADAPTER]
    return config.lora_alpha / config.r


def adapter_state_dict(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter alone of an adapted model's state dict (`state`, peft's names), under the names
    peft saves it with: `base_model.model.<module path>.lora_A.weight` (the adapter's name dropped)."""
    out = {}
    for key, value in state.items():
        for part in ("lora_A", "lora_B"):
            mid = f".{part}.{_ADAPTER}."
            if mid in key:
                out[key.replace(mid, f".{part}.")] = value
    assert out, "no LoRA adapter weights in the model's state dict"
    return out


def write_adapter_config(model: torch.nn.Module, dest, *, base_model: str) -> None:
    """`dest/adapter_config.json`: the adapter's peft config, naming `base_model` as its base."""
    import copy

    config = copy.copy(model.peft_config[_ADAPTER])
    config.base_model_name_or_path = base_model
    config.inference_mode = True
    config.save_pretrained(str(dest))


def initial_adapters(model: torch.nn.Module, *, seed: int) -> dict[str, torch.Tensor]:
    """The whole initial tensors of the adapted `model`'s adapters, by parameter name, as peft
    initialises them (A kaiming-uniform, B zeros) but drawn from a generator seeded with `seed`, in
    the model's order: the same on every rank and at every world size, and known without the
    model's own (possibly `meta`) storage."""
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, p in model.named_parameters():
        if f".lora_A.{_ADAPTER}." in name:
            a = torch.empty(tuple(p.shape), dtype=torch.float32)
            torch.nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=gen)  # peft's reset_lora_parameters
            out[name] = a.to(p.dtype)
        elif f".lora_B.{_ADAPTER}." in name:
            out[name] = torch.zeros(tuple(p.shape), dtype=p.dtype)
    assert out, "no LoRA adapters in the model"
    return out


def adapter_tensors(model: torch.nn.Module, path) -> dict[str, torch.Tensor]:
    """The published adapter in the directory `path` (peft's format) under the adapted `model`'s
    parameter names; ValueError naming what does not fit the model."""
    from safetensors.torch import load_file

    from common.checkpoints import ADAPTER_FILE

    own = dict(model.named_parameters())
    theirs = {}
    for key, value in load_file(str(Path(path) / ADAPTER_FILE)).items():
        for part in ("lora_A", "lora_B"):
            key = key.replace(f".{part}.weight", f".{part}.{_ADAPTER}.weight")
        theirs[key] = value
    wanted = {k for k in own if ".lora_" in k}
    wrong = sorted(k for k in theirs if k in own and tuple(own[k].shape) != tuple(theirs[k].shape))
    if wanted != set(theirs) or wrong:
        raise ValueError(f"adapter {path} does not fit the model: missing {sorted(wanted - set(theirs))[:3]}, "
                         f"unexpected {sorted(set(theirs) - wanted)[:3]}, wrong shapes {wrong[:3]}")
    return theirs


def copy_adapters(model: torch.nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Copy `tensors` (adapter_tensors, initial_adapters) into the adapted `model`'s own (unsharded) adapters."""
    own = dict(model.named_parameters())
    with torch.no_grad():
        for key, value in tensors.items():
            own[key].copy_(value)


def load_adapter(model: torch.nn.Module, path) -> None:
    """Copy the published adapter in the directory `path` (peft's format) into the adapted `model`;
    ValueError naming what does not fit (the model unchanged)."""
    copy_adapters(model, adapter_tensors(model, path))
