"""The trainer's memory per rank at the configured micro-batch: what one forward and backward of
the check's own micro-batch measured (activations), scaled to the largest micro-batch the config
allows, plus the arithmetic of the weights, gradients and AdamW's moments.

Measured on CUDA as torch.cuda.max_memory_allocated above what was allocated before the pass; on
the CPU as the growth of the process's resident set over the pass, its high-water mark reset just
before (Linux: /proc/self/clear_refs) and freed heap handed back first (malloc_trim), so what the
engine or an earlier pass once held is not counted. The pass is the trainer's own
(trainer.step.backward_mini: its loss, log-probs, chunked head and activation checkpointing), run
a second time once the first has allocated the gradients: what it grows by is the activations
and the temporaries of one micro-batch.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import numpy as np
import torch

from common.config import Config
from trainer.batch import MicroBatch
from trainer.devices import DTYPES
from trainer.logprobs import sequence_logprobs
from trainer.losses import correction_of, kl_coef_of, loss_function, takes_proximal
from trainer.step import StepBatches, Sums, backward_mini, log_probs

ADAMW_MOMENTS = 2  # AdamW's state per trained parameter: two moments in the parameter's dtype


@dataclass(frozen=True, slots=True)
class Memory:
    """What the check knows of the trainer's memory on one rank."""

    state: int  # bytes of the weights, gradients and AdamW moments of the whole model (arithmetic)
    params: int  # the model's parameters
    reference: int  # bytes of the frozen reference model of a KL term (arithmetic; 0: none)
    measured: int | None  # bytes one forward and backward grew by (None: not measurable here)
    positions: int  # positions through the model in that pass (rows x longest, or packed)
    target: int  # positions of the largest micro-batch the config allows
    rows: int  # ... its rows (trainer.micro_batch_size)
    row_tokens: int  # ... its longest row
    device: str  # where it was measured: "cuda" or "cpu"

    def activations(self) -> int | None:
        """The measured bytes scaled linearly to `target` positions."""
        return None if self.measured is None else round(self.measured / max(self.positions, 1) * self.target)


def state_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the weights, gradients and AdamW moments, parameters): every parameter's weights,
    and for each trained one (all, or LoRA's adapters) a gradient and two moments in its dtype."""
    total, params = 0, 0
    for p in model.parameters():
        size = p.numel() * p.element_size()
        total += size * (1 + (1 + ADAMW_MOMENTS) * p.requires_grad)
        params += p.numel()
    return total, params


def trainer_pass(config: Config, model: torch.nn.Module, mb: MicroBatch) -> None:
    """One forward and backward of `mb` as the trainer's step runs it (its loss on `mb`'s trained
    tokens; the proximal and reference log-probs its loss needs, from `model` without gradients)."""
    cfg, ro = config.trainer, config.rollout
    forward = partial(sequence_logprobs, temperature=ro.temperature, top_k=ro.top_k, top_p=ro.top_p,
                      chunk_tokens=cfg.logits_chunk_tokens)
    correction = correction_of(cfg.loss)
    with torch.no_grad():
        prox = log_probs(forward, model, mb)[0] if takes_proximal(cfg.loss) else None
        ref = log_probs(forward, model, mb)[0] if kl_coef_of(cfg.loss) > 0 else None
    tokens = max(int(mb.mask.sum()), 1)
    mini = StepBatches(batches=[mb], tokens=tokens, seqs=int((mb.mask.sum(1) > 0).sum()), tokens_in=0,
                       computed=tokens, rows=mb.mask.shape[0])
    backward_mini(model, mini, [prox], [ref], Sums(), loss_fn=loss_function(cfg.loss), correction=correction,
                  forward=forward, step=0, total_tokens=tokens, max_new_tokens=ro.max_new_tokens)


def peak_growth(device: torch.device, run: Callable[[], None]) -> int | None:
    """Bytes the device's memory (CUDA) or the process's resident set (CPU) peaked at above where it
    stood before `run()`; None where the CPU's peak cannot be reset (not Linux)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        run()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    gc.collect()
    libc = ctypes.util.find_library("c")
    if libc is not None and hasattr(ctypes.CDLL(libc), "malloc_trim"):
        ctypes.CDLL(libc).malloc_trim(0)  # freed heap back to the system: the pass's pages count anew
    try:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    except OSError:
        return None
    base = status_kb("VmRSS")
    run()
    return (status_kb("VmHWM") - base) * 1024


def status_kb(field: str) -> int:
    """A kB field of /proc/self/status (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise AssertionError(f"/proc/self/status has no {field}")


def trainer_memory(config: Config, model: torch.nn.Module, batches: list[MicroBatch], *,
                   prompt_tokens: int, completion_tokens: int) -> Memory:
    """Measure the largest of `batches` (the check's own rows as the trainer batches them) and
    scale to the largest micro-batch the config allows: trainer.micro_batch_size rows of the
    longest prompt seen (`prompt_tokens`) and `completion_tokens` (the longest a completion or an
    episode may grow), at most trainer.micro_batch_tokens and the model's positions."""
    cfg = config.trainer
    device = next(model.parameters()).device
    mb = max(batches, key=positions_of)
    model.train()
    trainer_pass(config, model, mb)  # the gradients allocated (and the allocator warmed): not measured
    measured = peak_growth(device, partial(trainer_pass, config, model, mb))
    model.zero_grad(set_to_none=True)
    model.eval()
    longest = prompt_tokens + completion_tokens - 1  # a row's positions: its tokens but the last
    context = getattr(model.config, "max_position_embeddings", None)
    longest = min(longest, context) if context else longest
    rows = cfg.micro_batch_size
    if cfg.micro_batch_tokens:
        rows = max(min(rows, cfg.micro_batch_tokens // longest), 1)
    state, params = state_bytes(model)
    # a KL term's reference: the initial model in model.dtype, frozen (trainer.main.objective)
    reference = params * DTYPES[config.model.dtype].itemsize if kl_coef_of(cfg.loss) > 0 else 0
    return Memory(state=state, params=params, reference=reference, measured=measured, positions=positions_of(mb),
                  target=rows * longest, rows=rows, row_tokens=longest, device=device.type)


def positions_of(mb: MicroBatch) -> int:
    """Positions `mb` puts through the model: rows x longest, or its packed sequences'."""
    return int(np.prod(mb.input_ids.shape if mb.packed is None else mb.packed.ids.shape))


def size(n: float) -> str:
    """`n` bytes in the unit that gives 3 significant figures: 512 B, 12.3 MB, 2.17 GB."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n:.0f} B"


def memory_line(memory: Memory, *, ranks: int) -> str:
    """The check's "memory" line: the total per rank, then its parts, each said measured or arithmetic."""
    state = memory.state / ranks  # FSDP2 shards weights, gradients and moments over the ranks
    reference = memory.reference / ranks
    activations = memory.activations()
    total = state + reference + (activations or 0)
    per_param = memory.state / max(memory.params, 1)
    parts = [f"weights, gradients and AdamW {size(state)} ({per_param:.3g} B/param x {memory.params / 1e6:.3g}M"
             f"{f' / {ranks} ranks' if ranks > 1 else ''}, arithmetic)"]
    if reference:
        parts.append(f"KL reference {size(reference)} (arithmetic)")
    if activations is None:
        parts.append(f"activations not measured (no peak to reset on this {memory.device} host)")
    else:
        parts.append(f"activations {size(activations)} (measured {size(memory.measured or 0)} over one forward "
                     f"and backward of {memory.positions} positions on {memory.device}, scaled to {memory.target})")
    return (f"memory     trainer about {size(total)} per rank at micro-batches of {memory.rows} x "
            f"{memory.row_tokens} tokens: {' + '.join(parts)}")

