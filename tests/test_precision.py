"""bf16 as model.dtype: the trainer computes in it over float32 master weights (FSDP2 mixed
precision at world size 2, autocast at 1), tracks the float32 run, publishes bf16 checkpoints,
and its log-probs agree with a bf16 generator's."""

import json
import random

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.config import GrpoLoss
from common.keys import PAYLOAD, Keys
from common.messages import encode
from engines.base import SamplingSettings
from engines.hf_engine import HFEngine
from tests.harness.groups import make_group
from tests.harness.metrics import read_steps
from tests.harness.pipeline import run_ranks
from trainer.checkpoints import load_model, save_checkpoint
from trainer.grpo import token_logprobs
from trainer.logprobs import sequence_logprobs
from trainer.parallel import parallelize
from trainer.step import GrpoOptions, train_step

# Stated tolerances, in nats per token (the loss is a token mean of ratio x advantage terms):
# bf16 keeps 8 bits of mantissa, so log-probs move by about 1e-2 and so does the loss.
LOSS_TOL = 0.005
LOGP_MAX_TOL, LOGP_MEAN_TOL = 0.02, 0.005


def test_a_bf16_step_tracks_float32_and_publishes_bf16(tmp_path, tiny_model):
    """In one process: the same step on the same groups in float32 and in bf16 over float32 master
    weights; the loss agrees within LOSS_TOL, AdamW's moments stay float32, the checkpoint is bf16."""
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(4)
    groups = [make_group(base, f"g{i}", version=0, rng=rng) for i in range(4)]
    out = {}
    for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        model = parallelize(load_model(tiny_model), device=torch.device("cpu"), compute_dtype=dtype)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        how = GrpoOptions(loss=GrpoLoss(), temperature=1.0, estimator="grpo", overlong="none", overlong_penalty=0.0,
                          micro_batch_size=8, micro_batch_tokens=0, updates=1, max_grad_norm=1.0)
        out[name] = [train_step(model, opt, groups, how=how).loss for _ in range(2)]
    print(f"one process: loss/policy fp32 {out['fp32']}, bf16 {out['bf16']}")
    assert max(abs(a - b) for a, b in zip(out["fp32"], out["bf16"], strict=True)) < LOSS_TOL
    assert out["fp32"] != out["bf16"], "the bf16 step computed in float32"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert {v.dtype for st in opt.state.values() for v in st.values() if v.dim() > 0} == {torch.float32}
    path = save_checkpoint(model, checkpoint_dir=tmp_path, step=1, source_dir=tiny_model, dtype=torch.bfloat16)
    assert {t.dtype for t in load_file(path / "model.safetensors").values()} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"


def test_activation_checkpointing_gives_the_same_step(tiny_model):
    torch.set_num_threads(1)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(6)
    groups = [make_group(base, f"g{i}", version=0, rng=rng) for i in range(3)]
    weights = []
    for checkpointing in (False, True):
        model = parallelize(load_model(tiny_model), device=torch.device("cpu"), activation_checkpointing=checkpointing)
        assert model.is_gradient_checkpointing == checkpointing
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        train_step(model, opt, groups, how=GrpoOptions(loss=GrpoLoss(), temperature=1.0, estimator="grpo",
                                                       overlong="none", overlong_penalty=0.0, micro_batch_size=8,
                                                       micro_batch_tokens=0, updates=1, max_grad_norm=1e9))
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    torch.testing.assert_close(weights[1], weights[0], rtol=0, atol=1e-6)


@pytest.mark.slow
def test_bf16_training_tracks_float32_at_world_sizes_1_and_2(tmp_path, redis_url, r, tiny_model):
    """The pipeline's trainer (torchrun and FSDP2 on gloo at world size 2), with a KL term: the
    frozen reference is loaded in bf16 and sharded like the policy."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(11)
    blobs = [encode(make_group(model, f"g{i}", version=0, rng=rng)) for i in range(8)]
    runs = {"fp32": (1, "float32"), "bf16-1": (1, "bfloat16"), "bf16-2": (2, "bfloat16")}
    for name, (nproc, dtype) in runs.items():
        for blob in blobs:
            r.xadd(Keys(name).samples, {PAYLOAD: blob})
        out = run_ranks(tmp_path, name, redis_url, tiny_model, nproc=nproc, dtype=dtype, kl_coef=0.1)
        assert f"{nproc} rank(s) on cpu, {dtype}" in out

    want = read_steps(tmp_path / "fp32" / "metrics.jsonl")
    for name in ("bf16-1", "bf16-2"):
        got = read_steps(tmp_path / name / "metrics.jsonl")
        diffs = [abs(a["loss"] - b["loss"]) for a, b in zip(want, got, strict=True)]  # metrics.jsonl: TRL's names
        print(f"{name}: loss fp32 {[round(m['loss'], 5) for m in want]}, "
              f"bf16 {[round(m['loss'], 5) for m in got]}, largest difference {max(diffs):.3g}")
        assert max(diffs) < LOSS_TOL
        # Published in the model's dtype, config included; the master weights stayed float32.
        step = tmp_path / name / "checkpoints" / "step_2"
        weights = load_file(step / "model.safetensors")
        assert {t.dtype for t in weights.values()} == {torch.bfloat16}
        assert json.loads((step / "config.json").read_text())["dtype"] == "bfloat16"
        ref = load_file(tmp_path / "fp32" / "checkpoints" / "step_2" / "model.safetensors")
        drift = max((weights[k].float() - ref[k]).abs().max().item() for k in ref)
        print(f"{name}: largest weight difference from the float32 run after 2 steps (lr 1e-3): {drift:.3g}")
        # Two Adam steps of lr 1e-3 move a weight by up to 2e-3 each, whatever the gradient's size: a
        # gradient near 0 that bf16 flips in sign moves it the other way. Beyond that: a real divergence.
        assert drift < 5e-3


def test_the_trainers_head_computes_in_bf16_as_the_models_own_forward(tiny_model):
    """In one process under bf16 autocast, the head the trainer applies a chunk of positions at a
    time (outside the model's forward) computes in bf16 as the model's own forward does, not in the
    float32 of the master weights (a tenth of bf16's speed on a GPU without TF32): the log-probs are
    the model's own logits', and the head's output is bf16."""
    torch.manual_seed(0)
    model = parallelize(load_model(tiny_model), device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    ids = torch.randint(0, 300, (3, 40))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    dtypes = []
    hook = model.get_output_embeddings().register_forward_hook(lambda _m, _a, out: dtypes.append(out.dtype))
    with torch.no_grad():
        logp, _ = sequence_logprobs(model, inputs, torch.ones_like(inputs), targets, temperature=0.8,
                                    chunk_tokens=16)
        hook.remove()
        own = token_logprobs(model(input_ids=inputs).logits, targets, temperature=0.8)
    print(f"head output dtypes in the trainer's pass: {set(dtypes)}; |trainer - own| max "
          f"{(logp - own).abs().max():.3g}")
    assert set(dtypes) == {torch.bfloat16}
    torch.testing.assert_close(logp, own, rtol=0, atol=1e-5)


def test_trainer_logprobs_agree_with_a_bf16_generator(tiny_model):
    torch.manual_seed(0)
    engine = HFEngine(tiny_model, dtype="bfloat16", seed=3)
    prompts = [[5, 17, 33, 8], [100, 2, 2, 41, 9, 12]]
    samples = engine.sample(prompts, SamplingSettings(n=4, max_new_tokens=16, temperature=0.8))
    trainer = parallelize(load_model(tiny_model), device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    diffs = []
    for prompt, group in zip(prompts, samples, strict=True):
        for s in group:
            full = torch.tensor([prompt + s.ids])
            with torch.no_grad():
                logp, _ = sequence_logprobs(trainer, full[:, :-1], torch.ones_like(full[:, :-1]), full[:, 1:],
                                            temperature=0.8)
            diffs.append((logp[0, len(prompt) - 1:] - torch.tensor(s.logprobs)).abs())
    diffs = torch.cat(diffs)
    print(f"bf16 generator vs trainer log-probs: max |diff| {diffs.max():.3g}, mean {diffs.mean():.3g} "
          f"over {diffs.numel()} tokens")
    assert diffs.max() < LOGP_MAX_TOL and diffs.mean() < LOGP_MEAN_TOL
