"""SFT on the same trainer: the loss, the producer's sft sources, and SFT then RL from its checkpoint."""

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.config import config_from_dict, load_config
from common.keys import PAYLOAD, TRAINER_GROUP, Keys
from common.messages import decode_group, encode
from common.progress import read_producer, read_trainer
from producers.sft import conversation_group, truncate
from tests.harness.configs import write_config
from tests.harness.groups import make_group
from tests.harness.metrics import STEP, read_steps
from tests.harness.processes import ROOT, spawn, stop, wait_for
from trainer.batch import micro_batches
from trainer.grpo import token_logprobs
from trainer.losses.sft import sft_loss
from trainer.metrics import step_metrics, summary_line


def test_sft_loss_is_the_masked_mean_nll():
    logits = torch.tensor([[[0.0, 1.0, 2.0], [1.0, 0.0, 0.0], [0.0, 0.0, 3.0]]])  # (1, 3, 3)
    targets = torch.tensor([[2, 0, 1]])
    mask = torch.tensor([[1.0, 0.0, 1.0]])
    logp = token_logprobs(logits, targets, 1.0)
    # -log softmax: position 0 picks 2 of (0, 1, 2); position 2 picks 1 of (0, 0, 3).
    nll0 = -(2.0 - math.log(1 + math.e + math.e ** 2))
    nll2 = -(0.0 - math.log(2 + math.e ** 3))
    # normalised by the step's masked tokens (here 4: another micro-batch holds the other 2)
    assert sft_loss(logp, mask, total_tokens=4).item() == pytest.approx((nll0 + nll2) / 4, rel=1e-6)
    assert sft_loss(logp, mask, total_tokens=2).item() == pytest.approx((nll0 + nll2) / 2, rel=1e-6)


def test_sft_groups_batch_with_one_completion_and_metrics_have_no_reward(tiny_model):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi there"}]
    group = conversation_group(tokenizer, messages, group_id="c:0:0")
    batches, total_tokens, total_seqs = micro_batches([group], micro_batch_size=4, objective="sft")
    assert total_tokens == sum(group.completions[0].loss_mask) > 0 and total_seqs == 1
    assert batches[0].advantages.tolist() == [0.0]
    m = step_metrics([group], staleness=[0], rewarded=False)
    assert m["reward_mean"] is None and m["reward_std"] is None and m["frac_reward_zero_std"] is None
    line = summary_line(replace(STEP, **m, step=3, policy=None, sft_loss=1.5, entropy=2.0, lr=1e-3, time_step=0.1))
    assert "sft 1.5000" in line and "reward   -  " in line

    # Truncation keeps the prompt and cuts the completion; nothing trainable left: None.
    (c,) = group.completions
    cut, n = truncate(group, max_length=len(group.prompt_ids) + 2)
    assert n == len(c.ids) - 2 and len(cut.completions[0].ids) == 2 and cut.completions[0].finish == "length"
    assert truncate(group, max_length=len(group.prompt_ids))[0] is None
    assert truncate(group, max_length=10_000) == (group, 0)


CONVERSATIONS = [
    [{"role": "user", "content": f"What is {a} plus {b}?"},
     {"role": "assistant", "content": f"{a} plus {b} is {a + b}."},
     {"role": "user", "content": "And doubled?"},
     {"role": "assistant", "content": f"Doubled it is {2 * (a + b)}."}]
    for a, b in [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3)]
]


def masked_nll(model, tokenizer, conversations) -> float:
    """Mean negative log-likelihood of the conversations' assistant tokens under `model`."""
    total, count = 0.0, 0
    for i, messages in enumerate(conversations):
        g = conversation_group(tokenizer, messages, group_id=str(i))
        (c,) = g.completions
        ids = torch.tensor([g.prompt_ids + c.ids])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[:, :-1]
        logp = token_logprobs(logits, ids[:, 1:], 1.0)[0, len(g.prompt_ids) - 1:]
        mask = torch.tensor(c.loss_mask, dtype=torch.float32)
        total += -(logp * mask).sum().item()
        count += int(mask.sum())
    return total / count


def run_config(path: Path, *, run: str, redis_url: str, out: Path, model: Path, trainer: dict, **tables) -> Path:
    write_config(path, run=run, redis_url=redis_url, output_dir=out, model=model, base={},
                 rollout={"prompts_per_step": 4, "max_staleness": 1}, trainer=trainer, **tables)
    return path


def test_sft_run_lowers_the_loss_and_its_checkpoint_starts_rl(tmp_path, redis_url, r, tiny_model):
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS)
                    + json.dumps({"messages": [{"role": "user", "content": "no answer"}]}) + "\n")
    sources = [{"name": "chat", "kind": "sft", "path": str(data), "max_length": 56}]
    cfg = run_config(tmp_path / "sft.toml", run="sft", redis_url=redis_url, out=tmp_path / "sft",
                     model=tiny_model, data={"sources": sources},
                     trainer={"objective": "sft", "lr": 1e-2, "max_steps": 6, "threads": 1,
                              "micro_batch_size": 4, "sync_every": 3})  # admitted against step, not version
    assert load_config(cfg, env={}).trainer.objective == "sft"
    env = {"ROLLOUTS_CONFIG": str(cfg)}
    producer = spawn("producers", cwd=tmp_path, env=env, log=tmp_path / "producer.log")
    trainer = spawn("trainer", cwd=tmp_path, env=env, log=tmp_path / "trainer.log")
    keys = Keys("sft")
    written: dict[bytes, dict] = {}  # the samples stream's entries as they come: publishing trims them

    def finished() -> bool:
        written.update(r.xrange(keys.samples))
        return trainer.poll() is not None

    try:
        wait_for(finished, timeout=240, what="the sft trainer's 6 steps", procs=[producer], poll=0.05)
    finally:
        stop(trainer)
        stop(producer)
    log = (tmp_path / "trainer.log").read_text()
    assert trainer.returncode == 0, log

    # The producer wrote one-completion groups with an assistant-only mask to the samples
    # stream, skipped the conversation with no assistant turn, and cut the long ones to 56 tokens.
    groups = [decode_group(f[PAYLOAD]) for f in written.values()]
    assert groups and all(len(g.completions) == 1 and g.version == 0 for g in groups)
    assert all(len(g.prompt_ids) + len(g.completions[0].ids) <= 56 for g in groups)
    progress = read_producer(r, keys)
    assert progress.rows_skipped >= 1 and progress.sft_truncated >= 1
    assert r.xlen(keys.prompts) == 0

    # Six SFT steps, nothing stale or dead; the console shows the SFT loss.
    metrics = read_steps(tmp_path / "sft" / "metrics.jsonl")
    assert [m["step"] for m in metrics] == [1, 2, 3, 4, 5, 6]
    assert all(m["groups/dropped_stale"] == 0 and m["groups/dead"] == 0 for m in metrics)
    assert all(m["reward"] is None and "clip_ratio/low_mean" not in m for m in metrics)
    assert "| sft " in log
    assert read_trainer(r, keys).groups_trained == 24
    assert r.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0

    # The assistant tokens' NLL falls from the initial model to the checkpoint.
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    before_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    checkpoint = tmp_path / "sft" / "checkpoints" / "step_6"
    after_model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    before = masked_nll(before_model, tokenizer, CONVERSATIONS)
    after = masked_nll(after_model, tokenizer, CONVERSATIONS)
    print(f"assistant-token NLL: initial {before:.3f}, after 6 SFT steps {after:.3f}; "
          f"loss first {metrics[0]['loss']:.3f} last {metrics[-1]['loss']:.3f}")
    assert after < before - 0.5, (before, after)
    assert metrics[-1]["loss"] < metrics[0]["loss"]

    # RL from the SFT checkpoint: a new run whose model.path is checkpoints/step_6 takes GRPO steps.
    rng = random.Random(0)
    rl_keys = Keys("rl")
    for i in range(4):
        r.xadd(rl_keys.samples, {PAYLOAD: encode(make_group(after_model, f"rl{i}", version=0, rng=rng))})
    rl_cfg = run_config(tmp_path / "rl.toml", run="rl", redis_url=redis_url, out=tmp_path / "rl",
                        model=checkpoint, trainer={"lr": 1e-3, "max_steps": 1, "threads": 1})
    assert config_from_dict({"trainer": {}}).trainer.objective == "grpo"
    rl = spawn("trainer", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(rl_cfg)}, log=tmp_path / "rl.log")
    try:
        wait_for(lambda: rl.poll() is not None, timeout=180, what="the rl trainer's step")
    finally:
        stop(rl)
    rl_log = (tmp_path / "rl.log").read_text()
    assert rl.returncode == 0, rl_log
    assert f"model {checkpoint}" in rl_log and "| loss " in rl_log
    (m,) = read_steps(tmp_path / "rl" / "metrics.jsonl")
    assert m["step"] == 1 and "clip_ratio/low_mean" in m and m["reward"] is not None
    rl_weights = AutoModelForCausalLM.from_pretrained(tmp_path / "rl" / "checkpoints" / "step_1").state_dict()
    sft_weights = after_model.state_dict()
    assert any(not torch.equal(sft_weights[k], rl_weights[k]) for k in sft_weights)


def test_the_sft_config_loads():
    cfg = load_config(ROOT / "configs" / "sft.toml", env={})
    assert cfg.trainer.objective == "sft" and [s.kind for s in cfg.sources] == ["sft"]
    assert cfg.sources[0].messages_column == "messages"
    assert cfg.trainer.max_steps % cfg.trainer.sync_every == 0


def test_an_sft_source_without_a_trainable_conversation_stops_the_producer(tmp_path, r, tiny_model):
    from common.config import source_config
    from producers.data import DataError, Source
    from producers.main import admit

    data = tmp_path / "bad.jsonl"
    data.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"q{i}"}]}) + "\n"
                            for i in range(3)))
    source = Source(source_config(name="chat", kind="sft", path=str(data)), seed=0, field="data.sources.0")
    with pytest.raises(DataError, match="no row makes a trainable conversation"):
        admit(r, Keys("bad"), sources=[source], weights=[1.0], seed=0, admitted=0, count=1, n=1, version=0,
              tokenizer=AutoTokenizer.from_pretrained(tiny_model))
