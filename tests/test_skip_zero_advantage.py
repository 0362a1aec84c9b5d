"""trainer.skip_zero_advantage: the completions of a group that scored alike (advantage 0) go
through no forward or backward pass, and the step's update is the one every completion gives."""

import random
from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import CispoLoss, CustomLoss, GrpoLoss, GspoLoss
from common.messages import SampleGroup
from tests.harness.groups import make_group
from trainer.batch import mini_batches
from trainer.step import GrpoOptions, train_step

SHAPES = [(6, [1, 4, 9, 3]), (3, [5, 1, 2, 7]), (9, [2, 2, 6, 1]), (5, [4, 3, 8, 2]), (4, [6, 2, 3, 5])]


def alike(group: SampleGroup, reward: float) -> SampleGroup:
    """`group` with every completion scored `reward`: its advantages are all 0."""
    return replace(group, completions=[replace(c, reward=reward, rewards={"correct": reward})
                                       for c in group.completions])


def groups_with_alike(seed: int = 3) -> list[SampleGroup]:
    """Five groups: the first, third and fifth scored alike (all right, all wrong, all right)."""
    rng = random.Random(seed)
    made = [make_group(300, f"g{i}", version=0, rng=rng, shape=shape, partial_mask=True)
            for i, shape in enumerate(SHAPES)]
    return [alike(made[0], 1.0), made[1], alike(made[2], 0.0), made[3], alike(made[4], 1.0)]


def step(tiny_model, groups, *, skip: bool, loss=None, share: bool = True, updates: int = 1, ref: bool = False):
    """One train_step of the tiny model on `groups`: its stats and the weights before and after."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    before = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    stats = train_step(model, opt, groups, how=GrpoOptions(
        loss=loss or GrpoLoss(), temperature=0.8, estimator="grpo", overlong="none", overlong_penalty=0.0,
        micro_batch_size=3, micro_batch_tokens=0, updates=updates, max_grad_norm=1.0, share_prompts=share,
        max_new_tokens=16, skip_zero_advantage=skip),
        ref_model=AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval() if ref else None)
    return stats, before, {k: v.detach().clone() for k, v in model.state_dict().items()}


def largest_difference(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


LOSSES = {
    "grpo": GrpoLoss(), "grpo seq_mean": GrpoLoss(loss_agg="seq_mean"),
    "grpo token_sum_norm": GrpoLoss(loss_agg="token_sum_norm"), "grpo decoupled": GrpoLoss(correction="decoupled"),
    "grpo dual clip": GrpoLoss(clip_ratio_c=3.0), "gspo": GspoLoss(), "cispo": CispoLoss(),
}


@pytest.mark.parametrize("share", [True, False], ids=["shared prompts", "rows"])
@pytest.mark.parametrize("name", list(LOSSES))
def test_leaving_out_the_groups_that_scored_alike_gives_the_same_update(tiny_model, name, share):
    groups = groups_with_alike()
    full, before, want = step(tiny_model, groups, skip=False, loss=LOSSES[name], share=share, updates=2)
    skipped, _, got = step(tiny_model, groups, skip=True, loss=LOSSES[name], share=share, updates=2)
    # the alike groups' completions went through no pass: fewer positions, the same loss and update
    assert skipped.tokens_forward < 0.7 * full.tokens_forward, (skipped.tokens_forward, full.tokens_forward)
    assert skipped.tokens_trained == full.tokens_trained
    for key in ("loss", "grad_norm"):
        assert getattr(skipped, key) == pytest.approx(getattr(full, key), rel=1e-4, abs=1e-7), key
    # float32 sums in another order, amplified where AdamW divides a near-zero gradient by its
    # root mean square (as between shared prompts and rows); a wrong normaliser moves every weight
    # by a share of the whole step (lr 1e-3)
    assert largest_difference(got, want) < 1e-5
    assert largest_difference(got, before) > 1e-4  # it did train


def test_the_step_figures_are_means_over_the_completions_that_went_through(tiny_model):
    """Entropy, ratio, clip shares and mismatch: those of a step on the other groups alone."""
    groups = groups_with_alike()
    skipped = step(tiny_model, groups, skip=True)[0]
    alone = step(tiny_model, [g for i, g in enumerate(groups) if i % 2], skip=False)[0]
    assert alone.tokens_trained < skipped.tokens_trained and alone.tokens_forward == skipped.tokens_forward
    assert skipped.entropy == pytest.approx(alone.entropy, rel=1e-5)
    for key in ("ratio", "clip_low", "clip_high", "tis"):
        assert getattr(skipped.policy, key) == pytest.approx(getattr(alone.policy, key), rel=1e-5, abs=1e-7), key
    assert skipped.mismatch_mean == pytest.approx(alone.mismatch_mean, rel=1e-5)
    # each group left out still has its mismatch over all its completions, measured in a pass
    # without a gradient: the quarantine judges every generator as before (a wrong one's groups
    # often all score alike)
    full = step(tiny_model, groups, skip=False)[0]
    assert skipped.group_mismatch == pytest.approx(full.group_mismatch, rel=1e-5)


def test_a_mini_batch_of_alike_groups_still_runs_one_completion_its_gradient_zero(tiny_model):
    """Every group scored alike: each mini-batch keeps one completion (ranks pair up their passes,
    and AdamW's step on a gradient of 0 is the one the full batch takes)."""
    groups = [alike(g, r) for g, r in zip(groups_with_alike(), [1.0, 0.0, 1.0, 0.0, 0.0], strict=True)]
    parts = mini_batches(groups, parts=2, micro_batch_size=3, share_prompts=True, skip_zero=True)
    assert [sum(mb.input_ids.shape[0] for mb in p.batches) for p in parts] == [1, 1]
    assert [p.rows for p in parts] == [10, 10] and all(p.tokens > 10 for p in parts)
    full, before, want = step(tiny_model, groups, skip=False, updates=2)
    skipped, _, got = step(tiny_model, groups, skip=True, updates=2)
    assert skipped.grad_norm == full.grad_norm == 0.0 and skipped.entropy > 0.0
    assert skipped.group_mismatch == pytest.approx(full.group_mismatch, rel=1e-5)
    assert largest_difference(got, want) == 0.0  # AdamW's weight decay alone, on both


def grpo_as_custom(x):
    """The grpo loss, as a custom loss."""
    from trainer.losses.grpo import loss

    return loss(x, GrpoLoss())


def test_a_kl_term_or_a_custom_loss_keeps_every_completion(tiny_model):
    """With a KL term a completion of advantage 0 still pulls towards the reference, and what a
    custom loss does with one is not known: nothing is left out."""
    groups = groups_with_alike()
    for loss, ref in ((GrpoLoss(kl_coef=0.1), True),
                      (CustomLoss(function="tests.test_skip_zero_advantage:grpo_as_custom"), False)):
        full = step(tiny_model, groups, skip=False, loss=loss, ref=ref)[0]
        kept = step(tiny_model, groups, skip=True, loss=loss, ref=ref)[0]
        assert kept.tokens_forward == full.tokens_forward, loss
