from generators.rewards import arithmetic, score


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


def test_components_sum_to_the_reward():
    def two(**kwargs):
        return {"correct": 1.0, "format": 0.5}

    assert score(two, prompt="p", completion="c", completion_ids=[1], meta={}) == \
        (1.5, {"correct": 1.0, "format": 0.5}, None)
