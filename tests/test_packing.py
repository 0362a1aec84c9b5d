"""Padding-free micro-batches (trainer.pack_sequences): a micro-batch's sequences packed end to
end, each attending only to itself, give the update of right-padded rows for every loss, with
every position through the model a token of a sequence. World size 2 (FSDP2 on gloo, the trainer
itself, packed, against one process on right-padded rows): tests/test_trainer_fsdp.py."""

import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import CispoLoss, Decoupled, GrpoLoss, GspoLoss, SequenceMask, TokenMask
from tests.harness.groups import make_group
from trainer.batch import group_rows, micro_batches, packed_rows, split_packs
from trainer.logprobs import sequence_logprobs
from trainer.step import GrpoOptions, sft_step, train_step

# (prompt length, completion lengths): two groups share a prompt length, completions of 1 token too
SHAPES = [(6, [1, 4, 9, 3]), (3, [5, 1, 2, 7]), (9, [2, 2, 6, 1]), (6, [3, 8, 1, 5])]
LR = 1e-4  # a wrong mask or position moves a weight by about a step (AdamW: ~lr); rounding by ~1e-7
STEPS = 2
MBS, MBT = 8, 40  # two groups (two documents) a micro-batch, 14 to 19 positions each

LOSSES = {
    "grpo": GrpoLoss(),
    "grpo_decoupled": GrpoLoss(correction=Decoupled()),
    "grpo_dual_clip_token_mask": GrpoLoss(clip_ratio_c=3.0, correction=TokenMask()),
    "gspo_sequence_mask": GspoLoss(correction=SequenceMask()),
    "cispo": CispoLoss(),
    "kl": GrpoLoss(kl_coef=0.1, correction=Decoupled()),
}


def groups_of(model, shapes=SHAPES, seed: int = 0):
    """Groups of these shapes carrying `model`'s own log-probs (so the corrections keep tokens)."""
    rng = random.Random(seed)
    return [make_group(model, f"g{g}", version=0, rng=rng, shape=shape, partial_mask=True)
            for g, shape in enumerate(shapes)]


def options(loss, *, pack: bool, share: bool = True) -> GrpoOptions:
    return GrpoOptions(loss=loss, temperature=1.0, estimator="grpo", overlong="none", overlong_penalty=0.0,
                       micro_batch_size=MBS, micro_batch_tokens=MBT, updates=2, max_grad_norm=1.0, pack=pack,
                       share_prompts=share)


def trained(tiny_model, run) -> tuple[dict, list, dict]:
    """(weights after `run(model, optimizer)` for STEPS steps, the steps' stats, the weights before)."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    stats = [run(model, opt, step) for step in range(STEPS)]
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, stats, before


def assert_same_update(packed: tuple, padded: tuple) -> None:
    (w_packed, _, before), (w_padded, _, _) = packed, padded
    diff = max((w_packed[k] - w_padded[k]).abs().max().item() for k in w_packed)
    moved = max((w_padded[k] - before[k]).abs().max().item() for k in w_packed)
    assert diff < 1e-5, f"packed and padded weights differ by {diff:.3g} (the steps moved them by {moved:.3g})"
    assert moved > 1e-4, "the steps did not train: the comparison would be empty"


@pytest.fixture(scope="module")
def groups(tiny_model):
    return groups_of(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32))


@pytest.mark.parametrize("name", list(LOSSES))
def test_a_packed_step_gives_the_update_of_padded_rows_for_each_loss(tiny_model, groups, name):
    loss = LOSSES[name]
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval() if loss.kl_coef else None

    def run(pack: bool, share: bool = True):
        return trained(tiny_model, lambda model, opt, step: train_step(
            model, opt, groups, how=options(loss, pack=pack, share=share), ref_model=ref, step=step))

    for mb in micro_batches(groups, micro_batch_size=MBS, micro_batch_tokens=MBT, share_prompts=True)[0]:
        assert mb.packed.docs.unique().tolist() == [0, 1]  # documents side by side: the mask matters
    padded = run(False)
    packed = run(True)
    assert_same_update(packed, padded)
    for a, b in zip(packed[1], padded[1], strict=True):
        assert a.loss == pytest.approx(b.loss, rel=1e-4, abs=1e-6) and a.tokens_trained == b.tokens_trained
        assert a.tokens_forward < b.tokens_forward  # shared prompts, no padding
    if name == "grpo":  # each completion its own document (share_prompts false) too
        assert_same_update(run(True, share=False), padded)


def test_a_packed_sft_step_gives_the_update_of_padded_rows(tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(3)
    groups = [make_group(model, f"s{i}", version=0, rng=rng, shape=(p, [n]), partial_mask=False)
              for i, (p, n) in enumerate([(5, 9), (3, 2), (8, 6), (4, 12), (6, 1), (7, 7)])]

    def run(pack: bool):
        return trained(tiny_model, lambda model, opt, step: sft_step(
            model, opt, groups, micro_batch_size=3, micro_batch_tokens=30, max_grad_norm=1.0, pack=pack))

    packed, padded = run(True), run(False)
    assert_same_update(packed, padded)
    rows = sum(len(g.prompt_ids) + len(g.completions[0].ids) - 1 for g in groups)
    assert all(s.tokens_forward == rows for s in packed[1])


def test_every_position_through_the_model_is_a_token_of_a_sequence(tiny_model):
    """Tokens through the model / tokens of the sequences: 1.00 packed (the padded rows' is above)."""
    rng = random.Random(5)
    shapes = [(rng.randint(3, 30), [rng.randint(1, 40) for _ in range(4)]) for _ in range(12)]
    groups = [make_group(300, f"g{i}", version=0, rng=rng, shape=s) for i, s in enumerate(shapes)]
    rows = sum(p + n - 1 for p, ns in shapes for n in ns)
    for budget in (0, 64, 200):
        batches, _, _ = micro_batches(groups, micro_batch_size=6, micro_batch_tokens=budget, share_prompts=False)
        through = sum(mb.packed.ids.numel() for mb in batches)
        assert through == rows == sum(int((mb.packed.segments >= 0).sum()) for mb in batches), budget
        assert all(mb.packed.ids.shape[0] == 1 for mb in batches)
        longest = max(p + n - 1 for p, ns in shapes for n in ns)
        assert all(mb.packed.ids.numel() <= max(budget, longest) for mb in batches if budget)
        padded, _, _ = micro_batches(groups, micro_batch_size=6, micro_batch_tokens=budget, pack=False)
        assert sum(mb.input_ids.numel() for mb in padded) > rows
    # train_step counts the same: no padding position goes through the model
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    stats = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), groups[:4],
                       how=options(GrpoLoss(), pack=True, share=False))
    assert stats.tokens_forward == sum(p + n - 1 for p, ns in shapes[:4] for n in ns)


def test_a_dense_masks_documents_go_in_rows_of_their_own_where_that_is_cheaper():
    """SDPA's dense mask computes every pair of a packed row: a micro-batch of three documents of
    ~2.8k positions (gsm8k's groups) at Qwen2.5-0.5B's hidden size goes in three rows (a third of
    one row's pairs), documents of the demo's size beside a longer one at SmolLM2's in one (the
    padding of rows as long as it would cost more than their pairs), and for an attention that
    computes only each document's pairs (flex attention's BlockMask: hidden size 0 here) one row,
    end to end."""
    gsm8k = [3000, 2800, 2400]
    rows = packed_rows(gsm8k, hidden_size=896)
    assert sorted(r for r, _ in rows) == [0, 1, 2] and all(offset == 0 for _, offset in rows), rows
    assert packed_rows(gsm8k, hidden_size=0) == [(0, 0), (0, 3000), (0, 5800)]
    demo = [120, 40, 30, 25]
    assert {r for r, _ in packed_rows(demo, hidden_size=576)} == {0}
    # rows hold whole documents end to end, in their order, spread evenly (longest first into the
    # row with the fewest positions): 3 rows of 110, 100 and 100 positions for these at hidden size 16
    sizes = [100, 30, 60, 40, 70, 10]
    placed = packed_rows(sizes, hidden_size=16)
    ends = {}
    for (r, offset), n in zip(placed, sizes, strict=True):
        assert offset == ends.get(r, 0), placed
        ends[r] = offset + n
    assert sorted(ends.values()) == [100, 100, 110], placed


def test_a_packed_step_with_documents_in_several_rows_gives_the_update_of_padded_rows(tiny_model):
    """The trainer's own batching for an SDPA model (its dense mask) puts a micro-batch's documents
    in several packed rows, each right-padded to the longest: the same update as the padded rows,
    each document's images in the order the rows hold them, no padding position counted through
    the model."""
    from trainer.step import step_batches

    shapes = [(12, [19, 17, 18, 19]), (9, [16, 19, 19, 14]), (14, [19, 18, 15, 19]), (11, [17, 19, 19, 16])]
    groups = groups_of(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), shapes, seed=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    (mini,) = step_batches(groups, micro_batch_size=16, micro_batch_tokens=400, pack=True,
                           hidden_size=model.config.hidden_size, model=model)
    rows = [mb.packed.ids.shape[0] for mb in mini.batches]
    assert max(rows) > 1, rows  # the documents went in rows of their own
    assert mini.tokens_in == sum(int((mb.packed.segments >= 0).sum()) for mb in mini.batches) < sum(
        mb.packed.ids.numel() for mb in mini.batches)  # padding of the rows is not counted

    def run(pack: bool):
        how = replace(options(GrpoLoss(), pack=pack), micro_batch_size=16, micro_batch_tokens=400, updates=1)
        return trained(tiny_model, lambda model, opt, step: train_step(model, opt, groups, how=how, step=step))

    assert_same_update(run(True), run(False))


def test_micro_batches_are_balanced_by_tokens():
    """Documents go longest first into the micro-batch with the fewest tokens: the micro-batches'
    token counts differ by at most the longest document, and `at_least` (every rank's count)
    spreads them over more."""
    rng = random.Random(7)
    groups = [make_group(300, f"g{i}", version=0, rng=rng, shape=(rng.randint(2, 20), [rng.randint(1, 60)]))
              for i in range(24)]
    rows = [r for i, g in enumerate(groups) for r in group_rows(g, index=i, objective="sft")]
    sizes = [r.length for r in rows]
    for at_least in (1, 5):
        batches = split_packs(rows, micro_batch_size=8, micro_batch_tokens=256, at_least=at_least)
        tokens = [sum(r.length for doc in mb for r in doc) for mb in batches]
        assert len(batches) == max(at_least, -(-len(rows) // 8), -(-sum(sizes) // 256)) and sum(tokens) == sum(sizes)
        assert max(tokens) <= 256 and max(tokens) - min(tokens) <= max(sizes), tokens
        assert sorted(id(r) for mb in batches for doc in mb for r in doc) == sorted(id(r) for r in rows)


def test_flex_attention_with_the_block_mask_gives_the_padded_rows_logprobs(tiny_model, monkeypatch):
    """The CUDA path (flex attention, a document BlockMask) on the CPU: eager flex attention (it
    has no backward on the CPU, and transformers would compile it), forward only."""
    import transformers.integrations.flex_attention as flex
    from torch.nn.attention.flex_attention import flex_attention

    monkeypatch.setattr(flex, "compile_friendly_flex_attention",
                        lambda q, k, v, training=False, **kwargs: flex_attention(q, k, v, **kwargs))
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():  # weights large enough that every log-prob depends on its context
        for w in sdpa.parameters():
            if w.dim() == 2:
                w.normal_(0.0, 0.1)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attn_implementation="flex_attention")
    model.load_state_dict(sdpa.state_dict())
    (mb,), _, _ = micro_batches(groups_of(sdpa), micro_batch_size=16, share_prompts=True)
    assert mb.packed.docs.unique().numel() == len(SHAPES)  # one document a group, end to end

    def logp(m, packed):
        with torch.no_grad():
            return sequence_logprobs(m, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0,
                                     positions=mb.trained_at, packed=packed)[0]

    want = logp(sdpa, None)
    torch.testing.assert_close(logp(model, mb.packed), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(logp(sdpa, mb.packed), want, rtol=0, atol=1e-5)
    assert want[mb.mask.bool()].std() > 0.5, "the log-probs barely depend on their context: the check would be empty"


def test_a_model_whose_attention_takes_no_packed_mask_counts_the_padded_rows_it_runs(tiny_model, monkeypatch):
    """A model whose attention takes no packed mask (a sliding window: packed_attention None) runs
    the right-padded rows even with pack_sequences on: tokens_forward is their tokens, each prompt
    once per completion, not the packed positions it would have run."""
    import trainer.logprobs
    import trainer.step

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    groups = groups_of(model)

    def forward_tokens() -> int:
        return train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), groups,
                          how=options(GrpoLoss(), pack=True, share=True)).tokens_forward

    padded = sum(p + n - 1 for p, ns in SHAPES for n in ns)  # each row: its prompt and completion, less the last
    assert forward_tokens() < padded  # packed with shared prompts: each prompt once
    for module in (trainer.logprobs, trainer.step):
        monkeypatch.setattr(module, "packed_attention", lambda model: None)
    assert forward_tokens() == padded
