"""Shared-prefix packing (trainer.share_prompts): each group's prompt goes through the model once,
its completions packed after it under the packed attention mask (the groups end to end), and
gives the log-probs, gradients and updates of the right-padded rows."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import GrpoLoss
from common.messages import SampleGroup
from tests.harness.groups import make_group
from trainer.batch import collate_packed, group_rows, micro_batches, split_packs
from trainer.grpo import token_entropy, token_logprobs
from trainer.logprobs import sequence_logprobs
from trainer.step import GrpoOptions, train_step

# (prompt length, completion lengths): prompts of different lengths, completions of 1 token too.
SHAPES = [(6, [1, 4, 9, 3]), (3, [5, 1, 2, 7]), (9, [2, 2, 6, 1])]


def shaped_groups(vocab: int, shapes=SHAPES, seed: int = 0) -> list[SampleGroup]:
    """The harness's groups of these shapes, random tokens below `vocab` and random log-probs;
    one completion in each trains on only some of its tokens."""
    rng = random.Random(seed)
    return [make_group(vocab, f"g{g}", version=0, rng=rng, shape=shape, partial_mask=True)
            for g, shape in enumerate(shapes)]


def rows_of(groups):
    return [group_rows(g) for g in groups]


@pytest.fixture(params=["sdpa", "eager"])
def model(request, tiny_model):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation=request.param)


@pytest.mark.parametrize("sampler", [dict(temperature=1.0), dict(temperature=0.7, top_k=20, top_p=0.9)])
def test_packed_logprobs_and_gradients_equal_the_padded_rows(model, sampler):
    mb = collate_packed(rows_of(shaped_groups(model.config.vocab_size)))
    # the groups end to end in one row, one document a group
    assert mb.packed.ids.shape == (1, sum(p + sum(n - 1 for n in ns) for p, ns in SHAPES))
    assert mb.packed.docs.unique().tolist() == list(range(len(SHAPES)))
    weights = torch.randn(mb.mask.shape) * mb.mask  # any loss over the trained positions

    def run(packed):
        model.zero_grad()
        logp, entropy = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, entropy=True,
                                          chunk_tokens=5, positions=mb.trained_at, packed=packed, **sampler)
        (logp * weights).sum().backward()
        return logp.detach(), entropy, [p.grad.clone() for p in model.parameters()]

    want, want_entropy, want_grads = run(None)
    got, entropy, grads = run(mb.packed)
    # and both are the full logits' (the untrained positions 0)
    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits
    full = token_logprobs(logits, mb.targets, sampler["temperature"], top_k=sampler.get("top_k", 0),
                          top_p=sampler.get("top_p", 1.0)) * mb.mask
    torch.testing.assert_close(got, full.detach(), rtol=0, atol=1e-5)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=0, atol=1e-5)
    torch.testing.assert_close(entropy, token_entropy(logits, sampler["temperature"]) * mb.mask, rtol=0, atol=1e-5)
    for g, w in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert got.abs().sum() > 0 and any(g.abs().sum() > 0 for g in grads)


def test_the_packed_forward_runs_fewer_positions(tiny_model):
    """4 completions of 20 tokens after a 38-token prompt (the demo's shapes): 4 x 57 padded
    positions, 38 + 4 x 19 packed."""
    groups = shaped_groups(300, shapes=[(38, [20] * 4)] * 4)
    (padded,), _, _ = micro_batches(groups, micro_batch_size=16, pack=False)
    (packed,), _, _ = micro_batches(groups, micro_batch_size=16, share_prompts=True, pack=True)
    assert padded.packed is None and padded.input_ids.numel() == 16 * 57
    assert packed.packed.ids.numel() == 4 * (38 + 4 * 19)
    # the row layout every loss reads is the same
    for name in ("input_ids", "targets", "mask", "behaviour_logp", "advantages", "versions"):
        assert getattr(packed, name).shape == getattr(padded, name).shape


def test_micro_batches_keep_whole_groups_within_their_budgets():
    groups = shaped_groups(300, shapes=[(5, [3, 3, 3, 3]), (8, [2, 6, 2, 2]), (4, [1, 1, 1, 1]), (6, [4, 4, 4, 4])])
    prompts = {tuple(g.prompt_ids) for g in groups}
    batches, tokens, seqs = micro_batches(groups, micro_batch_size=8, share_prompts=True)
    plain = micro_batches(groups, micro_batch_size=8, pack=False)
    assert (tokens, seqs) == plain[1:]  # the loss's normalisers do not change
    assert [mb.input_ids.shape[0] for mb in batches] == [8, 8]
    for mb in batches:  # two whole groups a micro-batch, one document each, each starting with its prompt
        docs = [mb.packed.ids[mb.packed.docs == d].tolist() for d in range(int(mb.packed.docs.max()) + 1)]
        assert len(docs) == 2 and all(any(tuple(doc[:len(p)]) == p for p in prompts) for doc in docs)
    # micro_batch_size cuts a group: each piece carries the prompt
    pieces = split_packs([r for g in groups for r in group_rows(g)], micro_batch_size=3)
    assert all(sum(len(p) for p in mb) <= 3 for mb in pieces)
    assert sorted(len(p) for mb in pieces for p in mb) == [1, 1, 1, 1, 3, 3, 3, 3]
    # micro_batch_tokens counts packed positions, no padding among them
    for budget in (10, 20, 40):
        for mb in micro_batches(groups, micro_batch_size=16, micro_batch_tokens=budget, share_prompts=True)[0]:
            seqs_, width = mb.packed.ids.shape
            alone = int(mb.packed.segments.max()) <= 1 and int(mb.packed.docs.max()) == 0  # one too long: alone
            assert seqs_ == 1 and (width <= budget or alone), (budget, seqs_, width)
    # every row is still there once, with its advantage
    def rows(batches):  # each row's targets (its padding cut) and advantage
        return sorted((tuple(r[:n]), a) for mb in batches for r, n, a in zip(
            mb.targets.tolist(), mb.attention_mask.sum(1).tolist(), mb.advantages.tolist(), strict=True))

    assert rows(batches) == rows(plain[0]) and len(rows(batches)) == 16


def test_rows_packed_together_must_share_their_prompt():
    a, b = (group_rows(g)[0] for g in shaped_groups(300)[:2])
    with pytest.raises(AssertionError, match="share their prompt"):
        collate_packed([[a, b]])
    # equal prompts are found by value, not by identity: one document holding both rows
    c = group_rows(shaped_groups(300)[0])[1]
    assert a.prompt is not c.prompt
    (mb,) = split_packs([a, c], micro_batch_size=8, share_prompts=True)
    assert [[id(row) for row in doc] for doc in mb] == [[id(a), id(c)]]


@pytest.mark.parametrize("lora", [False, True])
def test_a_train_step_gives_the_same_update_with_and_without_shared_prompts(tiny_model, lora):
    from trainer.lora import apply_lora

    groups = shaped_groups(300, shapes=SHAPES + [(7, [3, 8, 1, 5])], seed=1)
    out = {}
    for share in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        if lora:  # peft's model passes the packed mask and positions through
            model = apply_lora(model, rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
        out0 = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        stats = train_step(model, opt, groups, how=GrpoOptions(
            loss=GrpoLoss(correction="decoupled", kl_coef=0.1), temperature=0.8, top_k=30, estimator="grpo",
            overlong="none", overlong_penalty=0.0, micro_batch_size=5, micro_batch_tokens=0, updates=2,
            max_grad_norm=1.0, share_prompts=share),
            ref_model=AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval())
        out[share] = stats, {k: v.detach().clone() for k, v in model.state_dict().items()}
    (off, w_off), (on, w_on) = out[False], out[True]
    assert on.tokens_forward < off.tokens_forward
    for key in ("loss", "grad_norm", "entropy", "tokens_trained"):
        assert getattr(on, key) == pytest.approx(getattr(off, key), rel=1e-4, abs=1e-6), key
    assert on.policy.kl == pytest.approx(off.policy.kl, rel=1e-4, abs=1e-6)
    # Packed and padded rows sum the same terms in another order. AdamW's second update divides the
    # momentum by its root mean square: in a weight whose two gradients nearly cancel, that order
    # shows at up to a few thousandths of the step (lr 1e-3: 1.2e-6 to 4.3e-6 over eight draws);
    # a wrong mask or position moves weights by the whole step.
    assert max((w_on[k] - w_off[k]).abs().max().item() for k in w_on) < 1e-5
    assert max((w_on[k] - out0[k]).abs().max().item() for k in w_on) > 1e-4  # it did train


def test_a_model_with_sliding_window_layers_keeps_its_rows(tmp_path):
    """A custom 4D mask would drop a sliding window: such a model is run on the padded rows."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from trainer.logprobs import packed_attention

    torch.manual_seed(0)
    windowed = Qwen2ForCausalLM(Qwen2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, use_sliding_window=True, sliding_window=4, max_window_layers=1))
    assert packed_attention(windowed) is None
    full = Qwen2ForCausalLM(Qwen2Config(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=1))
    assert packed_attention(full) == "sdpa"
    mb = collate_packed(rows_of(shaped_groups(300)))
    with torch.no_grad():
        want, _ = sequence_logprobs(windowed, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                    positions=mb.trained_at)
        got, _ = sequence_logprobs(windowed, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                   positions=mb.trained_at, packed=mb.packed)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_long_completions_after_a_short_prompt_go_as_their_own_rows(tiny_model):
    """Packing G completions of n tokens makes one attention of (P + G n)^2 pairs instead of
    G of (P + n)^2: where that costs more than the prompt saves (with the model's hidden size)
    each completion goes as its own piece; a long prompt with short completions is packed whole."""
    long_completions = [r for g in shaped_groups(300, shapes=[(4, [200] * 4)]) for r in group_rows(g)]
    long_prompt = [r for g in shaped_groups(300, shapes=[(200, [4] * 4)]) for r in group_rows(g)]
    cut = split_packs(long_completions, micro_batch_size=8, hidden_size=64)
    assert sorted(len(piece) for mb in cut for piece in mb) == [1, 1, 1, 1]
    assert [len(piece) for mb in split_packs(long_prompt, micro_batch_size=8, hidden_size=64)
            for piece in mb] == [4]
    # without the model's size only the budgets cut (a big model's pairs are cheap: 0.15 / H each)
    assert [len(p) for mb in split_packs(long_completions, micro_batch_size=8) for p in mb] == [4]
    (mb,), _, _ = micro_batches(shaped_groups(300, shapes=[(4, [200] * 4)]), micro_batch_size=8,
                                share_prompts=True, hidden_size=64)
    assert mb.packed.ids.shape == (1, 4 * (4 + 199)) and mb.packed.docs.unique().tolist() == [0, 1, 2, 3]
    # train_step cuts by its model's hidden size (the tiny model's 64): 4 rows of 203 positions, not 4 + 4 x 199
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), shaped_groups(300, shapes=[(4, [200] * 4)]),
                       how=GrpoOptions(loss=GrpoLoss(), temperature=1.0, estimator="grpo", overlong="none",
                                       overlong_penalty=0.0, micro_batch_size=8, micro_batch_tokens=0, updates=1,
                                       max_grad_norm=1.0))
    assert model.config.hidden_size == 64 and stats.tokens_forward == 4 * 203


@pytest.mark.parametrize("device", [
    "cpu",
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                    reason="needs a CUDA GPU; torch sees none here")]),
])
def test_packed_logprobs_in_bf16_are_the_padded_rows_within_bf16_rounding(tiny_model, device):
    # bf16 weights (the GPU path): the mask stays bool for SDPA whatever the model's dtype, and on
    # CUDA the packed and padded layouts may take different SDPA kernels
    from trainer.devices import to_device

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():  # weights large enough that every log-prob depends on its context (a fresh
        for w in model.parameters():  # tiny model is near uniform: its log-probs barely move)
            if w.dim() == 2:
                w.normal_(0.0, 0.1)
    model = model.to(device, torch.bfloat16)
    mb = to_device(collate_packed(rows_of(shaped_groups(model.config.vocab_size))), torch.device(device))
    assert mb.packed.attention("bool").dtype == torch.bool and mb.packed.ids.device.type == device

    def logp(packed):
        got, _ = sequence_logprobs(model, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                   positions=mb.trained_at, packed=packed)
        return got.float()

    want, got = logp(None), logp(mb.packed)
    assert got.device.type == device and torch.isfinite(got).all()
    trained = mb.mask.bool()
    # bf16 keeps 8 bits of mantissa: the two layouts round differently, by about 0.01 here (a
    # packed forward without its position ids is off by 0.18 on average, up to 1.1)
    torch.testing.assert_close(got[trained], want[trained], rtol=0, atol=0.05)
    assert (got[trained] - want[trained]).abs().mean() < 0.01
    assert want[trained].std() > 0.5, "the log-probs barely depend on their context: the check would be empty"
    assert (got[~trained] == 0).all()
