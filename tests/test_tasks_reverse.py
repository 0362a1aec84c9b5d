"""A synthetic task added as one file (tasks/reverse.py): its source kind, its problems drawn by the
producer, its reward as the source's built-in, its options checked with the dotted field."""

from __future__ import annotations

import re

import pytest

from common import rewards
from common.config import ConfigError, config_from_dict
from producers.data import Source
from tasks.rows import eval_prompts


def test_a_reverse_source_draws_problems_its_own_reward_scores():
    config = config_from_dict({"data": {"sources": [{"name": "rev", "kind": "reverse", "max_letters": 5}]}})
    [source] = config.sources
    assert source.reward_name == "tasks.reverse:reward"
    score = rewards.load(source.reward_name)
    drawn = Source(source, seed=7, field="data.sources.0")
    for _ in range(20):
        prompt = drawn.take()
        word = re.fullmatch(r"Reverse the letters of '([a-z]+)'\. .*", prompt.messages[0]["content"])[1]
        assert 3 <= len(word) <= 5 and prompt.meta == {"answer": word[::-1], "source": "rev"}, prompt
        assert score(prompt="", completion=f"It is {word[::-1]}", completion_ids=[], meta=prompt.meta) == \
            {"correct": 1.0}
        if word != word[::-1]:
            assert score(prompt="", completion=word, completion_ids=[], meta=prompt.meta) == {"correct": 0.0}
    again = Source(source, seed=7, field="data.sources.0")
    assert again.take() == Source(source, seed=7, field="data.sources.0").take()  # the seed decides
    held = eval_prompts(source, count=4, seed=1, holdout=None)
    assert len(held) == 4 and all(p.meta["answer"] for p in held)


def test_a_reverse_source_takes_only_its_own_options():
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.max_letters: 2 is below min_letters \(5\)"):
        config_from_dict({"data": {"sources": [{"name": "r", "kind": "reverse", "min_letters": 5, "max_letters": 2}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.0\.max_operand: unknown field for kind 'reverse'"):
        config_from_dict({"data": {"sources": [{"name": "r", "kind": "reverse", "max_operand": 9}]}})
