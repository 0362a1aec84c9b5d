"""The SGLang engine (generator.engine = "sglang", engines/sglang_engine.py).

Its reading of SGLang's /generate answers runs in the default suite, on answers of a real server
(sglang 0.5.23, 2026-11-27, trimmed to the fields the engine reads and a few beside). The rest
drives a real SGLang server of the tiny model with tied embeddings, which the test starts with the
interpreter ROLLOUTS_SGLANG_PYTHON names (SGLang in an environment of its own: it pins its own
torch and transformers): log-probs against the trainer's and greedy tokens against a fresh HF
engine before and after a reload of a published version, a reload by someone else refused, and
(slow) a generator sampling groups on the server and loading a published version.
Marked `gpu`, and skipped without ROLLOUTS_SGLANG_PYTHON; with it and no CUDA they run on SGLang's
CPU engine (as they did on this project's CPU machine, with sgl_kernel stubbed out:
docs/generators.md). Not run on a GPU yet.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from engines.base import SamplingSettings
from engines.choice import open_engine
from engines.openai_engine import ServerError
from engines.sglang_engine import SGLangEngine, parse_generated
from tests.harness.groups import ask
from tests.harness.models import LOGPROB_TOL, perturbed_copy, reference_logprobs, tied_variant
from tests.harness.server_generator import generator_drives_server
from tests.harness.servers import sglang_server

SGLANG_PYTHON = os.environ.get("ROLLOUTS_SGLANG_PYTHON", "")

# /generate {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0.7},
# "return_logprob": true} on the tiny model: a completion cut at max_new_tokens.
CUT = {"text": "\u0010 20\ufffd 17iTh", "output_ids": [207, 308, 160, 319, 75, 287], "meta_info": {
    "id": "7c3494feb7af4207bce00aee4089454d", "finish_reason": {"type": "length", "length": 6}, "prompt_tokens": 4,
    "weight_version": "default", "input_token_logprobs": [], "output_token_logprobs": [
        [-5.786275863647461, 207, None], [-6.277916431427002, 308, None], [-5.8879194259643555, 160, None],
        [-5.538970947265625, 319, None], [-5.621096134185791, 75, None], [-5.737924098968506, 287, None]],
    "completion_tokens": 6, "cached_tokens": 0, "weight_versions": [{"version": "default", "start": 0, "end": 6}]}}
# a completion that sampled a stop token: its finish_reason as that server gave it with "stop_token_ids":
# [304, ...] (the stop token kept in output_ids), shortened to its last two tokens, log-probs written by hand
STOPPED = {"output_ids": [175, 304], "meta_info": {
    "finish_reason": {"type": "stop", "matched": 304}, "weight_version": "default",
    "output_token_logprobs": [[-5.61, 175, None], [-5.97, 304, None]]}}


def test_an_sglang_answer_reads_as_its_tokens_with_their_logprobs_and_weight_version():
    cut = parse_generated(CUT, eos_ids=[2], weight_version="default")
    assert cut.ids == [207, 308, 160, 319, 75, 287] and cut.finish == "length"
    assert cut.logprobs == [t[0] for t in CUT["meta_info"]["output_token_logprobs"]]
    assert parse_generated(STOPPED, eos_ids=[2, 304], weight_version="default").finish == "stop"
    assert parse_generated(STOPPED, eos_ids=[2], weight_version="default").finish == "length"  # not an eos of ours
    # sampled under weights the engine did not load: failed, not attributed to the version loaded
    with pytest.raises(ServerError, match="did another client reload the server"):
        parse_generated(CUT, eos_ids=[2], weight_version="3")
    shifted = copy.deepcopy(CUT)
    shifted["meta_info"]["output_token_logprobs"] = shifted["meta_info"]["output_token_logprobs"][1:]
    with pytest.raises(ServerError, match="log-probs of tokens"):
        parse_generated(shifted, eos_ids=[2], weight_version="default")
    with pytest.raises(ServerError, match="without output_ids"):  # return_logprob not honoured
        parse_generated({"output_ids": [1], "meta_info": {"finish_reason": None}}, eos_ids=[2],
                        weight_version="default")


# ---------------------------------------------------------------------------- against a real server

# without ROLLOUTS_SGLANG_PYTHON: skipped (with CUDA or not); with it, run on CUDA where torch sees
# it, else on SGLang's CPU engine
needs_sglang = pytest.mark.skipif(not SGLANG_PYTHON, reason="needs SGLang and a CUDA GPU: set "
                                  "ROLLOUTS_SGLANG_PYTHON to an interpreter with sglang installed")


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, tiny_model):
    return tied_variant(tiny_model, tmp_path_factory.mktemp("tied") / "model")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tied_model):
    with sglang_server(SGLANG_PYTHON, tied_model, tmp_path_factory.mktemp("sglang") / "server.log") as url:
        yield url


def sample(engine: SGLangEngine, prompt: list[int]) -> dict[str, list]:
    engine.add("a", prompt, SamplingSettings(n=3, max_new_tokens=12, temperature=0.7))
    engine.add("b", prompt[:4], SamplingSettings(n=1, max_new_tokens=12, temperature=0.7))
    done = {}
    while engine.has_unfinished():
        for f in engine.step():
            assert f.error is None, f.error
            done[f.request_id] = f.samples
    assert sorted(done) == ["a", "b"] and len(done["a"]) == 3
    return done


@pytest.mark.gpu
@needs_sglang
def test_sglang_samples_with_the_trainers_logprobs_and_reloads_a_version(server, tied_model, tmp_path):
    engine = SGLangEngine(server, tied_model, timeout_s=600)
    prompt = engine.prompt_ids(ask(6))
    probe = [prompt, engine.prompt_ids(ask(9))]
    step_1 = perturbed_copy(tied_model, tmp_path / "step_1", seed=1, scale=0.05)  # new greedy tokens
    greedy = {}
    for model_dir, version in ((tied_model, 0), (step_1, 1)):
        if version:
            engine.load_weights(model_dir, version=1)
        fresh = open_engine("hf", model_dir, seed=0)  # the same checkpoint loaded from scratch
        greedy[version] = engine.greedy(probe, max_new_tokens=12)
        assert greedy[version] == fresh.greedy(probe, max_new_tokens=12), version
        done = sample(engine, prompt)
        trainer = reference_logprobs(model_dir)
        for p, samples in ((prompt, done["a"]), (prompt[:4], done["b"])):
            for s in samples:
                off = (torch.tensor(s.logprobs) - trainer(p, s.ids, 0.7)).abs().max().item()
                assert off <= LOGPROB_TOL, (version, off, s)
    assert greedy[0] != greedy[1] and engine.version == 1  # the reload changed what the server samples
    engine.load_weights(tied_model, version=2)  # the module's other tests start from the model's own weights
    engine.close()


@pytest.mark.gpu
@needs_sglang
def test_completions_after_someone_elses_reload_come_back_failed(server, tied_model, tmp_path):
    engine = SGLangEngine(server, tied_model, timeout_s=600)
    other = SGLangEngine(server, tied_model, timeout_s=600)
    prompt = engine.prompt_ids(ask(6))
    other.load_weights(perturbed_copy(tied_model, tmp_path / "step_7", seed=7, scale=0.05), version=7)
    engine.add("a", prompt, SamplingSettings(n=2, max_new_tokens=4, temperature=1.0))
    done = []
    while engine.has_unfinished():
        done += engine.step()
    assert [f.samples for f in done] == [[]] and "did another client reload the server" in done[0].error
    other.load_weights(tied_model, version=8)
    engine.close()
    other.close()


@pytest.mark.slow
@pytest.mark.gpu
@needs_sglang
def test_a_generator_samples_on_the_sglang_server_and_loads_a_published_version(server, tied_model, tmp_path,
                                                                                 redis_url, r):
    generator_drives_server("sglang", server, tied_model, tmp_path, redis_url, r, timeout_s=300)
