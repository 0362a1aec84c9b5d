"""`rollouts check`: a right config passes with its figures; an engine sampling at another
temperature, an engine on other weights and a reward that always raises each fail, each for its own
reason. The command runs as a user runs it (a process, `python -m common.cli check`) on the tiny
model with the HF engine; its verdict's rules are checked by hand below."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from functools import partial
from pathlib import Path

import numpy as np
import torch

from checks.check import BOUNDS, Mismatch, mismatch_problems, reward_problems
from common.messages import Completion, SampleGroup
from tests.harness.configs import write_config
from tests.harness.processes import ROOT
from tests.harness.templates import DROPS_EARLIER_TURNS, DROPS_TURNS_BEFORE_THE_USER, with_template


def check_config(tmp_path: Path, model: Path, *, reward: str = "tests.reward_fixtures:length") -> Path:
    """The run's config for the check: the HF engine, 4 completions of 16 tokens at temperature 1."""
    path = tmp_path / "run.toml"
    write_config(path, run="check", output_dir=tmp_path / "out", model=model, base={}, generator={"engine": "hf"},
                 rollout={"group_size": 4, "max_new_tokens": 16, "temperature": 1.0},
                 data={"sources": [{"name": "arith", "kind": "arithmetic", "reward": reward}]})
    return path


def episode_config(tmp_path: Path, model: Path, *, environment: str = "tests.env_fixtures:Echo") -> Path:
    """check_config with a second source that plays episodes: the environment (a tool, by default)
    answers each model turn until the model has taken 3."""
    path = tmp_path / "run.toml"
    write_config(path, run="check", output_dir=tmp_path / "out", model=model, base={}, generator={"engine": "hf"},
                 rollout={"group_size": 4, "max_new_tokens": 16, "temperature": 1.0},
                 data={"sources": [{"name": "arith", "kind": "arithmetic", "reward": "tests.reward_fixtures:length"},
                                   {"name": "tool", "kind": "arithmetic", "environment": environment,
                                    "max_turns": 3}]})
    return path


def check(tmp_path: Path, config: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_") or k == "ROLLOUTS_CACHE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    return subprocess.run([sys.executable, "-m", "common.cli", "check", "--config", str(config), *args],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def failures(out: str) -> list[str]:
    return [line.removeprefix("check: FAILED: ") for line in out.splitlines() if line.startswith("check: FAILED: ")]


def test_a_right_config_passes_with_its_figures(tmp_path, tiny_model):
    done = check(tmp_path, check_config(tmp_path, tiny_model), "--prompts", "3")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("check: 3 prompts from arith, 4 completions each, hf engine at temperature 1")
    for label in ("mismatch   mean |log-ratio| ", "           by position  0-15 ", "ratio      exp(",
                  "rewards    12 completions, 0 errors, constant no, zero-variance groups ", "time       sampling ",
                  "estimate   at prompts_per_step 8: "):
        assert any(line.startswith(label) for line in lines), (label, done.stdout)
    assert not any(line.startswith("template ") for line in lines)  # no source plays episodes
    # the trainer's memory per rank: its parts, each positive and said measured or arithmetic
    [memory] = [line for line in lines if line.startswith("memory     ")]
    found = re.fullmatch(r"memory     trainer about ([\d.]+) (\w+) per rank at micro-batches of 8 x (\d+) tokens: "
                         r"weights, gradients and AdamW ([\d.]+) (\w+) \(16 B/param x [\d.]+M, arithmetic\) \+ "
                         r"activations ([\d.]+) (\w+) \(measured ([\d.]+) (\w+) over one forward and backward of "
                         r"(\d+) positions on cpu, scaled to (\d+)\)", memory)
    assert found, memory
    assert all(float(found[i]) > 0 for i in (1, 3, 4, 6, 8, 10, 11)), memory
    assert int(found[11]) == 8 * int(found[3])  # 8 rows of the longest prompt and max_new_tokens
    # the settings the trainer resolves at start-up on this host: "auto" checkpointing is off on a CPU
    [trainer] = [line for line in lines if line.startswith("trainer    ")]
    found = re.fullmatch(r"trainer    activation checkpointing off \(auto: off on the cpu; about ([\d.e+-]+) GiB "
                         r"without it\), micro_batch_tokens 0 \(no limit: micro_batch_size 8 rows\) \(estimated "
                         r"at micro-batches of (\d+) positions\), attention sdpa \(auto\), packed micro-batches, "
                         r"compile off",
                         trainer)
    assert found and float(found[1]) > 0, trainer
    assert int(found[2]) == 8 * 2 * 16  # 8 rows of twice max_new_tokens (a prompt up to as long)
    assert lines[-1].startswith("check: ok (mean |log-ratio| ")
    assert failures(done.stdout) == []


def test_a_run_with_a_teacher_reports_its_agreement_with_the_trainers_forward(tmp_path, tiny_model):
    from tests.harness.models import perturbed_copy

    teacher = perturbed_copy(tiny_model, tmp_path / "tiny-teacher", seed=7, scale=0.05)
    config = check_config(tmp_path, tiny_model)
    config.write_text(config.read_text() + f'\n[teacher]\npath = "{teacher}"\n')
    done = check(tmp_path, config, "--prompts", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("teacher    ")]
    found = re.fullmatch(r"teacher    tiny-teacher \(hf\): mean \|log-ratio\| (\S+)  max (\S+)  over (\d+) tokens "
                         r"\(the trainer's forward of the teacher minus its hf log-probs\)", line)
    assert found and float(found[1]) <= BOUNDS["float32"][0] and int(found[3]) > 0, line


def test_a_teacher_off_by_one_position_fails_the_check(tiny_model, tmp_path, monkeypatch):
    """The check's teacher measure, in-process, on hand-written groups: the hf teacher agrees with
    the trainer's forward of the same model; shifted by one token it fails, naming the teacher."""
    from checks import teacher as teacher_check
    from checks.check import open_trainer_model, trainer_mismatch
    from common import teacher as teacher_module
    from common.config import config_from_dict
    from tests.harness.groups import completion, hand_group
    from tests.harness.models import perturbed_copy

    config = config_from_dict({"model": {"path": str(tiny_model)}, "rollout": {"temperature": 0.7},
                               "teacher": {"path": str(perturbed_copy(tiny_model, tmp_path / "t", seed=3))}})
    groups = [hand_group([completion([25, 8, 40, 11], [-1.0] * 4, 1.0), completion([60, 2], [-1.0] * 2, 0.0)],
                         prompt=[3, 17, 9])]

    def agreement():
        found = teacher_check.agreement(
            config, groups, open_model=lambda c: open_trainer_model(c, checkpointing=False),
            mismatch=lambda c, m, gs: trainer_mismatch(c, m, gs, temperature=0.7).log_ratio)
        return found, teacher_check.problems(found, dtype="float32")

    agreed, problems = agreement()
    assert agreed.log_ratio.numel() == 6 and problems == [], (agreed, problems)
    assert float(agreed.log_ratio.abs().max()) <= BOUNDS["float32"][0]

    honest = teacher_module._hf_logprobs
    monkeypatch.setattr(teacher_module, "_hf_logprobs",  # each token given the prefix one shorter
                        lambda *a, **k: [np.roll(lp, 1) for lp in honest(*a, **k)])
    agreed, problems = agreement()
    [problem] = problems
    assert problem.startswith("teacher: mean |log-ratio| ") and "off by a position" in problem, problem
    assert float(agreed.log_ratio.abs().mean()) > BOUNDS["float32"][0]


def test_an_engine_sampling_at_another_temperature_fails_saying_which(tmp_path, tiny_model):
    done = check(tmp_path, check_config(tmp_path, tiny_model), "--prompts", "3", "--engine-temperature", "2.0")
    assert done.returncode == 1, done.stdout + done.stderr
    [reason] = failures(done.stdout)
    assert reason.startswith("mismatch: mean |log-ratio| "), done.stdout
    fitted = re.search(r"the engine samples at temperature (\d+\.\d+) ", reason)
    assert fitted and abs(float(fitted[1]) - 2.0) <= 0.02, reason  # the fit's own tolerance: 0.3%
    assert "the trainer computes them at rollout.temperature = 1.0" in reason


def test_an_engine_on_other_weights_fails_saying_so(tmp_path, tiny_model):
    from common.tiny import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1)
    done = check(tmp_path, check_config(tmp_path, tiny_model), "--prompts", "3", "--engine-model", str(other))
    assert done.returncode == 1, done.stdout + done.stderr
    reason, *ratio = failures(done.stdout)  # some tokens may also be far likelier under the trainer
    assert reason.startswith("mismatch: mean |log-ratio| "), done.stdout
    assert "no temperature explains it" in reason and "other weights than the trainer's model.path" in reason
    assert all(line.startswith("ratio: max importance ratio ") for line in ratio), done.stdout


def test_a_reward_that_always_raises_fails_with_its_error(tmp_path, tiny_model):
    (tmp_path / "broken_rewards.py").write_text(
        "def score(**_):\n    raise RuntimeError('the grader is down')\n")
    done = check(tmp_path, check_config(tmp_path, tiny_model, reward="broken_rewards:score"), "--prompts", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    [reason] = failures(done.stdout)  # the log-probs agree: only the rewards fail
    assert reason.startswith("rewards: every completion's reward raised: ")
    assert "the grader is down" in reason


def test_episodes_through_a_template_that_keeps_earlier_turns_pass(tmp_path, tiny_model):
    done = check(tmp_path, episode_config(tmp_path, tiny_model), "--prompts", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert re.match(r"check: \d+ prompts from arith, tool, 4 completions each, ", lines[0]), lines[0]
    [template] = [line for line in lines if line.startswith("template   ")]
    found = re.fullmatch(r"template   preserves earlier turns: yes \((\d+) episodes, (\d+) turns\)", template)
    assert found and int(found[1]) >= 4 and int(found[2]) == 3 * int(found[1]), template  # 3 model turns each
    assert failures(done.stdout) == []


def test_a_template_that_drops_earlier_turns_fails_saying_where(tmp_path, tiny_model):
    model = with_template(tiny_model, tmp_path / "dropping", DROPS_EARLIER_TURNS)
    done = check(tmp_path, episode_config(tmp_path, model), "--prompts", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    [reason] = failures(done.stdout)  # the log-probs and rewards agree: only the template fails
    assert reason.startswith("template: episode tool:"), reason
    # where: an earlier model turn (the first, unless it was empty), left out once a later one follows
    assert re.search(r"differ at token \d+ \(model turn [12] of 3\)", reason), reason
    assert "a trainer that re-applies the template to the conversation trains on other tokens" in reason


def test_a_template_that_stops_the_generator_mid_episode_fails_saying_so(tmp_path, tiny_model):
    model = with_template(tiny_model, tmp_path / "dropping", DROPS_TURNS_BEFORE_THE_USER)
    done = check(tmp_path, episode_config(tmp_path, model, environment="tests.env_fixtures:Chat"), "--prompts", "2")
    assert done.returncode == 1, done.stdout + done.stderr
    [reason] = failures(done.stdout)
    assert reason == ("template: source 'tool': environment 'tests.env_fixtures:Chat' with the model's chat "
                      "template: the chat template renders an assistant turn differently once other turns follow "
                      "it; an episode cannot be extended token by token with it (a generator ends such episodes "
                      "there, their reward an error)")
    assert "template   refused: " in done.stdout and "Traceback" not in done.stderr


# ---------------------------------------------------------------------- the verdict's rules


def mismatch_of(log_ratios: list[float]) -> Mismatch:
    return Mismatch(log_ratio=torch.tensor(log_ratios, dtype=torch.float64),
                    position=torch.arange(len(log_ratios)), forward_s=0.0)


def test_the_bounds_by_hand():
    bound, max_ratio = BOUNDS["float32"]
    assert mismatch_problems(mismatch_of([bound / 2, -bound / 2]), fitted=None, temperature=1.0,
                             dtype="float32") == []
    [mean] = mismatch_problems(mismatch_of([0.05, -0.05]), fitted=None, temperature=1.0, dtype="float32")
    assert mean.startswith(f"mismatch: mean |log-ratio| 0.05 above {bound}: ")
    assert mismatch_problems(mismatch_of([0.05, -0.05]), fitted=None, temperature=1.0, dtype="bfloat16") == []
    # one token 4x likelier under the trainer: the mean over 1000 stays in bounds, the ratio does not
    [ratio] = mismatch_problems(mismatch_of([0.0] * 999 + [1.3863]), fitted=None, temperature=1.0, dtype="float32")
    assert ratio.startswith(f"ratio: max importance ratio 4 above {max_ratio}")
    [fitted] = mismatch_problems(mismatch_of([0.1]), fitted=(0.7, 1e-4), temperature=1.0, dtype="float32")
    assert "the engine samples at temperature 0.70" in fitted
    [unfitted] = mismatch_problems(mismatch_of([0.1]), fitted=(0.25, 0.09), temperature=1.0, dtype="float32")
    assert "no temperature explains it" in unfitted


def group_of(*rewards: float | str) -> SampleGroup:
    completions = [Completion(ids=[1], logprobs=[-0.5], reward=r if isinstance(r, float) else 0.0, rewards={},
                              finish="stop", text="x", reward_error=r if isinstance(r, str) else None)
                   for r in rewards]
    return SampleGroup(id="p", prompt_id="p", prompt_ids=[2], version=0, generator="g", engine="hf",
                       completions=completions)


def test_reward_problems_by_hand():
    assert reward_problems([group_of(0.0, 1.0)]) == ([], [])
    assert reward_problems([group_of("ValueError: no", "ValueError: no")]) == (
        ["rewards: every completion's reward raised: ValueError: no"], [])
    assert reward_problems([group_of(1.0, "timeout"), group_of(0.0, 1.0)])[0] == [
        "rewards: 1 of 4 completions' rewards failed: timeout"]
    assert reward_problems([group_of(0.0, 0.0), group_of(0.0, 0.0)]) == (
        [], ["rewards: every completion scored 0: no group teaches anything yet"])


def episode_row(tok, turns: list[list[int]], env: list[dict[str, str]]) -> tuple[list[int], int, list[int]]:
    """(row, prompt length, loss mask) of an episode built as the generator builds it: the prompt,
    then each model turn's ids as given, `env`'s message (engines.base.turn_ids) between them."""
    from engines.base import turn_ids

    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": "Go."}], tokenize=False,
                                                add_generation_prompt=True), add_special_tokens=False)
    ids, mask = [], []
    for i, turn in enumerate(turns):
        ids, mask = ids + turn, mask + [1] * len(turn)
        if i < len(turns) - 1:
            glue = turn_ids(tok, env, eos_id=turn[-1] if turn[-1] == tok.eos_token_id else None)
            ids, mask = ids + glue, mask + [0] * len(glue)
    return prompt + ids, len(prompt), mask


def test_an_episode_against_its_template_by_hand(tiny_model):
    from transformers import AutoTokenizer

    from checks.episodes import departure

    tok = AutoTokenizer.from_pretrained(tiny_model)
    eos, end_of_text = tok.eos_token_id, tok.convert_tokens_to_ids("<|endoftext|>")
    one, two = tok.encode("1", add_special_tokens=False), tok.encode("2", add_special_tokens=False)
    twelve = one + two  # "12" as "1" then "2": encoding the text again gives one token, the text is the same
    assert tok.encode("12", add_special_tokens=False) != twelve
    turns = [tok.encode("What is", add_special_tokens=False) + twelve + [eos],  # stopped at its eos
             tok.encode(" 3 + 4", add_special_tokens=False),  # cut at max_new_tokens: no eos
             tok.encode("The answer is 7.", add_special_tokens=False) + [end_of_text]]  # another stop token
    env = [{"role": "tool", "content": "turn 0: 12 + 34"}]
    row, prompt, mask = episode_row(tok, turns, env)
    same = partial(departure, tok, opening=[{"role": "user", "content": "Go."}], tools=None, row=row,
                   prompt=prompt, mask=mask, env_turns=[env, env], eos_ids=[eos, end_of_text], name="g #1")
    assert same() is None  # the tiny model's template renders the conversation as the ids were sampled

    tok.chat_template = DROPS_EARLIER_TURNS
    row, prompt, mask = episode_row(tok, turns, env)  # its turn ids are the same: it keeps the last turn
    d = departure(tok, opening=[{"role": "user", "content": "Go."}], tools=None, row=row, prompt=prompt, mask=mask,
                  env_turns=[env, env], eos_ids=[eos, end_of_text], name="g #1")
    assert (d.episode, d.token, d.where) == ("g #1", prompt, "model turn 1 of 3")  # the first turn's first token
    assert d.before.endswith("<|im_start|>assistant\n") and d.sampled.startswith("What is12<|im_end|>")
    assert d.templated.startswith("<|im_end|>\n<|im_start|>tool\nturn 0")


def test_the_memory_line_by_hand():
    from checks.memory import Memory, memory_line, state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(10, 10), torch.nn.Linear(10, 10).to(torch.bfloat16))
    model[1].requires_grad_(False)  # frozen, as a LoRA's base: its weights only
    assert state_bytes(model) == (110 * 4 * 4 + 110 * 2, 220)
    memory = Memory(state=16_000_000_000, params=1_000_000_000, reference=0, measured=50_000_000, positions=500,
                    target=4000, rows=8, row_tokens=500, device="cuda")
    assert memory.activations() == 400_000_000
    assert memory_line(memory, ranks=4) == (
        "memory     trainer about 4.4 GB per rank at micro-batches of 8 x 500 tokens: weights, gradients and "
        "AdamW 4 GB (16 B/param x 1e+03M / 4 ranks, arithmetic) + activations 400 MB (measured 50 MB over one "
        "forward and backward of 500 positions on cuda, scaled to 4000)")


def test_the_checks_model_computes_attention_as_the_trainer_places_it(tiny_model):
    """trainer.attention reaches the model the check measures (its log-probs and memory), as it
    reaches the trainer's, LoRA's included: "varlen" (trainer/varlen.py) computes on the CPU too."""
    from checks.check import open_trainer_model
    from common.config import config_from_dict
    from trainer.logprobs import packed_attention
    from trainer.varlen import VARLEN

    for lora in ({}, {"lora": {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}}):
        def opened(attention: str, lora=lora):
            config = config_from_dict({"model": {"path": str(tiny_model)},
                                       "trainer": {"attention": attention, **lora}})
            return open_trainer_model(config, checkpointing=False)

        assert packed_attention(opened("varlen")) == VARLEN, lora
        assert packed_attention(opened("sdpa")) == "sdpa", lora  # the model's own, as the trainer's
