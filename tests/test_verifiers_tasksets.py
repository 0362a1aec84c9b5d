"""`kind = "verifiers"` sources: a verifiers taskset's tasks are the prompts, its reward hooks the
reward (weighted as verifiers weighs them), through the producer and the generator's reward
workers; what needs verifiers' own runtime is refused by name."""

from __future__ import annotations

import asyncio
import re

import pytest

from common.config import ConfigError, VerifiersSource, config_from_dict, source_config
from common.keys import PAYLOAD, Keys
from common.messages import decode_group
from generators.scoring import RewardRunner, Scored, reward_names
from producers.data import Source
from tasks.rows import DataError
from tests.harness.configs import write_config
from tests.harness.processes import spawn, stop, wait_for

FIX = "tests.vf_fixtures"


def echo_source(**extra) -> VerifiersSource:
    return source_config(name="echo", kind="verifiers", taskset=f"{FIX}:EchoTaskset", **extra)


def verifiers_own_reward(index: int, reply: str, num_tasks: int = 6) -> float:
    """What verifiers' own scoring gives the reply: the task's hooks on a trace, `trace.reward`."""
    import verifiers.v1 as vf
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, TraceTask
    from verifiers.v1.types import AssistantMessage, UserMessage

    from tests.vf_fixtures import EchoConfig, EchoTaskset

    task = list(EchoTaskset(EchoConfig(id="echo", num_tasks=num_tasks)))[index]
    trace = vf.Trace(task=TraceTask(type="EchoTask", data=task.data), agent=AgentInfo(config=vf.AgentConfig()),
                     nodes=[MessageNode(message=UserMessage(content=task.data.prompt)),
                            MessageNode(parent=0, message=AssistantMessage(content=reply), sampled=True)])
    asyncio.run(task.score(trace))
    return trace.reward


def test_a_tasksets_tasks_are_the_sources_prompts_shuffled_per_epoch():
    source = Source(echo_source(taskset_args={"num_tasks": 4}), seed=0, field="data.sources.0")
    taken = [source.take() for _ in range(8)]  # two epochs of four
    words = {"apple", "river", "stone", "cloud"}
    for p in taken:
        system, user = p.messages
        assert system == {"role": "system", "content": "You repeat words."}
        assert user["role"] == "user" and user["content"].startswith("Say the word ")
        assert p.meta["source"] == "echo" and p.meta["vf_taskset"] == f"{FIX}:EchoTaskset"
    assert {p.messages[1]["content"][13:-1] for p in taken[:4]} == words == {p.messages[1]["content"][13:-1]
                                                                             for p in taken[4:]}
    assert [p.id.split(":")[1] for p in taken] == ["0"] * 4 + ["1"] * 4
    assert [p.meta["vf_index"] for p in taken[:4]] != [0, 1, 2, 3] or \
        [p.meta["vf_index"] for p in taken[4:]] != [0, 1, 2, 3], "shuffled"


@pytest.mark.parametrize("workers", [0, 1])
def test_the_reward_is_the_tasks_hooks_weighted_as_verifiers_weighs_them(workers):
    source = Source(echo_source(), seed=0, field="data.sources.0")
    prompt = source.take()
    index, word = prompt.meta["vf_index"], prompt.messages[1]["content"][13:-1]
    replies = [word, f"The word is {word}, as asked.", "", "no"]
    config = config_from_dict({"data": {"sources": [echo_source().model_dump()]}})
    with RewardRunner(reward_names(config), timeout_s=30, workers=workers) as runner:
        scored = runner.score("echo", prompt=prompt.messages[1]["content"], messages=prompt.messages,
                              meta=prompt.meta, completions=[(t, [1]) for t in replies])
    length = [min(len(t), 10) / 10 for t in replies]
    assert scored == [
        Scored(0.5 + 2 * length[0] + 1, {"says_something": 0.5, "length": 2 * length[0], "has_word": 1.0}, None),
        Scored(0.5 + 2.0 + 1, {"says_something": 0.5, "length": 2.0, "has_word": 1.0}, None),
        Scored(0.0, {"says_something": 0.0, "length": 0.0, "has_word": 0.0}, None),
        Scored(0.5 + 0.4, {"says_something": 0.5, "length": 0.4, "has_word": 0.0}, None)]
    assert [s.reward for s in scored] == pytest.approx([verifiers_own_reward(index, t) for t in replies])


def test_the_built_in_arithmetic_taskset_scores_as_the_arithmetic_task():
    source = Source(source_config(name="vf", kind="verifiers", taskset="tasks.vf_arithmetic",
                                 taskset_args={"num_tasks": 20, "max_operand": 9}), seed=0, field="data.sources.0")
    from tasks import arithmetic

    config = config_from_dict({"data": {"sources": [{"name": "vf", "kind": "verifiers",
                                                     "taskset": "tasks.vf_arithmetic"}]}})
    prompts = [source.take() for _ in range(5)]
    problems = {arithmetic.problem(seed=0, index=i, max_operand=9, ops=["+", "-"]).question: i for i in range(20)}
    with RewardRunner(reward_names(config), timeout_s=30, workers=0) as runner:
        for p in prompts:
            answer = arithmetic.problem(seed=0, index=problems[p.messages[0]["content"]], max_operand=9,
                                        ops=["+", "-"]).answer
            right, wrong = runner.score("vf", prompt="", messages=p.messages, meta=p.meta,
                                        completions=[(f"It is {answer}", [1]), (f"It is {answer + 1}", [1])])
            assert (right.reward, wrong.reward) == (1.0, 0.0), p


def test_what_cannot_score_here_is_refused_by_name():
    cases = {
        f"{FIX}:BoxTaskset": "scores with ['file_written'], which need a verifiers runtime",
        f"{FIX}:SilentTaskset": "declares no @vf.reward hook or judge",
        f"{FIX}:NoSuchTaskset": "is not a verifiers taskset",
        "no_such_taskset_package": "is not a verifiers taskset",
        FIX: "defines no `__all__`",  # a module path: verifiers' rule, it exports its one taskset there
    }
    for taskset, said in cases.items():
        named = re.escape(f"data.sources.0.taskset: {taskset!r} ") + ".*" + re.escape(said)
        with pytest.raises(DataError, match=named):
            Source(source_config(name="x", kind="verifiers", taskset=taskset), seed=0, field="data.sources.0")
    with pytest.raises(DataError, match=r"data\.sources\.0\.taskset_args: not a valid EchoConfig.*num_tasks: "):
        Source(echo_source(taskset_args={"num_tasks": "many"}), seed=0, field="data.sources.0")


def test_a_verifiers_source_config_names_what_is_wrong():
    with pytest.raises(ConfigError, match=r"data\.sources\.0.*needs taskset"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "verifiers"}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.0.*path, prompt_column"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "verifiers", "taskset": "t", "path": "x.jsonl"}]}})
    with pytest.raises(ConfigError, match=r"data\.sources\.0.*only a verifiers source reads a taskset"):
        config_from_dict({"data": {"sources": [{"name": "a", "kind": "arithmetic", "taskset": "t"}]}})


def test_producer_and_generator_train_a_taskset_end_to_end(tiny_model, tmp_path, redis_url, r):
    config = tmp_path / "run.toml"
    write_config(config, run="vf", redis_url=redis_url, model=tiny_model, base={},
                 rollout={"max_new_tokens": 6, "group_size": 2, "prompts_per_step": 2},
                 generator={"engine": "hf", "threads": 1},
                 data={"sources": [{"name": "echo", "kind": "verifiers", "taskset": f"{FIX}:EchoTaskset"}]})
    keys, env = Keys("vf"), {"ROLLOUTS_CONFIG": str(config)}
    procs = {"generator": spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=tmp_path / "generator.log"),
             "producer": spawn("producers", cwd=tmp_path, env=env, log=tmp_path / "producer.log")}
    try:
        wait_for(lambda: r.xlen(keys.samples) >= 4, timeout=180, what="4 groups", procs=list(procs.values()))
    finally:
        codes = {name: stop(p) for name, p in procs.items()}
    assert codes == {"generator": 0, "producer": 0}, (tmp_path / "generator.log").read_text()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    groups = [decode_group(fields[PAYLOAD]) for _, fields in r.xrange(keys.samples)]
    for g in groups:
        assert g.prompt_id.startswith("echo:") and len(g.completions) == 2
        index = int(g.prompt_id.split(":")[-1])  # the row, which is the task's index in the taskset
        for c in g.completions:
            assert c.reward_error is None and set(c.rewards) == {"says_something", "length", "has_word"}
            reply = tok.decode(c.ids, skip_special_tokens=True)
            assert c.reward == pytest.approx(verifiers_own_reward(index, reply.strip())), reply
