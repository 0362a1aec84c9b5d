"""TRL's reward functions, unchanged: several per source with weights, called once per group,
None left out of the sum, each function's mean and std in the step's metrics; text or messages
by the data's format, as TRL decides it; TRL's own `trl.rewards`; what TRL's trainer passes beyond
the data (trainer_state, async functions, log_extra / log_metric / environments); the README's
example on the README's own source."""

import json
import re
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

from common.config import ConfigError, config_from_dict
from common.keys import Keys
from common.messages import Completion, PromptTask, SampleGroup
from common.rewards import TrainerState, prompt_text
from generators.scoring import RewardRunner, Scored, conversational_sources, reward_names
from tasks import rows
from tests import reward_fixtures
from tests.harness.groups import read_groups
from tests.harness.pipeline import generate_groups, generator_toml
from trainer.metrics import step_metrics

FIX = "tests.reward_fixtures"
TRL_FIX = "tests.trl_reward_fixtures"
README = Path(__file__).resolve().parents[1] / "README.md"
CHAT = [{"role": "system", "content": "Think, then answer."}, {"role": "user", "content": "What is 6 * 7?"}]


@pytest.mark.parametrize("workers", [0, 1])
def test_trl_functions_from_the_docs_score_a_group_with_weights(workers):
    names = {"chat": [(f"{FIX}:format_reward_func", 0.5)],
             "text": [(f"{FIX}:reward_func", 1.0), (f"{FIX}:half", 2.0)]}  # TRL's beside a per-completion one
    texts = ["<think>6 sevens</think><answer>\\boxed{42}</answer>", "\\boxed{42}",
             "<think>hm</think><answer>41</answer>"]
    with RewardRunner(names, timeout_s=5, workers=workers, conversational=frozenset({"chat"})) as runner:
        chat = runner.score("chat", prompt="What is 6 * 7?", messages=CHAT, meta={"ground_truth": "42"},
                            completions=[(t, [1, 2]) for t in texts])
        text = runner.score("text", prompt="What is 6 * 7?", messages=CHAT, meta={"ground_truth": "42"},
                            completions=[(t, [1, 2]) for t in texts])
    # a chat prompt's completions come as [{"role": "assistant", "content": text}]: format_reward_func
    # reads completion[0]["content"]; weighted 0.5
    assert chat == [Scored(0.5, {"format_reward_func": 1.0}, None), Scored(0.0, {"format_reward_func": 0.0}, None),
                    Scored(0.5, {"format_reward_func": 1.0}, None)]
    # a text source's are text, although its prompt goes to the model as a chat message: reward_func
    # compares the \boxed{} content with the ground_truth column
    assert text == [Scored(2.0, {"reward_func": 1.0, "half": 0.5}, None),
                    Scored(2.0, {"reward_func": 1.0, "half": 0.5}, None),
                    Scored(1.0, {"reward_func": 0.0, "half": 0.5}, None)]


def test_a_trl_function_is_called_once_per_group_with_lists_and_the_columns():
    reward_fixtures.CALLS.clear()
    with RewardRunner({"s": [(f"{FIX}:counting", 1.0)]}, timeout_s=5, workers=0) as runner:
        out = runner.score("s", prompt="Add 2 and 3.", meta={"answer": "5", "source": "s"},
                           completions=[("5", [7]), ("five", [7, 8, 9])], version=3)
    assert [o.reward for o in out] == [1.0, 3.0] and out[0].rewards == {"counting": 1.0}
    state = TrainerState(global_step=3)  # the weight version the group was sampled with
    assert [{"prompts": ["Add 2 and 3."] * 2, "completions": ["5", "five"],
                                      "completion_ids": [[7], [7, 8, 9]], "answer": ["5", "5"], "source": ["s", "s"],
                                      "trainer_state": state}] == reward_fixtures.CALLS


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


# ---------------------------------------------------------------------- text or messages, by the data's format


def test_a_template_source_gives_text_and_a_messages_source_messages_as_trl_decides():
    # TRL: a prompt that is a string gives string completions, a list of messages message lists
    # (trl.data_utils.is_conversational); the chat template the generator applies does not count
    common = {"path": "x.jsonl", "reward_funcs": [f"{FIX}:counting"]}
    config = config_from_dict({"data": {"sources": [
        {**common, "name": "tpl", "template": "{question}"},
        {**common, "name": "col", "prompt_column": "question"},
        {**common, "name": "msgs", "messages_column": "messages"},
        {**common, "name": "msgs_as_text", "messages_column": "messages", "chat": False},
        {"name": "arith", "kind": "arithmetic", "reward_funcs": [f"{FIX}:counting"]}]}})
    assert conversational_sources(config) == {"msgs"}
    row = {"question": "What is 6 * 7?", "messages": CHAT}
    seen = {}
    with RewardRunner(reward_names(config), timeout_s=5, workers=0,
                      conversational=conversational_sources(config)) as runner:
        for source in config.sources[:4]:
            p = rows.row_prompt(row, source=source, prompt_id=f"{source.name}:0:0")
            task = PromptTask(id=p.id, messages=p.messages, text=p.text, meta=p.meta, n=1, admitted_at=0)
            reward_fixtures.CALLS.clear()
            runner.score(source.name, prompt=prompt_text(task), messages=task.messages, meta=task.meta,
                         completions=[("42", [1])])
            seen[source.name] = (reward_fixtures.CALLS[0]["prompts"], reward_fixtures.CALLS[0]["completions"])
    assert seen["tpl"] == seen["col"] == (["What is 6 * 7?"], ["42"])  # sent as a user message all the same
    assert seen["msgs"] == ([CHAT], [[{"role": "assistant", "content": "42"}]])
    # chat = false: the model is given the messages' text, and so is the function
    assert seen["msgs_as_text"] == (["Think, then answer.\n\nWhat is 6 * 7?"], ["42"])


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_trls_own_reward_functions_unchanged_through_the_reward_workers(kind):
    import trl.rewards  # a dev dependency: TRL's own functions, not copies

    assert trl.rewards.accuracy_reward.__module__ == "trl.rewards.accuracy_rewards"
    chat = kind == "chat"
    funcs = ["trl.rewards:accuracy_reward", "trl.rewards:think_format_reward"] if chat else []
    source = {"name": kind, "path": "x.jsonl", "meta_columns": ["solution"],
              "reward_funcs": [*funcs, f"{TRL_FIX}:repetition_penalty_reward"],
              **({"messages_column": "messages"} if chat else {"template": "{question}"})}
    config = config_from_dict({"data": {"sources": [source]}})
    row = {"question": "What is 6 * 7?", "messages": CHAT, "solution": "42"}
    p = rows.row_prompt(row, source=config.sources[0], prompt_id=f"{kind}:0:0")
    task = PromptTask(id=p.id, messages=p.messages, text=p.text, meta=p.meta, n=3, admitted_at=0)
    completions = [("<think>six sevens</think>The answer is $\\boxed{42}$.", [1, 2, 3]),
                   ("The answer is $\\boxed{41}$.", [4, 4, 4, 4]), ("<think>no answer", [5, 6])]
    with RewardRunner(reward_names(config), timeout_s=60, workers=1,
                      conversational=conversational_sources(config)) as runner:
        out = runner.score(kind, prompt=prompt_text(task), messages=task.messages, meta=task.meta,
                           completions=completions)
    # repetition_penalty_reward reads the ids only: [4, 4, 4, 4] repeats 2 of its 3 bigrams
    if chat:  # accuracy_reward and think_format_reward read completion[0]["content"]
        assert out == [Scored(2.0, {"accuracy_reward": 1.0, "think_format_reward": 1.0,
                                    "repetition_penalty_reward": 0.0}, None),
                       Scored(pytest.approx(-2 / 3), {"accuracy_reward": 0.0, "think_format_reward": 0.0,
                                                      "repetition_penalty_reward": pytest.approx(-2 / 3)}, None),
                       Scored(0.0, {"accuracy_reward": 0.0, "think_format_reward": 0.0,
                                    "repetition_penalty_reward": 0.0}, None)]
    else:
        assert [o.rewards for o in out] == [{"repetition_penalty_reward": 0.0},
                                            {"repetition_penalty_reward": pytest.approx(-2 / 3)},
                                            {"repetition_penalty_reward": 0.0}]
        assert all(o.error is None for o in out)


def test_trls_message_readers_fail_on_a_text_source_as_they_do_in_trl():
    # think_format_reward reads completion[0]["content"]: on text completions that is TRL's own error
    config = config_from_dict({"data": {"sources": [{"name": "t", "path": "x.jsonl", "template": "{question}",
                                                     "reward_funcs": ["trl.rewards:think_format_reward"]}]}})
    with RewardRunner(reward_names(config), timeout_s=60, workers=1,
                      conversational=conversational_sources(config)) as runner:
        out = runner.score("t", prompt="What is 6 * 7?", messages=[{"role": "user", "content": "What is 6 * 7?"}],
                           meta={}, completions=[("<think>x</think>42", [1])])
    assert out == [Scored(0.0, {}, "TypeError: string indices must be integers, not 'str'")]


# ---------------------------------------------------------------------- what TRL's trainer passes beyond the data


@pytest.mark.parametrize("workers", [0, 1])
def test_trainer_state_is_the_weight_version_and_async_functions_are_awaited_together(workers):
    names = {"s": [(f"{TRL_FIX}:by_step", 1.0), (f"{TRL_FIX}:async_length", 1.0), (f"{TRL_FIX}:first", 1.0),
                   (f"{TRL_FIX}:second", 1.0), (f"{TRL_FIX}:async_half", 1.0)],
             "epoch": [(f"{TRL_FIX}:by_epoch", 1.0)]}
    with RewardRunner(names, timeout_s=30, workers=workers) as runner:
        out = runner.score("s", prompt="p", meta={}, completions=[("ab", [1]), ("abcd", [1])], version=7)
        epoch = runner.score("epoch", prompt="p", meta={}, completions=[("ab", [1])], version=7)
    # first and second each wait for the other to start: both finish only if gathered in one loop
    assert out == [Scored(7 + 2 + 1 + 1 + 0.5, {"by_step": 7.0, "async_length": 2.0, "first": 1.0, "second": 1.0,
                                                "async_half": 0.5}, None),
                   Scored(7 + 4 + 1 + 1 + 0.5, {"by_step": 7.0, "async_length": 4.0, "first": 1.0, "second": 1.0,
                                                "async_half": 0.5}, None)]
    # only global_step is given: another TrainerState field is the completions' recorded error
    assert epoch == [Scored(0.0, {}, "AttributeError: 'TrainerState' object has no attribute 'epoch'")]


@pytest.mark.parametrize("param", ["log_metric", "log_extra", "environments"])
def test_a_function_that_needs_what_we_do_not_pass_is_refused_at_start_up_by_name(param):
    config = config_from_dict({"data": {"sources": [
        {"name": "s", "path": "x.jsonl", "template": "{q}",
         "reward_funcs": [f"{FIX}:half", f"{TRL_FIX}:needs_{param}"]}]}})
    with pytest.raises(ConfigError, match=rf"data\.sources\.0\.reward_funcs: reward '{TRL_FIX}:needs_{param}' "
                                          rf"needs `{param}`, which TRL's trainer passes and rollouts does not"):
        reward_names(config)


def test_log_callables_are_not_passed_and_a_function_that_reads_one_says_so():
    names = {"s": [(f"{TRL_FIX}:logs_if_given", 1.0)], "k": [(f"{TRL_FIX}:reads_log_metric", 1.0)]}
    with RewardRunner(names, timeout_s=30, workers=1) as runner:
        given = runner.score("s", prompt="p", meta={}, completions=[("a", [1])])
        read = runner.score("k", prompt="p", meta={}, completions=[("a", [1])])
    assert given == [Scored(1.0, {"logs_if_given": 1.0}, None)]  # its defaults, as outside a trainer
    assert read == [Scored(0.0, {}, "reads_log_metric reads `log_metric`, which TRL's trainer passes "
                                    "and rollouts does not")]


# ---------------------------------------------------------------------- the README's example, as written there


def readme_example() -> tuple[str, str, str]:
    """From README.md's "Bring your own model, data and reward": the source table, the reward
    block's config lines and the reward module's code, as written there (TOML text, TOML text,
    Python)."""
    section = README.read_text().split("## Bring your own model, data and reward", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```toml\n(.*?)```", section, re.S)
    source = blocks[0]
    (rewards_block,) = [b for b in blocks if "reward_funcs" in b and "my_rewards:" in b]  # the TRL example
    comments = [line[1:] for line in rewards_block.splitlines() if line.startswith("#")]
    assert "my_rewards.py" in comments[0], comments[0]
    config = "\n".join(line for line in rewards_block.splitlines() if not line.startswith("#"))
    return source, config, textwrap.dedent("\n".join(comments[1:]))


def readme_setup(folder: Path) -> str:
    """The README's reward module and a data file of its layout ("question" and "answer", GSM8K's)
    in `folder`; the README's TOML: source table and reward lines."""
    source, config, code = readme_example()
    module = tomllib.loads(config)["reward_funcs"][0].partition(":")[0]
    (folder / f"{module}.py").write_text(code)
    path = tomllib.loads(source)["data"]["sources"][0]["path"]
    (folder / path).parent.mkdir(parents=True, exist_ok=True)
    (folder / path).write_text("\n".join(json.dumps(row) for row in [
        {"question": "What is 6 * 7?", "answer": "Six sevens are 42.\n#### 42"},
        {"question": "What is 5 + 4?", "answer": "#### 9"}]) + "\n")
    return f"{source}\n{config}\n"


def test_the_readmes_trl_example_scores_the_readmes_own_source(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))  # the reward workers get it too
    config = config_from_dict(tomllib.loads(readme_setup(tmp_path)))
    (source,) = config.sources
    p = rows.row_prompt(rows.load(source, field="data.sources.0")[0], source=source, prompt_id="mine:0:0")
    assert p.messages is not None, "a template source is sent as a chat message"
    task = PromptTask(id=p.id, messages=p.messages, text=p.text, meta=p.meta, n=2, admitted_at=0)
    with RewardRunner(reward_names(config), timeout_s=30, workers=1,
                      conversational=conversational_sources(config)) as runner:
        out = runner.score(source.name, prompt=prompt_text(task), messages=task.messages, meta=task.meta,
                           completions=[("6 * 7 = \\boxed{42}", [1]), ("42", [2])])
    assert out == [Scored(pytest.approx(1.1), {"reward_func": 1.0, "format": 1.0}, None),
                   Scored(0.0, {"reward_func": 0.0, "format": 0.0}, None)]


def test_a_generator_runs_the_readmes_trl_example_on_the_readmes_source(tiny_model, tmp_path, redis_url, r,
                                                                         monkeypatch):
    monkeypatch.chdir(tmp_path)  # the README's path is relative, as the generator's cwd
    config = tmp_path / "run.toml"
    config.write_text(generator_toml(run="trl", redis_url=redis_url, model=tiny_model) + readme_setup(tmp_path))
    parsed = config_from_dict(tomllib.loads(config.read_text()))
    (source,) = parsed.sources
    keys = Keys("trl")
    tasks = []
    for i, row in enumerate(rows.load(source, field="data.sources.0")):
        p = rows.row_prompt(row, source=source, prompt_id=f"{source.name}:0:{i}")
        tasks.append(PromptTask(id=p.id, messages=p.messages, text=p.text, meta=p.meta, n=2, admitted_at=0))
    said = generate_groups(r, keys, tasks, config=config, groups=2, cwd=tmp_path)
    assert "source mine: TRL reward functions my_rewards:reward_func get prompts and completions as text" in said
    completions = [c for group in read_groups(r, keys) for c in group.completions]
    assert [(c.reward_error, sorted(c.rewards)) for c in completions] == [(None, ["format", "reward_func"])] * 4
