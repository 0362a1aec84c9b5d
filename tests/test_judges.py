"""LLM judges: a "judge:PATH?parser=..." entry of reward_funcs is a causal LM asked about each
completion, the whole group in one greedy generate, its answer parsed into the reward; an answer the
parser cannot read is that completion's recorded error (never a silent 0); a bad entry is refused at
start-up by its field and entry."""

import json
import re
from pathlib import Path

import pytest

from common import judges
from common.config import ConfigError, config_from_dict
from common.judges import Judge, parse
from generators.scoring import RewardRunner, Scored, reward_names
from tests.harness.models import one_layer_llama
from tests.harness.overruns import held_back

FIX = "tests.reward_fixtures"
PROMPT = "What is 6 * 7?"


def completions(*texts: str) -> list[tuple[str, list[int]]]:
    return [(t, [1, 2]) for t in texts]


# ---------------------------------------------------------------------- parsers


@pytest.mark.parametrize(("parser", "answer", "value"), [
    ("yesno", "yes", 1.0), ("yesno", " Yes, it is right.", 1.0), ("yesno", "No.", 0.0), ("yesno", "no", 0.0),
    ("score10", "7", 0.7), ("score10", "Score: 10/10", 1.0), ("score10", " 1", 0.1),
    ("boxed", "so \\boxed{2} or rather \\boxed{3.5}", 3.5), ("boxed", "\\boxed{ -1,000 }", -1000.0),
])
def test_each_parser_reads_its_answers(parser, answer, value):
    assert parse(parser, answer) == pytest.approx(value)


@pytest.mark.parametrize(("parser", "answer", "why"), [
    ("yesno", "", "no leading yes or no"), ("yesno", "maybe", "no leading yes or no"),
    ("yesno", "yesterday", "no leading yes or no"), ("yesno", "I say yes", "no leading yes or no"),
    ("score10", "", "no score"), ("score10", "great", "no score"), ("score10", "11", "not an integer from 1 to 10"),
    ("score10", "0", "not an integer from 1 to 10"), ("score10", "7.5", "not an integer from 1 to 10"),
    ("boxed", "42", "no \\boxed"), ("boxed", "\\boxed{x}", "holds no number"), ("boxed", "\\boxed{inf}", "not finite"),
])
def test_a_malformed_answer_is_an_error_not_a_zero(parser, answer, why):
    with pytest.raises(ValueError, match=re.escape(why)):
        parse(parser, answer)


# ---------------------------------------------------------------------- judges on tiny models


def build_judge(path: Path, tokenizer_from: Path, *, answer: str, trigger: int | None = None) -> Path:
    """A tiny causal LM whose greedy answer is known: its layers add nothing to the residual stream,
    so the next token depends on the last one alone, and the embeddings and LM head are set so that
    after any token it says `answer` then its end token. With `trigger`, only a question ending in
    that token is answered so; any other gets the end token at once (an empty answer). Saved without
    a chat template, so that the question is the template's text as is."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    for leftover in path.glob("chat_template.*"):
        leftover.unlink()
    chain = tokenizer(answer, add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(chain) == answer and len(set(chain)) == len(chain), chain
    eos = tokenizer.eos_token_id
    model = LlamaForCausalLM(one_layer_llama(tokenizer, pad_token_id=eos, tie_word_embeddings=False))
    hidden = model.config.hidden_size
    # next token after each token: its own direction in the embedding; every other token shares direction 0
    after = {**dict(zip(chain, chain[1:] + [eos], strict=True))}
    default = eos if trigger is not None else chain[0]
    if trigger is not None:
        assert trigger not in chain
        after[trigger] = chain[0]
    assert len(after) < hidden
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.zero_()
        model.model.embed_tokens.weight[:, 0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[default, 0] = 10.0
        for k, (token, nxt) in enumerate(after.items(), start=1):
            model.model.embed_tokens.weight[token] = 0.0
            model.model.embed_tokens.weight[token, k] = 1.0
            model.lm_head.weight[nxt, k] = 10.0
    model.save_pretrained(path, safe_serialization=True)
    return path


def last_token(path: Path, text: str) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)(text, add_special_tokens=False)["input_ids"][-1]


class Generates:
    """The batch size of each `generate` call the process's copy of a judge's model makes."""

    def __init__(self, entry: str, monkeypatch: pytest.MonkeyPatch) -> None:
        model, _ = Judge(entry).load()  # the process's one copy, which the runner uses too
        self.calls: list[int] = []
        original = model.generate

        def counted(*args, **kwargs):
            self.calls.append(kwargs["input_ids"].shape[0])
            return original(*args, **kwargs)

        monkeypatch.setattr(model, "generate", counted)


@pytest.fixture(scope="module")
def only_completion(tmp_path_factory) -> Path:
    template = tmp_path_factory.mktemp("templates") / "only-completion.txt"
    template.write_text("{completion}")
    return template


@pytest.mark.parametrize(("parser", "answer", "value"), [("yesno", "yes", 1.0), ("score10", "7", 0.7),
                                                         ("boxed", "\\boxed{-3}", -3.0)])
def test_a_judge_that_gives_a_known_answer_scores_every_completion_its_value_in_one_generate(
        tiny_model, tmp_path, monkeypatch, parser, answer, value):
    path = build_judge(tmp_path / f"judge-{parser}", tiny_model, answer=answer)
    entry = f"judge:{path}?parser={parser}"
    texts = ["42", "The answer is 42.", "6 * 7 = 41, I think, or maybe 43"]  # of different lengths: padding
    assert Judge(entry).answers([PROMPT] * 3, texts) == [answer] * 3  # the model does say it: greedy, as built
    generates = Generates(entry, monkeypatch)
    names = {"s": [(entry, 2.0), (f"{FIX}:half", 1.0)]}
    with RewardRunner(names, timeout_s=30, workers=1) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions(*texts))
    assert generates.calls == [3]  # the whole group in one batched generate, in this (the generator's) process
    name = path.name
    assert out == [Scored(pytest.approx(2.0 * value + 0.5), {name: pytest.approx(value), "half": 0.5}, None)] * 3


def test_an_unparsable_answer_is_that_completions_error_alone(tiny_model, tmp_path, only_completion):
    trigger_text = "right!"
    trigger = last_token(tiny_model, trigger_text)
    path = build_judge(tmp_path / "picky", tiny_model, answer="yes", trigger=trigger)
    texts = ["6 * 7 = 42", trigger_text, "forty-two"]
    assert [last_token(tiny_model, t) == trigger for t in texts] == [False, True, False]
    entry = f"judge:{path}?parser=yesno&template={only_completion}&name=picky-judge"
    with RewardRunner({"s": [(entry, 1.0)]}, timeout_s=30, workers=0) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions(*texts))
    error = "judge picky-judge: parser 'yesno': no leading yes or no, in the answer ''"
    assert out == [Scored(0.0, {}, error), Scored(1.0, {"picky-judge": 1.0}, None), Scored(0.0, {}, error)]


def test_a_random_judges_garbage_answers_are_each_completions_error_naming_parser_and_answer(tiny_model):
    entry = f"judge:{tiny_model}?parser=boxed&max_new_tokens=8"
    texts = ["42", "The answer is 42.", "no idea"]
    answers = Judge(entry).answers([PROMPT] * 3, texts)
    assert all("\\boxed{" not in a for a in answers), answers  # garbage, as a random model's is
    names = {"s": [(entry, 1.0), (f"{FIX}:half", 1.0)]}
    with RewardRunner(names, timeout_s=30, workers=1) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions(*texts))
    for o, answer in zip(out, answers, strict=True):  # not a silent 0 + 0.5: no reward, with the error
        assert (o.reward, o.rewards) == (0.0, {}), o
        assert o.error == f"judge {tiny_model.name}: parser 'boxed': no \\boxed{{}}, in the answer {answer.strip()!r}"


def test_a_judge_past_the_groups_budget_is_its_timeout_error(tiny_model, monkeypatch):
    names = {"s": [(f"judge:{tiny_model}?parser=yesno&max_new_tokens=2", 1.0), (f"{FIX}:half", 1.0)]}
    with RewardRunner(names, timeout_s=0.2, workers=1) as runner, held_back(monkeypatch, Judge, "answers"):
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions("a", "b"))
    assert out == [Scored(0.0, {}, f"{tiny_model.name}: timeout after 0.6 s")] * 2


def test_a_bad_judge_entry_is_refused_at_start_up_naming_it(tiny_model, tmp_path):
    classifier = tmp_path / "classifier"
    classifier.mkdir()
    (classifier / "config.json").write_text(json.dumps({"architectures": ["LlamaForSequenceClassification"]}))
    bad_template = tmp_path / "bad.txt"
    bad_template.write_text("Judge {answer}")
    extra_field = tmp_path / "extra.txt"
    extra_field.write_text("Judge {completion} against {answer}")
    source = {"name": "s", "kind": "arithmetic"}
    for entry, why in [
            (f"judge:{tmp_path / 'nowhere'}?parser=yesno", "no directory"),
            (f"judge:{classifier}?parser=yesno", "holds LlamaForSequenceClassification, not a causal LM"),
            (f"judge:{tiny_model}?parser=stars", "parser 'stars' is not one of yesno, score10, boxed"),
            (f"judge:{tiny_model}", "parser '' is not one of"),
            (f"judge:{tiny_model}?parser=yesno&temperature=1", "unknown temperature"),
            (f"judge:{tiny_model}?parser=yesno&max_new_tokens=0", "max_new_tokens must be a positive integer"),
            (f"judge:{tiny_model}?parser=yesno&template={bad_template}", "has fields ['answer']"),
            (f"judge:{tiny_model}?parser=yesno&template={extra_field}", "has fields ['answer', 'completion']"),
            (f"judge:{tiny_model}?parser=yesno&template=nowhere.txt", "neither a built-in"),
    ]:
        config = config_from_dict({"data": {"sources": [{**source, "reward_funcs": [f"{FIX}:half", entry]}]}})
        with pytest.raises(ConfigError, match=rf"data\.sources\.0\.reward_funcs: {re.escape(f'reward {entry!r}: ')}"
                                              rf".*{re.escape(why)}"):
            reward_names(config)
    good = f"judge:{tiny_model}?parser=score10"
    config = config_from_dict({"data": {"sources": [{**source, "reward_funcs": [f"{FIX}:half", good]}]}})
    assert reward_names(config) == {"s": [(f"{FIX}:half", 1.0), (good, 1.0)]}
    assert Judge(good).template == judges.TEMPLATES["score10"]
