"""LoRA: the trainer trains adapters only and publishes merged full weights that load as a plain
HF checkpoint and generate what the trainer's adapted model generates."""

import random
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.keys import PAYLOAD, Keys
from common.messages import encode
from tests.harness.configs import write_config
from tests.harness.groups import make_group, xadd
from tests.harness.pipeline import run_trainer, train_groups

RUN = "t"
KEYS = Keys(RUN)
LORA = {"rank": 4, "alpha": 8.0, "target_modules": ["q_proj", "v_proj"]}


def test_lora_trains_the_adapters_only_and_publishes_merged_weights(tmp_path, redis_url, r, tiny_model):
    from trainer.lora import apply_lora
    from trainer.schedule import build_scheduler
    from trainer.state import load_state

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(0)
    for i in range(4):
        xadd(r, KEYS, encode(make_group(base, f"g{i}", version=0, rng=rng)))
    train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=2, lr=0.05, lora=LORA)

    # The published checkpoint is a plain HF model under the base model's names: the adapted
    # weights (q_proj, v_proj) moved, every other weight is the initial one to the bit.
    published = tmp_path / "out" / "checkpoints" / "step_2"
    merged = AutoModelForCausalLM.from_pretrained(published, dtype=torch.float32)
    before, after = base.state_dict(), merged.state_dict()
    assert before.keys() == after.keys()
    moved = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert moved and all(k.endswith(("q_proj.weight", "v_proj.weight")) for k in moved), moved

    # The trainer's own model, rebuilt from its saved state (the adapters and AdamW over them only),
    # generates greedily what the merged checkpoint generates.
    trainer_model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), rank=4,
                               alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    trained = [p for p in trainer_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=0.05)
    load_state(trainer_model, optimizer, build_scheduler(optimizer, schedule="constant", warmup_steps=0,
                                                          total_steps=0),
               path=tmp_path / "out" / "trainer_state" / "step_2")
    assert sum(p.numel() for p in trained) < 0.2 * sum(p.numel() for p in trainer_model.parameters())
    assert len(optimizer.state) == len(trained)  # AdamW holds state for the adapters alone
    state_bytes = sum(f.stat().st_size for f in (tmp_path / "out" / "trainer_state" / "step_2").iterdir())
    weight_bytes = sum(f.stat().st_size for f in Path(published).glob("*.safetensors"))
    assert state_bytes < weight_bytes, (state_bytes, weight_bytes)  # no copy of the frozen model in it
    trainer_model.eval()
    prompt = torch.tensor([[1, 5, 9, 13, 2, 7]])
    with torch.no_grad():
        ours = trainer_model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
        theirs = merged.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
        torch.testing.assert_close(trainer_model(input_ids=prompt).logits, merged(input_ids=prompt).logits,
                                   rtol=1e-4, atol=1e-5)
    assert ours.tolist() == theirs.tolist()
    assert r.xlen(KEYS.weights) == 2


def test_lora_under_two_fsdp_ranks_publishes_what_one_rank_does(tmp_path, redis_url, r, tiny_model):
    from safetensors.torch import load_file

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(5)
    blobs = [encode(make_group(base, f"g{i}", version=0, rng=rng)) for i in range(4)]
    for name in ("one", "two"):
        for blob in blobs:
            r.xadd(Keys(name).samples, {PAYLOAD: blob})
        config = write_config(tmp_path / f"{name}.toml", run=name, redis_url=redis_url, output_dir=tmp_path / name,
                              model=tiny_model, base={}, rollout={"group_size": 4, "prompts_per_step": 2},
                              trainer={"max_steps": 2, "lr": 0.05, "threads": 1, "lora": LORA})
        run_trainer(config, cwd=tmp_path, nproc=1 if name == "one" else 2)
    a = load_file(tmp_path / "one" / "checkpoints" / "step_2" / "model.safetensors")
    b = load_file(tmp_path / "two" / "checkpoints" / "step_2" / "model.safetensors")
    assert a.keys() == b.keys() and a.keys() == {k for k in base.state_dict() if k != "lm_head.weight"} | (
        {"lm_head.weight"} & a.keys())
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
    assert any(not torch.equal(a[k], base.state_dict()[k]) for k in a)
