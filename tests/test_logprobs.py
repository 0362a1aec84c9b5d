"""Chunked log-probs and entropy: the same numbers and gradients as the full logits, without them."""

import copy
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from trainer.grpo import token_entropy, token_logprobs
from trainer.head import compute_dtype, fusable, head_logprobs
from trainer.logprobs import _at_positions, sequence_logprobs
from trainer.parallel import autocast_forward


@pytest.fixture
def batch(tiny_model):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (3, 41))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding, as collate makes it
    return model, ids[:, :-1], mask[:, :-1], ids[:, 1:]


def exact_grads(model: torch.nn.Module, loss_of) -> list[torch.Tensor]:
    """The gradients of `loss_of(model)` in float64 (a copy of `model`): what float32 rounds from."""
    double = copy.deepcopy(model).double()
    double.zero_grad(set_to_none=True)
    loss_of(double).backward()
    return [p.grad for p in double.parameters()]


def assert_as_close_to_exact(model: torch.nn.Module, full: list[torch.Tensor], exact: list[torch.Tensor]) -> None:
    """Each of `model`'s float32 gradients is as close to the exact (float64) one as the full logits'
    float32 gradient `full` is, within twice its error: the two paths sum the same products in other
    orders (chunk by chunk, or in one matmul), and which rounds closer varies with BLAS's blocking."""
    for (name, p), f, e in zip(model.named_parameters(), full, exact, strict=True):
        err, full_err = (p.grad.double() - e).abs().max().item(), (f.double() - e).abs().max().item()
        assert err <= 2 * full_err + 1e-7, f"{name}: {err:.2e} off the exact gradient, the full logits' {full_err:.2e}"


@pytest.mark.parametrize(("chunk_tokens", "temperature"), [(1, 0.7), (7, 0.7), (4096, 0.7), (7, 1.0)])
def test_chunked_logprobs_and_entropy_equal_the_full_logits(batch, chunk_tokens, temperature):
    model, inputs, attn, targets = batch
    logits = model(input_ids=inputs, attention_mask=attn, use_cache=False).logits
    want = token_logprobs(logits, targets, temperature)
    want_entropy = token_entropy(logits, temperature)
    (want * attn).sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    got, entropy = sequence_logprobs(model, inputs, attn, targets, temperature=temperature, entropy=True,
                                     chunk_tokens=chunk_tokens)
    (got * attn).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    exact = exact_grads(model, lambda m: (token_logprobs(
        m(input_ids=inputs, attention_mask=attn, use_cache=False).logits, targets, temperature) * attn).sum())
    assert_as_close_to_exact(model, want_grads, exact)
    assert sequence_logprobs(model, inputs, attn, targets, temperature=0.7)[1] is None


class LargestVocabTensor(TorchDispatchMode):
    """Records the most rows (batch x positions) of (B, T, V) float tensors any op makes, forward and backward."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() == 3 and t.shape[-1] == self.vocab:
                self.rows = max(self.rows, t.numel() // self.vocab)
        return out


def test_no_full_vocabulary_logits_for_the_batch(batch):
    """With 3 x 40 positions and 16-token chunks, no vocabulary-wide tensor has more than 16 rows
    (the model's own head sees one position per sequence), in the forward or the backward pass."""
    model, inputs, attn, targets = batch
    watch = LargestVocabTensor(model.config.vocab_size)
    with watch:
        logp, _ = sequence_logprobs(model, inputs, attn, targets, temperature=1.0, entropy=True, chunk_tokens=16)
        logp.sum().backward()
    assert 0 < watch.rows <= 16, f"a tensor of {watch.rows} vocabulary-wide rows (the batch has {inputs.numel()})"


class HeadRows(TorchDispatchMode):
    """Counts the rows of every vocabulary-wide product (the head, forward and backward)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.rows = vocab, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if str(func.overloadpacket) in ("aten.mm", "aten.addmm", "aten.bmm", "aten.matmul") \
                and isinstance(out, torch.Tensor) and out.shape[-1] == self.vocab:
            self.rows += out.numel() // self.vocab
        return out


@pytest.mark.parametrize("chunk_tokens", [3, 4096])
def test_logprobs_at_trained_positions_only(batch, chunk_tokens):
    """With `positions` (a loss mask) the log-probs, entropy and gradients there are those of the
    full logits, 0 elsewhere, and the head computes only those rows (plus the model's own one
    position per sequence), not the batch's."""
    model, inputs, attn, targets = batch
    trained = torch.zeros_like(attn, dtype=torch.float32)
    trained[0, 25:] = 1.0
    trained[1, 20:29] = 1.0  # row 1 is padded from 29 on
    trained[2, [3, 17, 39]] = 1.0
    logits = model(input_ids=inputs, attention_mask=attn, use_cache=False).logits
    want = token_logprobs(logits, targets, 0.7) * trained
    want_entropy = token_entropy(logits, 0.7) * trained
    want.sum().backward()
    want_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()

    watch = HeadRows(model.config.vocab_size)
    with watch:
        got, entropy = sequence_logprobs(model, inputs, attn, targets, temperature=0.7, entropy=True,
                                         chunk_tokens=chunk_tokens, positions=trained.reshape(-1).nonzero().squeeze(1))
        got.sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    exact = exact_grads(model, lambda m: (token_logprobs(
        m(input_ids=inputs, attention_mask=attn, use_cache=False).logits, targets, 0.7) * trained.double()).sum())
    assert_as_close_to_exact(model, want_grads, exact)
    n, batch_rows = int(trained.sum()), inputs.shape[0]
    # forward, its recomputation in the backward pass, the gradient of the hidden states: 3 x n rows.
    assert watch.rows <= 3 * n + batch_rows, f"the head made {watch.rows} rows for {n} trained positions"


def test_no_trained_position_still_reaches_every_parameter(batch):
    """A micro-batch with nothing to train (a rank's padding micro-batch under FSDP) gives 0
    log-probs, and its backward pass still reaches every parameter (FSDP's collectives pair up)."""
    model, inputs, attn, targets = batch
    logp, _ = sequence_logprobs(model, inputs, attn, targets, temperature=1.0,
                                positions=torch.zeros(0, dtype=torch.long))
    assert logp.abs().sum() == 0
    logp.sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@pytest.mark.parametrize(("bias", "temperature", "chunk_tokens"), [(False, 1.0, 8), (True, 0.7, 5), (True, 1.0, 64)])
def test_the_fused_head_equals_autograd_through_the_head(bias, temperature, chunk_tokens):
    """trainer/head.py's hand-written forward and backward give the log-probs, entropy and the
    gradients of the rows, the weight and the bias that autograd through `head(rows)` gives."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 257, bias=bias)
    rows = torch.randn(37, 16, requires_grad=True)
    targets, weights = torch.randint(0, 257, (37,)), torch.randn(37)

    logits = head(rows) / temperature
    want = logits.log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    (want * weights).sum().backward()
    want_grads = [t.grad.clone() for t in (rows, *head.parameters())]
    rows.grad = None
    head.zero_grad(set_to_none=True)

    assert fusable(head)
    got, entropy = head_logprobs(head, rows, targets, temperature=temperature, entropy=True,
                                 chunk_tokens=chunk_tokens)
    (got * weights).sum().backward()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits[None].detach(), 1.0)[0], rtol=0, atol=1e-5)
    for t, g in zip((rows, *head.parameters()), want_grads, strict=True):
        torch.testing.assert_close(t.grad, g, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA GPU; torch sees none here")]),
])
def test_the_fused_head_computes_in_the_heads_autocast_dtype(device):
    """Under a single process's mixed precision (the head's forward autocast to bf16) the fused head
    multiplies in bf16 as `head(rows)` does: the same log-probs, and the weight's gradient as close
    to float32's as autograd's through the autocast head. On CUDA: its kernels in bf16."""
    torch.manual_seed(0)
    exact = torch.nn.Linear(32, 301, bias=False).to(device)
    rows = torch.randn(40, 32, device=device, requires_grad=True)
    targets = torch.randint(0, 301, (40,), device=device)
    exact(rows).log_softmax(-1).gather(1, targets[:, None]).sum().backward()
    heads = [copy.deepcopy(exact) for _ in range(2)]
    for head in heads:
        head.zero_grad(set_to_none=True)
        autocast_forward(head, device_type=device, dtype=torch.bfloat16)
    assert compute_dtype(heads[0]) == torch.bfloat16 and compute_dtype(exact) == torch.float32
    fused, _ = head_logprobs(heads[0], rows.detach(), targets, temperature=1.0, entropy=False, chunk_tokens=8)
    fused.sum().backward()
    autograd = heads[1](rows.detach()).float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    autograd.sum().backward()
    assert fused.device.type == device and heads[0].weight.grad.dtype == torch.float32
    # on CUDA the chunks' bf16 matmuls may take other kernels than the whole's, rounding otherwise
    torch.testing.assert_close(fused, autograd, rtol=0, atol=1e-5 if device == "cpu" else 0.03)
    error = [float((h.weight.grad - exact.weight.grad).norm() / exact.weight.grad.norm()) for h in heads]
    assert 1e-4 < error[0] < 2 * error[1] < 0.02, f"relative error of the weight's gradient: fused, autograd {error}"


# operators that make no elementwise pass over a tensor: views, casts to the same dtype, allocations,
# reads or writes at one index a row (a gather, a scatter, cross-entropy's pick), and the head's matmuls
NO_PASS = {"aten::gather", "aten::scatter_add_", "aten::scatter_", "aten::nll_loss_forward", "aten::nll_loss",
           "aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear",
           "aten::view", "aten::_unsafe_view", "aten::as_strided", "aten::to", "aten::resolve_conj", "aten::real",
           "aten::empty", "aten::empty_like", "aten::empty_strided", "aten::t", "aten::transpose", "aten::detach",
           "aten::alias", "aten::slice", "aten::select", "aten::expand", "aten::unsqueeze", "aten::squeeze",
           "aten::reshape", "aten::lift_fresh"}


def vocab_wide_kernels(step, rows: int, vocab: int) -> list[str]:
    """The elementwise kernels one `step()` runs over `rows` positions' vocabulary-wide tensors:
    the aten operators the profiler saw take one (of any shape (..., vocab) with `rows` positions)
    whose own operators take none, less those in NO_PASS."""
    from torch.profiler import ProfilerActivity, profile

    def wide(e) -> bool:
        return e.name.startswith("aten::") and any(
            isinstance(s, list) and s and s[-1] == vocab and math.prod(s[:-1]) == rows for s in e.input_shapes)

    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        step()
    return sorted(e.name for e in prof.events()
                  if wide(e) and not any(wide(c) for c in e.cpu_children) and e.name not in NO_PASS)


def test_the_heads_vocabulary_wide_passes_are_few():
    """On a GPU each elementwise pass over a chunk's float32 logits costs about a tenth of the head's
    matmul. The trainer's head at a step's trained positions (log-probs and the entropy, forward and
    backward) runs no more vocabulary-wide kernels than a plain cross-entropy's three (log-softmax,
    the gradient's fill, the log-softmax's backward) and the entropy's three (exp, multiply, sum);
    autograd through `head(...)` with logsumexp under checkpointing ran sixteen."""
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 1031, bias=False)
    rows, targets = torch.randn(1, 24, 16, requires_grad=True), torch.randint(0, 1031, (1, 24))

    def trainer():
        logp, _ = _at_positions(head, rows, targets, torch.arange(24), temperature=1.0, top_k=0, top_p=1.0,
                                entropy=True, chunk_tokens=24)
        logp.sum().backward()

    def cross_entropy():
        torch.nn.functional.cross_entropy(head(rows[0]), targets[0], reduction="sum").backward()

    trained, plain = vocab_wide_kernels(trainer, 24, 1031), vocab_wide_kernels(cross_entropy, 24, 1031)
    assert plain == ["aten::_log_softmax", "aten::_log_softmax_backward_data", "aten::zero_"], plain
    assert len(trained) <= len(plain) + 3, f"the head ran {trained} against cross-entropy's {plain}"
