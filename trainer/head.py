"""The head's log-probs and entropy at N positions, its V-wide work in few passes.

With a 150k-token vocabulary the head's float32 (positions x V) work is, on a GPU, memory-bound:
each elementwise kernel over a chunk's logits reads and writes more bytes than the head's matmul
takes time for. Applying the head with autograd (a chunk's logits, `torch.logsumexp`, a gather,
the entropy, all under activation checkpointing) ran 16 such kernels a chunk, forward, recompute
and backward together: logsumexp alone is four (max, subtract, exp, sum) and its backward three
more, the gather's backward a V-wide zero fill and an add; and each chunk cast the head's weight
to the compute dtype twice (forward and recompute) and added its gradient into the float32 one.

`head_logprobs` does the same arithmetic by hand in one autograd function:

  forward   logits (the compute dtype) -> float32 -> / temperature -> log_softmax (torch's fused
            kernel) -> the target's log-prob; the entropy -sum(p log p) from the same log-softmax.
            Nothing V-wide is kept: only the rows, the weight and the targets.
  backward  each chunk's logits again -> softmax (fused) -> times -g, plus g at the target:
            d logp / d logits = onehot - softmax, scaled by the log-probs' gradient g (and
            1 / temperature) -> the compute dtype -> the rows' and the weight's gradients, the
            weight's summed over the chunks in its own dtype.

6 kernels a chunk with the entropy (log-softmax; exp, multiply, sum; softmax, multiply), 3
without, as many as `cross_entropy`'s; the weight cast once a call each way.
The same numbers as autograd through `head(...)` to float rounding
(tests/test_logprobs.py). It takes a plain `nn.Linear` head (FSDP2's gathered parameters and a
single process's autocast included: `compute_dtype`) and no top-k or top-p truncation; anything
else goes through trainer/logprobs.py's checkpointed chunks.
"""

from __future__ import annotations

import torch
from torch import Tensor

AUTOCAST_DTYPE = "autocast_dtype"  # the attribute trainer/parallel.py `autocast_forward` sets on its wrapper


def fusable(head: torch.nn.Module) -> bool:
    """Whether `head_logprobs` computes what `head(...)` would: a plain Linear with no hooks."""
    return type(head) is torch.nn.Linear and not head._forward_hooks and not head._forward_pre_hooks


def compute_dtype(head: torch.nn.Linear) -> torch.dtype:
    """The dtype the head's forward computes in: its autocast's (a single process's mixed precision)
    or its weight's (FSDP2 gathers it in the compute dtype; float32 throughout)."""
    return getattr(head.forward, AUTOCAST_DTYPE, None) or head.weight.dtype


def head_logprobs(head: torch.nn.Linear, rows: Tensor, targets: Tensor, *, temperature: float, entropy: bool,
                  chunk_tokens: int) -> tuple[Tensor, Tensor]:
    """log_softmax(head(rows) / temperature) at `targets` ((N, H) rows, (N,) targets: (N,) float32),
    and the entropy of that distribution ((N,) nats, no gradient; zeros without `entropy`),
    `chunk_tokens` rows at a time."""
    return _Head.apply(rows, head.weight, head.bias, targets, temperature, entropy, chunk_tokens,
                       compute_dtype(head))


def _logits(x: Tensor, w: Tensor, b: Tensor | None, temperature: float) -> Tensor:
    """One chunk's float32 logits over the temperature, (c, V): a fresh tensor, free to change in place."""
    logits = torch.nn.functional.linear(x, w, b)
    logits = logits.float() if logits.dtype != torch.float32 else logits
    return logits.div_(temperature) if temperature != 1.0 else logits


class _Head(torch.autograd.Function):
    @staticmethod
    def forward(ctx, rows: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, temperature: float,
                entropy: bool, chunk_tokens: int, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        w, b, x = weight.to(dtype), None if bias is None else bias.to(dtype), rows.to(dtype)
        logp = rows.new_empty(rows.shape[0], dtype=torch.float32)
        ent = torch.zeros_like(logp)
        for s in range(0, rows.shape[0], chunk_tokens):
            e = min(s + chunk_tokens, rows.shape[0])
            logsm = _logits(x[s:e], w, b, temperature).log_softmax(-1)  # (c, V)
            logp[s:e] = logsm.gather(1, targets[s:e, None]).squeeze(1)
            if entropy:  # -sum p log p
                ent[s:e] = logsm.exp().mul_(logsm).sum(-1).neg_()
            del logsm
        ctx.save_for_backward(rows, weight, bias, targets)
        ctx.temperature, ctx.chunk_tokens, ctx.dtype = temperature, chunk_tokens, dtype
        ctx.mark_non_differentiable(ent)
        return logp, ent

    @staticmethod
    def backward(ctx, grad_logp: Tensor, _grad_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        rows, weight, bias, targets = ctx.saved_tensors
        dtype, temperature, chunk = ctx.dtype, ctx.temperature, ctx.chunk_tokens
        want_rows, want_w, want_b = ctx.needs_input_grad[:3]
        w, b, x = weight.to(dtype), None if bias is None else bias.to(dtype), rows.to(dtype)
        g = grad_logp.float() / temperature  # (N,): d loss / d logits = g (onehot - softmax) / temperature
        grad_rows = torch.empty_like(rows) if want_rows else None
        grad_w = grad_b = None
        for s in range(0, rows.shape[0], chunk):
            e = min(s + chunk, rows.shape[0])
            d = _logits(x[s:e], w, b, temperature).softmax(-1)  # (c, V) float32
            d.mul_(-g[s:e, None]).scatter_add_(1, targets[s:e, None], g[s:e, None])
            d = d.to(dtype)
            if want_rows:
                grad_rows[s:e] = d @ w
            if want_w:
                part = d.t() @ x[s:e]  # (V, H)
                grad_w = part.to(weight.dtype) if grad_w is None else grad_w.add_(part)
            if want_b:
                part = d.sum(0, dtype=torch.float32)
                grad_b = part if grad_b is None else grad_b.add_(part)
            del d
        if grad_b is not None:
            grad_b = grad_b.to(bias.dtype)
        return grad_rows, grad_w, grad_b, None, None, None, None, None
