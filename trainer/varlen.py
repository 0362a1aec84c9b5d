"""Packed micro-batches' attention as variable-length sequences: FlashAttention's varlen kernel.

A packed micro-batch (trainer/logprobs.py `Packed`) holds documents end to end: each a prompt,
then one completion's inputs or, with shared prompts, several completions' one after another,
each attending to the prompt and to itself only. SDPA takes that as a dense (L, L) mask, which
keeps it off its flash kernel and computes every pair of the row; here the same rule is a list of
variable-length causal sequences, the layout the flash kernel takes (`cu_seqlens`, as prime-rl,
verl and slime pack), so only each sequence's own pairs are computed:

- a prompt and the completion after it: one sequence (the prompt's positions see the prompt's,
  the completion's see the prompt and itself: plain causal attention);
- each further completion sharing that prompt: its own queries over the prompt's keys and values
  followed by its own (`keys`: the flat positions gathered for it), causal with the queries
  aligned to the end of the keys (the flash kernel's rule for fewer queries than keys: query i
  sees keys up to i + keys - queries);
- a run of padding: a sequence of its own (its outputs are read by nothing).

The queries are the packed positions in order, so the output needs no scattering back. On CUDA
in bf16 or fp16 the sequences go to `torch.ops.aten._flash_attention_forward` and its backward
(aten's own FlashAttention-2 kernels, which SDPA's flash path and `torch.nn.attention.varlen`
call: no extra package); anywhere else (the CPU, float32) each
sequence goes through SDPA with the same end-aligned causal mask (`reference`), which the tests
hold equal to the dense mask's numbers. `flash_failure` checks the kernel against that reference
on the device once, forward and backward, before a trainer uses it (trainer/devices.py).
`varlen_kernel` then checks cuDNN's fused attention over the same cu_seqlens
(`aten::_cudnn_attention_forward`) alike, times both on micro-batches of new lengths, and has the
trainer compute with cuDNN's where it is right and under 0.9 of flash's time: on the H200 the bare
loop's SDPA on cuDNN took 18.7 ms where flash's varlen took 25.4 ms for fewer pairs (docs/gpu.md).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

# transformers' name for this attention (AttentionInterface), set on the trainer's models
VARLEN = "rollouts_varlen"
# the keyword the model's forward carries the micro-batch's layout to each attention call under
LAYOUT_KWARG = "rollouts_varlen_layout"
FLASH_DTYPES = (torch.bfloat16, torch.float16)


@dataclass(frozen=True, slots=True)
class Varlen:
    """A packed micro-batch (S rows of L positions) as N causal sequences over its S * L flat
    positions: sequence i's queries are flat positions cu_q[i]:cu_q[i + 1] (every position once, in
    order), its keys and values the flat positions keys[cu_k[i]:cu_k[i + 1]] (None: the queries'
    own, cu_k = cu_q), its queries aligned to the end of its keys."""

    cu_q: Tensor  # (N + 1,) int32
    cu_k: Tensor  # (N + 1,) int32
    keys: Tensor | None  # (K,) int64 flat positions, or None where every sequence's keys are its queries
    max_q: int
    max_k: int


def layout(docs: np.ndarray, segments: np.ndarray) -> Varlen:
    """The varlen layout of packed rows whose positions are in `docs` (each position's document,
    -1 on padding) and `segments` (0 on a document's prompt, j + 1 on its completion j, -1 on
    padding), both (S, L) as trainer/batch.py `pack` makes them."""
    docs, segments = np.asarray(docs), np.asarray(segments)
    assert docs.shape == segments.shape and docs.ndim == 2, f"docs {docs.shape} vs segments {segments.shape}"
    width = segments.shape[1]
    queries: list[tuple[int, int]] = []  # each sequence's flat query range
    keys: list[tuple[tuple[int, int], ...]] = []  # each sequence's key ranges, in order
    shared = False
    for s in range(segments.shape[0]):
        seg, doc, base = segments[s], docs[s], s * width
        cut = np.flatnonzero((np.diff(doc) != 0) | (np.diff(seg) != 0)) + 1
        starts, ends = np.concatenate([[0], cut]), np.concatenate([cut, [width]])
        prompt: tuple[int, int] | None = None  # the current document's prompt (flat)
        joinable = False  # the last sequence is a prompt alone: its first completion joins it
        for a, b in zip(starts.tolist(), ends.tolist(), strict=True):
            run = (base + a, base + b)
            if seg[a] == 0:  # a prompt: opens its document
                prompt, joinable = run, True
                queries.append(run)
                keys.append((run,))
            elif seg[a] > 0 and prompt is not None and joinable:  # its first completion: plain causal
                queries[-1] = (queries[-1][0], run[1])
                keys[-1] = (queries[-1],)
                joinable = False
            elif seg[a] > 0:  # a further completion sharing the prompt
                assert prompt is not None, f"row {s}: completion positions {a}:{b} follow no prompt"
                queries.append(run)
                keys.append((prompt, run))
                shared = True
            else:  # padding
                prompt, joinable = None, False
                queries.append(run)
                keys.append((run,))
    q_lens = [b - a for a, b in queries]
    k_lens = [sum(b - a for a, b in ranges) for ranges in keys]
    cu_q = torch.tensor([0, *np.cumsum(q_lens).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *np.cumsum(k_lens).tolist()], dtype=torch.int32)
    index = None
    if shared:
        index = torch.from_numpy(np.concatenate([np.arange(a, b) for ranges in keys for a, b in ranges]))
    return Varlen(cu_q=cu_q, cu_k=cu_k, keys=index, max_q=max(q_lens, default=0), max_k=max(k_lens, default=0))


def end_aligned_causal(queries: int, keys: int, device: torch.device | None = None) -> Tensor:
    """(queries, keys) bool, True to attend: query i sees keys up to i + keys - queries (the flash
    kernel's causal rule where a sequence has fewer queries than keys)."""
    return torch.ones(queries, keys, dtype=torch.bool, device=device).tril(keys - queries)


def reference(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, scale: float) -> Tensor:
    """The varlen attention of `q` (T, H, D) over `k`, `v` (K, Hkv, D) sequence by sequence through
    SDPA with `end_aligned_causal` masks: (T, H, D). Any device and dtype, with autograd."""
    outs = []
    for (qa, qb), (ka, kb) in zip(itertools.pairwise(cu_q.tolist()), itertools.pairwise(cu_k.tolist()), strict=True):
        qi, ki, vi = q[qa:qb].transpose(0, 1), k[ka:kb].transpose(0, 1), v[ka:kb].transpose(0, 1)
        mask = end_aligned_causal(qb - qa, kb - ka, device=q.device)
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale,
                                                   enable_gqa=ki.shape[0] != qi.shape[0]).transpose(0, 1))
    return torch.cat(outs)


class _Flash(torch.autograd.Function):
    """FlashAttention's varlen forward and backward (aten's), causal, no dropout: grouped-query
    keys and values as they are (the kernel takes H a multiple of Hkv)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int,
                scale: float) -> Tensor:
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, True, False, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k, seed, offset)
        ctx.sizes = (max_q, max_k, scale)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        q, k, v, out, lse, cu_q, cu_k, seed, offset = ctx.saved_tensors
        max_q, max_k, scale = ctx.sizes
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            grad.contiguous(), q, k, v, out, lse, cu_q, cu_k, max_q, max_k, 0.0, True, seed, offset, scale=scale)
        return dq, dk, dv, None, None, None, None, None


def _flash(q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, scale: float) -> Tensor:
    return _Flash.apply(q, k, v, varlen.cu_q, varlen.cu_k, varlen.max_q, varlen.max_k, scale)


def _cudnn(q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, scale: float) -> Tensor:
    """cuDNN's fused attention over the same cu_seqlens (`aten::_cudnn_attention_forward`, the op
    torch's nested tensors call for SDPA on cuDNN), causal, no dropout, the log-sum-exp kept for the
    backward, which autograd takes from torch's own formula for the op."""
    return torch.ops.aten._cudnn_attention_forward(q, k, v, None, varlen.cu_q, varlen.cu_k, varlen.max_q, varlen.max_k,
                                                   True, 0.0, True, False, scale=scale)[0]


# the CUDA kernels a trainer may compute varlen attention with: `varlen_kernel` checks each against
# `reference` and takes the fastest that matches (flash unless cuDNN's is right and faster)
KERNELS = {"flash": _flash, "cudnn": _cudnn}
CUDNN_MAX_HEAD = 128  # cuDNN's kernel is taken up to this head size (checked and timed at 64 and 128); flash above


def flash_takes(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """Whether the flash kernel computes these queries, keys and values: CUDA, all in bf16 or all in
    fp16, a head size it has (a multiple of 8, at most 256), query heads a multiple of key heads."""
    d = q.shape[-1]
    return (q.is_cuda and q.dtype in FLASH_DTYPES and k.dtype == v.dtype == q.dtype and d % 8 == 0 and d <= 256
            and q.shape[1] % k.shape[1] == 0)


def attend(q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, scale: float, kernel: str | None = None) -> Tensor:
    """Queries (T, H, D) over keys and values (T, Hkv, D), all of a micro-batch's flat positions,
    under `varlen`: (T, H, D). On CUDA in bf16 or fp16 with `kernel` of `KERNELS` (None: the one
    `varlen_kernel` chose for this device), else `reference`."""
    if varlen.keys is not None:
        k, v = k[varlen.keys], v[varlen.keys]
    if flash_takes(q, k, v):
        kernel = kernel or varlen_kernel(q.device, q.dtype).kernel
        if kernel == "cudnn" and q.shape[-1] > CUDNN_MAX_HEAD:
            kernel = "flash"
        return KERNELS[kernel](q.contiguous(), k.contiguous(), v.contiguous(), varlen, scale)
    return reference(q, k, v, varlen.cu_q, varlen.cu_k, scale)


@torch.compiler.disable  # eager inside a compiled block (trainer.compile): one kernel already, and the
# layout's lengths (Python ints, a loop of sequences off CUDA) would recompile the block for each batch
def attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
              scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[Tensor, None]:
    """transformers' attention function (`VARLEN`): query (B, H, L, D), key and value (B, Hkv, L, D)
    -> (B, L, H, D). With the micro-batch's layout under `LAYOUT_KWARG` (trainer/logprobs.py
    `final_hidden` passes it) the varlen sequences; without one (right-padded rows, a model run
    outside the trainer's passes) transformers' SDPA with the mask it made."""
    varlen = kwargs.pop(LAYOUT_KWARG, None)
    if varlen is None:
        assert attention_mask is None or attention_mask.numel() > 0, (
            "a packed micro-batch's forward reached attention without its varlen layout: this model's forward "
            "does not pass keyword arguments on to its attention")
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout,
                                      **kwargs)
    if dropout > 0:
        raise ValueError(f"varlen attention runs without dropout; this model's attention dropout is {dropout}")
    if torch.is_autocast_enabled(query.device.type):  # as autocast casts SDPA's inputs: a float32
        # hidden state's rotary cos and sin make the rotated queries and keys float32 under autocast
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    b, h, length, d = query.shape
    scale = scaling if scaling is not None else d ** -0.5
    q = query.transpose(1, 2).reshape(b * length, h, d)
    k = key.transpose(1, 2).reshape(b * length, key.shape[1], d)
    v = value.transpose(1, 2).reshape(b * length, value.shape[1], d)
    return attend(q, k, v, varlen, scale).view(b, length, h, d), None


# the (0, 1, 0, 0) mask a packed forward passes: 4-D, so transformers builds no mask of its own
# (and a model that dropped the layout fails in `attention` instead of attending to everything)
def no_mask(device: torch.device) -> Tensor:
    return torch.ones(0, 1, 0, 0, dtype=torch.bool, device=device)


def register() -> None:
    """`VARLEN` in transformers' attention functions, with SDPA's mask for the forwards that carry
    no layout."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(VARLEN, attention)
    AttentionMaskInterface.register(VARLEN, sdpa_mask)


register()


@functools.cache
def flash_failure(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the flash varlen kernel is not to be used on CUDA `device` in `dtype`, or None where its
    output and its gradients match `reference`'s on a small packed micro-batch with a shared prompt,
    grouped-query heads and padding: the check a trainer makes once before computing with it."""
    if device.type != "cuda":
        return f"the flash kernel runs on CUDA; this is {device.type}"
    if dtype not in FLASH_DTYPES:
        return f"the flash kernel computes in bf16 or fp16; this trainer computes in {dtype}"
    return kernel_failure(device, dtype)


def kernel_failure(device: torch.device, dtype: torch.dtype, kernel: str = "flash") -> str | None:
    """`flash_failure`'s comparison: `attend` with `kernel` on `device` in `dtype` against
    `reference` in float32."""
    # one row: a prompt of 37 with completions of 29, 41 and 3 positions, a document of 70, padding
    docs = np.array([[0] * 110 + [1] * 70 + [-1] * 12])
    segments = np.array([[0] * 37 + [1] * 29 + [2] * 41 + [3] * 3 + [0] * 30 + [1] * 40 + [-1] * 12])
    made = layout(docs, segments)
    varlen = Varlen(cu_q=made.cu_q.to(device), cu_k=made.cu_k.to(device), keys=made.keys.to(device),
                    max_q=made.max_q, max_k=made.max_k)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(192, n, 64, generator=g).to(device, dtype).requires_grad_() for n in (8, 2, 2))
    grad = torch.randn(192, 8, 64, generator=g).to(device, dtype)
    try:
        got = attend(q, k, v, varlen, 0.125, kernel=kernel)
        got_grads = torch.autograd.grad(got, (q, k, v), grad)
    except Exception as e:  # noqa: BLE001 - any failure of the kernel is the answer
        return f"the {kernel} kernel failed: {type(e).__name__}: {str(e)[:300]}"
    ref = [x.detach().float().requires_grad_() for x in (q, k, v)]
    want = attend(*ref, varlen, 0.125)
    want_grads = torch.autograd.grad(want, ref, grad.float())
    for name, a, b in [("output", got, want), *zip(("dq", "dk", "dv"), got_grads, want_grads, strict=True)]:
        err = (a.float() - b).abs().max().item()
        if not err <= 0.05 * max(b.abs().max().item(), 1.0):
            return f"the {kernel} kernel's {name} differs from the reference by {err:.3g}"
    return None


@dataclass(frozen=True)
class KernelChoice:
    """The kernel of `KERNELS` a trainer's varlen attention computes with on one device, and why."""

    kernel: str
    why: str

    def line(self) -> str:
        return f"{self.kernel} ({self.why})"


# the layouts `varlen_kernel` times the kernels on: a prompt of 64 shared by two completions, each
# micro-batch of another length (cuDNN builds an execution plan for each new shape, as a trainer's
# micro-batches are), Qwen3's heads (16 query, 8 key, 128 a head); the first untimed
TIMED_TOKENS = (2048, 4096, 6144, 8192, 12288, 16384)


_CHOSEN: dict[tuple[torch.device, torch.dtype], KernelChoice] = {}  # this process's, once a device and dtype


def varlen_kernel(device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The kernel varlen attention computes with on `device` in `dtype`: `choose_kernel`'s, made
    once (`agreed_kernel` makes it alike on every rank)."""
    key = _key(device, dtype)
    if key not in _CHOSEN:
        _CHOSEN[key] = choose_kernel(device, dtype)
    return _CHOSEN[key]


def _key(device: torch.device, dtype: torch.dtype) -> tuple[torch.device, torch.dtype]:
    """`device` with its index ("cuda" and a tensor's "cuda:0" are one choice), and `dtype`."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return device, dtype


def agreed_kernel(device: torch.device, dtype: torch.dtype, any_rank: Callable[[bool], bool]) -> KernelChoice:
    """`varlen_kernel` alike on every rank (each times its own GPU, and a close call may differ):
    cuDNN's only where every rank chose it. Every rank calls it with trainer/parallel.py's
    `any_rank` (a collective under torchrun)."""
    choice = varlen_kernel(device, dtype)
    if any_rank(choice.kernel != "cudnn") and choice.kernel == "cudnn":
        why = f"another rank's is flash; this rank's {choice.why}"
        choice = _CHOSEN[_key(device, dtype)] = KernelChoice("flash", why)
    return choice


def choose_kernel(device: torch.device, dtype: torch.dtype) -> KernelChoice:
    """The kernel for `device` in `dtype`: where both match the reference (`kernel_failure`),
    cuDNN's where its forward and backward over `TIMED_TOKENS`' micro-batches took under 0.9 of
    flash's, else flash (the kernel `flash_failure` vouched for). Off CUDA, flash (never called:
    `reference` computes)."""
    if device.type != "cuda" or dtype not in FLASH_DTYPES:
        return KernelChoice("flash", f"no choice on {device.type} in {dtype}")
    failure = kernel_failure(device, dtype, "cudnn")
    if failure:
        return KernelChoice("flash", failure)
    try:
        ms = {name: kernel_ms(name, device, dtype) for name in ("flash", "cudnn")}
    except Exception as e:  # noqa: BLE001 - a kernel that fails on a longer micro-batch is not taken
        return KernelChoice("flash", f"a kernel failed on a longer micro-batch: {type(e).__name__}: {str(e)[:300]}")
    timed = (f"cudnn {ms['cudnn']:.1f} ms, flash {ms['flash']:.1f} ms over micro-batches of "
             f"{TIMED_TOKENS[1]:,}-{TIMED_TOKENS[-1]:,} tokens, forward and backward")
    return KernelChoice("cudnn" if ms["cudnn"] < 0.9 * ms["flash"] else "flash", timed)


def kernel_ms(kernel: str, device: torch.device, dtype: torch.dtype) -> float:
    """Milliseconds `kernel` took over the forward and backward of `TIMED_TOKENS`' micro-batches
    after the first (untimed), each one group of a 64-token prompt and two completions."""
    g = torch.Generator(device="cpu").manual_seed(0)
    total = 0.0
    for i, tokens in enumerate(TIMED_TOKENS):
        half = (tokens - 64) // 2
        made = layout(np.array([[0] * (64 + 2 * half)]), np.array([[0] * 64 + [1] * half + [2] * half]))
        varlen = Varlen(cu_q=made.cu_q.to(device), cu_k=made.cu_k.to(device), keys=made.keys.to(device),
                        max_q=made.max_q, max_k=made.max_k)
        n = 64 + 2 * half
        q, k, v = (torch.randn(n, heads, 128, generator=g).to(device, dtype).requires_grad_() for heads in (16, 8, 8))
        grad = torch.randn(n, 16, 128, generator=g).to(device, dtype)
        sync = torch.cuda.synchronize if device.type == "cuda" else lambda _device: None
        sync(device)
        start = time.perf_counter()
        torch.autograd.grad(attend(q, k, v, varlen, 128 ** -0.5, kernel=kernel), (q, k, v), grad)
        sync(device)
        total += (time.perf_counter() - start) * 1e3 if i else 0.0
    return total
