"""On-policy distillation from a teacher ([teacher], common/teacher.py): the generator carries the
teacher's log-prob of each sampled token over the same prefix (environment tokens unscored); the
trainer's token advantages are A - distill_weight * (log pi_behav - log pi_teacher) on the trained
tokens; a source with reward = "none" (distillation alone) needs a teacher; a teacher that fails
or overruns never loses the prompt: its group is written once, reward-only, the error recorded."""

import dataclasses
import random
import re
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import ConfigError, config_from_dict
from common.keys import Keys
from common.messages import MessageError, decode_group, encode
from common.teacher import Teacher, fingerprint
from generators.groups import with_teacher
from tests.harness.groups import completion, hand_group, make_group
from tests.harness.models import perturbed_copy, reference_logprobs
from tests.harness.teacher_runs import run_generator
from trainer.batch import collate, group_rows
from trainer.grpo import token_advantages

TOL = 1e-5  # the teacher's batched, padded pass against one plain sequence (float32)


@pytest.fixture(scope="module")
def teacher_model(tiny_model, tmp_path_factory) -> Path:
    """A teacher unlike the student: the tiny model's weights moved a little (same tokenizer)."""
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("teacher") / "tiny-teacher", seed=7, scale=0.05)


@pytest.fixture(scope="module")
def broken_teacher(teacher_model, tmp_path_factory) -> Path:
    """A teacher whose config.json passes the start-up check and whose weights do not load."""
    broken = shutil.copytree(teacher_model, tmp_path_factory.mktemp("broken") / "broken-teacher")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    return broken


# ------------------------------------------------------------------ the teacher's log-probs


def test_the_teachers_logprobs_are_its_own_over_the_same_prefix_and_environment_tokens_get_none(teacher_model):
    reference = reference_logprobs(teacher_model)
    prompt, short, long = [3, 17, 40, 9], [25, 8], [11, 60, 2, 33, 7]  # of different lengths: padding
    mask = [True, True, False, False, True]  # an episode: the environment's two tokens are not the model's
    teacher = Teacher(str(teacher_model), name="t", timeout_s=60, temperature=0.7)
    group = hand_group([completion(short, [-1.0] * 2, 1.0), completion(long, [-1.0] * 5, 0.0, loss_mask=mask)],
                       prompt=prompt)
    try:
        out = with_teacher(group, teacher)  # as the generator runs it, on a played group's loss masks
    finally:
        teacher.close()
    got = [c.teacher_logprobs for c in out.completions]
    want_short, want_long = (reference(prompt, ids, 0.7).numpy() for ids in (short, long))
    np.testing.assert_allclose(got[0], want_short, atol=TOL)
    np.testing.assert_allclose(got[1][[0, 1, 4]], want_long[[0, 1, 4]], atol=TOL)
    assert got[1][2] == got[1][3] == 0.0
    assert (got[0] < -0.01).all()  # real log-probs, not zeros
    assert out.teacher == "t" and out.teacher_error == ""


def test_a_group_with_teacher_logprobs_round_trips_and_older_groups_still_decode():
    plain = hand_group([completion([1, 2], [-0.5, -0.25], 1.0), completion([3], [-1.0], 0.0)])
    taught = dataclasses.replace(plain, teacher="t", teacher_version="0123456789abcdef", completions=[
        dataclasses.replace(c, teacher_logprobs=[-0.75] * len(c.ids)) for c in plain.completions])
    back = decode_group(encode(taught))
    assert back == taught and (back.teacher, back.teacher_version) == ("t", "0123456789abcdef")
    assert back.completions[0].teacher_logprobs.tolist() == [-0.75, -0.75]
    old = decode_group(encode(plain))  # written without a teacher: no field at all
    assert old == plain and old.teacher == old.teacher_version == "" and old.completions[0].teacher_logprobs is None
    wrong = dataclasses.replace(taught, completions=[
        dataclasses.replace(taught.completions[0], teacher_logprobs=[-0.75]), taught.completions[1]])
    with pytest.raises(MessageError, match="2 ids but 1 teacher_logprobs"):
        decode_group(encode(wrong))


# ------------------------------------------------------------------ the trainer's token advantages


def test_token_advantages_take_the_teachers_kl_off_the_trained_tokens_only():
    behav = [[-0.5, -1.25, -2.0], [-0.75, -3.0, -0.125, -1.5]]
    teach = [[-0.25, -2.0, -1.0], [-1.5, 0.0, -0.5, -0.25]]  # the episode's environment token: 0
    group = hand_group([
        dataclasses.replace(completion([1, 2, 3], behav[0], 1.0), teacher_logprobs=teach[0]),
        dataclasses.replace(completion([4, 5, 6, 7], behav[1], 0.0, loss_mask=[1, 0, 1, 1]),
                            teacher_logprobs=teach[1])])
    rows = group_rows(group)
    mb = collate(rows)
    w = 0.5
    adv = token_advantages(mb.advantages, mb.teacher_kl, w)
    assert adv.shape == mb.mask.shape
    p = len(group.prompt_ids)
    for i, row in enumerate(rows):
        a = np.float32(row.advantage)
        assert a != 0
        for j, trained in enumerate(row.trained):
            k = np.float32(behav[i][j]) - np.float32(teach[i][j])
            want = a - np.float32(w) * k if trained else a  # the environment's token: no KL
            assert adv[i, p - 1 + j].item() == want, (i, j)
    assert mb.teacher_at[1, p - 1:p + 3].tolist() == [1, 0, 1, 1]
    # no teacher (or weight 0): one advantage per completion, as before
    plain = collate(group_rows(hand_group([completion([1, 2], [-0.5, -0.5], 1.0), completion([3], [-1.0], 0.0)])))
    assert plain.teacher_kl is None and token_advantages(plain.advantages, plain.teacher_kl, w) is plain.advantages
    assert token_advantages(mb.advantages, mb.teacher_kl, 0.0) is mb.advantages


def test_a_step_of_distillation_alone_learns_from_the_teachers_kl_and_logs_it(tiny_model):
    from transformers import AutoModelForCausalLM

    from common.config import GrpoLoss
    from trainer.step import GrpoOptions, train_step

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(0)
    groups, trained_k = [], []
    for g in range(2):  # every reward equal: the advantage is 0, only the teacher teaches
        group = make_group(model, f"g{g}", version=0, rng=rng, n=3, partial_mask=True)
        completions = []
        for c in group.completions:
            delta = np.array([rng.uniform(0.1, 1.0) for _ in c.ids], dtype=np.float32)
            mask = np.ones(len(c.ids), dtype=bool) if c.loss_mask is None else np.asarray(c.loss_mask, dtype=bool)
            lp = np.asarray(c.logprobs, dtype=np.float32)
            teacher = np.where(mask, lp - delta, 0.0).astype(np.float32)
            trained_k += (lp - teacher)[mask].tolist()
            completions.append(dataclasses.replace(c, reward=0.0, rewards={}, teacher_logprobs=teacher))
        groups.append(dataclasses.replace(group, completions=completions, teacher="t"))

    def step(weight: float):
        how = GrpoOptions(loss=GrpoLoss(), temperature=1.0, estimator="grpo", overlong="none", overlong_penalty=0.0,
                          micro_batch_size=4, micro_batch_tokens=0, updates=1, max_grad_norm=1.0,
                          distill_weight=weight)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # the weights stay: both steps see the same model
        return train_step(model, opt, groups, how=how)

    taught, alone = step(1.0), step(0.0)
    assert taught.teacher_kl == pytest.approx(float(np.mean(trained_k)), rel=1e-5)
    assert taught.grad_norm > 1e-3  # the teacher's KL gives a gradient where the rewards give none
    assert alone.grad_norm == 0.0


# ------------------------------------------------------------------ config


def source_config(reward: str, teacher: str = "") -> dict:
    cfg = {"data": {"sources": [{"name": "calc", "kind": "arithmetic", "reward": reward}]}}
    if teacher:
        cfg["teacher"] = {"path": teacher}
    return cfg


def test_distillation_alone_needs_a_teacher_and_is_refused_without_one(tmp_path):
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.reward = 'none' .*needs a teacher.*\[teacher\] path"):
        config_from_dict(source_config("none"))
    config = config_from_dict(source_config("none", teacher=str(tmp_path)))
    assert config.teacher.on and config.teacher.label == tmp_path.name and config.teacher.distill_weight == 1.0
    assert config.sources[0].reward_functions == [("common.teacher:no_reward", 1.0)]
    assert not config_from_dict({}).teacher.on  # off by default
    for cut in ({"top_k": 5}, {"top_p": 0.9}):  # the teacher scores the whole distribution: no truncation
        with pytest.raises(ConfigError, match=r"teacher: rollout\.top_k = .* truncate the sampler.*set rollout"):
            config_from_dict({**source_config("none", teacher=str(tmp_path)), "rollout": cut})


def test_a_teacher_path_that_is_no_causal_lm_is_refused_naming_it(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForSequenceClassification"]}')
    with pytest.raises(ValueError, match=r"teacher\.path .* not a causal LM"):
        Teacher(str(tmp_path), name="t", timeout_s=1)
    with pytest.raises(ValueError, match=r"teacher\.path .* no such directory"):
        Teacher(str(tmp_path / "missing"), name="t", timeout_s=1)


def test_a_teacher_whose_tokenizer_is_not_the_students_is_refused_at_start_naming_a_token(
        tiny_model, teacher_model, tmp_path):
    import json

    from generators.main import teacher_for

    def config(teacher: Path):
        return config_from_dict({"model": {"path": str(tiny_model)}, "teacher": {"path": str(teacher)}})

    assert teacher_for(config(teacher_model), name="g").path == teacher_model.resolve()  # same tokenizer: taken
    swapped = Path(shutil.copytree(teacher_model, tmp_path / "swapped"))
    tok = json.loads((swapped / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = sorted(vocab, key=vocab.get)[300:302]  # two merged tokens trade ids
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (swapped / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ConfigError, match=rf"teacher\.path .*swapped.*tokenizer is not the student's.*2 of the "
                                          rf"student's tokens have other ids, e\.g\. {re.escape(repr(min(a, b)))}"):
        teacher_for(config(swapped), name="g")

    small = Path(shutil.copytree(teacher_model, tmp_path / "small"))  # no tokenizer, fewer embeddings
    for f in small.glob("*token*"):
        f.unlink()
    cfg = json.loads((small / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "vocab_size": cfg["vocab_size"] - 1}))
    n = cfg["vocab_size"]  # the student's tokenizer, all of it
    with pytest.raises(ConfigError, match=rf"teacher\.path .*small.* {n - 1} token embeddings, fewer than the {n} "):
        teacher_for(config(small), name="g")


# ------------------------------------------------------------------ a teacher that fails


def test_a_teacher_that_cannot_load_or_overruns_leaves_the_group_reward_only_with_its_error(
        broken_teacher, teacher_model, monkeypatch):
    group = hand_group([completion([1, 2], [-0.5, -0.5], 1.0), completion([3], [-1.0], 0.0)])
    broken = Teacher(str(broken_teacher), name="b", timeout_s=30)
    out = with_teacher(group, broken)
    assert out.completions == group.completions and out.teacher == ""
    assert "teacher 'b'" in out.teacher_error and "cannot be loaded" in out.teacher_error
    assert decode_group(encode(out)).teacher_error == out.teacher_error  # it travels with the group

    release = threading.Event()
    monkeypatch.setattr(Teacher, "logprobs", lambda self, *a: release.wait(timeout=120))
    slow = Teacher(str(teacher_model), name="s", timeout_s=0.2)
    try:
        out = with_teacher(group, slow)
    finally:
        release.set()
        slow.close()
    assert out.teacher_error == "teacher 's': timeout after 0.2 s" and out.completions == group.completions


# ------------------------------------------------------------------ the generator


def test_a_generator_carries_the_teachers_logprobs_of_every_sampled_token(tiny_model, teacher_model, tmp_path,
                                                                          redis_url, r):
    log, groups = run_generator(tmp_path, redis_url, r, model=tiny_model, teacher=teacher_model, run="teach")
    version = fingerprint(teacher_model)  # its weights': another teacher's differ
    assert len(version) == 16 and version != fingerprint(tiny_model)
    assert "teacher tiny-teacher" in log and f"its version {version}" in log
    (group,) = groups
    assert group.teacher == "tiny-teacher" and group.teacher_error == "" and group.teacher_version == version
    reference = reference_logprobs(teacher_model)
    for c in group.completions:
        assert c.reward == 0.0 and c.reward_error is None  # no reward function: distillation alone
        np.testing.assert_allclose(c.teacher_logprobs, reference(group.prompt_ids, c.ids, 0.7).numpy(), atol=TOL)
        assert not np.allclose(c.teacher_logprobs, c.logprobs, atol=1e-3)  # the teacher's, not the student's


@pytest.mark.slow  # a second generator run (~20 s); the failure itself is tested in-process above
def test_a_generator_whose_teacher_fails_writes_the_group_once_without_it(tiny_model, broken_teacher, tmp_path,
                                                                          redis_url, r):
    log, groups = run_generator(tmp_path, redis_url, r, model=tiny_model, teacher=broken_teacher, run="broken",
                                teacher_errors=1)
    (group,) = groups  # delivered exactly once
    assert group.teacher == "" and "cannot be loaded" in group.teacher_error
    assert all(c.teacher_logprobs is None for c in group.completions)
    assert "teacher error (group calc:0:0 written without teacher log-probs" in log


@pytest.mark.slow  # producer, generator and trainer (~1 min)
def test_a_run_distils_alone_on_text_and_episodes_and_logs_the_teachers_kl(tiny_model, teacher_model, tmp_path,
                                                                           redis_url, r):
    from tests.harness.configs import write_config
    from tests.harness.pipeline import run_watching_groups

    keys = Keys("distil")
    env = write_config(tmp_path / "run.toml", run="distil", redis_url=redis_url, output_dir=tmp_path / "run",
                       model=tiny_model, base={},
                       rollout={"group_size": 2, "prompts_per_step": 2, "max_staleness": 1, "max_new_tokens": 6},
                       generator={"engine": "hf", "threads": 1}, trainer={"lr": 1e-3, "max_steps": 2, "threads": 1},
                       teacher={"path": str(teacher_model), "name": "tiny-teacher"},
                       data={"sources": [{"name": "plain", "kind": "arithmetic", "reward": "none"},
                                         {"name": "calc", "kind": "arithmetic", "max_operand": 100000,
                                          "environment": "envs.calculator", "max_turns": 3}]})
    metrics, groups = run_watching_groups(tmp_path, r, keys, env)
    assert [m["step"] for m in metrics] == [1, 2]
    assert all(m["teacher_kl"] != 0.0 for m in metrics), [m["teacher_kl"] for m in metrics]
    # where every group's rewards were equal (the tiny model's are 0), only the teacher gives a gradient
    alone = [m for m in metrics if m["frac_reward_zero_std"] == 1.0]
    assert alone and all(m["grad_norm"] > 0 for m in alone), [(m["frac_reward_zero_std"], m["grad_norm"])
                                                             for m in metrics]
    assert {g.id.split(":")[0] for g in groups} == {"plain", "calc"}, [g.id for g in groups]
    for g in groups:
        assert g.teacher == "tiny-teacher", g.teacher_error
        for c in g.completions:
            mask = np.ones(len(c.ids), dtype=bool) if c.loss_mask is None else np.asarray(c.loss_mask, dtype=bool)
            assert (c.teacher_logprobs[~mask] == 0).all() and (c.teacher_logprobs[mask] < 0).all()
