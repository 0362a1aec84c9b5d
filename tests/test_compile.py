"""trainer.compile: each transformer block torch.compile'd (trainer/parallel.py `compile_each_block`)
trains as the eager blocks do, through the trainer's own loading, on packed micro-batches of
lengths that vary: with SDPA's dense mask; with activation checkpointing around the compiled
blocks and varlen attention left eager inside them; and compiled before FSDP2 shards the blocks,
two ranks on gloo (tests/harness/compile_ranks.py). Slow: inductor compiles a block's forward and
backward on the CPU (about 20 s a case on two cores). Refused, in the default suite, where torch's
compiling is switched off."""

import json
import subprocess
import sys

import pytest
import torch

from common.config import ConfigError
from tests.harness.compile_ranks import compared
from tests.harness.processes import ROOT, process_env
from trainer.parallel import compile_each_block


def assert_trains_as_eager(found: dict) -> None:
    assert all(g == 0 for g in found["eager_graphs"]), found
    assert all(g > 0 for g in found["compiled_graphs"]), f"trainer.compile compiled nothing: {found}"
    assert found["names_same"], found  # state-dict names unchanged: checkpoints read as before
    assert found["moved"] > 1e-3, f"the steps did not train: the comparison would be empty: {found}"
    assert found["diff"] < 1e-6, f"compiled and eager weights differ by {found['diff']:.3g} ({found})"


@pytest.mark.slow
@pytest.mark.parametrize(("attention", "checkpointing"), [("sdpa", False), ("varlen", True)])
def test_compiled_blocks_train_as_the_eager_ones(tiny_model, attention, checkpointing):
    assert_trains_as_eager(compared(tiny_model, attention=attention, checkpointing=checkpointing))


@pytest.mark.slow
def test_blocks_compiled_then_sharded_over_two_ranks_train_as_the_eager_ones(tiny_model, tmp_path):
    env = process_env({"OMP_NUM_THREADS": "1"})
    env.pop("TORCH_COMPILE_DISABLE", None)  # common/teacher_vllm.py sets it in a process that ran a vLLM teacher
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                           "-m", "tests.harness.compile_ranks", str(tiny_model), str(tmp_path), "varlen", "on"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = json.loads((tmp_path / "compared.json").read_text())
    assert len(found["compiled_graphs"]) == 2, found
    assert_trains_as_eager(found)


def test_compile_is_refused_where_torch_compiling_is_switched_off(monkeypatch):
    """TORCH_COMPILE_DISABLE=1 (read by torch at import) would leave every block eager in silence."""
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    monkeypatch.setattr(torch._dynamo.config, "disable", True)
    monkeypatch.setenv("TORCH_COMPILE_DISABLE", "1")
    with pytest.raises(ConfigError, match=r"trainer.compile = true, but torch.compile is disabled in this process "
                                          r"\(TORCH_COMPILE_DISABLE='1'"):
        compile_each_block(model)
