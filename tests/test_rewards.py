import pytest

from common.rewards import score
from tasks.arithmetic import reward as arithmetic


def reward(text: str, answer: int) -> float:
    total, rewards, err = score(arithmetic, prompt="What is 8 + 9?", completion=text,
                                completion_ids=[1, 2], meta={"answer": answer})
    assert err is None
    assert total == sum(rewards.values())
    return rewards["correct"]


def test_arithmetic_takes_the_last_integer():
    assert reward("The answer is 17.", 17) == 1.0
    assert reward("The answer is 17.", 18) == 0.0
    assert reward("-3", -3) == 1.0
    assert reward("-3", 3) == 0.0
    assert reward("17 or 18", 18) == 1.0  # the last number wins
    assert reward("17 or 18", 17) == 0.0
    assert reward("8 + 9 = 17", 17) == 1.0
    assert reward("no number here", 0) == 0.0
    assert reward("", 0) == 0.0


def test_a_raising_reward_scores_zero_with_the_error():
    def broken(**kwargs):
        raise RuntimeError("boom")

    assert score(broken, prompt="p", completion="c", completion_ids=[1], meta={}) == \
        (0.0, {}, "RuntimeError: boom")
    # missing ground truth is an error of the reward, not of the generator
    total, rewards, err = score(arithmetic, prompt="p", completion="17", completion_ids=[1], meta={})
    assert (total, rewards) == (0.0, {}) and err is not None and "answer" in err


def test_a_reward_returning_garbage_is_an_error():
    def nan(**kwargs):
        return {"x": float("nan")}

    total, rewards, err = score(nan, prompt="p", completion="c", completion_ids=[1], meta={})
    assert (total, rewards) == (0.0, {}) and "finite" in err


def test_a_number_is_one_component_named_reward():
    for value in (0.75, 2, -1):
        assert score(lambda value=value, **_: value, prompt="p", completion="c", completion_ids=[1], meta={}) == \
            (float(value), {"reward": float(value)}, None)
    for bad in (True, float("inf"), "1.0", None, [1.0], {"x": True}, {1: 1.0}):
        total, rewards, err = score(lambda bad=bad, **_: bad, prompt="p", completion="c", completion_ids=[1], meta={})
        assert (total, rewards) == (0.0, {}) and "expected a finite number" in err, bad


def test_components_sum_to_the_reward():
    def two(**kwargs):
        return {"correct": 1.0, "format": 0.5}

    assert score(two, prompt="p", completion="c", completion_ids=[1], meta={}) == \
        (1.5, {"correct": 1.0, "format": 0.5}, None)


# ---------------------------------------------------------------------- final answer (GSM8K)


def final(text: str, answer) -> float:
    from tasks.gsm8k import reward as final_answer

    return final_answer(prompt="p", completion=text, completion_ids=[1], meta={"answer": answer})["correct"]


def test_final_answer_reads_hashes_boxed_and_the_last_number():
    assert final("3 + 4 = 7\n#### 7", "7") == 1.0
    assert final("so the total is \\boxed{1,234}.", "1234") == 1.0
    assert final("\\boxed{\\frac{1}{2}} no wait \\boxed{42}", 42) == 1.0  # the last box counts
    assert final("#### 42.0", "42") == 1.0 and final("It costs $18.", "18") == 1.0
    assert final("#### 41", "42") == 0.0 and final("no number here", "42") == 0.0
    assert final("42 is wrong, \\boxed{43}", "42") == 0.0  # the box wins over a bare number


# ---------------------------------------------------------------------- format


def fmt(text: str) -> float:
    from tasks.format import reward as format_reward

    return format_reward(prompt="p", completion=text, completion_ids=[1], meta={})["format"]


def test_format_rewards_a_final_answer_marked_at_the_end():
    # GSM8K: "#### answer" on the last line
    assert fmt("3 + 4 = 7\n#### 7") == 1.0 and fmt("#### 1,234 apples\n\n") == 1.0
    assert fmt("So 3 + 4 = 7. #### 7") == 1.0 and fmt("#### 6\n#### 7") == 1.0
    assert fmt("#### 7 ####") == 0.0  # nothing after the last mark
    assert fmt("#### 7\nI hope that helps") == 0.0  # something after it
    assert fmt("3 + 4 = 7\n####") == 0.0 and fmt("####   \n") == 0.0  # no answer
    # \boxed{}, then at most closing math delimiters and a period
    assert fmt("So the answer is \\boxed{42}") == 1.0 and fmt("so $\\boxed{\\frac{1}{2}}$.") == 1.0
    assert fmt("\\[\\boxed{x^{2}}\\]\n") == 1.0
    assert fmt("\\boxed{42} is my answer") == 0.0 and fmt("\\boxed{}") == 0.0 and fmt("\\boxed{42") == 0.0
    # <answer>...</answer>, with or without thinking first
    assert fmt("<think>8 + 9 is 17</think>\n<answer>17</answer>") == 1.0 and fmt("<answer> 17 </answer>\n") == 1.0
    assert fmt("<answer>17</answer> done") == 0.0 and fmt("<answer> </answer>") == 0.0
    assert fmt("<answer>17") == 0.0 and fmt("17") == 0.0 and fmt("") == 0.0


# ---------------------------------------------------------------------- countdown


def cd(text: str, target: int, numbers: list[int]) -> float:
    from tasks.countdown import reward as countdown

    return countdown(prompt="p", completion=text, completion_ids=[1],
                     meta={"target": target, "numbers": numbers})["correct"]


def test_countdown_checks_the_value_and_the_numbers_used():
    assert cd("(25 - 5) * 2", 40, [25, 5, 2, 7]) == 1.0
    assert cd("I'd try: <answer>100 / (7 - 2)</answer>", 20, [100, 7, 2]) == 1.0
    assert cd("Working...\n25 * 2 - 4 = 46", 46, [25, 2, 4]) == 1.0  # "= target" is fine
    assert cd("(25 - 5) * 2", 41, [25, 5, 2]) == 0.0  # wrong value
    assert cd("5 * 5 + 2", 27, [5, 2]) == 0.0  # 5 used twice
    assert cd("6 * 9", 54, [6, 8]) == 0.0  # 9 not given
    assert cd("7 / (2 - 2)", 1, [7, 2, 2]) == 0.0  # division by zero
    assert cd("2 ** 3", 8, [2, 3]) == 0.0 and cd("-2 + 10", 8, [2, 10]) == 0.0  # not + - * /
    assert cd("__import__('os').system('true')", 0, [1]) == 0.0  # never evaluated
    assert cd("no expression", 3, [1, 2]) == 0.0


def test_countdown_expressions_are_parsed_never_evaluated():
    from tasks.countdown import evaluate

    assert evaluate("(3 + 5) * 2 / 4") == (4, [3, 5, 2, 4])
    for bad in ("abs(-3)", "x + 1", "1.5 + 1", "3 % 2", "[1]"):
        with pytest.raises(ValueError):
            evaluate(bad)


def test_every_countdown_problem_is_solved_by_its_own_solution():
    from tasks.countdown import problem, reward

    for i in range(100):
        p = problem(seed=5, index=i, numbers=4, max_number=25)
        meta = {"target": p.target, "numbers": p.numbers}
        assert reward(prompt=p.question, completion=p.solution, completion_ids=[1], meta=meta) == {"correct": 1.0}


# ---------------------------------------------------------------------- rewards by source


def test_each_source_gets_its_configured_reward():
    from common.config import ConfigError, config_from_dict
    from generators.scoring import RewardRunner, reward_names

    config = config_from_dict({"data": {"sources": [
        {"name": "a", "kind": "arithmetic"},
        {"name": "c", "kind": "countdown"},
        {"name": "d", "path": "x.jsonl", "prompt_column": "q"},
        {"name": "g", "path": "x.jsonl", "prompt_column": "q", "reward": "tasks.arithmetic:reward"}]}})
    names = reward_names(config)
    assert names == {"a": [("tasks.arithmetic:reward", 1.0)], "c": [("tasks.countdown:reward", 1.0)],
                     "d": [("tasks.gsm8k:reward", 1.0)], "g": [("tasks.arithmetic:reward", 1.0)]}
    assert reward_names(config_from_dict({})) == {"arithmetic": [("tasks.arithmetic:reward", 1.0)]}  # the [task]

    with RewardRunner(names, timeout_s=1, workers=0) as runner:
        def reward(source, text, meta):
            (scored,) = runner.score(source, prompt="p", completions=[(text, [1])], meta=meta)
            return scored

        assert reward("c", "3 * 4", {"target": 12, "numbers": [3, 4]}).reward == 1.0
        assert reward("g", "17", {"answer": 17}).reward == 1.0
        assert reward("d", "#### 17", {"answer": "17"}).reward == 1.0
        assert "no reward configured for source 'zzz'" in reward("zzz", "1", {}).error
        assert "no reward configured for source None" in reward(None, "1", {}).error  # several: name one

    bad = config_from_dict({"data": {"sources": [{"name": "c", "kind": "countdown", "reward": "nope.mod:fn"}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.reward: reward 'nope.mod:fn' cannot be loaded"):
        reward_names(bad)
