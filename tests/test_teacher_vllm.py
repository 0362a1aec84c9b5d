"""The teacher on vLLM, in-process (`[teacher] engine = "vllm"`, common/teacher_vllm.py) or served
(`engine = "openai"`, `url`: common/teacher_openai.py): its prompt log-probs of each sampled token
are the HF teacher's on the same tokens, environment tokens unscored; an engine that is none, a
vLLM teacher at a temperature its prompt log-probs do not apply, and a served one without its URL
are refused at start-up naming the field; a server that does not answer costs the group its
teacher log-probs, recorded, never the group."""

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.config import ConfigError, config_from_dict
from common.teacher import Teacher
from generators.groups import with_teacher
from tests.harness.groups import completion, hand_group
from tests.harness.http import JsonHandler, serving
from tests.harness.models import LOGPROB_TOL, perturbed_copy, reference_logprobs
from tests.harness.needs import need_vllm
from tests.harness.servers import free_port, vllm_server
from tests.harness.teacher_runs import run_generator


@pytest.fixture(scope="module")
def teacher_model(tiny_model, tmp_path_factory) -> Path:
    """A teacher unlike the student: the tiny model's weights moved a little (same tokenizer)."""
    return perturbed_copy(tiny_model, tmp_path_factory.mktemp("teacher") / "tiny-teacher", seed=7, scale=0.05)


def test_an_unknown_teacher_engine_is_refused_at_start_up_naming_the_field(tmp_path):
    with pytest.raises(ConfigError, match=r"teacher\.engine: .*'hf', 'vllm' or 'openai' \(got 'sglang'\)"):
        config_from_dict({"teacher": {"path": str(tmp_path), "engine": "sglang"}})
    with pytest.raises(ValueError, match=r"teacher\.engine 'sglang' is no teacher engine: one of hf, vllm, openai"):
        Teacher(str(tmp_path), name="t", timeout_s=1, engine="sglang")


def test_a_vllm_teacher_at_a_temperature_other_than_1_is_refused_naming_both_fields(tmp_path):
    with pytest.raises(ConfigError, match=r"teacher\.engine = 'vllm' scores at temperature 1 only.*"
                                          r"rollout\.temperature is 0\.7"):
        config_from_dict({"teacher": {"path": str(tmp_path), "engine": "vllm"}, "rollout": {"temperature": 0.7}})
    assert config_from_dict({"teacher": {"path": str(tmp_path), "engine": "vllm"}}).teacher.engine == "vllm"
    with pytest.raises(ValueError, match=r"teacher\.engine 'vllm' .*rollout\.temperature is 0\.7"):
        Teacher(str(tmp_path), name="t", timeout_s=1, temperature=0.7, engine="vllm")


def test_a_served_teacher_needs_its_url_and_a_url_needs_a_served_teacher(tmp_path):
    with pytest.raises(ConfigError, match=r"teacher\.url is the server of teacher\.engine = 'openai'.*url ''"):
        config_from_dict({"teacher": {"path": "tiny", "engine": "openai"}})
    with pytest.raises(ConfigError, match=r"teacher\.url .*engine 'hf' with url 'http://h:1'"):
        config_from_dict({"teacher": {"path": str(tmp_path), "url": "http://h:1"}})
    with pytest.raises(ConfigError, match=r"teacher\.engine = 'openai' scores at temperature 1 only"):
        config_from_dict({"teacher": {"path": "tiny", "engine": "openai", "url": "http://h:1"},
                          "rollout": {"temperature": 0.5}})
    with pytest.raises(ValueError, match=r"teacher\.url 'h:1' is no http\(s\)://host:port URL"):
        Teacher("tiny", name="t", timeout_s=1, engine="openai", url="h:1")
    with pytest.raises(ValueError, match=r"teacher\.url is needed with teacher\.engine 'openai'"):
        Teacher("tiny", name="t", timeout_s=1, engine="openai")
    teacher = Teacher("tiny", name="t", timeout_s=1, engine="openai", url="http://127.0.0.1:8000/v1/")
    assert teacher.url == "http://127.0.0.1:8000" and str(teacher.path) == "tiny"  # the model's name on the server


def test_a_served_teacher_that_does_not_answer_leaves_the_group_reward_only_with_its_error():
    group = hand_group([completion([25, 8], [-1.0] * 2, 1.0), completion([11], [-1.0], 0.0)], prompt=[3, 17])
    teacher = Teacher("tiny", name="t", timeout_s=30, engine="openai", url=f"http://127.0.0.1:{free_port()}")
    try:
        out = with_teacher(group, teacher)  # nothing listens there
    finally:
        teacher.close()
    assert out.teacher == "" and out.completions == group.completions  # delivered as it was, reward-only
    assert out.teacher_error.startswith("teacher 't': RuntimeError: http://127.0.0.1:")
    assert "ConnectionRefusedError" in out.teacher_error and "refused" in out.teacher_error
    assert out.teacher_error.endswith("(3 attempts)")  # the first and [teacher] retries = 2 more


@pytest.fixture
def completions_server() -> Iterator[tuple[str, list[int | None], list[dict]]]:
    """A /v1/completions server on a free local port answering as vLLM's does with prompt log-probs
    (token t at position k: -(t + k) / 100), after the HTTP statuses the test puts in its list (one
    per request, None: a real answer). Yields its URL, that list and the requests it took."""
    statuses: list[int | None] = []
    taken: list[dict] = []

    class Handler(JsonHandler):
        def do_POST(self) -> None:
            body = self.read_json()
            taken.append(body)
            status = statuses.pop(0) if statuses else None
            if status is not None:
                self.reply(b"busy", status, "text/plain")
                return
            choices = [{"index": i, "prompt_logprobs": [None] + [{str(t): {"logprob": -(t + k) / 100}}
                                                                  for k, t in enumerate(ids) if k > 0]}
                       for i, ids in enumerate(body["prompt"])]
            self.reply_json({"choices": choices})

    with serving(Handler) as url:
        yield url, statuses, taken


def test_a_served_teacher_tries_a_busy_server_again_and_not_a_refusal(completions_server):
    url, statuses, taken = completions_server
    prompt, ids = [3, 17], [25, 8]
    group = hand_group([completion(ids, [-1.0] * 2, 1.0)], prompt=prompt)

    statuses[:] = [503, 429]  # busy twice, then an answer: within [teacher] retries = 2
    out = with_teacher(group, teacher := Teacher("tiny", name="t", timeout_s=30, engine="openai", url=url))
    teacher.close()
    assert out.teacher_error == "" and len(taken) == 3
    np.testing.assert_allclose(out.completions[0].teacher_logprobs, [-(25 + 2) / 100, -(8 + 3) / 100], rtol=1e-6)

    taken.clear()
    statuses[:] = [503, 503, 503]  # busy past the retries: the group's error, saying how often it tried
    out = with_teacher(group, teacher := Teacher("tiny", name="t", timeout_s=30, engine="openai", url=url))
    teacher.close()
    assert len(taken) == 3 and out.teacher == ""
    assert "answered 503: busy (3 attempts)" in out.teacher_error, out.teacher_error

    taken.clear()
    statuses[:] = [404]  # a model the server does not serve: trying again gets the same
    out = with_teacher(group, teacher := Teacher("tiny", name="t", timeout_s=30, engine="openai", url=url))
    teacher.close()
    assert len(taken) == 1 and out.teacher_error.endswith("/v1/completions answered 404: busy"), out.teacher_error


def scored(group, teacher: Teacher) -> list[np.ndarray]:
    """The teacher's log-probs of `group`'s completions, as the generator runs it."""
    try:
        out = with_teacher(group, teacher)
    finally:
        teacher.close()
    assert out.teacher == "t" and out.teacher_error == "", out.teacher_error
    return [c.teacher_logprobs for c in out.completions]


@pytest.mark.slow  # a vLLM engine started on the CPU (~20-40 s)
def test_the_vllm_teachers_logprobs_are_the_hf_teachers_on_the_same_tokens(teacher_model):
    need_vllm()
    prompt, short, long = [3, 17, 40, 9], [25, 8], [11, 60, 2, 33, 7, 19, 4]  # of different lengths
    mask = [True, True, False, False, True, True, True]  # an episode: the environment's two tokens are not the model's
    group = hand_group([completion(short, [-1.0] * 2, 1.0), completion(long, [-1.0] * 7, 0.0, loss_mask=mask)],
                       prompt=prompt)
    got = {}
    for engine in ("hf", "vllm"):
        teacher = Teacher(str(teacher_model), name="t", timeout_s=120, engine=engine)
        try:
            out = with_teacher(group, teacher)  # as the generator runs it
        finally:
            teacher.close()
        assert out.teacher == "t" and out.teacher_error == "", out.teacher_error
        got[engine] = [c.teacher_logprobs for c in out.completions]
    reference = reference_logprobs(teacher_model)
    want = [reference(prompt, ids, 1.0).numpy() for ids in (short, long)]
    trained = np.asarray(mask)
    for i in range(2):
        diff = float(np.max(np.abs(got["vllm"][i] - got["hf"][i])))
        print(f"completion {i}: vllm - hf teacher log-probs, max abs diff {diff:.2e} (tolerance {LOGPROB_TOL:.0e})")
        assert diff < LOGPROB_TOL
    np.testing.assert_allclose(got["vllm"][0], want[0], atol=LOGPROB_TOL)
    np.testing.assert_allclose(got["vllm"][1][trained], want[1][trained], atol=LOGPROB_TOL)
    assert (got["vllm"][1][~trained] == 0.0).all()
    assert (got["vllm"][0] < -0.01).all()  # real log-probs, not zeros


@pytest.mark.slow  # a `vllm serve` of the teacher started on the CPU (one to three minutes)
def test_a_served_teachers_logprobs_are_the_hf_teachers_on_the_same_tokens(teacher_model, tmp_path):
    need_vllm()
    prompt, short, long = [3, 17, 40, 9], [25, 8], [11, 60, 2, 33, 7, 19, 4]
    mask = [True, True, False, False, True, True, True]
    group = hand_group([completion(short, [-1.0] * 2, 1.0), completion(long, [-1.0] * 7, 0.0, loss_mask=mask)],
                       prompt=prompt)
    hf = scored(group, Teacher(str(teacher_model), name="t", timeout_s=120))
    with vllm_server(teacher_model, tmp_path / "server", extension=False) as url:
        served = scored(group, Teacher(str(teacher_model), name="t", timeout_s=120, engine="openai", url=url))
    for i in range(2):
        diff = float(np.max(np.abs(served[i] - hf[i])))
        print(f"completion {i}: served - hf teacher log-probs, max abs diff {diff:.2e} (tolerance {LOGPROB_TOL:.0e})")
        assert diff < LOGPROB_TOL
    assert (served[1][~np.asarray(mask)] == 0.0).all() and (served[0] < -0.01).all()


@pytest.mark.slow  # a generator process starting two vLLM engines on the CPU (~1-2 min)
def test_a_vllm_generator_with_a_vllm_teacher_carries_the_teachers_logprobs(tiny_model, teacher_model, tmp_path,
                                                                            redis_url, r):
    need_vllm()
    log, groups = run_generator(tmp_path, redis_url, r, model=tiny_model, teacher=teacher_model, run="teach-vllm",
                                engine="vllm", teacher_engine="vllm", temperature=1.0)
    assert f"teacher tiny-teacher ({teacher_model.resolve()}, vllm)" in log
    (group,) = groups  # delivered exactly once
    assert group.teacher == "tiny-teacher" and group.teacher_error == "", group.teacher_error
    reference = reference_logprobs(teacher_model)
    for c in group.completions:
        np.testing.assert_allclose(c.teacher_logprobs, reference(group.prompt_ids, c.ids, 1.0).numpy(),
                                   atol=LOGPROB_TOL)
        assert not np.allclose(c.teacher_logprobs, c.logprobs, atol=1e-3)  # the teacher's, not the student's
