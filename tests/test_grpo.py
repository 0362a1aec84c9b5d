"""GRPO's pure functions against numbers worked out by hand."""

import math

import pytest
import torch

from common.config import GrpoLoss
from tests.harness.losses import clip_case
from trainer.grpo import group_advantages, token_logprobs
from trainer.losses import LossInputs
from trainer.losses.grpo import loss as grpo_loss


def test_group_advantages_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0], [0.5, 0.5, 0.5, 0.5]])
    adv = group_advantages(rewards)
    # Group 0: mean 0.5, deviations ±0.5; unbiased var = 4 * 0.25 / 3 = 1/3, std = 0.57735.
    # A = ±0.5 / 0.57735 = ±0.866025.
    # Group 1: mean 2, deviations 1, -1, 0, 0; var = 2 / 3, std = 0.816497; A = ±1.224745, 0, 0.
    # Group 2: all equal: std 0, A = 0 / (0 + eps) = 0.
    want = torch.tensor([[0.866025, -0.866025, -0.866025, 0.866025],
                         [1.224745, -1.224745, 0.0, 0.0],
                         [0.0, 0.0, 0.0, 0.0]])
    torch.testing.assert_close(adv, want, atol=1e-5, rtol=0)


def test_group_advantages_needs_two_completions():
    with pytest.raises(AssertionError, match="at least 2"):
        group_advantages(torch.tensor([[1.0]]))


def test_token_logprobs_by_hand():
    # logits [0, ln 3]: softmax = [1/4, 3/4]. At temperature 2 the logits halve to [0, ln √3]:
    # softmax = [1 / (1 + √3), √3 / (1 + √3)].
    logits = torch.tensor([[[0.0, math.log(3.0)], [0.0, math.log(3.0)]]])  # (1, 2, 2)
    targets = torch.tensor([[1, 0]])
    torch.testing.assert_close(token_logprobs(logits, targets, 1.0),
                               torch.tensor([[math.log(0.75), math.log(0.25)]]))
    s3 = math.sqrt(3.0)
    torch.testing.assert_close(token_logprobs(logits, targets, 2.0),
                               torch.tensor([[math.log(s3 / (1 + s3)), math.log(1 / (1 + s3))]]))


def test_token_logprobs_matches_log_softmax():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 11, generator=g, dtype=torch.float64).to(torch.bfloat16)
    targets = torch.randint(0, 11, (3, 5), generator=g)
    want = torch.log_softmax(logits.float() / 0.7, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    got = token_logprobs(logits, targets, 0.7)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want)


def test_grpo_loss_by_hand():
    logp, behaviour, adv, mask = clip_case()
    loss, stats = grpo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=5),
                            GrpoLoss(clip_low=0.2, clip_high=0.3))
    # Clip range [0.8, 1.3]. Per-token loss -min(r A, clip(r) A):
    #   row 0, r 1.5, A +1: min(1.5, 1.3) = 1.3   -> -1.3 (high clip active)
    #   row 0, r 0.9, A +1: min(0.9, 0.9)         -> -0.9
    #   row 1, r 0.5, A -1: min(-0.5, -0.8) = -0.8 -> +0.8 (low clip active)
    #   row 1, r 1.1, A -1:                       -> +1.1
    #   row 1, r 1.0, A -1:                       -> +1.0
    # Sum 0.7 over 5 tokens = 0.14.
    assert loss.item() == pytest.approx(0.14, abs=1e-6)
    assert stats.clip_high == pytest.approx(1 / 5)
    assert stats.clip_low == pytest.approx(1 / 5)
    assert stats.clip_region == pytest.approx(2 / 5)
    assert stats.ratio == pytest.approx((1.5 + 0.9 + 0.5 + 1.1 + 1.0) / 5)
    # d loss / d logp = -r A / 5 where the clip is inactive, 0 where it is active or masked.
    loss.backward()
    want = torch.tensor([[0.0, -0.9 / 5, 0.0], [0.0, 1.1 / 5, 1.0 / 5]])
    torch.testing.assert_close(logp.grad, want)


def test_grpo_loss_micro_batches_add_up_to_the_step_mean():
    logp, behaviour, adv, mask = clip_case()
    cfg = GrpoLoss(clip_low=0.2, clip_high=0.3)
    whole, _ = grpo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=5), cfg)
    parts = [grpo_loss(LossInputs(logp[i : i + 1], behaviour[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                                  total_tokens=5), cfg)[0] for i in range(2)]
    # Row 0 gives (-1.3 - 0.9) / 5 = -0.44; row 1 gives (0.8 + 1.1 + 1.0) / 5 = 0.58.
    assert parts[0].item() == pytest.approx(-0.44, abs=1e-6)
    assert parts[1].item() == pytest.approx(0.58, abs=1e-6)
    assert (parts[0] + parts[1]).item() == pytest.approx(whole.item(), abs=1e-6)


def test_clip_bounds_are_asymmetric():
    def loss(ratio: float, adv: float, clip_low: float, clip_high: float) -> float:
        logp = torch.tensor([[math.log(ratio)]])
        out, _ = grpo_loss(LossInputs(logp, torch.zeros(1, 1), torch.tensor([adv]), torch.ones(1, 1), total_tokens=1),
                           GrpoLoss(clip_low=clip_low, clip_high=clip_high))
        return out.item()

    # r = 1.25, A = +1: inside [0.8, 1.3] -> -1.25; with the high bound at 1.2 -> -1.2.
    assert loss(1.25, 1.0, 0.2, 0.3) == pytest.approx(-1.25)
    assert loss(1.25, 1.0, 0.3, 0.2) == pytest.approx(-1.2)
    # r = 0.75, A = -1: low bound 0.8 -> -min(-0.75, -0.8) = 0.8; low bound 0.7 -> 0.75.
    assert loss(0.75, -1.0, 0.2, 0.3) == pytest.approx(0.8)
    assert loss(0.75, -1.0, 0.3, 0.2) == pytest.approx(0.75)


def test_padding_never_makes_nan():
    # A masked position whose log-ratio would overflow exp() contributes nothing.
    logp = torch.tensor([[-1.0, 0.0]], requires_grad=True)
    behaviour = torch.tensor([[-1.0, -1000.0]])
    loss, stats = grpo_loss(LossInputs(logp, behaviour, torch.tensor([1.0]), torch.tensor([[1.0, 0.0]]),
                                       total_tokens=1), GrpoLoss(clip_low=0.2, clip_high=0.2))
    loss.backward()
    assert loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(logp.grad).all() and stats.ratio == pytest.approx(1.0)
