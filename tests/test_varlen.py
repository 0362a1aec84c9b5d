"""Varlen attention (trainer.attention = "varlen", trainer/varlen.py): a packed micro-batch's
documents as variable-length causal sequences, a shared prompt's further completions as sequences
of their own over the prompt's keys, give the dense document mask's log-probs, gradients and
update. On the CPU each sequence goes through SDPA (the kernel is CUDA's); the layout, the keys
gathered and the attention function around the kernel are the ones CUDA runs. The flash kernel
itself, and cuDNN's: `test_the_varlen_kernels_match_the_reference_on_cuda` (marked gpu)."""

import itertools
import random
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

import trainer.varlen as varlen
from common.config import ConfigError, Decoupled, GrpoLoss
from tests.harness.groups import make_group
from trainer.batch import collate_packed, group_rows
from trainer.devices import attention_implementation, resolve_attention
from trainer.logprobs import packed_attention, sequence_logprobs
from trainer.step import GrpoOptions, step_batches, train_step

# (prompt length, completion lengths): shared prompts, completions of 1 token (no input position) too
SHAPES = [(6, [1, 4, 9, 3]), (3, [5, 1, 2, 7]), (9, [2, 2, 6, 1]), (6, [3, 8, 1, 5])]


def groups_of(model, shapes=SHAPES, seed: int = 0):
    rng = random.Random(seed)
    return [make_group(model, f"g{g}", version=0, rng=rng, shape=shape, partial_mask=True)
            for g, shape in enumerate(shapes)]


def implied_mask(layout: varlen.Varlen, positions: int) -> torch.Tensor:
    """(positions, positions) bool over the flat positions: what each query attends to under `layout`."""
    keys = layout.keys if layout.keys is not None else torch.arange(positions)
    mask = torch.zeros(positions, positions, dtype=torch.bool)
    for (qa, qb), (ka, kb) in zip(itertools.pairwise(layout.cu_q.tolist()), itertools.pairwise(layout.cu_k.tolist()),
                                  strict=True):
        sees = varlen.end_aligned_causal(qb - qa, kb - ka)
        for i in range(qb - qa):
            mask[qa + i, keys[ka:kb][sees[i]]] = True
    return mask


@pytest.mark.parametrize("several_rows", [False, True])
def test_the_varlen_layout_attends_as_the_packed_mask(tiny_model, several_rows):
    """Every query of a document sees exactly the positions the dense document mask lets it see:
    shared prompts, completions of one token, documents in several right-padded rows."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    docs = [group_rows(g) for g in groups_of(model)]
    mb = collate_packed(docs, hidden_size=1 if several_rows else 0)  # a hidden size of 1: pairs cost most
    packed = mb.packed
    assert (packed.ids.shape[0] > 1) == several_rows
    layout = packed.attention("varlen")
    s, length = packed.ids.shape
    assert layout.cu_q[-1] == s * length  # every position once, in order
    assert layout.keys is not None  # shared prompts: their keys gathered for the further completions
    dense = torch.block_diag(*packed.attention("bool")[:, 0])  # (S L, S L): rows never see each other
    got = implied_mask(layout, s * length)
    real = (packed.segments >= 0).reshape(-1)
    assert torch.equal(got[real], dense[real])
    # one completion a document: plain causal sequences, no keys gathered
    single = collate_packed([[row] for rows_ in docs for row in rows_[:1]]).packed.attention("varlen")
    assert single.keys is None and torch.equal(single.cu_q, single.cu_k)


def test_a_wrong_alignment_is_not_the_packed_mask(tiny_model, monkeypatch):
    """The check above fails where further completions' queries align to the start of their keys
    (a causal mask's other convention): they would see the prompt's first positions only."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    packed = collate_packed([group_rows(g) for g in groups_of(model)]).packed
    layout = packed.attention("varlen")
    real, dense = (packed.segments >= 0).reshape(-1), packed.attention("bool")[0, 0]
    assert torch.equal(implied_mask(layout, dense.shape[0])[real], dense[real])
    monkeypatch.setattr(varlen, "end_aligned_causal",
                        lambda queries, keys, device=None: torch.ones(queries, keys, dtype=torch.bool).tril())
    assert not torch.equal(implied_mask(layout, dense.shape[0])[real], dense[real])


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory, tiny_model) -> Path:
    """A tiny Qwen3 (query and key norms) with 4 query heads over 2 key heads: keys and values whose
    heads and positions a wrong reshape would mix (the tiny Llama has one key head)."""
    from transformers import AutoTokenizer, Qwen3Config

    path = tmp_path_factory.mktemp("qwen3") / "model"
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=AutoTokenizer.from_pretrained(tiny_model).vocab_size + 8, hidden_size=64,
                         intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16)
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture(params=["llama", "qwen3"])
def family(request, tiny_model, qwen3) -> Path:
    return {"llama": tiny_model, "qwen3": qwen3}[request.param]


def opened(tiny_model, attention: str) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    impl = attention_implementation(torch.device("cpu"), attention)
    if impl is not None:
        model.set_attn_implementation(impl)
    return model


@pytest.mark.parametrize("sampler", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_varlen_logprobs_and_gradients_equal_the_dense_masks(family, sampler):
    dense, model = opened(family, "sdpa"), opened(family, "varlen")
    assert packed_attention(dense) == "sdpa" and packed_attention(model) == varlen.VARLEN
    mb = collate_packed([group_rows(g) for g in groups_of(dense)])
    weights = torch.randn(mb.mask.shape) * mb.mask

    def run(m, packed):
        m.zero_grad()
        logp, entropy = sequence_logprobs(m, mb.input_ids, mb.attention_mask, mb.targets, entropy=True,
                                          chunk_tokens=5, positions=mb.trained_at, packed=packed, **sampler)
        (logp * weights).sum().backward()
        return logp.detach(), entropy, [p.grad.clone() for p in m.parameters()]

    calls = []
    kernel = varlen.attend

    def counted(*args, **kwargs):
        calls.append(1)
        return kernel(*args, **kwargs)

    want, want_entropy, want_grads = run(dense, mb.packed)
    varlen.attend = counted
    try:
        got, entropy, grads = run(model, mb.packed)
    finally:
        varlen.attend = kernel
    assert len(calls) == model.config.num_hidden_layers  # every layer went through the varlen sequences
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert got.abs().sum() > 0 and any(g.abs().sum() > 0 for g in grads)


def test_in_float64_varlen_is_the_dense_mask_to_rounding(family):
    """In float64 the two attentions' log-probs and gradients agree to 1e-12: what differs in float32
    (about 1e-6, `test_varlen_logprobs_and_gradients_equal_the_dense_masks`) is rounding alone."""
    dense, model = opened(family, "sdpa").double(), opened(family, "varlen").double()
    mb = collate_packed([group_rows(g) for g in groups_of(dense, seed=3)])
    out = []
    for m in (dense, model):
        logp, _ = sequence_logprobs(m, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                    positions=mb.trained_at, packed=mb.packed)
        logp.sum().backward()
        out.append((logp.detach(), torch.cat([p.grad.reshape(-1) for p in m.parameters()])))
    assert (out[0][0] - out[1][0]).abs().max() < 1e-12 and (out[0][1] - out[1][1]).abs().max() < 1e-12
    assert out[0][1].abs().max() > 1e-3


def test_a_varlen_model_without_a_layout_computes_as_sdpa(tiny_model):
    """Right-padded rows (pack_sequences = false, a model run outside the trainer's passes) carry
    no layout: the model computes as SDPA with the mask transformers makes, padding included."""
    dense, model = opened(tiny_model, "sdpa"), opened(tiny_model, "varlen")
    mb = collate_packed([group_rows(g) for g in groups_of(dense)])
    want = dense(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    got = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits
    real = mb.attention_mask.bool()
    torch.testing.assert_close(got[real], want[real], rtol=0, atol=1e-5)


def grpo(**kw) -> GrpoOptions:
    base = dict(loss=GrpoLoss(correction=Decoupled()), temperature=1.0, estimator="grpo", overlong="none",
                overlong_penalty=0.0, micro_batch_size=8, micro_batch_tokens=40, updates=2, max_grad_norm=1.0,
                pack=True, share_prompts=True)
    return GrpoOptions(**{**base, **kw})


@pytest.mark.parametrize("checkpointing", [False, True])
def test_a_varlen_step_gives_the_dense_masks_update(tiny_model, checkpointing):
    """The trainer's own step (its batching: the layout made on the host, one packed row a
    micro-batch) under varlen attention, with activation checkpointing too (the layout reaching
    the blocks' recomputation): the weights of the dense mask's steps to 1e-5."""
    from trainer.parallel import parallelize

    groups = groups_of(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))

    def trained(attention: str):
        torch.manual_seed(0)
        model = opened(tiny_model, attention)
        if attention == "varlen":
            model = parallelize(model, device=torch.device("cpu"), activation_checkpointing=checkpointing)
        before = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        for step in range(2):
            train_step(model, opt, groups, how=grpo(), step=step)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}, before

    model = opened(tiny_model, "varlen")
    (mini,) = step_batches(groups, micro_batch_size=8, micro_batch_tokens=40, pack=True, model=model)
    assert all(mb.packed.varlen is not None and mb.packed.ids.shape[0] == 1 for mb in mini.batches)
    (got, before), (want, _) = trained("varlen"), trained("sdpa")
    diff = max((got[k] - want[k]).abs().max().item() for k in got)
    moved = max((want[k] - before[k]).abs().max().item() for k in got)
    assert diff < 1e-5 and moved > 1e-4, (diff, moved)


def test_auto_takes_varlen_only_where_its_flash_kernel_passes_its_check(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_attention(cpu, "auto", torch.bfloat16) == "sdpa"  # no flash kernel on the CPU
    assert resolve_attention(cpu, "varlen", torch.float32) == "varlen"  # SDPA a sequence at a time
    assert varlen.flash_failure(cpu) == "the flash kernel runs on CUDA; this is cpu"
    failure = {"why": None}
    monkeypatch.setattr(varlen, "flash_failure", lambda device, dtype: failure["why"] or (
        None if dtype in varlen.FLASH_DTYPES else "float32"))
    assert resolve_attention(cuda, "auto", torch.bfloat16) == "varlen"
    assert resolve_attention(cuda, "auto", torch.float32) == "sdpa"
    assert attention_implementation(cuda, "auto", torch.bfloat16) == varlen.VARLEN
    failure["why"] = "the flash kernel's output differs from the reference by 0.5"
    assert resolve_attention(cuda, "auto", torch.bfloat16) == "sdpa"
    with pytest.raises(ConfigError, match="differs from the reference by 0.5; use 'sdpa'"):
        resolve_attention(cuda, "varlen", torch.bfloat16)
    with pytest.raises(ValueError, match="trainer.attention must be one of"):
        resolve_attention(cpu, "flash")


@pytest.mark.parametrize("kernel", list(varlen.KERNELS))
@pytest.mark.parametrize("broken", [False, True])
def test_the_kernels_check_names_a_kernel_that_attends_wrongly(monkeypatch, broken, kernel):
    """`kernel_failure`, the comparison `flash_failure` makes on CUDA, run on the CPU with stand-in
    kernels: SDPA a sequence at a time passes; start-aligned causal masks (a kernel whose causal
    rule differs for fewer queries than keys) are named."""
    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        if not broken:
            return varlen.reference(q, k, v, cu_q, cu_k, scale)
        original = varlen.end_aligned_causal
        varlen.end_aligned_causal = lambda n, m, device=None: torch.ones(n, m, dtype=torch.bool).tril()
        try:
            return varlen.reference(q, k, v, cu_q, cu_k, scale)
        finally:
            varlen.end_aligned_causal = original

    monkeypatch.setitem(varlen.KERNELS, kernel, lambda q, k, v, made, scale: stand_in(
        q, k, v, made.cu_q, made.cu_k, made.max_q, made.max_k, scale))
    monkeypatch.setattr(varlen, "flash_takes", lambda q, k, v: q.dtype == torch.bfloat16)
    got = varlen.kernel_failure(torch.device("cpu"), torch.bfloat16, kernel)
    if broken:
        assert got is not None and got.startswith(f"the {kernel} kernel's output differs from the reference by"), got
    else:
        assert got is None


@pytest.mark.parametrize(("failure", "cudnn_ms", "want"), [
    ("the cudnn kernel's output differs from the reference by 0.7", 5.0, "flash"),
    (None, 8.0, "cudnn"), (None, 9.5, "flash"), (None, RuntimeError("no plan for this shape"), "flash")])
def test_varlen_takes_cudnns_kernel_only_where_it_is_right_and_faster(monkeypatch, failure, cudnn_ms, want):
    """`varlen_kernel`, run once a device: cuDNN's kernel where it matches the reference and took
    under 0.9 of flash's time (10 ms here), else flash, with why; never off CUDA."""
    def ms(kernel, device, dtype):
        if isinstance(cudnn_ms, Exception) and kernel == "cudnn":
            raise cudnn_ms
        return cudnn_ms if kernel == "cudnn" else 10.0

    monkeypatch.setattr(varlen, "kernel_failure", lambda device, dtype, kernel="flash": failure)
    monkeypatch.setattr(varlen, "kernel_ms", ms)
    got = varlen.choose_kernel(torch.device("cuda"), torch.bfloat16)
    assert got.kernel == want, got
    if failure:
        assert got.why == failure
    elif isinstance(cudnn_ms, Exception):
        assert got.why.startswith("a kernel failed on a longer micro-batch: RuntimeError: no plan"), got
    else:
        assert got.why.startswith(f"cudnn {cudnn_ms:.1f} ms, flash 10.0 ms over micro-batches of 4,096-16,384"), got
    assert varlen.choose_kernel(torch.device("cpu"), torch.bfloat16).kernel == "flash"


def test_ranks_take_cudnns_kernel_only_where_every_rank_chose_it(monkeypatch):
    cuda = torch.device("cuda")
    monkeypatch.setattr(varlen, "_CHOSEN", {})
    monkeypatch.setattr(varlen, "choose_kernel", lambda device, dtype: varlen.KernelChoice("cudnn", "8.0 ms"))
    assert varlen.agreed_kernel(cuda, torch.bfloat16, lambda flag: flag).kernel == "cudnn"  # every rank as this one
    got = varlen.agreed_kernel(cuda, torch.bfloat16, lambda flag: True)  # another rank chose flash
    assert got == varlen.KernelChoice("flash", "another rank's is flash; this rank's 8.0 ms")
    assert varlen.varlen_kernel(cuda, torch.bfloat16) == got  # what `attend` computes with from then on


def test_the_chosen_kernel_computes_and_the_timing_sees_new_lengths(monkeypatch):
    """`attend` calls the kernel `varlen_kernel` chose (cuDNN's only up to its head size of 128);
    `kernel_ms` times micro-batches of a new length each (cuDNN plans each new shape), the first
    untimed. Stand-ins on the CPU for the CUDA kernels."""
    seen = []

    def stand_in(name):
        def kernel(q, k, v, layout_, scale):
            seen.append((name, q.shape[0], q.shape[-1]))
            return varlen.reference(q, k, v, layout_.cu_q, layout_.cu_k, scale)
        return kernel

    for name in varlen.KERNELS:
        monkeypatch.setitem(varlen.KERNELS, name, stand_in(name))
    monkeypatch.setattr(varlen, "flash_takes", lambda q, k, v: q.dtype == torch.bfloat16)
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device, dtype: varlen.KernelChoice("cudnn", "stand-in"))
    made = varlen.layout(np.zeros((1, 12), dtype=np.int64), np.array([[0] * 4 + [1] * 4 + [2] * 4]))
    for head in (128, 256):
        q, k, v = (torch.randn(12, n, head, dtype=torch.bfloat16) for n in (4, 2, 2))
        varlen.attend(q, k, v, made, head ** -0.5)
    assert seen == [("cudnn", 12, 128), ("flash", 12, 256)]
    seen.clear()
    assert len(set(varlen.TIMED_TOKENS)) == len(varlen.TIMED_TOKENS) >= 3
    monkeypatch.setattr(varlen, "TIMED_TOKENS", (96, 130, 160))  # the CPU's reference is slow at 16,384
    assert varlen.kernel_ms("cudnn", torch.device("cpu"), torch.bfloat16) > 0
    assert [t for _, t, _ in seen] == [96, 130, 160]  # a 64-token prompt and two completions of one length


def test_under_autocast_the_kernel_gets_queries_keys_and_values_in_the_compute_dtype(qwen3, monkeypatch):
    """bf16 compute over float32 master weights in one process (trainer/parallel.py: autocast): the
    rotary embedding of a float32 hidden state makes the queries and keys float32; they reach the
    kernel in bf16, as autocast casts SDPA's, so the flash kernel (bf16 only) takes every layer.
    The kernel stands in on the CPU (it is CUDA's)."""
    from trainer.parallel import parallelize

    seen = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, scale):
        seen.append((q.dtype, k.dtype, v.dtype))
        return varlen.reference(q, k, v, cu_q, cu_k, scale)

    monkeypatch.setattr(varlen._Flash, "apply", stand_in)
    monkeypatch.setattr(varlen, "flash_takes", lambda q, k, v: q.dtype == k.dtype == v.dtype == torch.bfloat16)
    model = parallelize(opened(qwen3, "varlen"), device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    mb = collate_packed([group_rows(g) for g in groups_of(opened(qwen3, "sdpa"))])
    logp, _ = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                positions=mb.trained_at, packed=mb.packed)
    logp.sum().backward()
    assert seen == [(torch.bfloat16,) * 3] * model.config.num_hidden_layers


@pytest.mark.gpu
@pytest.mark.parametrize("kernel", list(varlen.KERNELS))
def test_the_varlen_kernels_match_the_reference_on_cuda(qwen3, monkeypatch, kernel):
    """On a GPU: the flash kernel passes its check (cuDNN's is skipped where it fails its own, the
    reason given), and the trainer's placement (bf16 autocast over float32 master weights) computes
    every layer of a packed micro-batch with the kernel, the log-probs and gradients the dense
    mask's within bf16's rounding."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from trainer.devices import to_device
    from trainer.parallel import parallelize

    cuda = torch.device("cuda")
    assert varlen.flash_failure(cuda, torch.bfloat16) is None
    assert resolve_attention(cuda, "auto", torch.bfloat16) == "varlen"
    if kernel != "flash" and (failure := varlen.kernel_failure(cuda, torch.bfloat16, kernel)):
        pytest.skip(failure)
    print(f"varlen_kernel: {varlen.varlen_kernel(cuda, torch.bfloat16).line()}")  # the choice, for the sitting's log
    calls = []
    chosen = varlen.KERNELS[kernel]
    monkeypatch.setitem(varlen.KERNELS, kernel, lambda *args: calls.append(1) or chosen(*args))
    monkeypatch.setattr(varlen, "varlen_kernel", lambda device, dtype: varlen.KernelChoice(kernel, "this test's"))
    mb = collate_packed([group_rows(g) for g in groups_of(opened(qwen3, "sdpa"), seed=1)])
    mb = to_device(replace(mb, packed=mb.packed.with_varlen()), cuda)
    out = {}
    for attention in ("sdpa", "varlen"):
        model = parallelize(opened(qwen3, attention), device=cuda, compute_dtype=torch.bfloat16)
        logp, _ = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                    positions=mb.trained_at, packed=mb.packed)
        logp.sum().backward()
        out[attention] = (logp.detach().float(), torch.cat([p.grad.reshape(-1).float() for p in model.parameters()]))
    assert len(calls) == model.config.num_hidden_layers
    torch.testing.assert_close(out["varlen"][0], out["sdpa"][0], rtol=0, atol=0.05)
    cos = torch.nn.functional.cosine_similarity(out["varlen"][1], out["sdpa"][1], dim=0).item()
    assert cos > 0.99, cos
