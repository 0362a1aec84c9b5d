"""The trainer's model is built on `meta`, sharded, and each rank reads only its own shards from
the checkpoint (trainer/loading.py): the weights are the checkpoint's, tied embeddings too, and a
rank's host memory holds its shards, not the whole model (a bf16 checkpoint trained in float32, as
Qwen's are: the whole-model load converts every tensor on the host)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.harness.processes import ROOT, process_env

MB = 1 << 20


def load(checkpoint: Path, how: str, out: Path, warm: Path, *, nproc: int = 2, adapter: Path | None = None) -> dict:
    launcher = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}"]
    done = subprocess.run([sys.executable, *launcher, "-m", "tests.harness.load_rank", str(checkpoint), how, str(out),
                           str(warm), *([str(adapter)] if adapter else [])], cwd=ROOT,
                          env=process_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    ranks = [json.loads((out / f"rank{i}.json").read_text()) for i in range(nproc)]
    return {"ranks": ranks, **json.loads((out / "weights.json").read_text())}


def bf16_copy(model: Path, dest: Path, *, tied: bool = False) -> Path:
    """`model` saved in bfloat16 (its lm_head tied to the embedding with `tied`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    if tied:
        m.config.tie_word_embeddings = True
        m.tie_weights()
    m.save_pretrained(dest, safe_serialization=True)
    AutoTokenizer.from_pretrained(model).save_pretrained(dest)
    return dest


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> Path:
    """A 21M-parameter model (85 MB in float32) saved in bf16."""
    from common.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("big")
    return bf16_copy(build_tiny_model(root / "f32", hidden=512, layers=8, heads=8, kv_heads=8), root / "bf16")


def test_two_ranks_hold_the_checkpoints_weights_each_from_its_own_shards(big, tiny_model, tmp_path):
    fp32_bytes = 4 * sum(v.numel() for v in _tensors(big).values())
    placed = load(big, "placed", tmp_path / "placed", tiny_model)
    assert all(placed["same"].values()) and len(placed["same"]) == 75, placed["same"]
    whole = load(big, "whole", tmp_path / "whole", tiny_model)
    assert all(whole["same"].values())
    # each rank's anonymous memory grew by about its half of the float32 weights, not by the whole
    for rank in placed["ranks"]:
        assert rank["anon"] < 0.7 * fp32_bytes, (rank["anon"] / MB, fp32_bytes / MB)
    for rank in whole["ranks"]:  # the old way: the whole model converted on every rank's host
        assert rank["anon"] > 0.9 * fp32_bytes, (rank["anon"] / MB, fp32_bytes / MB)


def test_lora_on_two_ranks_holds_half_the_base_model_each_and_the_adapters_one_rank_starts_with(big, tiny_model,
                                                                                                tmp_path):
    """With LoRA too each rank reads only its own shards of the frozen base weights, and the adapters
    it starts from are those one process starts from: A the same on every rank, B zeros."""
    from safetensors.torch import load_file

    from tests.harness.load_rank import LORA
    from trainer.checkpoints import adapted_model
    from trainer.devices import Placement

    fp32_bytes = 4 * sum(v.numel() for v in _tensors(big).values())
    placed = load(big, "lora", tmp_path / "lora", tiny_model)
    assert all(placed["same"].values()) and len(placed["same"]) == 75, placed["same"]
    for rank in placed["ranks"]:  # about half the float32 base weights each (the adapters are 1%)
        assert rank["anon"] < 0.7 * fp32_bytes, (rank["anon"] / MB, fp32_bytes / MB)
    torch.manual_seed(1234)  # the ranks' seed
    one = adapted_model(big, Placement(device=torch.device("cpu"), dtype=torch.float32, master_fp32=True), LORA)
    want = {k: v for k, v in one.state_dict().items() if ".lora_" in k}
    got = load_file(tmp_path / "lora" / "adapters.safetensors")
    assert got.keys() == want.keys() and len(got) == 2 * 4 * 8  # A and B of q, k, v, o in 8 blocks
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert all(v.abs().sum() > 0 if ".lora_A." in k else not v.any() for k, v in got.items())


@pytest.mark.slow
def test_lora_on_two_ranks_resumes_from_a_published_adapter(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    from common.checkpoints import ADAPTER_FILE
    from tests.harness.load_rank import LORA
    from trainer.lora import adapter_state_dict, apply_lora, write_adapter_config

    model = apply_lora(_tiny(tiny_model), rank=LORA.rank, alpha=LORA.alpha, dropout=0.0,
                       target_modules=LORA.target_modules)
    gen = torch.Generator().manual_seed(3)
    trained = {k: torch.randn(v.shape, generator=gen) for k, v in model.state_dict().items() if ".lora_" in k}
    (tmp_path / "adapter").mkdir()
    save_file(adapter_state_dict(trained), tmp_path / "adapter" / ADAPTER_FILE)
    write_adapter_config(model, tmp_path / "adapter", base_model=str(tiny_model))
    placed = load(tiny_model, "lora", tmp_path / "out", tiny_model, adapter=tmp_path / "adapter")
    assert all(placed["same"].values()), placed["same"]
    got = load_file(tmp_path / "out" / "adapters.safetensors")
    assert got.keys() == trained.keys() and all(torch.equal(got[k], trained[k]) for k in trained)


def test_tied_embeddings_are_read_once_and_stay_tied(tiny_model, tmp_path):
    tied = bf16_copy(tiny_model, tmp_path / "tied", tied=True)
    assert "lm_head.weight" not in _tensors(tied)
    placed = load(tied, "placed", tmp_path / "out", tiny_model)
    assert all(placed["same"].values()), placed["same"]
    assert "lm_head.weight" in placed["model"]  # the head is the embedding, as in the checkpoint


def test_a_checkpoint_missing_a_tensor_is_refused_by_name(tiny_model, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = bf16_copy(tiny_model, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", "-m",
                           "tests.harness.load_rank", str(broken), "placed", str(tmp_path / "out"), str(tiny_model)],
                          cwd=ROOT, env=process_env({"OMP_NUM_THREADS": "1"}), capture_output=True, text=True,
                          timeout=300)
    assert done.returncode != 0
    assert "has no tensor 'model.layers.1.mlp.up_proj.weight'" in done.stdout + done.stderr


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(path / "model.safetensors")


def _tiny(path: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
