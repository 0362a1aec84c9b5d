"""FSDP2 under torchrun: two ranks, each its own consumer, give the update of one process."""

import random
from dataclasses import replace

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.keys import PAYLOAD, TRAINER_GROUP, Keys
from common.messages import encode
from tests.harness.groups import make_group
from tests.harness.metrics import assert_same_grad_norms, read_steps
from tests.harness.pipeline import run_ranks


def test_two_ranks_give_the_same_weights_as_one(tmp_path, redis_url, r, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(11)
    blobs = [encode(make_group(model, f"g{i}", version=0, rng=rng)) for i in range(8)]
    for name in ("one", "two"):
        for blob in blobs:
            r.xadd(Keys(name).samples, {PAYLOAD: blob})
    run_ranks(tmp_path, "one", redis_url, tiny_model, nproc=1)
    stdout = run_ranks(tmp_path, "two", redis_url, tiny_model, nproc=2)
    assert "2 rank(s)" in stdout

    # Each rank read as its own consumer; every group was trained once and acknowledged.
    consumers = {c["name"].decode() for c in r.xinfo_consumers(Keys("two").samples, TRAINER_GROUP)}
    assert consumers == {"rank0", "rank1"}
    assert r.xpending(Keys("two").samples, TRAINER_GROUP)["pending"] == 0
    # step 1's trainer state, written beside step 2 by each rank's writer thread: both ranks' shards
    state_1 = tmp_path / "two" / "trainer_state" / "step_1"
    assert sorted(f.name for f in state_1.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    lines = read_steps(tmp_path / "two" / "metrics.jsonl")
    assert [sorted(m["group_ids"]) for m in lines] == [[f"g{i}" for i in range(4)], [f"g{i}" for i in range(4, 8)]]
    one_lines = read_steps(tmp_path / "one" / "metrics.jsonl")
    for a, b in zip(one_lines, lines, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["tokens/trained"] == b["tokens/trained"]
    assert_same_grad_norms(one_lines, lines)

    # Same groups per step, losses normalised by the global token count: the same update, up to
    # float32 summation order (gradients summed across ranks in another order), amplified a
    # little by Adam's normalisation where a gradient is near zero. lr is 1e-3: 1e-5 is 1% of a step.
    a = load_file(tmp_path / "one" / "checkpoints" / "step_2" / "model.safetensors")
    b = load_file(tmp_path / "two" / "checkpoints" / "step_2" / "model.safetensors")
    assert a.keys() == b.keys()
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"largest parameter difference between world sizes 1 and 2: {diff:.3g}")
    assert diff < 1e-5


def test_two_ranks_sharing_prompts_give_the_weights_of_one_with_padded_rows(tmp_path, redis_url, r, tiny_model):
    """trainer.share_prompts and pack_sequences under FSDP2: two ranks on packed groups
    (micro-batches of whole groups end to end, cut by micro_batch_size 3 and micro_batch_tokens
    40, balanced by tokens) make the update one process makes on right-padded rows."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(12)
    blobs = [encode(make_group(model, f"g{i}", version=0, rng=rng)) for i in range(8)]
    for name in ("rows", "packed"):
        for blob in blobs:
            r.xadd(Keys(name).samples, {PAYLOAD: blob})
    run_ranks(tmp_path, "rows", redis_url, tiny_model, nproc=1, share_prompts=False, pack_sequences=False)
    run_ranks(tmp_path, "packed", redis_url, tiny_model, nproc=2, share_prompts=True, state_every=2)
    rows, packed = (read_steps(tmp_path / n / "metrics.jsonl")
                    for n in ("rows", "packed"))
    for a, b in zip(rows, packed, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["tokens/trained"] == b["tokens/trained"]
    assert_same_grad_norms(rows, packed)
    a = load_file(tmp_path / "rows" / "checkpoints" / "step_2" / "model.safetensors")
    b = load_file(tmp_path / "packed" / "checkpoints" / "step_2" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_two_ranks_leaving_out_alike_groups_give_the_weights_of_one_with_every_completion(tmp_path, redis_url, r,
                                                                                          tiny_model):
    """trainer.skip_zero_advantage under FSDP2: the groups that scored alike go through no pass on
    either rank, a rank left with none of the others runs one completion of gradient 0 (its
    collectives pair up), and the update is the one a process makes on every completion."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(13)
    groups = [make_group(model, f"g{i}", version=0, rng=rng) for i in range(8)]
    alike = {0, 1, 2, 4, 6}  # step 1: three of four (a rank has two), step 2: two of four
    groups = [replace(g, completions=[replace(c, reward=1.0, rewards={"correct": 1.0}) for c in g.completions])
              if i in alike else g for i, g in enumerate(groups)]
    for name in ("every", "skipped"):
        for g in groups:
            r.xadd(Keys(name).samples, {PAYLOAD: encode(g)})
    run_ranks(tmp_path, "every", redis_url, tiny_model, nproc=1, skip_zero_advantage=False)
    run_ranks(tmp_path, "skipped", redis_url, tiny_model, nproc=2)
    every, skipped = (read_steps(tmp_path / n / "metrics.jsonl") for n in ("every", "skipped"))
    for a, b in zip(every, skipped, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["tokens/trained"] == b["tokens/trained"]
        assert b["tokens/forward"] < 0.75 * a["tokens/forward"], (a["tokens/forward"], b["tokens/forward"])
    assert_same_grad_norms(every, skipped)
    a = load_file(tmp_path / "every" / "checkpoints" / "step_2" / "model.safetensors")
    b = load_file(tmp_path / "skipped" / "checkpoints" / "step_2" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5


def test_two_ranks_on_varlen_attention_give_the_weights_of_one(tmp_path, redis_url, r, tiny_model):
    """trainer.attention = "varlen" (trainer/varlen.py) under FSDP2: each sharded block's attention
    takes the micro-batch's layout, and two ranks make the update of one process. (Against the dense
    mask's update: tests/test_varlen.py, equal in float64; in float32 the two attentions round apart by
    about 2% of a step at this lr, as Adam amplifies near-zero gradients.)"""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(12)
    blobs = [encode(make_group(model, f"g{i}", version=0, rng=rng)) for i in range(8)]
    for name in ("one", "two"):
        for blob in blobs:
            r.xadd(Keys(name).samples, {PAYLOAD: blob})
    outs = [run_ranks(tmp_path, name, redis_url, tiny_model, nproc=n, attention="varlen")
            for name, n in (("one", 1), ("two", 2))]
    assert all("trainer: attention varlen\n" in out for out in outs)
    one, two = (read_steps(tmp_path / n / "metrics.jsonl") for n in ("one", "two"))
    for a, b in zip(one, two, strict=True):
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["tokens/trained"] == b["tokens/trained"]
    assert_same_grad_norms(one, two)
    a = load_file(tmp_path / "one" / "checkpoints" / "step_2" / "model.safetensors")
    b = load_file(tmp_path / "two" / "checkpoints" / "step_2" / "model.safetensors")
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5
