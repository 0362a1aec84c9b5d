"""Reward models as TRL runs them: a "model:PATH" entry of reward_funcs is a sequence-classification
model whose logits[:, 0] on prompt + completion (the conversation under its chat template, for
messages) is a weighted reward component named after its directory; a group is one batch that
scores as each completion alone; a path that is no such model is refused at start-up by its entry;
one that fails later is every completion's recorded error; a generator scores its groups with one
beside a reward function."""

import json
import re
import shutil
import tomllib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from common.config import ConfigError, config_from_dict
from common.keys import Keys
from common.messages import PromptTask
from common.reward_models import RewardModel
from generators.scoring import RewardRunner, Scored, reward_names
from tests.harness.groups import read_groups
from tests.harness.models import one_layer_llama
from tests.harness.overruns import held_back
from tests.harness.pipeline import generate_groups, generator_toml

FIX = "tests.reward_fixtures"
PROMPT = "What is 6 * 7?"
CHAT = [{"role": "system", "content": "Answer with the number."}, {"role": "user", "content": PROMPT}]
TEXTS = ["42", "The answer is 42.", "6 * 7 = 41, I think, or maybe 43"]  # of different lengths: padding


def build_reward_model(path: Path, tokenizer_from: Path) -> Path:
    """A tiny Llama sequence classifier (one label, random weights, a score head large enough that
    texts score far apart) with the tiny model's tokenizer and chat template; its config names no
    pad token, as many reward models' do not (the scorer must give it the tokenizer's)."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    model = LlamaForSequenceClassification(one_layer_llama(tokenizer, num_labels=1, pad_token_id=None))
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    assert json.loads((path / "config.json").read_text()).get("pad_token_id") is None
    return path


@pytest.fixture(scope="module")
def reward_model(tiny_model, tmp_path_factory) -> Path:
    return build_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm", tiny_model)


def logit(path: Path, text: str) -> float:
    """The model's logits[0, 0] on `text` alone, computed here directly (no batch, no padding)."""
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.inference_mode():
        return float(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0])


def chat_text(path: Path, completion: str) -> str:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path).apply_chat_template(
        [*CHAT, {"role": "assistant", "content": completion}], tokenize=False)


def completions(*texts: str) -> list[tuple[str, list[int]]]:
    return [(t, [1, 2]) for t in texts]


@pytest.mark.parametrize("chat", [False, True], ids=["text", "messages"])
def test_the_reward_is_the_models_first_logit_on_prompt_and_completion(reward_model, chat):
    names = {"s": [(f"model:{reward_model}", 1.0)]}
    with RewardRunner(names, timeout_s=30, workers=0, conversational=frozenset({"s"} if chat else ())) as runner:
        out = runner.score("s", prompt=PROMPT, messages=CHAT, meta={"answer": "42"}, completions=completions(*TEXTS))
    # TRL: prompt + completion for text, the conversation under the reward model's chat template for messages
    expected = [logit(reward_model, chat_text(reward_model, t) if chat else PROMPT + t) for t in TEXTS]
    assert [o.error for o in out] == [None] * 3
    assert [o.rewards for o in out] == [{"tiny-rm": pytest.approx(v, abs=1e-5)} for v in expected]
    assert [o.reward for o in out] == pytest.approx(expected, abs=1e-5)
    assert len({round(v, 3) for v in expected}) == 3, expected  # the texts do score apart: the check can fail


@contextmanager
def forwards(path: Path) -> Iterator[list[int]]:
    """The batch size of each forward pass this process's copy of the model at `path` makes."""
    model, _ = RewardModel(f"model:{path}").load()  # the process's one copy, which the runner uses too
    calls: list[int] = []
    hook = model.register_forward_hook(lambda module, args, kwargs, out: calls.append(kwargs["input_ids"].shape[0]),
                                       with_kwargs=True)
    try:
        yield calls
    finally:
        hook.remove()


def test_a_group_is_one_batch_that_scores_as_each_completion_alone(reward_model):
    with forwards(reward_model) as calls, \
            RewardRunner({"s": [(f"model:{reward_model}", 1.0)]}, timeout_s=30, workers=1) as runner:
        group = runner.score("s", prompt=PROMPT, meta={}, completions=completions(*TEXTS))
        assert calls == [3]  # the whole group in one forward pass
        alone = [runner.score("s", prompt=PROMPT, meta={}, completions=completions(t))[0] for t in TEXTS]
    assert [g.error for g in group] == [None] * 3
    assert [g.reward for g in group] == pytest.approx([a.reward for a in alone], abs=1e-5)


def test_a_path_that_is_no_reward_model_is_refused_at_start_up_naming_its_entry(reward_model, tiny_model, tmp_path):
    two_labels = tmp_path / "two-labels"
    two_labels.mkdir()
    (two_labels / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForSequenceClassification"], "id2label": {"0": "a", "1": "b"}}))
    source = {"name": "s", "kind": "arithmetic"}
    for path, why in [(tmp_path / "nowhere", "no directory"),
                      (tiny_model, "holds LlamaForCausalLM, not a sequence-classification model"),
                      (two_labels, "has 2 labels")]:
        config = config_from_dict({"data": {"sources": [
            {**source, "reward_funcs": [f"{FIX}:half", f"model:{path}"]}]}})
        entry = re.escape(f"reward 'model:{path}': ")
        with pytest.raises(ConfigError, match=rf"data\.sources\.0\.reward_funcs: {entry}.*{why}"):
            reward_names(config)
        with pytest.raises(ValueError, match=rf"{entry}.*{why}"):
            RewardRunner({"s": [(f"model:{path}", 1.0)]}, timeout_s=5, workers=0)
    # the good one is taken, and named after its directory beside the function
    good = config_from_dict({"data": {"sources": [{**source, "reward_funcs": [f"{FIX}:half", f"model:{reward_model}"],
                                                   "reward_weights": [1.0, 0.5]}]}})
    assert reward_names(good) == {"s": [(f"{FIX}:half", 1.0), (f"model:{reward_model}", 0.5)]}


def test_a_reward_model_beside_a_function_is_weighted_through_the_reward_workers(reward_model):
    names = {"s": [(f"model:{reward_model}", 0.5), (f"{FIX}:half", 2.0)]}
    with forwards(reward_model) as calls, RewardRunner(names, timeout_s=30, workers=1) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions(*TEXTS))
    assert calls == [3]  # run here, in the generator's process, not in its reward worker
    values = [logit(reward_model, PROMPT + t) for t in TEXTS]
    assert out == [Scored(pytest.approx(0.5 * v + 2.0 * 0.5, abs=1e-5),
                          {"tiny-rm": pytest.approx(v, abs=1e-5), "half": 0.5}, None) for v in values]


def test_a_reward_model_that_cannot_load_is_every_completions_recorded_error(reward_model, tmp_path):
    broken = shutil.copytree(reward_model, tmp_path / "broken-rm")
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")  # its config.json still passes the check
    names = {"s": [(f"model:{broken}", 1.0), (f"{FIX}:half", 1.0)]}
    with RewardRunner(names, timeout_s=30, workers=1) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions("a", "b"))
        again = runner.score("s", prompt=PROMPT, meta={}, completions=completions("c"))
    for o in out + again:  # not a silent 0: reward 0 with the error, which the trainer leaves out
        assert (o.reward, o.rewards) == (0.0, {}) and o.error is not None, o
        assert f"reward model 'model:{broken}' cannot be loaded" in o.error, o.error


def test_a_reward_model_past_the_groups_budget_is_its_timeout_error(reward_model, monkeypatch):
    names = {"s": [(f"model:{reward_model}", 1.0), (f"{FIX}:half", 1.0)]}
    with RewardRunner(names, timeout_s=0.2, workers=1) as runner, held_back(monkeypatch, RewardModel, "__call__"):
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions("a", "b"))
    # the group's budget, 0.2 s x (2 + 1), as a TRL function's; every completion gets the error
    assert out == [Scored(0.0, {}, "tiny-rm: timeout after 0.6 s")] * 2


def test_a_generator_scores_its_groups_with_a_reward_model_beside_a_function(tiny_model, reward_model, tmp_path,
                                                                              redis_url, r):
    config = tmp_path / "run.toml"
    config.write_text(generator_toml(run="rm", redis_url=redis_url, model=tiny_model) + f"""[[data.sources]]
name = "calc"
kind = "arithmetic"
reward_funcs = ["model:{reward_model}", "{FIX}:half"]
reward_weights = [0.5, 2.0]
""")
    config_from_dict(tomllib.loads(config.read_text()))  # the table as a user writes it
    keys = Keys("rm")
    task = PromptTask(id="calc:0:0", messages=None, text=PROMPT, meta={"answer": "42"}, n=3, admitted_at=0,
                      source="calc")
    said = generate_groups(r, keys, [task], config=config, groups=1, cwd=tmp_path)
    assert f"source calc: reward models model:{reward_model} score prompt + completion as text" in said
    (group,) = read_groups(r, keys)
    for c in group.completions:
        v = logit(reward_model, PROMPT + c.text)
        assert c.reward_error is None, c.reward_error
        assert c.rewards == {"tiny-rm": pytest.approx(v, abs=1e-4), "half": 0.5}
        assert c.reward == pytest.approx(0.5 * v + 1.0, abs=1e-4)


# ---------------------------------------------------------------------- TRL's reward_processing_classes


def tokenizer_dir(path: Path, tokenizer_from: Path, *, chat_template: str, extra_tokens: int = 0) -> Path:
    """The tokenizer of `tokenizer_from` with its own chat template and no pad token, plus
    `extra_tokens` added tokens, saved alone in `path`."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.chat_template = chat_template
    tokenizer.pad_token = None
    tokenizer.add_tokens([f"<extra-{i}>" for i in range(extra_tokens)])
    tokenizer.save_pretrained(path)
    assert AutoTokenizer.from_pretrained(path).pad_token_id is None  # the scorer must pad with eos, as TRL does
    return path


def test_a_tokenizer_named_with_the_model_is_its_reward_processing_class(reward_model, tmp_path):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    weights = tmp_path / "weights-only"  # the reward model without a tokenizer of its own
    weights.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(reward_model / name, weights / name)
    tok = tokenizer_dir(tmp_path / "tok", reward_model,
                        chat_template="{% for m in messages %}<{{ m['role'] }}> {{ m['content'] }}\n{% endfor %}")
    entry = f"model:{weights}?tokenizer={tok}"
    with RewardRunner({"s": [(entry, 1.0)]}, timeout_s=30, workers=0, conversational=frozenset({"s"})) as runner:
        out = runner.score("s", prompt=PROMPT, messages=CHAT, meta={}, completions=completions(*TEXTS))
    # each completion alone, unpadded, rendered and tokenized by the named tokenizer (its chat template)
    tokenizer = AutoTokenizer.from_pretrained(tok)
    model = AutoModelForSequenceClassification.from_pretrained(weights).eval()
    expected = []
    for t in TEXTS:
        text = tokenizer.apply_chat_template([*CHAT, {"role": "assistant", "content": t}], tokenize=False)
        assert text.startswith(f"<system> {CHAT[0]['content']}\n"), text
        with torch.inference_mode():
            expected.append(float(model(**tokenizer(text, return_tensors="pt", add_special_tokens=False)).logits[0, 0]))
    assert [o.error for o in out] == [None] * 3
    assert [o.rewards for o in out] == [{"weights-only": pytest.approx(v, abs=1e-5)} for v in expected]
    assert len({round(v, 3) for v in expected}) == 3, expected  # the texts do score apart: the check can fail
    # without the option, the tokenizer is the model directory's own (TRL's default), and it has none
    with RewardRunner({"s": [(f"model:{weights}", 1.0)]}, timeout_s=30, workers=0) as runner:
        (alone,) = runner.score("s", prompt=PROMPT, meta={}, completions=completions("42"))
    assert alone.error is not None and f"reward model 'model:{weights}' cannot be loaded" in alone.error, alone


def test_a_bad_tokenizer_is_refused_at_start_up_or_when_it_loads_naming_it(reward_model, tmp_path):
    source = {"name": "s", "kind": "arithmetic"}
    nowhere = tmp_path / "nowhere"
    for entry, why in [(f"model:{reward_model}?tokenizer={nowhere}", "is no directory holding a tokenizer"),
                       (f"model:{reward_model}?tokenizer=", "is no directory holding a tokenizer"),
                       (f"model:{reward_model}?tokeniser={reward_model}", "unknown tokeniser")]:
        config = config_from_dict({"data": {"sources": [{**source, "reward_funcs": [f"{FIX}:half", entry]}]}})
        with pytest.raises(ConfigError, match=rf"data\.sources\.0\.reward_funcs: {re.escape(f'reward {entry!r}: ')}"
                                              rf".*{re.escape(why)}"):
            reward_names(config)
    # a tokenizer with more tokens than the model has embeddings: every completion's error, not a crash
    big = tokenizer_dir(tmp_path / "big-tok", reward_model, chat_template="", extra_tokens=8)
    entry = f"model:{reward_model}?tokenizer={big}"
    with RewardRunner({"s": [(entry, 1.0), (f"{FIX}:half", 1.0)]}, timeout_s=30, workers=0) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions("a", "b"))
    rows = json.loads((reward_model / "config.json").read_text())["vocab_size"]
    for o in out:
        assert (o.reward, o.rewards) == (0.0, {}), o
        assert o.error == (f"reward model {entry!r} cannot be loaded: the tokenizer at {big} has {rows + 8} tokens, "
                           f"more than the {rows} embeddings of the model at {reward_model}"), o.error
