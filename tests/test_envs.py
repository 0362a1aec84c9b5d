"""Environments and episodes: the built-in environments, tool calls, environment steps in worker
processes with time limits, and episodes as completions whose ids are exactly the ids sampled.
The generator playing episodes for real: tests/test_episodes.py."""

from __future__ import annotations

import pytest
import trio
from transformers import AutoTokenizer

from common.messages import SampleGroup, decode_group, encode
from engines.base import Sampled, turn_ids
from envs import base, calculator, guess
from envs.tools import call_tools, parse_calls
from generators.environments import EnvRunner
from generators.episodes import EpisodeLimits, run_episode
from trainer.batch import group_rows

# ---------------------------------------------------------------------- built-in environments


def test_calculator_answers_calls_and_scores_the_final_answer():
    state = calculator.start({"answer": 48213 + 90877})
    s = calculator.step(state, "Let me compute. <calc>48213 + 90877</calc>")
    assert not s.done and s.messages == [{"role": "tool", "content": "139090"}] and s.reward == 0.0
    assert calculator.calc("(123456789 * 987654321) - 5") == 123456789 * 987654321 - 5
    wrong = calculator.step(s.state, "The answer is 139091.")
    right = calculator.step(s.state, "The answer is 139,090.")
    assert wrong.done and wrong.reward == 0.0 and right.done and right.reward == 1.0 == right.rewards["correct"]


def test_calculator_refuses_anything_but_integer_arithmetic():
    for bad in ["__import__('os').system('true')", "2 ** 100000", "1 / 3", "9" * 150 + " * " + "9" * 150, "1 +"]:
        with pytest.raises(ValueError):
            calculator.calc(bad)
    s = calculator.step(calculator.start({"answer": 1}), "<calc>open('x')</calc>")
    assert not s.done and s.messages[0]["content"].startswith("error: ValueError")


def test_guess_the_number_says_higher_or_lower_until_found():
    state = guess.start({"secret": 37, "high": 100})
    replies = []
    for text in ["50", "I guess 20", "no idea", "37"]:
        s = guess.step(state, text)
        state = s.state
        replies.append(s.messages[0]["content"] if s.messages else ("done", s.reward))
    assert replies == ["Lower.", "Higher.", "Guess a number.", ("done", pytest.approx(0.8))]
    assert len(guess.dataset(size=5, seed=1)) == 5


def test_tool_calls_parse_in_the_hermes_and_the_tag_format():
    text = ('<tool_call>{"name": "add", "arguments": {"a": 2, "b": 3}}</tool_call> and '
            '<tool_call>{"name": "add", "arguments": [1]}</tool_call> <tool_call>{"name": "nope"}</tool_call>')
    calls = parse_calls(text, format="hermes", names=[])
    assert [(c.name, c.arguments, c.error is None) for c in calls] == [
        ("add", {"a": 2, "b": 3}, True), ("", {}, False), ("nope", {}, True)]

    def add(a: int, b: int) -> int:
        return a + b

    answers = call_tools(calls, {"add": add})
    assert answers[0] == "5" and answers[1].startswith("error: the tool call does not parse")
    assert answers[2].startswith("error: no tool named 'nope'")
    tags = parse_calls("<calc>1 + 2</calc> <other>x</other> <calc>oops", format="tag", names=["calc"])
    assert [(c.name, c.arguments) for c in tags] == [("calc", "1 + 2")]
    assert call_tools(tags, {"calc": lambda e: 1 // 0}) == [
        "error: ZeroDivisionError: integer division or modulo by zero"]


def test_an_environment_is_loaded_by_name_and_a_bad_one_is_refused():
    assert base.spec("envs.calculator").tools[0]["function"]["name"] == "calc"
    assert base.spec("tests.env_fixtures:Faulty").system == "Call the tool."
    with pytest.raises(ValueError, match="cannot be loaded"):
        base.spec("envs.nothing_here")
    with pytest.raises(ValueError, match="no callable start or step"):
        base.spec("envs.tools")


# ---------------------------------------------------------------------- steps in worker processes


def test_a_step_that_hangs_or_raises_answers_with_an_error_and_the_runner_goes_on():
    with EnvRunner(["tests.env_fixtures:Faulty", "tests.env_fixtures:BadStart"], workers=1) as envs:
        name = "tests.env_fixtures:Faulty"
        state, err = envs.start(name, {"tool": "hang"}, timeout_s=5)
        assert err is None and state == {"tool": "hang", "answered": False}
        step, err = envs.step(name, state, "x", timeout_s=0.5)
        assert step is None and err == "the environment did not answer within 0.5 s"
        assert envs.restarts == 1  # the hung worker was killed and replaced
        state, _ = envs.start(name, {"tool": "boom"}, timeout_s=5)
        step, err = envs.step(name, state, "x", timeout_s=5)  # the replacement answers
        assert err is None and step.messages == [{"role": "tool", "content": "error: RuntimeError: boom"}]
        _, err = envs.start("tests.env_fixtures:BadStart", {}, timeout_s=5)
        assert err == "KeyError: 'no such game'"
        assert envs.restarts == 1


# ---------------------------------------------------------------------- episodes


def scripted(turns: list[list[int]], log: list[list[int]]):
    """A policy that writes the given turns (its "sampled" ids), with log-prob -0.5 per token,
    recording the running ids it was asked to continue."""
    queue = list(turns)

    async def sample(ids: list[int], max_new_tokens: int) -> Sampled:
        log.append(list(ids))
        out = queue.pop(0)[:max_new_tokens]
        return Sampled(ids=out, logprobs=[-0.5] * len(out), finish="stop" if out[-1] == 2 else "length")

    return sample


def limits(**kw) -> EpisodeLimits:
    return EpisodeLimits(**{"max_turns": 4, "max_tokens": 200, "max_new_tokens": 64, "turn_timeout_s": 10.0,
                            "episode_timeout_s": 60.0, **kw})


def play(envs, name: str, tok, turns, meta, **kw):
    log: list[list[int]] = []
    ep = trio.run(lambda: run_episode(sample=scripted(turns, log), envs=envs, spec=base.spec(name), tokenizer=tok,
                                      prompt_ids=[1, 5, 6], meta=meta, limits=limits(**kw)))
    return ep, log


def test_an_episode_trains_exactly_the_ids_sampled_with_a_tokenizer_that_does_not_round_trip(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    one, two = tok.encode("1", add_special_tokens=False), tok.encode("2", add_special_tokens=False)
    eos = tok.eos_token_id
    # The model writes "12" as "1" then "2": decoding and encoding again gives other ids ("12" is one token).
    turn1 = tok.encode("<calc>", add_special_tokens=False) + one + two + tok.encode(" + 34</calc>",
                                                                                  add_special_tokens=False) + [eos]
    turn2 = tok.encode("4", add_special_tokens=False) + tok.encode("6", add_special_tokens=False) + [eos]
    assert tok.encode(tok.decode(turn1, skip_special_tokens=False), add_special_tokens=False) != turn1
    with EnvRunner(["envs.calculator"], workers=1) as envs:
        ep, asked = play(envs, "envs.calculator", tok, [turn1, turn2], {"answer": 46})
    env_turn = turn_ids(tok, [{"role": "tool", "content": "46"}], eos_id=eos)
    assert tok.decode(env_turn) == "\n<|im_start|>tool\n46<|im_end|>\n<|im_start|>assistant\n"
    assert ep.ids == turn1 + env_turn + turn2
    assert ep.mask == [1] * len(turn1) + [0] * len(env_turn) + [1] * len(turn2)
    assert ep.logprobs == [-0.5] * len(turn1) + [0.0] * len(env_turn) + [-0.5] * len(turn2)
    assert asked == [[1, 5, 6], [1, 5, 6] + turn1 + env_turn]  # each turn continues the ids as they are
    assert (ep.finish, ep.turns, ep.reward, ep.rewards, ep.errors) == ("stop", 2, 1.0, {"correct": 1.0}, [])

    # On the wire and in the trainer: the trained targets on masked-in positions are the sampled ids.
    c = ep.completion(tok.decode(ep.ids, skip_special_tokens=True))
    group = decode_group(encode(SampleGroup(id="p", prompt_id="p", prompt_ids=[1, 5, 6], version=0, generator="g",
                                            engine="hf", completions=[c, c])))
    row = group_rows(group)[0]
    trained = [t for t, m in zip(row.targets, row.mask, strict=True) if m]
    assert trained == turn1 + turn2
    assert [lp for lp, m in zip(row.behaviour_logp, row.mask, strict=True) if m] == [-0.5] * len(trained)


def test_an_episode_stops_at_its_limits_and_records_why(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    turn = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id]
    name = "tests.env_fixtures:Echo"
    with EnvRunner([name, "tests.env_fixtures:BadStart"], workers=1) as envs:
        ep, _ = play(envs, name, tok, [turn] * 5, {}, max_turns=3)
        assert (ep.finish, ep.turns, ep.reward, ep.rewards) == ("turns", 3, 0.75, {"turn": 0.75})
        assert sum(ep.mask) == 3 * len(turn) and len(ep.ids) > sum(ep.mask)
        ep, _ = play(envs, name, tok, [turn] * 5, {}, max_tokens=len(turn) + 5)  # the tool's turn does not fit
        assert (ep.finish, ep.turns, ep.ids) == ("length", 1, turn)
        ep, _ = play(envs, name, tok, [turn] * 5, {}, max_tokens=len(turn) - 2)  # the model's turn is cut
        assert (ep.finish, ep.ids) == ("length", turn[:-2])
        ep, _ = play(envs, name, tok, [turn] * 5, {}, episode_timeout_s=1e-9)
        assert (ep.finish, ep.turns) == ("timeout", 1)
        ep, _ = play(envs, "tests.env_fixtures:BadStart", tok, [turn], {})
        assert (ep.finish, ep.ids, ep.reward) == ("abort", turn, 0.0)
        assert ep.reward_error == "environment start: KeyError: 'no such game'"


def test_a_failing_step_is_the_models_error_turn_and_the_episode_goes_on(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    turn = tok.encode("hello", add_special_tokens=False) + [tok.eos_token_id]
    name = "tests.env_fixtures:Faulty"
    with EnvRunner([name], workers=1) as envs:
        ep, _ = play(envs, name, tok, [turn] * 3, {"tool": "hang"}, max_turns=3, turn_timeout_s=0.5)
        assert (ep.finish, ep.turns, ep.reward) == ("turns", 3, 0.0)
        assert ep.errors == ["the environment did not answer within 0.5 s"] * 3
        error_turn = turn_ids(tok, [{"role": "tool", "content": "error: the environment did not answer within 0.5 s"}],
                              eos_id=tok.eos_token_id)
        assert ep.ids == turn + error_turn + turn + error_turn + turn
        ep, _ = play(envs, name, tok, [turn] * 3, {"tool": "boom"})
        assert (ep.finish, ep.turns, ep.reward, ep.errors) == ("stop", 2, 1.0, [])
        assert "error: RuntimeError: boom" in tok.decode(ep.ids)


def test_the_trainers_length_of_an_episode_counts_the_models_tokens():
    from common.messages import Completion
    from trainer.metrics import step_metrics

    def episode(mask: list[int]) -> Completion:
        return Completion(ids=list(range(len(mask))), logprobs=[-0.1 if m else 0.0 for m in mask], reward=0.0,
                          rewards={}, finish="stop", text="", loss_mask=mask)

    group = SampleGroup(id="p", prompt_id="p", prompt_ids=[1], version=0, generator="g", engine="hf",
                        completions=[episode([1, 1, 0, 0, 0, 1]), episode([1, 0, 0, 1, 1, 1, 1])])
    m = step_metrics([group], staleness=[0])
    assert (m["mean_length"], m["max_length"]) == (4.0, 5)


def test_a_template_that_rewrites_earlier_turns_is_refused(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    # Like templates that drop the reasoning of all but the last assistant turn: what the model
    # sampled would no longer be the prefix of the rendered episode.
    tok.chat_template = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
                         "{% if m['role'] == 'assistant' and not loop.last %}[earlier]{% else %}{{ m['content'] }}"
                         "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
                         "{% endif %}")
    with pytest.raises(ValueError, match="renders an assistant turn differently"):
        turn_ids(tok, [{"role": "tool", "content": "1"}], eos_id=None)
