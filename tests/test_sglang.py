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

import contextlib
import copy
import dataclasses
import json
import os
import signal
import subprocess
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from common.checkpoints import checksum_dir
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import WeightVersion, decode_group, encode
from engines.base import SamplingSettings
from engines.choice import open_engine
from engines.openai_engine import ServerError
from engines.sglang_engine import SGLangEngine, parse_generated
from tests.harness.groups import ask
from tests.harness.models import LOGPROB_TOL, perturbed_copy, publish_weights, reference_logprobs, tied_variant
from tests.harness.processes import spawn, stop, wait_for
from tests.harness.servers import free_port

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


@contextlib.contextmanager
def sglang_server(model: Path, log: Path, *, start_timeout_s: float = 900) -> Iterator[str]:
    """The URL of `python -m sglang.launch_server` of `model` in float32 (ROLLOUTS_SGLANG_PYTHON), on
    CUDA where torch sees it, else SGLang's CPU engine; stopped with its workers on leaving."""
    cpu = not torch.cuda.is_available()
    port = free_port()
    argv = [SGLANG_PYTHON, "-m", "sglang.launch_server", "--model-path", str(model), "--host", "127.0.0.1",
            "--port", str(port), "--dtype", "float32", "--sampling-defaults", "openai", "--random-seed", "0",
            "--max-total-tokens", "8192", "--attention-backend", "torch_native", "--disable-cuda-graph",
            "--disable-overlap-schedule", "--skip-server-warmup", *(["--device", "cpu"] if cpu else [])]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_") and k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", **({"SGLANG_USE_CPU_ENGINE": "1"} if cpu else {}))
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(url + "/model_info", timeout=5) as r:
                return bool(json.loads(r.read())["is_generation"])
        except OSError:
            return False
    try:
        wait_for(up, timeout=start_timeout_s, what=f"the SGLang server (log: {log})", procs=[proc], poll=1.0)
        yield url
    finally:  # the server and its scheduler and detokenizer processes, all in its session
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=60)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory, tiny_model):
    return tied_variant(tiny_model, tmp_path_factory.mktemp("tied") / "model")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tied_model):
    with sglang_server(tied_model, tmp_path_factory.mktemp("sglang") / "server.log") as url:
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
    keys = Keys("sgl")
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "sgl", "ROLLOUTS_MODEL__PATH": str(tied_model),
           "ROLLOUTS_GENERATOR__ENGINE": "sglang", "ROLLOUTS_GENERATOR__SERVER_URL": server,
           "ROLLOUTS_ROLLOUT__GROUP_SIZE": "2", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "6"}
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    g1 = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=tmp_path / "g1.log")
    try:
        r.xadd(keys.prompts, {PAYLOAD: encode(ask(0, n=2))})
        wait_for(lambda: r.xlen(keys.samples) >= 1, timeout=300, what="a group", procs=[g1])
        step_1 = perturbed_copy(tied_model, tmp_path / "checkpoints" / "step_1", seed=1, scale=0.05)
        publish_weights(r, keys, WeightVersion(version=1, step=1, path=str(step_1), format="safetensors",
                                               checksums=checksum_dir(step_1), created_at=time.time()))
        # admitted at version 1: sampled with weights >= 1 (the generator reads weights:latest first)
        r.xadd(keys.prompts, {PAYLOAD: encode(dataclasses.replace(ask(1, n=2), admitted_at=1))})
        wait_for(lambda: r.xlen(keys.samples) >= 2, timeout=300, what="a second group", procs=[g1])
    finally:
        assert stop(g1) == 0, (tmp_path / "g1.log").read_text()[-3000:]
    first, second = (decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples))
    assert (first.engine, first.version, second.version) == ("sglang", 0, 1)
    trainer = reference_logprobs(step_1)
    for c in second.completions:
        assert (torch.tensor(c.logprobs) - trainer(second.prompt_ids, c.ids, 1.0)).abs().max().item() <= LOGPROB_TOL
