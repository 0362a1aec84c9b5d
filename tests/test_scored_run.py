"""A run scored by models end to end: producer, generator and trainer as processes, a source whose
rewards are a tiny sequence classifier (a reward model) and a tiny judge that follows a known rule;
every completion written carries the classifier's own logit and the judge's rule-given value (or,
where the rule gives no yes or no, its parse error), and the trainer's steps log both components."""

import json
import math
from pathlib import Path

import pytest

from common.keys import PAYLOAD, Keys
from common.messages import decode_prompt
from tests.harness.configs import write_config
from tests.harness.pipeline import run_watching_groups
from tests.harness.scorers import answer_tokens, classifier, last_token, rule_judge

TEMPLATE = "Answer: {completion}"  # the judge's question ends in the completion's last token


def says_yes(token: int) -> bool:
    return token % 2 == 0


def logit(path: Path, text: str) -> float:
    """The classifier's logits[0, 0] on `text` alone, computed here directly (no batch, no padding)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return float(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])


@pytest.mark.slow  # producer, generator and trainer (~1 min)
def test_a_run_is_scored_by_a_classifier_and_a_rule_following_judge_per_completion(tiny_model, tmp_path, redis_url,
                                                                                   r):
    rm = classifier(tmp_path / "tiny-rm", tiny_model)
    judge = rule_judge(tmp_path / "parity-judge", tiny_model, says_yes)
    template = tmp_path / "judge.txt"
    template.write_text(TEMPLATE)
    keys = Keys("scored")
    env = write_config(tmp_path / "run.toml", run="scored", redis_url=redis_url, output_dir=tmp_path / "run",
                       model=tiny_model, base={},
                       rollout={"group_size": 4, "prompts_per_step": 2, "max_staleness": 1, "max_new_tokens": 6},
                       generator={"engine": "hf", "threads": 1}, trainer={"lr": 1e-3, "max_steps": 2, "threads": 1},
                       data={"sources": [{"name": "calc", "kind": "arithmetic",
                                          "reward_funcs": [f"model:{rm}",
                                                           f"judge:{judge}?parser=yesno&template={template}"],
                                          "reward_weights": [1.0, 2.0]}]})
    # the prompts, kept for the test: the producer trims only what every consumer group acknowledged
    r.xgroup_create(keys.prompts, "watch", id="0", mkstream=True)
    metrics, groups = run_watching_groups(tmp_path, r, keys, env)
    prompts = {task.id: task.messages for task in (decode_prompt(f[PAYLOAD]) for _, f in r.xrange(keys.prompts))}

    yes, no = answer_tokens(tiny_model)
    judged = []
    for group in groups:
        # a synthetic task's source sends text: the classifier reads its last user message + the completion
        prompt = [m["content"] for m in prompts[group.prompt_id] if m["role"] == "user"][-1]
        for c in group.completions:
            token = last_token(tiny_model, TEMPLATE.format(completion=c.text))
            if token in yes + no:  # the judge answers with the rest of that word: no yes or no
                assert c.reward_error and "judge parity-judge: parser 'yesno'" in c.reward_error, (c.text, c)
                continue
            assert c.reward_error is None, (c.text, c.reward_error)
            value = 1.0 if says_yes(token) else 0.0
            score = logit(rm, prompt + c.text)
            assert c.rewards == {"tiny-rm": pytest.approx(score, abs=1e-4), "parity-judge": value}, (c.text, c.rewards)
            assert c.reward == pytest.approx(score + 2.0 * value, abs=1e-4)
            judged.append(value)
    # both of the rule's values seen: 16 completions or so, whose random last tokens' parities all
    # agree with odds of about 2^-15
    assert set(judged) == {0.0, 1.0}, judged

    assert [m["step"] for m in metrics] == [1, 2], json.dumps(metrics)[:2000]
    for m in metrics:
        assert 0.0 <= m["rewards/parity-judge/mean"] <= 1.0 and math.isfinite(m["rewards/tiny-rm/mean"]), m
