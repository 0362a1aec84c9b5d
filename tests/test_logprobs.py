"""Chunked log-probs and entropy: the same numbers and gradients as the full logits, without them."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoModelForCausalLM

from trainer.grpo import token_entropy, token_logprobs
from trainer.logprobs import sequence_logprobs


@pytest.fixture
def batch(tiny_model):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (3, 41))
    mask = torch.ones_like(ids)
    mask[1, 30:] = 0  # right padding, as collate makes it
    return model, ids[:, :-1], mask[:, :-1], ids[:, 1:]


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
    for p, g in zip(model.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
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
    for p, g in zip(model.parameters(), want_grads, strict=True):
        torch.testing.assert_close(p.grad, g, rtol=1e-4, atol=1e-6)
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
