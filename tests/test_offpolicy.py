"""The off-policy layer: corrections that act (decoupled PPO, token and sequence masking, dual
clip), the mismatch they measure, log-probs under the sampler's truncation, configurations that
would stall, and the updates that must not happen (non-finite, errored rewards, duplicates)."""

import copy
import math
import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.config import CORRECTIONS, Config, ConfigError, GrpoLoss, RolloutConfig, TrainerConfig, config_from_dict
from common.keys import Keys
from common.messages import Completion, SampleGroup
from common.progress import read_trainer
from common.shaping import zero_variance
from engines.base import SamplingSettings
from engines.hf_engine import HFEngine
from producers.admission import admission_limit
from tests.harness.groups import make_group
from trainer.batch import group_rows
from trainer.devices import placement
from trainer.grpo import token_logprobs
from trainer.losses import LossInputs
from trainer.losses.grpo import loss as grpo_loss
from trainer.losses.kl import kl_penalty
from trainer.main import objective, train
from trainer.run import Run
from trainer.samples import Collected, cross_rank_duplicates, group_tokens
from trainer.schedule import build_scheduler
from trainer.step import GrpoOptions, train_step

LN = math.log


def weighted_case(weights: list[list[float]], adv: list[float]):
    """logp = proximal (ratio 1), behaviour = -2, proximal / behaviour = `weights` per token."""
    behaviour = torch.full((len(weights), len(weights[0])), -2.0)
    prox = behaviour + torch.tensor(weights).log()
    return prox.clone().requires_grad_(), behaviour, torch.tensor(adv), torch.ones_like(behaviour), prox


# --------------------------------------------------------------------------- the corrections, by hand


def test_token_mask_drops_tokens_outside_the_band():
    # A = +1, ratio 1: pg = -1 per token. Weights 3 and 0.4 leave [0.5, 2] (dropped); 1 stays.
    logp, behaviour, adv, mask, prox = weighted_case([[3.0, 1.0, 0.4]], [1.0])
    loss, stats = grpo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=3, prox_logp=prox),
                            GrpoLoss(correction={"type": "token_mask", "mask_low": 0.5, "mask_high": 2.0}))
    assert loss.item() == pytest.approx(-1 / 3, abs=1e-6)
    assert stats.tis == pytest.approx(1 / 3, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -1 / 3, 0.0]]))
    # decoupled caps instead: min(3, 2) = 2, 1, 0.4 -> (-2 - 1 - 0.4) / 3.
    logp2 = prox.clone().requires_grad_()
    loss2, _ = grpo_loss(LossInputs(logp2, behaviour, adv, mask, total_tokens=3, prox_logp=prox),
                         GrpoLoss(correction={"type": "decoupled", "tis_cap": 2.0}))
    assert loss2.item() == pytest.approx(-3.4 / 3, abs=1e-6)


def test_sequence_mask_drops_whole_sequences_by_geometric_mean():
    # Row 0: weights 3, 1 -> geometric mean sqrt(3) = 1.732 inside [0.5, 2]: each token weighs 1.732.
    # Row 1: weights 3, 3 -> 3, outside: the sequence is dropped. A = +1, ratio 1, pg = -1.
    logp, behaviour, adv, mask, prox = weighted_case([[3.0, 1.0], [3.0, 3.0]], [1.0, 1.0])
    loss, _ = grpo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=4, prox_logp=prox),
                        GrpoLoss(correction="sequence_mask"))
    assert loss.item() == pytest.approx(-2 * math.sqrt(3) / 4, abs=1e-6)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-math.sqrt(3) / 4] * 2, [0.0, 0.0]]))


def test_behaviour_clip_clips_the_behaviour_ratio_and_ignores_the_proximal():
    # Same tokens: against behaviour the ratio is 3 (A = +1, clipped to 1.2, no gradient) and 1.
    logp, behaviour, adv, mask, prox = weighted_case([[3.0, 1.0]], [1.0])
    loss, stats = grpo_loss(LossInputs(logp, behaviour, adv, mask, total_tokens=2, prox_logp=prox),
                            GrpoLoss(correction="behaviour_clip", clip_low=0.2, clip_high=0.2))
    assert loss.item() == pytest.approx((-1.2 - 1.0) / 2, abs=1e-6)
    assert stats.clip_high == pytest.approx(0.5) and stats.tis == 1.0


def test_dual_clip_bounds_negative_advantage_losses():
    # A = -1, ratio 5: PPO's loss is -min(-5, -1.2) = 5; the dual clip c = 3 bounds it at 3 (no gradient).
    behaviour = torch.tensor([[-2.0]])
    logp = (behaviour + LN(5.0)).requires_grad_()
    inputs = LossInputs(logp, behaviour, torch.tensor([-1.0]), torch.ones(1, 1), total_tokens=1)
    plain, _ = grpo_loss(inputs, GrpoLoss(clip_low=0.2, clip_high=0.2))
    dual, stats = grpo_loss(inputs, GrpoLoss(clip_low=0.2, clip_high=0.2, clip_ratio_c=3.0))
    assert plain.item() == pytest.approx(5.0, abs=1e-5) and dual.item() == pytest.approx(3.0, abs=1e-6)
    assert stats.clip_dual == 1.0
    dual.backward()
    assert logp.grad.item() == 0.0


def test_dr_grpo_constant_normaliser():
    # Per-token losses (tests/test_grpo clip_case, clip 0.2 / 0.3): -1.3, -0.9 | 0.8, 1.1, 1.0, sum 0.7.
    from tests.harness.losses import clip_case

    logp, behaviour, adv, mask = clip_case()
    inputs = LossInputs(logp, behaviour, adv, mask, total_tokens=5, norm_tokens=2 * 4)
    token_mean, _ = grpo_loss(inputs, GrpoLoss(clip_low=0.2, clip_high=0.3))
    constant, _ = grpo_loss(inputs, GrpoLoss(clip_low=0.2, clip_high=0.3, loss_agg="token_sum_norm"))
    assert token_mean.item() == pytest.approx(0.7 / 5, abs=1e-6)
    assert constant.item() == pytest.approx(0.7 / 8, abs=1e-6)  # 2 completions x max_new_tokens 4


def test_bias_corrected_k3_is_k3_times_the_ratio():
    # pi = 0.5, ref = 0.25, ratio pi / pi_old = 2: k3 = -0.5 + ln 2; k3_is = 2 k3; its gradient
    # d(ratio * k3)/d logp = ratio * k3 + ratio * (1 - ref / pi) = 2 k3 + 1.
    logp = torch.tensor([[LN(0.5)]], requires_grad=True)
    ratio = torch.exp(logp - (LN(0.5) - LN(2.0)))
    k3 = -0.5 + LN(2.0)
    value = kl_penalty(logp, torch.tensor([[LN(0.25)]]), "k3_is", ratio=ratio)
    assert value.item() == pytest.approx(2 * k3, abs=1e-6)
    value.sum().backward()
    assert logp.grad.item() == pytest.approx(2 * k3 + 1.0, abs=1e-5)


def test_truncated_logprobs_by_hand():
    # probs 0.1, 0.2, 0.3, 0.4. top_k 3 keeps the last three: 2/9, 3/9, 4/9. top_p 0.6 keeps the
    # smallest set of largest reaching 0.6: {0.3, 0.4} -> 3/7, 4/7; token 0 is cut (its log-prob floors).
    logits = torch.tensor([[0.1, 0.2, 0.3, 0.4]]).log().unsqueeze(0).expand(1, 4, 4)  # (1, 4, 4)
    targets = torch.tensor([[0, 1, 2, 3]])
    got_k = token_logprobs(logits, targets, 1.0, top_k=3)
    torch.testing.assert_close(got_k[0, 1:], torch.tensor([2 / 9, 3 / 9, 4 / 9]).log())
    got_p = token_logprobs(logits, targets, 1.0, top_p=0.6)
    torch.testing.assert_close(got_p[0, 2:], torch.tensor([3 / 7, 4 / 7]).log())
    assert got_p[0, 0].item() <= -1e4 and got_k[0, 0].item() <= -1e4


# --------------------------------------------------------------------------- whole steps


def sampled_groups(model_dir, *, top_k: int, n_groups: int = 2, version: int = 0) -> list[SampleGroup]:
    """Groups sampled by the HF engine (temperature 1, `top_k`) with its behaviour log-probs."""
    engine = HFEngine(model_dir, seed=3)
    rng = random.Random(1)
    prompts = [[rng.randrange(10, 300) for _ in range(5)] for _ in range(n_groups)]
    out = engine.sample(prompts, SamplingSettings(n=4, max_new_tokens=8, temperature=1.0, top_k=top_k))
    return [SampleGroup(id=f"s{i}", prompt_id=f"s{i}", prompt_ids=p, version=version, generator="t", engine="hf",
                        completions=[Completion(ids=s.ids, logprobs=s.logprobs, reward=float(j % 2),
                                                rewards={}, finish=s.finish, text="")
                                     for j, s in enumerate(samples)])
            for i, (p, samples) in enumerate(zip(prompts, out, strict=True))]


def step_args(**kw) -> GrpoOptions:
    return GrpoOptions(**{**dict(loss=GrpoLoss(), temperature=1.0, estimator="grpo", overlong="none",
                                 overlong_penalty=0.0, micro_batch_size=16, micro_batch_tokens=0, updates=1,
                                 max_grad_norm=1e9), **kw})


def test_top_k_sampling_gives_ratio_one_on_policy(tiny_model):
    torch.set_num_threads(1)
    groups = sampled_groups(tiny_model, top_k=2)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    truncated = train_step(model, opt, groups, how=step_args(top_k=2, loss=GrpoLoss(correction="decoupled")))
    assert truncated.policy.ratio == pytest.approx(1.0, abs=1e-4)
    assert truncated.mismatch_max < 1e-4
    # The full softmax (what the trainer computed before) puts the on-policy ratio well below 1.
    full = train_step(model, opt, groups, how=step_args())
    assert full.policy.ratio < 0.9


def test_mismatch_is_logged_by_staleness_and_masking_acts(tiny_model):
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(4)
    groups = [make_group(base, "a", version=1, rng=rng), make_group(base, "b", version=0, rng=rng)]
    moved = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        moved.lm_head.weight.mul_(3.0)  # the trainer's policy has moved away from the sampler's
    opt = torch.optim.SGD(moved.parameters(), lr=0.0)
    st = train_step(moved, opt, groups, step=2, how=step_args(loss=GrpoLoss(correction="decoupled")))
    assert st.mismatch_mean > 0.05
    assert st.mismatch_max >= st.mismatch_mean
    assert {1, 2} <= set(st.mismatch_by_staleness)
    assert st.policy.tis != pytest.approx(1.0, abs=1e-3)  # the correction's weight acts
    masked = train_step(moved, opt, groups, step=2, how=step_args(
        loss=GrpoLoss(correction={"type": "token_mask", "mask_low": 0.9, "mask_high": 1.1})))
    assert 0 < masked.masked <= 1


def test_proximal_pass_runs_with_dropout_off(tiny_model):
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)  # eval mode: no dropout
    rng = random.Random(6)
    groups = [make_group(base, f"d{i}", version=0, rng=rng) for i in range(2)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, attention_dropout=0.5)
    model.train()  # as the trainer's model is after its first step
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    st = train_step(model, opt, groups, how=step_args(loss=GrpoLoss(correction="decoupled")))
    assert st.mismatch_max < 1e-4  # the proximal pass is the sampler's policy exactly


@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_the_step_runs_the_proximal_pass_exactly_where_the_correction_declares_it(tiny_model, correction,
                                                                                  monkeypatch):
    # Whether a correction takes the proximal pass is written once, in its file (its Options'
    # `proximal`, behaviour_clip's False). Turned the other way, the step follows the declaration
    # and not the correction's name: no forward pass without gradients where it declares none; where
    # it declares one, one for each micro-batch of the second update (the first update's weights are
    # the proximal policy: its log-probs are that update's own, test_the_first_update_...).
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    group = make_group(model.config.vocab_size, "g", version=0, rng=random.Random(0), shape=(4, [3, 5]))
    passes = {True: 0, False: 0}  # forward passes through the model, by whether they took gradients
    model.get_input_embeddings().register_forward_pre_hook(
        lambda *_: passes.__setitem__(torch.is_grad_enabled(), passes[torch.is_grad_enabled()] + 1))
    for declared in (not CORRECTIONS[correction].proximal, CORRECTIONS[correction].proximal):
        monkeypatch.setattr(CORRECTIONS[correction], "proximal", declared)
        passes.update({True: 0, False: 0})
        st = train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [group], how=step_args(
            loss=GrpoLoss(correction={"type": correction}), updates=2))
        assert math.isfinite(st.loss) and st.tokens_trained > 0
        assert passes[True] == 2, passes  # each update's forward of its one micro-batch
        assert passes[False] == (1 if declared else 0), (correction, declared, passes)


@pytest.mark.parametrize("updates", [1, 2])
def test_the_first_update_takes_its_proximal_log_probs_from_its_own_forward(tiny_model, updates, monkeypatch):
    # The first update's weights are the step's start, the proximal policy: its log-probs are that
    # update's own forward's (detached), not a pass of their own, and the update is the one a
    # separate proximal pass gives. A model whose training forward differs from its no-grad one
    # (dropout) still gets the pass: test_proximal_pass_runs_with_dropout_off.
    import trainer.step

    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(4)
    groups = [make_group(base.config.vocab_size, f"o{i}", version=0, rng=rng, shape=(4, [3, 6, 9, 5]))
              for i in range(2)]  # behaviour log-probs at random: the decoupled weight pi_prox / pi_behav acts
    how = step_args(loss=GrpoLoss(correction="decoupled", clip_low=0.05, clip_high=0.05), updates=updates,
                    micro_batch_size=4)
    after, stats, passes = {}, {}, {}
    for taken in (False, True):
        monkeypatch.setattr(trainer.step, "trains_as_it_infers", lambda m, taken=taken: not taken)
        model = copy.deepcopy(base).train()
        passes[taken] = 0
        model.get_input_embeddings().register_forward_pre_hook(
            lambda *_, taken=taken: passes.__setitem__(taken, passes[taken] + (not torch.is_grad_enabled())))
        stats[taken] = train_step(model, torch.optim.SGD(model.parameters(), lr=0.5), groups, step=1, how=how)
        after[taken] = model.state_dict()
    # two micro-batches in all (of 4 rows: both the one update's, or one each of two updates); the
    # separate pass runs over both, the first update's own log-probs leave only the second update's
    assert passes == {True: 2, False: updates - 1}, passes
    assert stats[False].skipped == stats[True].skipped == 0
    assert stats[False].loss == pytest.approx(stats[True].loss, abs=1e-6)
    assert stats[False].policy.tis == pytest.approx(stats[True].policy.tis, abs=1e-6)
    assert stats[False].mismatch_mean == pytest.approx(stats[True].mismatch_mean, abs=1e-6)
    assert stats[True].policy.tis != pytest.approx(1.0, abs=1e-3)  # the weight pi_prox / pi_behav acts
    moved = max((after[True][k] - base.state_dict()[k]).abs().max().item() for k in after[True])
    assert moved > 1e-3  # the steps did update the weights
    for name, tensor in after[True].items():
        torch.testing.assert_close(after[False][name], tensor, atol=1e-5, rtol=0, msg=name)


def test_a_model_with_dropout_does_not_train_as_it_infers(tiny_model):
    from trainer.lora import apply_lora
    from trainer.step import trains_as_it_infers

    def model(**load):
        return AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, **load)

    assert trains_as_it_infers(model())
    assert not trains_as_it_infers(model(attention_dropout=0.1))  # applied by `self.training`, no module
    assert trains_as_it_infers(apply_lora(model(), rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj"]))
    assert not trains_as_it_infers(apply_lora(model(), rank=4, alpha=8.0, dropout=0.1, target_modules=["q_proj"]))


def test_non_finite_update_is_skipped_not_applied_and_counted(tiny_model, r):
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(7)
    groups = [make_group(base, f"n{i}", version=0, rng=rng) for i in range(2)]
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        model.lm_head.weight[5, 3] = float("inf")  # every logit row gets an inf: the loss is NaN
    before = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    where = placement(dtype="float32", master_fp32=True, activation_checkpointing=False)
    run = Run(config=Config(), r=r, keys=Keys("nf"), model=model, optimizer=opt,
              scheduler=build_scheduler(opt, schedule="constant", warmup_steps=0, total_steps=0),
              update=objective(TrainerConfig(), RolloutConfig(), source_dir=tiny_model, where=where),
              source_dir=tiny_model, state_root=tiny_model / "unused", step=3, version=3)
    stats, _ = train(run, groups)
    assert stats.skipped == 1
    assert run.step == 3 and run.scheduler.last_epoch == 0  # not counted: nothing to publish
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, before[name], equal_nan=True)
    assert not opt.state  # AdamW never stepped
    assert read_trainer(r, Keys("nf")).steps_skipped == 1


def test_errored_rewards_leave_the_loss_and_the_group_statistics():
    ok = dict(ids=[5, 6], logprobs=[-1.0, -1.0], rewards={}, finish="stop", text="")
    group = SampleGroup(id="e", prompt_id="e", prompt_ids=[1, 2], version=0, generator="t", engine="hf",
                        completions=[Completion(reward=1.0, **ok), Completion(reward=0.0, reward_error="timeout", **ok),
                                     Completion(reward=0.0, **ok), Completion(reward=1.0, **ok)])
    rows = group_rows(group)
    # Scored rewards 1, 0, 1: mean 2/3, unbiased std sqrt(1/3); advantages 1/3 / 0.57735 = 0.57735, -1.1547.
    assert [row.advantage for row in rows] == pytest.approx([0.57735, 0.0, -1.1547, 0.57735], abs=1e-4)
    assert sum(rows[1].mask) == 0 and all(sum(row.mask) == 2 for row in rows if row is not rows[1])


def test_zero_variance_is_judged_after_the_overlong_penalty():
    c = dict(ids=[5], logprobs=[-1.0], reward=1.0, rewards={}, text="")
    group = SampleGroup(id="z", prompt_id="z", prompt_ids=[1, 2], version=0, generator="t", engine="hf",
                        completions=[Completion(finish="stop", **c), Completion(finish="length", **c)])
    assert zero_variance(group)  # both rewards 1
    assert not zero_variance(group, overlong="penalty", overlong_penalty=1.0)  # 1 and 0: the trainer learns


def test_a_group_read_by_two_ranks_trains_once():
    base_rng = random.Random(0)

    def group(gid: str) -> SampleGroup:
        comps = [Completion(ids=[base_rng.randrange(9)], logprobs=[-1.0], reward=float(i % 2), rewards={},
                            finish="stop", text="") for i in range(2)]
        return SampleGroup(id=gid, prompt_id=gid, prompt_ids=[1, 2], version=0, generator="t", engine="hf",
                           completions=comps)

    ranks = [Collected(groups=[group("a"), group("b")], entry_ids=[b"1-0", b"2-0"]),
             Collected(groups=[group("b"), group("c")], entry_ids=[b"3-0", b"4-0"])]
    everyone, _ = cross_rank_duplicates(ranks, rank=1)
    assert [[g.id for g in c.groups] for c in everyone] == [["a", "b"], ["c"]]
    assert everyone[1].duplicate == 1 and everyone[1].entry_ids == [b"3-0", b"4-0"]  # still acknowledged
    mine = [cross_rank_duplicates(ranks, rank=n)[1] for n in (0, 1)]
    assert [len(m) for m in mine] == [2, 2]  # each rank keeps as many groups as it read, for the collectives ...
    trained = [g.id for m in mine for g in m if any(sum(row.mask) for row in group_rows(g))]
    assert sorted(trained) == ["a", "b", "c"]  # ... and the copy of b trains nothing
    assert sorted(g.id for m in mine for g in m) == ["a", "b", "b", "c"]


def test_the_steps_groups_are_dealt_to_the_ranks_by_tokens():
    """Rank 0 read the two long groups, rank 1 the two short ones: each trains one of each, so that
    neither waits for the other; each as many groups as it read, every group once, the same deal
    on every rank."""

    def group(gid: str, n: int) -> SampleGroup:
        comps = [Completion(ids=[1] * n, logprobs=[-1.0] * n, reward=float(i % 2), rewards={}, finish="stop",
                            text="") for i in range(2)]
        return SampleGroup(id=gid, prompt_id=gid, prompt_ids=[1, 2], version=0, generator="t", engine="hf",
                           completions=comps)

    ranks = [Collected(groups=[group("long1", 300), group("long2", 280)]),
             Collected(groups=[group("short1", 10), group("short2", 12)])]
    mine = [cross_rank_duplicates(ranks, rank=n)[1] for n in (0, 1)]
    assert [sorted(g.id for g in m) for m in mine] == [["long1", "short1"], ["long2", "short2"]]
    tokens = [sum(group_tokens(g) for g in m) for m in mine]
    assert max(tokens) - min(tokens) <= max(group_tokens(g) for c in ranks for g in c.groups)
    assert mine == [cross_rank_duplicates(ranks, rank=n)[1] for n in (0, 1)]  # the same deal each time
    three = ranks + [Collected(groups=[group("mid", 100)])]
    dealt = [cross_rank_duplicates(three, rank=n)[1] for n in range(3)]
    assert [len(m) for m in dealt] == [2, 2, 1]


# --------------------------------------------------------------------------- configurations


def test_stalling_staleness_configuration_is_refused_in_one_line():
    with pytest.raises(ConfigError) as err:
        config_from_dict({"trainer": {"sync_every": 3}, "rollout": {"max_staleness": 1}})
    lines = str(err.value).splitlines()
    assert len(lines) == 2 and "trainer.sync_every" in lines[1] and "rollout.max_staleness" in lines[1]
    config_from_dict({"trainer": {"sync_every": 2}, "rollout": {"max_staleness": 1}})
    config_from_dict({"trainer": {"sync_every": 3, "objective": "sft"}, "rollout": {"max_staleness": 0}})


def test_gspo_needs_its_sequence_mean_and_dual_clip_above_one():
    with pytest.raises(ConfigError, match="loss_agg"):  # GSPO's aggregation is its sequence mean, always
        config_from_dict({"trainer": {"loss": {"type": "gspo", "loss_agg": "token_mean"}}})
    config_from_dict({"trainer": {"loss": {"type": "gspo"}}})
    with pytest.raises(ConfigError, match="clip_ratio_c"):
        config_from_dict({"trainer": {"loss": {"clip_ratio_c": 0.5}}})
    with pytest.raises(ConfigError, match="updates_per_batch"):
        config_from_dict({"trainer": {"updates_per_batch": 100}, "rollout": {"prompts_per_step": 2}})


def simulate(*, sync_every: int, max_staleness: int, steps: int, per_step: int = 2) -> int:
    """Trainer steps a run reaches (at most `steps`) under the producer's admission limit and the
    trainer's staleness drop, a generator sampling each admitted prompt at once with the published
    weights. Stops when no group can be admitted nor trained, or when groups only go round being
    admitted and dropped as stale (1000 reads without a step)."""
    admitted, dropped, step, version, idle = 0, 0, 0, 0, 0
    queue: list[int] = []  # sample versions, in stream order
    while step < steps and idle < 1000:
        idle += 1
        limit = admission_limit(version=version, max_staleness=max_staleness, prompts_per_step=per_step,
                                dropped=dropped)
        queue += [version] * (limit - admitted)
        admitted = limit
        fresh = []
        while queue and len(fresh) < per_step:
            v = queue.pop(0)
            if step - v > max_staleness:
                dropped += 1
            else:
                fresh.append(v)
        if len(fresh) < per_step:
            if not queue and admission_limit(version=version, max_staleness=max_staleness,
                                             prompts_per_step=per_step, dropped=dropped) == admitted:
                return step  # nothing more will come: stalled
            queue = fresh + queue
            continue
        step, idle = step + 1, 0
        if step % sync_every == 0:
            version = step
    return step


@pytest.mark.parametrize("max_staleness", [0, 1, 2, 4])
def test_admission_and_staleness_drop_agree_for_every_accepted_configuration(max_staleness):
    for sync_every in range(1, 7):
        try:
            config_from_dict({"trainer": {"sync_every": sync_every}, "rollout": {"max_staleness": max_staleness}})
            accepted = True
        except ConfigError:
            accepted = False
        reached = simulate(sync_every=sync_every, max_staleness=max_staleness, steps=30)
        assert (reached == 30) == accepted, (sync_every, max_staleness, reached)
