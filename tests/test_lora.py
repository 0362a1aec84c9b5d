"""LoRA: the trainer trains adapters only and publishes merged full weights that load as a plain
HF checkpoint and generate what the trainer's adapted model generates."""

import dataclasses
import random
from functools import partial
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from common.config import GrpoLoss, LoraConfig
from common.keys import PAYLOAD, Keys
from common.messages import encode
from tests.harness.configs import write_config
from tests.harness.groups import make_group, xadd
from tests.harness.pipeline import run_trainer, train_groups
from trainer.batch import collate_packed, group_rows
from trainer.checkpoints import adapted_model
from trainer.devices import Placement
from trainer.logprobs import packed_attention, sequence_logprobs
from trainer.lora import apply_lora
from trainer.step import GrpoOptions, log_probs, train_step

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


def adapted(tiny_model: Path, **load) -> torch.nn.Module:
    """The tiny model with LoRA adapters on q and v whose B is not zero: the adapters change its numbers."""
    torch.manual_seed(0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32, **load), rank=4,
                       alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"])
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0.0, 0.05)
    return model


def body_positions(model: torch.nn.Module) -> list[tuple[int, ...]]:
    """The shape of the input of each forward pass through `model`'s body from now on."""
    seen: list[tuple[int, ...]] = []
    model.get_input_embeddings().register_forward_pre_hook(lambda _m, args: seen.append(tuple(args[0].shape)))
    return seen


def test_a_lora_step_puts_through_the_model_the_packed_tokens_a_plain_step_does(tiny_model):
    # The trainer packs each micro-batch's sequences end to end; a LoRA model (peft's wrapper) takes
    # that path as the plain model does, never the right-padded rows: the same packed rows through the
    # body in each pass, holding the step's tokens_forward, fewer positions than the padded rows'.
    torch.set_num_threads(1)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(0)
    groups = [make_group(plain, f"g{i}", version=0, rng=rng, shape=(4, [3, 9, 17, 30])) for i in range(3)]
    how = GrpoOptions(loss=GrpoLoss(correction="decoupled"), estimator="grpo", overlong="none", overlong_penalty=0.0,
                      micro_batch_size=8, micro_batch_tokens=0, updates=1, max_grad_norm=1.0)
    through, shapes, tokens = {}, {}, {}
    for name, model in (("plain", plain), ("lora", adapted(tiny_model)), ("padded", plain)):
        seen = body_positions(model)
        st = train_step(model, torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.0), groups,
                        how=dataclasses.replace(how, pack=name != "padded"))
        through[name], shapes[name], tokens[name] = sum(shape[0] * shape[1] for shape in seen), list(seen), \
            st.tokens_forward
        if name != "padded":  # one pass over the packed rows: the update's, whose log-probs at the step's one
            assert st.tokens_forward == through[name], (name, seen)  # update are the proximal policy's too
    assert shapes["lora"] == shapes["plain"] and tokens["lora"] == tokens["plain"] < tokens["padded"], tokens
    assert through["lora"] == through["plain"] < through["padded"], through


def test_a_lora_models_packed_log_probs_are_its_padded_rows(tiny_model):
    model = adapted(tiny_model)
    assert packed_attention(model) == "sdpa"  # the attention of the model inside peft's wrapper
    groups = [make_group(model.config.vocab_size, f"g{i}", version=0, rng=random.Random(i), shape=(5, [2, 7, 4, 11]),
                         partial_mask=True) for i in range(2)]
    mb = collate_packed([[row] for group in groups for row in group_rows(group)])
    seen = body_positions(model)
    forward = partial(sequence_logprobs, temperature=0.8)
    with torch.no_grad():
        packed, _ = log_probs(forward, model, mb)  # as the step computes them
        padded, _ = log_probs(forward, model, dataclasses.replace(mb, packed=None))
        with model.disable_adapter():
            base, _ = log_probs(forward, model, dataclasses.replace(mb, packed=None))
    assert seen[:2] == [tuple(mb.packed.ids.shape), tuple(mb.input_ids.shape)] and seen[0][0] == 1  # packed, padded
    torch.testing.assert_close(packed, padded, rtol=0, atol=1e-5)
    assert packed.abs().sum() > 0 and (padded - base).abs().max() > 1e-3  # the adapters act on both


def test_a_lora_model_computes_attention_as_the_trainer_places_it(tiny_model):
    # trainer.attention = "varlen" reaches the model through with_attention: the LoRA model is
    # placed with it, as the full model is
    import trainer.loading
    from trainer.varlen import VARLEN

    where = Placement(device=torch.device("cpu"), dtype=torch.float32, master_fp32=True, attention="varlen")
    full = trainer.loading.placed_model(tiny_model, where)
    lora = adapted_model(tiny_model, where, LoraConfig(rank=4, alpha=8.0, target_modules=["q_proj", "v_proj"]))
    assert packed_attention(full) == packed_attention(lora) == VARLEN
