"""On CUDA: the pipeline in bf16 with each engine (HF always, vLLM where it is installed), and the
trainer at world size 2 under NCCL.

Marked `gpu` and skipped, with the reason, where torch sees no CUDA device (`pytest -m gpu`
collects them anywhere; `ops/gpu-check` runs them first). They have not been run on a GPU yet: this
project's CI machines have none.
"""

import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.heartbeats import read_heartbeat
from common.keys import PAYLOAD, Keys
from common.messages import encode
from engines.choice import vllm_available
from tests.harness.groups import make_group
from tests.harness.metrics import read_steps
from tests.harness.pipeline import run_ranks
from tests.harness.processes import spawn, stop, wait_for

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none here")]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_pipeline_on_a_shared_gpu_in_bf16(tmp_path, redis_url, r, tiny_model, engine):
    """Producer, one generator and the trainer on one GPU (a vLLM generator takes 30% of it): the HF
    engine runs on any GPU host, so a host without vLLM still runs the pipeline on CUDA."""
    if engine == "vllm" and not vllm_available():
        pytest.skip("needs vLLM for CUDA (pip install vllm)")
    config = tmp_path / "run.toml"
    config.write_text(f"""
run = "gpu"
redis_url = "{redis_url}"
output_dir = "{tmp_path / 'run'}"
[model]
path = "{tiny_model}"
dtype = "bfloat16"
[rollout]
group_size = 4
prompts_per_step = 4
max_new_tokens = 16
[generator]
engine = "{engine}"
gpu_memory_utilization = 0.3
max_model_len = 256
[trainer]
lr = 1e-3
max_steps = 3
""")
    env, logs = {"ROLLOUTS_CONFIG": str(config)}, tmp_path
    procs = {"g1": spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=logs / "g1.log"),
             "trainer": spawn("trainer", cwd=tmp_path, env=env, log=logs / "trainer.log"),
             "producer": spawn("producers", cwd=tmp_path, env=env, log=logs / "producer.log")}
    try:
        assert procs["trainer"].wait(timeout=600) == 0, (logs / "trainer.log").read_text()[-3000:]
        wait_for(lambda: (b := read_heartbeat(r, Keys("gpu"), "g1")) is not None and b.version >= 2, timeout=120,
                 what="the generator on version >= 2", procs=[procs["g1"]])
    finally:
        codes = {name: stop(p) for name, p in procs.items()}
    assert codes == {"g1": 0, "trainer": 0, "producer": 0}, codes
    assert "1 rank(s) on cuda, bfloat16 (float32 master weights)" in (logs / "trainer.log").read_text()
    metrics = read_steps(tmp_path / "run" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    weights = load_file(tmp_path / "run" / "checkpoints" / "step_3" / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    # the trainer state of every publish (state_every 0): step 2's copied into pinned host memory and
    # written by the writer thread (its CUDA device set) beside step 3; the last one, step 3's, in its step
    for step in (2, 3):
        state = tmp_path / "run" / "trainer_state" / f"step_{step}"
        assert sorted(f.name for f in state.iterdir()) == [".metadata", "__0_0.distcp"], step


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_two_ranks_under_nccl_give_the_update_of_one(tmp_path, redis_url, r, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(11)
    blobs = [encode(make_group(model, f"g{i}", version=0, rng=rng)) for i in range(8)]
    for name in ("one", "two"):
        for blob in blobs:
            r.xadd(Keys(name).samples, {PAYLOAD: blob})
    assert "1 rank(s) on cuda" in run_ranks(tmp_path, "one", redis_url, tiny_model, nproc=1)
    assert "2 rank(s) on cuda" in run_ranks(tmp_path, "two", redis_url, tiny_model, nproc=2)
    a = load_file(tmp_path / "one" / "checkpoints" / "step_2" / "model.safetensors")
    b = load_file(tmp_path / "two" / "checkpoints" / "step_2" / "model.safetensors")
    # GPU kernels sum in other orders than the CPU's: a looser bound than the gloo test's 1e-5.
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-4
