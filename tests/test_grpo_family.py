"""The GRPO family's options (advantage estimators, aggregation, GSPO, TIS, KL, entropy,
overlong handling), the lr schedule and token-budget micro-batches, against numbers worked out
by hand."""

import math
import random

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import GrpoLoss, GspoLoss
from tests.harness.groups import completion, hand_group, make_group
from tests.harness.losses import clip_case
from trainer.batch import Row, group_rows, micro_batches, split_rows
from trainer.grpo import group_advantages, token_entropy
from trainer.losses import LossInputs
from trainer.losses.grpo import loss as grpo_loss
from trainer.losses.gspo import loss as gspo_loss
from trainer.losses.kl import kl_penalty
from trainer.schedule import lr_factor
from trainer.step import GrpoOptions, train_step

REWARDS = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])


def test_dr_grpo_advantage_is_reward_minus_group_mean():
    # Means 0.5 and 2; no division by the std.
    want = torch.tensor([[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]])
    torch.testing.assert_close(group_advantages(REWARDS, "dr_grpo"), want)


def test_rloo_advantage_is_reward_minus_mean_of_the_others():
    # Group 0: 1 - (0 + 0 + 1) / 3 = 2/3; 0 - (1 + 0 + 1) / 3 = -2/3.
    # Group 1: 3 - (1 + 2 + 2) / 3 = 4/3; 1 - (3 + 2 + 2) / 3 = -4/3; 2 - (3 + 1 + 2) / 3 = 0.
    want = torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3], [4 / 3, -4 / 3, 0.0, 0.0]])
    torch.testing.assert_close(group_advantages(REWARDS, "rloo"), want)


def test_seq_mean_averages_each_sequence_then_the_sequences():
    logp, behaviour, adv, mask = clip_case()
    loss, _ = grpo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=5, total_seqs=2),
                        GrpoLoss(clip_low=0.2, clip_high=0.3, loss_agg="seq_mean"))
    # Per-token losses (test_grpo): row 0 -1.3, -0.9 -> mean -1.1; row 1 0.8, 1.1, 1.0 -> mean 2.9/3.
    # (-1.1 + 0.966667) / 2 = -0.0666667.
    assert loss.item() == pytest.approx((-1.1 + 2.9 / 3) / 2, abs=1e-6)
    # d/d logp = -r A / (n_i * 2) where the clip is inactive: row 0 token 2: -0.9 / 4;
    # row 1 tokens 2, 3: 1.1 / 6, 1.0 / 6.
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.9 / 4, 0.0], [0.0, 1.1 / 6, 1.0 / 6]]))


def test_seq_mean_micro_batches_add_up():
    logp, behaviour, adv, mask = clip_case()
    cfg, kw = GrpoLoss(clip_low=0.2, clip_high=0.3, loss_agg="seq_mean"), dict(total_tokens=5, total_seqs=2)
    whole, _ = grpo_loss(LossInputs(logp, behaviour, adv, mask, **kw), cfg)
    parts = [grpo_loss(LossInputs(logp[i : i + 1], behaviour[i : i + 1], adv[i : i + 1], mask[i : i + 1], **kw),
                       cfg)[0] for i in range(2)]
    # Row 0: -1.1 / 2 = -0.55; row 1: (2.9 / 3) / 2 = 0.483333.
    assert parts[0].item() == pytest.approx(-0.55, abs=1e-6)
    assert parts[1].item() == pytest.approx(2.9 / 6, abs=1e-6)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)


def test_gspo_sequence_ratio_is_the_geometric_mean():
    logp, behaviour, adv, mask = clip_case()
    loss, stats = gspo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=5, total_seqs=2),
                            GspoLoss(clip_low=0.2, clip_high=0.3))
    # Row 0: s = sqrt(1.5 * 0.9) = 1.161895, inside [0.8, 1.3], A = +1: -1.161895 on each of 2 tokens.
    # Row 1: s = (0.5 * 1.1 * 1.0)^(1/3) = 0.819321, inside, A = -1: +0.819321 on each of 3 tokens.
    # GSPO's sequence mean: each row's mean (-s0, +s1), over the 2 sequences.
    s0, s1 = math.sqrt(1.35), 0.55 ** (1 / 3)
    assert loss.item() == pytest.approx((-s0 + s1) / 2, abs=1e-6)  # -0.171287
    assert stats.ratio == pytest.approx((2 * s0 + 3 * s1) / 5, abs=1e-6)
    # d s_i / d logp_t = s_i / n_i, so row 0's tokens get -(1/2) * s0 / 2 = -s0 / 4, row 1's +s1 / 6.
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-s0 / 4, -s0 / 4, 0.0], [s1 / 6, s1 / 6, s1 / 6]]))


def test_gspo_clips_whole_sequences():
    logp, behaviour, adv, mask = clip_case()
    loss, stats = gspo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=5, total_seqs=2),
                            GspoLoss(clip_low=0.1, clip_high=0.1))
    # Range [0.9, 1.1]: row 0's s = 1.162 > 1.1 with A > 0 -> -1.1 per token (clipped);
    # row 1's s = 0.819 < 0.9 with A < 0 -> -min(-0.819, -0.9) = 0.9 per token (clipped).
    # (-1.1 + 0.9) / 2 sequences = -0.1; every token's sequence is clipped, so no gradient.
    assert loss.item() == pytest.approx(-0.1, abs=1e-6)
    assert stats.clip_high == pytest.approx(2 / 5)
    assert stats.clip_low == pytest.approx(3 / 5)
    loss.backward()
    assert torch.count_nonzero(logp.grad) == 0


def test_ratio_is_against_old_logp_and_tis_weights_by_the_behaviour_gap():
    # Two tokens, A = +1. old - behaviour = ln 3, ln 0.5 -> TIS weights min(3, 2) = 2 and 0.5.
    # logp = old: ratio 1 (not the 3 and 0.5 a ratio against behaviour would give), pg -1 each.
    behaviour = torch.tensor([[-2.0, -2.0]])
    old = behaviour + torch.tensor([[math.log(3.0), math.log(0.5)]])
    logp = old.clone().requires_grad_()
    loss, stats = grpo_loss(LossInputs(logp, behaviour, torch.tensor([1.0]), torch.ones(1, 2), total_tokens=2,
                                       prox_logp=old),
                            GrpoLoss(clip_low=0.2, clip_high=0.2, correction={"type": "decoupled", "tis_cap": 2.0}))
    # (2 * -1 + 0.5 * -1) / 2 = -1.25; d/d logp = -w r A / 2 = -1, -0.25.
    assert loss.item() == pytest.approx(-1.25, abs=1e-6)
    assert stats.ratio == pytest.approx(1.0) and stats.tis == pytest.approx(1.25)
    assert stats.clip_region == 0.0
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.0, -0.25]]))


def test_tis_is_one_when_old_is_behaviour():
    logp, behaviour, adv, mask = clip_case()
    plain, _ = grpo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=5), GrpoLoss(clip_low=0.2, clip_high=0.3))
    # decoupled with the proximal policy the behaviour one: ratio and weight as behaviour_clip's
    tis, stats = grpo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=5, prox_logp=behaviour),
                           GrpoLoss(clip_low=0.2, clip_high=0.3, correction={"type": "decoupled", "tis_cap": 2.0}))
    assert tis.item() == pytest.approx(plain.item()) and stats.tis == pytest.approx(1.0)


@pytest.mark.parametrize(("estimator", "value", "grad"), [
    # log r = ln(0.25 / 0.5) = -ln 2. k1 = ln 2 = 0.693147, d/d logp = 1.
    ("k1", math.log(2), 1.0),
    # k2 = (ln 2)^2 / 2 = 0.240227, d/d logp = -log r = ln 2.
    ("k2", math.log(2) ** 2 / 2, math.log(2)),
    # k3 = (0.5 - 1) + ln 2 = 0.193147, d/d logp = 1 - r = 0.5.
    ("k3", -0.5 + math.log(2), 0.5),
])
def test_kl_estimators_by_hand(estimator, value, grad):
    logp = torch.tensor([[math.log(0.5)]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25)]])
    assert kl_penalty(logp, ref, estimator).item() == pytest.approx(value, abs=1e-6)
    # In the loss, with A = 0 (no policy term) and kl_coef 0.1: 0.1 * k, gradient 0.1 * dk.
    loss, stats = grpo_loss(LossInputs(logp, logp.detach(), torch.tensor([0.0]), torch.ones(1, 1), total_tokens=1,
                                       ref_logp=ref),
                            GrpoLoss(clip_low=0.2, clip_high=0.2, kl_coef=0.1, kl_estimator=estimator))
    assert loss.item() == pytest.approx(0.1 * value, abs=1e-6)
    assert stats.kl == pytest.approx(value, abs=1e-6)
    loss.backward()
    assert logp.grad.item() == pytest.approx(0.1 * grad, abs=1e-6)


def test_entropy_by_hand():
    # softmax([0, ln 3]) = [1/4, 3/4]: H = 1/4 ln 4 + 3/4 ln(4/3) = 0.346574 + 0.215762 = 0.562335.
    logits = torch.tensor([[[0.0, math.log(3.0)]]])
    assert token_entropy(logits, 1.0).item() == pytest.approx(0.562335, abs=1e-6)
    # Uniform over 2: ln 2.
    assert token_entropy(torch.zeros(1, 1, 2), 0.7).item() == pytest.approx(math.log(2), abs=1e-6)


def _group(finishes, rewards):
    return hand_group([completion([8, 9], [-0.1, -0.2], r, finish=f) for f, r in zip(finishes, rewards, strict=True)])


def test_overlong_penalty_lowers_the_reward_before_advantages():
    g = _group(["stop", "length"], [1.0, 1.0])
    # Rewards 1, 1 - 0.5 = 0.5: dr_grpo advantages ±0.25. Without the penalty both are 0.
    rows = group_rows(g, estimator="dr_grpo", overlong="penalty", overlong_penalty=0.5)
    assert [r.advantage for r in rows] == pytest.approx([0.25, -0.25])
    assert [r.advantage for r in group_rows(g, estimator="dr_grpo")] == [0.0, 0.0]


def test_overlong_mask_drops_the_tokens_but_keeps_the_baseline():
    g = _group(["stop", "length"], [1.0, 0.0])
    rows = group_rows(g, estimator="dr_grpo", overlong="mask")
    assert [r.advantage for r in rows] == pytest.approx([0.5, -0.5])
    assert rows[0].mask == [0, 0, 1, 1] and rows[1].mask == [0, 0, 0, 0]
    _, total_tokens, total_seqs = micro_batches([g], micro_batch_size=8, overlong="mask")
    assert (total_tokens, total_seqs) == (2, 1)


def test_split_rows_by_token_budget():
    rows = [Row(prompt=np.zeros(1, dtype=np.int32), ids=np.zeros(n, dtype=np.int32), trained=np.ones(n, dtype=bool),
                logprobs=np.zeros(n, dtype=np.float32), advantage=0.0) for n in (4, 3, 6, 2)]
    # Budget 8 padded tokens: [4, 3] -> 2 x 4 = 8; adding 6 would be 3 x 6; [6] alone (2 x 6 = 12 with
    # the 2); [2]. A row over the budget (6 > 5) still goes, alone.
    lengths = lambda parts: [[len(r.inputs) for r in p] for p in parts]  # noqa: E731
    assert lengths(split_rows(rows, micro_batch_size=8, micro_batch_tokens=8)) == [[4, 3], [6], [2]]
    assert lengths(split_rows(rows, micro_batch_size=8, micro_batch_tokens=5)) == [[4], [3], [6], [2]]
    assert lengths(split_rows(rows, micro_batch_size=3, micro_batch_tokens=0)) == [[4, 3, 6], [2]]
    assert lengths(split_rows(rows, micro_batch_size=1, micro_batch_tokens=100)) == [[4], [3], [6], [2]]


def test_lr_schedule_by_hand():
    # Warm-up 2: steps 0, 1 get 1/3, 2/3; then the peak.
    assert [lr_factor(s, schedule="constant", warmup_steps=2, total_steps=0) for s in range(4)] == \
        pytest.approx([1 / 3, 2 / 3, 1.0, 1.0])
    # Cosine over steps 2..6: progress 0, 1/4, 1/2, 3/4, 1 -> (1 + cos(pi p)) / 2 = 1, 0.853553, 0.5,
    # 0.146447, 0; and 0 after the end.
    got = [lr_factor(s, schedule="cosine", warmup_steps=2, total_steps=6) for s in range(8)]
    assert got == pytest.approx([1 / 3, 2 / 3, 1.0, 0.853553, 0.5, 0.146447, 0.0, 0.0], abs=1e-6)


# --------------------------------------------------------------------------- whole steps, in-process


@pytest.fixture
def steps(tiny_model):
    """Run one train_step from the same initial weights with the given options; return the parameters."""
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(5)
    groups = [make_group(base, f"g{i}", version=0, rng=rng) for i in range(3)]

    def run(groups=groups, **kw):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is the gradient itself
        ref_model = kw.pop("ref_model", None)
        how = GrpoOptions(**{**dict(loss=GrpoLoss(), temperature=1.0, estimator="grpo", overlong="none",
                                    overlong_penalty=0.0, micro_batch_size=16, micro_batch_tokens=0, updates=1,
                                    max_grad_norm=1e9), **kw})
        stats = train_step(model, opt, groups, how=how, ref_model=ref_model)
        return torch.cat([p.detach().flatten() for p in model.parameters()]), stats

    return run


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean"])
def test_micro_batching_does_not_change_the_update(steps, agg):
    loss = GrpoLoss(loss_agg=agg)
    whole, _ = steps(loss=loss)
    for split in (dict(micro_batch_size=1), dict(micro_batch_size=5), dict(micro_batch_tokens=40)):
        part, _ = steps(loss=loss, **split)
        # Float sums in another order and padding widths: agreement to float32 rounding.
        torch.testing.assert_close(part, whole, atol=2e-6, rtol=0)


def test_decoupled_on_policy_equals_behaviour_clip_and_mini_batches_step_twice(steps, tiny_model):
    # The groups' behaviour log-probs are the initial model's: the proximal pass matches them, so
    # the behaviour weight is 1 and the decoupled update equals the behaviour-clipped one.
    one, plain = steps()
    decoupled, st = steps(loss=GrpoLoss(correction="decoupled"))
    torch.testing.assert_close(decoupled, one, atol=1e-6, rtol=0)
    assert st.policy.tis == pytest.approx(1.0, abs=1e-4) and st.entropy > 0
    assert st.mismatch_max < 1e-4 and st.masked == 0.0
    # Two PPO mini-batches: two optimizer steps in one pass over the batch; the second
    # mini-batch's policy has moved (ratio off 1), which is what the clip bounds.
    two, st2 = steps(updates=2, loss=GrpoLoss(correction="decoupled"))
    assert not torch.allclose(two, one)
    # one pass over the rows; with shared prompts (the default) a group the mini-batches cut carries
    # its prompt into both pieces
    assert st2.tokens_forward > plain.tokens_forward
    flat = [steps(updates=n, loss=GrpoLoss(correction="decoupled"), share_prompts=False)[1] for n in (1, 2)]
    assert flat[1].tokens_forward == flat[0].tokens_forward > st2.tokens_forward
    assert abs(st2.policy.ratio - 1.0) > 1e-4 and abs(plain.policy.ratio - 1.0) < 1e-5
    ref = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).requires_grad_(False)
    _, st3 = steps(ref_model=ref, loss=GrpoLoss(kl_coef=0.1))
    assert st3.policy.kl == pytest.approx(0.0, abs=1e-6)  # the policy is the reference before its first update


def initial_weights(tiny_model) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def test_gradients_are_clipped_to_max_grad_norm(steps, tiny_model):
    start = initial_weights(tiny_model)
    free, st = steps()  # max_grad_norm 1e9: never clipped
    norm = st.grad_norm
    assert norm > 0
    clipped, st_clipped = steps(max_grad_norm=norm / 4)
    assert st_clipped.grad_norm == pytest.approx(norm, rel=1e-5)  # the norm before clipping is reported
    # with SGD at lr 1 the update is the gradient: clipped to a quarter of its norm, same direction
    torch.testing.assert_close(clipped - start, (free - start) / 4, rtol=1e-3, atol=1e-7)
    loose, _ = steps(max_grad_norm=norm * 2)  # a bound above the norm changes nothing
    torch.testing.assert_close(loose, free)


def test_a_step_with_nothing_to_train_on_leaves_the_weights(steps, tiny_model):
    from dataclasses import replace

    start = initial_weights(tiny_model)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    groups = [make_group(base, f"g{i}", version=0, rng=random.Random(i)) for i in range(2)]
    # every completion truncated and overlong = "mask": no token to train on
    truncated = [replace(g, completions=[replace(c, finish="length") for c in g.completions]) for g in groups]
    after, st = steps(groups=truncated, overlong="mask")
    assert st.tokens_trained == 0 and st.grad_norm == 0 and st.loss == 0, st
    assert torch.equal(after, start)
    # every group's completions rewarded alike: every advantage is 0, so is the gradient
    alike = [replace(g, completions=[replace(c, reward=1.0) for c in g.completions]) for g in groups]
    after, st = steps(groups=alike)
    assert st.tokens_trained > 0 and st.grad_norm == 0 and math.isfinite(st.entropy), st
    assert torch.equal(after, start)
