"""TRL's reward functions, unchanged: several per source with weights, called once per group,
None left out of the sum, each function's mean and std in the step's metrics."""

import time

import pytest

from common.config import ConfigError, config_from_dict
from common.messages import Completion, SampleGroup
from generators.scoring import RewardRunner, Scored, reward_names
from tests import reward_fixtures
from trainer.metrics import step_metrics

FIX = "tests.reward_fixtures"
CHAT = [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": "What is 6 * 7?"}]


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_functions_from_the_docs_score_a_group_with_weights(workers):
    names = {"chat": [(f"{FIX}:format_reward_func", 0.5)],
             "text": [(f"{FIX}:reward_func", 1.0), (f"{FIX}:half", 2.0)]}  # TRL's beside a per-completion one
    texts = ["<think>6 sevens</think><answer>\\boxed{42}</answer>", "\\boxed{42}",
             "<think>hm</think><answer>41</answer>"]
    with RewardRunner(names, timeout_s=5, workers=workers) as runner:
        chat = runner.score("chat", prompt="What is 6 * 7?", messages=CHAT, meta={"ground_truth": "42"},
                            completions=[(t, [1, 2]) for t in texts])
        text = runner.score("text", prompt="What is 6 * 7?", meta={"ground_truth": "42"},
                            completions=[(t, [1, 2]) for t in texts])
    # a chat prompt's completions come as [{"role": "assistant", "content": text}]: format_reward_func
    # reads completion[0]["content"]; weighted 0.5
    assert chat == [Scored(0.5, {"format_reward_func": 1.0}, None), Scored(0.0, {"format_reward_func": 0.0}, None),
                    Scored(0.5, {"format_reward_func": 1.0}, None)]
    # a text prompt's are text: reward_func compares the \boxed{} content with the ground_truth column
    assert text == [Scored(2.0, {"reward_func": 1.0, "half": 0.5}, None),
                    Scored(2.0, {"reward_func": 1.0, "half": 0.5}, None),
                    Scored(1.0, {"reward_func": 0.0, "half": 0.5}, None)]


def test_a_trl_function_is_called_once_per_group_with_lists_and_the_columns():
    reward_fixtures.CALLS.clear()
    with RewardRunner({"s": [(f"{FIX}:counting", 1.0)]}, timeout_s=5, workers=0) as runner:
        out = runner.score("s", prompt="Add 2 and 3.", meta={"answer": "5", "source": "s"},
                           completions=[("5", [7]), ("five", [7, 8, 9])])
    assert [o.reward for o in out] == [1.0, 3.0] and out[0].rewards == {"counting": 1.0}
    assert reward_fixtures.CALLS == [{"prompts": ["Add 2 and 3."] * 2, "completions": ["5", "five"],
                                      "completion_ids": [[7], [7, 8, 9]], "answer": ["5", "5"], "source": ["s", "s"]}]


def test_none_is_left_out_of_the_sum_and_of_the_components():
    names = {"s": [(f"{FIX}:math_only", 2.0), (f"{FIX}:half", 1.0)]}  # a TRL function beside a per-completion one
    with RewardRunner(names, timeout_s=5, workers=0) as runner:
        math = runner.score("s", prompt="p", meta={"task": "math"}, completions=[("abc", [1])])
        other = runner.score("s", prompt="p", meta={"task": "code"}, completions=[("abc", [1])])
    assert math == [Scored(2.0 * 3 + 0.5, {"math_only": 3.0, "half": 0.5}, None)]
    assert other == [Scored(0.5, {"half": 0.5}, None)]  # math_only said None: not a 0 in the sum


def test_a_trl_function_that_fails_is_every_completions_error():
    with RewardRunner({"s": [(f"{FIX}:too_few", 1.0)]}, timeout_s=5, workers=1) as runner:
        out = runner.score("s", prompt="p", meta={}, completions=[("a", [1]), ("b", [1])])
    assert all(o.reward == 0.0 and o.rewards == {} and "expected a list of 2" in o.error for o in out)


def test_a_hanging_trl_function_times_out_for_its_group():
    with RewardRunner({"s": [(f"{FIX}:stuck", 1.0)]}, timeout_s=0.3, workers=1) as runner:
        t0 = time.monotonic()
        out = runner.score("s", prompt="p", meta={}, completions=[("a", [1]), ("b", [1])])
        elapsed = time.monotonic() - t0
    # one call for the group: the group's budget (0.3 s x (2 + 1)), then every completion's error
    assert out == [Scored(0.0, {}, "timeout after 0.9 s")] * 2
    assert 0.9 <= elapsed < 0.9 + 10.0, elapsed  # the budget, then the worker killed (slack for a loaded machine)


def test_reward_funcs_and_weights_in_the_config():
    source = {"name": "g", "path": "x.jsonl", "prompt_column": "q"}
    config = config_from_dict({"data": {"sources": [
        {**source, "reward_funcs": [f"{FIX}:format_reward_func", f"{FIX}:reward_func"], "reward_weights": [0.5, 1]},
        {**source, "name": "h", "reward_funcs": [f"{FIX}:counting"]}]}})
    assert reward_names(config) == {"g": [(f"{FIX}:format_reward_func", 0.5), (f"{FIX}:reward_func", 1.0)],
                                    "h": [(f"{FIX}:counting", 1.0)]}  # no weights: 1.0 each, as TRL
    for bad, field in [({"reward_weights": [1.0]}, "reward_weights"),
                       ({"reward": "tasks.gsm8k:reward"}, "reward_funcs")]:
        with pytest.raises(ConfigError, match=rf"data\.sources\.0\.{field}"):
            config_from_dict({"data": {"sources": [{**source, "reward_funcs": ["a:b", "c:d"], **bad}]}})
    missing = config_from_dict({"data": {"sources": [{**source, "reward_funcs": [f"{FIX}:half", "nope.mod:fn"]}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.reward_funcs: reward 'nope.mod:fn' cannot be loaded"):
        reward_names(missing)


def test_each_reward_functions_mean_and_std_are_step_metrics():
    def completion(rewards):
        return Completion(ids=[1, 2], logprobs=[0.0, 0.0], reward=sum(rewards.values()), rewards=rewards,
                          finish="stop", text="x")

    groups = [SampleGroup(id=f"g{i}", prompt_id=f"g{i}", prompt_ids=[1], version=0, generator="x", engine="hf",
                          completions=[completion(r) for r in rs]) for i, rs in enumerate([
                              [{"fmt": 1.0, "acc": 1.0}, {"fmt": 0.0, "acc": 0.0}],
                              [{"fmt": 1.0}, {"fmt": 1.0, "acc": 1.0}]])]
    m = step_metrics(groups, staleness=[0, 0])
    # over the completions that have the component (TRL's nanmean / nanstd)
    assert m["reward_components"] == {"acc": (2 / 3, pytest.approx(0.57735, abs=1e-5)),
                                      "fmt": (0.75, pytest.approx(0.5))}
