"""The loss as a plug-in: trainer/losses/<type>.py found by [trainer.loss]'s type, a custom loss
by its "module:function", each against numbers worked out by hand or the built-in it wraps."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import ConfigError, CustomLoss, GrpoLoss, config_from_dict
from tests.harness.groups import make_group
from tests.harness.losses import clip_case
from trainer.losses import LossInputs, LossOutputs, LossStats, loss_function
from trainer.losses import grpo as grpo_module
from trainer.step import GrpoOptions, train_step


def scaled_grpo(inputs: LossInputs, *, scale: float) -> LossOutputs:
    """A custom loss: grpo's with its defaults, times `scale` ([trainer.loss.kwargs])."""
    loss, stats = grpo_module.loss(inputs, GrpoLoss())
    return LossOutputs(loss * scale, stats)


def custom(**kwargs) -> CustomLoss:
    table = {"type": "custom", "function": "tests.test_losses:scaled_grpo", "kwargs": kwargs}
    return config_from_dict({"trainer": {"loss": table}}).trainer.loss


def test_a_custom_loss_is_its_function_with_its_kwargs():
    logp, behaviour, adv, mask = clip_case()
    inputs = LossInputs(logp, behaviour, adv, mask, total_tokens=5)
    got = loss_function(custom(scale=0.5))(inputs)
    want = grpo_module.loss(inputs, GrpoLoss())
    # grpo, clip [0.8, 1.2]: -1.2, -0.9 | +0.8, +1.1, +1.0 -> 0.8 / 5; halved.
    assert want.loss.item() == pytest.approx(0.8 / 5, abs=1e-6)
    assert got.loss.item() == pytest.approx(0.4 / 5, abs=1e-6)
    assert isinstance(got.stats, LossStats) and got.stats == want.stats


def test_a_custom_loss_that_does_not_load_names_its_field():
    with pytest.raises(ConfigError, match=r"trainer\.loss\.function: String should match pattern"):
        config_from_dict({"trainer": {"loss": {"type": "custom", "function": "no colon"}}})
    with pytest.raises(ValueError, match=r"trainer\.loss\.function 'tests\.test_losses:nothing' cannot be loaded"):
        loss_function(CustomLoss(function="tests.test_losses:nothing"))


def test_a_custom_loss_trains_a_step_as_its_function_says(tiny_model):
    """A custom loss goes through the step as a built-in does: scale 1 is grpo's update, bit for
    bit, with the same stats; scale 0 moves nothing."""
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(8)
    groups = [make_group(base, f"c{i}", version=0, rng=rng) for i in range(2)]

    def step(loss):
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
        stats = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), groups, how=GrpoOptions(
            loss=loss, temperature=1.0, estimator="grpo", overlong="none", overlong_penalty=0.0,
            micro_batch_size=3, micro_batch_tokens=0, updates=1, max_grad_norm=1e9))
        return torch.cat([p.detach().flatten() for p in model.parameters()]), stats

    builtin, builtin_stats = step(GrpoLoss())
    same, same_stats = step(custom(scale=1.0))
    assert torch.equal(same, builtin) and same_stats == builtin_stats
    still, still_stats = step(custom(scale=0.0))
    assert torch.equal(still, torch.cat([p.detach().flatten() for p in base.parameters()]))
    assert still_stats.loss == 0.0 and still_stats.policy is not None and builtin_stats.policy is not None


def test_cispo_by_hand():
    """CISPO weighs each token's log-likelihood by its clipped ratio, without gradient through it:
    clipped tokens keep their gradient (PPO's clip drops it)."""
    from common.config import CispoLoss
    from trainer.losses.cispo import loss as cispo_loss

    logp, behaviour, adv, mask = clip_case()  # ratios 1.5, 0.9 (A +1) | 0.5, 1.1, 1.0 (A -1); logp = -2 + ln r
    loss, stats = cispo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=5),
                             CispoLoss(clip_low=0.2, clip_high=0.3))
    # Weights clip(r, 0.8, 1.3): 1.3, 0.9 | 0.8, 1.1, 1.0. Per token -w A logp:
    #   row 0: -1.3 (-2 + ln 1.5) = 2.072895, -0.9 (-2 + ln 0.9) = 1.894824
    #   row 1: +0.8 (-2 + ln 0.5) = -2.154518, +1.1 (-2 + ln 1.1) = -2.095159, +1.0 (-2 + 0) = -2
    # Sum -2.281957 over 5 tokens = -0.456391.
    assert loss.item() == pytest.approx(-2.281957 / 5, abs=1e-6)
    assert stats.clip_high == pytest.approx(1 / 5) and stats.clip_low == pytest.approx(1 / 5)
    assert stats.ratio == pytest.approx((1.5 + 0.9 + 0.5 + 1.1 + 1.0) / 5)
    # d loss / d logp = -w A / 5 on every trained token, the clipped ones (1.5 and 0.5) included.
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-1.3 / 5, -0.9 / 5, 0.0], [0.8 / 5, 1.1 / 5, 1.0 / 5]]))
    # [trainer.loss] type = "cispo" is this file's loss
    cfg = config_from_dict({"trainer": {"loss": {"type": "cispo", "clip_low": 0.2, "clip_high": 0.3}}}).trainer.loss
    assert loss_function(cfg)(LossInputs(logp, behaviour, adv, mask, total_tokens=5)).loss.item() == loss.item()
