"""LoRA published as the adapter alone (trainer.lora.publish = "adapter"): peft's two files, a small
fraction of the merged weights, which peft and the HF engine load onto the base model and sample
with the trainer's log-probs."""

import random

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.checkpoints import ADAPTER_CONFIG, ADAPTER_FILE, ADAPTER_FORMAT, CheckpointError, verify_dir
from common.config import Config, ConfigError
from common.keys import Keys
from common.messages import WeightVersion
from common.streams import latest_weights
from engines.base import SamplingSettings
from engines.hf_engine import HFEngine
from tests.harness.adapters import TARGETS, adapted, logprobs_of
from tests.harness.groups import make_group, xadd
from tests.harness.pipeline import train_groups

RUN = "ad"
KEYS = Keys(RUN)
PROMPT = [1, 5, 9, 13, 2, 7]


def engine_matches(engine: HFEngine, trainer_model: torch.nn.Module) -> None:
    """The engine's behaviour log-probs of what it samples are the trainer model's (test_logprobs' tolerance)."""
    for sampled in engine.sample([PROMPT], SamplingSettings(n=3, max_new_tokens=10, temperature=1.0))[0]:
        torch.testing.assert_close(torch.tensor(sampled.logprobs), logprobs_of(trainer_model, PROMPT, sampled.ids),
                                   rtol=0, atol=1e-5)


def test_a_published_adapter_loads_in_peft_and_the_hf_engine_with_the_trainers_logprobs(tmp_path, tiny_model):
    from peft import PeftModel

    from trainer.checkpoints import write_checkpoint
    from trainer.lora import apply_lora

    model = adapted(tiny_model, seed=0)
    path, sums = write_checkpoint(model, checkpoint_dir=tmp_path / "ckpt", step=1, source_dir=tiny_model,
                                  adapter=True)
    assert sorted(p.name for p in path.iterdir()) == [ADAPTER_CONFIG, ADAPTER_FILE] == sorted(sums)
    verify_dir(path, sums)
    merged, _ = write_checkpoint(model, checkpoint_dir=tmp_path / "ckpt", step=2, source_dir=tiny_model)
    adapter_bytes = sum(f.stat().st_size for f in path.iterdir())
    merged_bytes = sum(f.stat().st_size for f in merged.glob("*.safetensors"))
    assert adapter_bytes * 20 < merged_bytes, (adapter_bytes, merged_bytes)

    # peft's own loader, on a fresh base model: the adapter's keys and config are what it expects.
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    loaded = PeftModel.from_pretrained(base, str(path)).eval()
    ids = [3, 8, 11, 4, 6, 2]
    torch.testing.assert_close(logprobs_of(loaded, PROMPT, ids), logprobs_of(model, PROMPT, ids), rtol=0, atol=1e-5)

    # The HF engine: base model loaded once, this adapter and then another on it, each sampled with its
    # trainer model's log-probs.
    engine = HFEngine(tiny_model, dtype="float32", seed=0)
    base_lps = logprobs_of(engine.model, PROMPT, ids)
    engine.load_weights(path, version=1)
    assert engine.version == 1
    engine_matches(engine, model)
    second = adapted(tiny_model, seed=1)
    path2, _ = write_checkpoint(second, checkpoint_dir=tmp_path / "ckpt", step=3, source_dir=tiny_model, adapter=True)
    engine.load_weights(path2, version=3)
    engine_matches(engine, second)
    assert not torch.allclose(logprobs_of(second, PROMPT, ids), base_lps, atol=1e-3)  # the adapter changes them

    # An adapter that does not fit (another rank) is refused; the one in use stays.
    rank_two = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), rank=2, alpha=8.0,
                          dropout=0.0, target_modules=TARGETS)
    other, _ = write_checkpoint(rank_two, checkpoint_dir=tmp_path / "ckpt", step=4, source_dir=tiny_model,
                                adapter=True)
    with pytest.raises(CheckpointError, match="differ from the adapter in use"):
        engine.load_weights(other, version=4)
    assert engine.version == 3
    engine_matches(engine, second)


@pytest.mark.slow  # the trainer process: about 20 s
def test_the_trainer_publishes_adapters_that_the_engine_follows_version_by_version(tmp_path, redis_url, r,
                                                                                    tiny_model):
    from trainer.lora import apply_lora, load_adapter
    from trainer.schedule import build_scheduler
    from trainer.state import load_state

    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(0)
    for i in range(4):
        xadd(r, KEYS, encode_group(base, f"g{i}", rng))
    train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=2, lr=0.05,
                 lora={"rank": 4, "alpha": 8.0, "target_modules": TARGETS, "publish": "adapter"})
    wv: WeightVersion = latest_weights(r, KEYS)
    assert (wv.version, wv.format) == (2, ADAPTER_FORMAT)
    verify_dir(wv.path, wv.checksums)
    assert sorted(wv.checksums) == [ADAPTER_CONFIG, ADAPTER_FILE]

    trainer_model = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), rank=4,
                               alpha=8.0, dropout=0.0, target_modules=TARGETS)
    optimizer = torch.optim.AdamW([p for p in trainer_model.parameters() if p.requires_grad], lr=0.05)
    load_state(trainer_model, optimizer, build_scheduler(optimizer, schedule="constant", warmup_steps=0,
                                                          total_steps=0),
               path=tmp_path / "out" / "trainer_state" / "step_2")
    trainer_model.eval()
    # The trainer's own loader (a resume from a published adapter) rebuilds the same adapter.
    rebuilt = apply_lora(AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32), rank=4,
                         alpha=8.0, dropout=0.0, target_modules=TARGETS)
    load_adapter(rebuilt, wv.path)
    want = trainer_model.state_dict()
    assert all(torch.equal(v, want[k]) for k, v in rebuilt.state_dict().items())

    engine = HFEngine(tiny_model, dtype="float32", seed=0)
    engine.load_weights(tmp_path / "out" / "checkpoints" / "step_1", version=1)
    engine.load_weights(wv.path, version=2)
    engine_matches(engine, trainer_model)


def encode_group(base, group_id, rng):
    from common.messages import encode

    return encode(make_group(base, group_id, version=0, rng=rng))


def test_an_adapter_publish_is_refused_where_it_cannot_be_loaded(tmp_path, tiny_model):
    from generators.main import check_lora_publish

    lora = {"rank": 4, "publish": "adapter"}
    config = Config.model_validate({"model": {"path": str(tiny_model)}, "trainer": {"lora": lora},
                                    "generator": {"engine": "vllm", "inflight_updates": True}})
    with pytest.raises(ConfigError, match='trainer.lora.publish = "adapter": the vllm engine cannot move'):
        check_lora_publish(config)
    for engine in ("hf", "vllm"):
        check_lora_publish(config.model_copy(update={"generator": config.generator.model_copy(
            update={"engine": engine, "inflight_updates": False})}))
    server = config.generator.model_copy(update={"engine": "openai", "inflight_updates": False})
    with pytest.raises(ConfigError, match='trainer.lora.publish = "adapter": the openai engine'):
        check_lora_publish(config.model_copy(update={"generator": server}))
    with pytest.raises(ValueError, match="trainer.weight_transfer"):
        Config.model_validate({"model": {"path": str(tiny_model)},
                               "trainer": {"lora": lora, "weight_transfer": "gloo"}})


def test_the_evaluator_opens_an_adapters_base_model_and_samples_with_the_adapter(tmp_path, tiny_model, monkeypatch):
    from dataclasses import replace

    from common.evals import EvalRequest
    from evaluator import jobs
    from trainer.checkpoints import write_checkpoint

    model = adapted(tiny_model, seed=2)
    path, sums = write_checkpoint(model, checkpoint_dir=tmp_path / "ckpt", step=5, source_dir=tiny_model, adapter=True)
    monkeypatch.setattr(jobs, "_ENGINE", {})
    req = EvalRequest(run=RUN, version=5, step=5, path=str(path), checksums=sums, prompts=1, seed=0, pass_k=0,
                      temperature=1.0, max_new_tokens=4, sources=[], holdout=0.0, pass_reward=1.0, dtype="float32",
                      evals_path="", engine="hf", engine_settings={})
    engine = jobs.engine_for(req)
    assert engine.version == 5
    engine_matches(engine, model)
    with pytest.raises(ValueError, match='trainer.lora.publish = "adapter"'):
        jobs.engine_for(replace(req, engine="openai"))


def test_vllm_samples_each_published_adapter_with_the_trainers_logprobs(tmp_path, tiny_model, monkeypatch):
    """The evaluator's vLLM engine, opened on the adapter's base with enable_lora, then the next version."""
    from common.evals import EvalRequest
    from evaluator import jobs
    from tests.harness.models import LOGPROB_TOL
    from tests.harness.needs import need_vllm
    from trainer.checkpoints import write_checkpoint

    need_vllm()
    first, second = adapted(tiny_model, seed=3), adapted(tiny_model, seed=4)
    path, sums = write_checkpoint(first, checkpoint_dir=tmp_path / "ckpt", step=1, source_dir=tiny_model, adapter=True)
    path2, _ = write_checkpoint(second, checkpoint_dir=tmp_path / "ckpt", step=2, source_dir=tiny_model, adapter=True)
    monkeypatch.setattr(jobs, "_ENGINE", {})
    req = EvalRequest(run=RUN, version=1, step=1, path=str(path), checksums=sums, prompts=1, seed=0, pass_k=0,
                      temperature=1.0, max_new_tokens=4, sources=[], holdout=0.0, pass_reward=1.0, dtype="float32",
                      evals_path="", engine="vllm", engine_settings={"threads": 1})
    engine = jobs.engine_for(req)
    try:
        assert (engine.name, engine.version) == ("vllm", 1)
        for model, at, version in ((first, path, 1), (second, path2, 2), (first, path, 3)):
            engine.load_weights(at, version=version)
            assert engine.version == version
            for sampled in engine.sample([PROMPT], SamplingSettings(n=3, max_new_tokens=10, temperature=1.0))[0]:
                torch.testing.assert_close(torch.tensor(sampled.logprobs), logprobs_of(model, PROMPT, sampled.ids),
                                           rtol=0, atol=LOGPROB_TOL)
    finally:
        jobs._ENGINE.clear()
        del engine


def test_a_trainer_resumes_from_a_published_adapter_onto_its_base_model(tmp_path, r, tiny_model, monkeypatch):
    """No saved trainer state, groups acknowledged with the newest published version: that version
    is where the trainer goes on from, here the adapter alone, loaded onto the initial model."""
    from common.config import LoraConfig
    from trainer import checkpoints
    from trainer.checkpoints import publish, resume
    from trainer.devices import placement

    # One process, no sharding, whatever torch.distributed state an in-process vLLM left behind.
    monkeypatch.setattr(checkpoints, "place", lambda model, where: model)
    monkeypatch.setattr(checkpoints, "full_state_dict", lambda model: None)

    keys, where = Keys("resume"), placement(dtype="float32", master_fp32=False, activation_checkpointing=False)
    lora = LoraConfig(rank=4, alpha=8.0, target_modules=TARGETS, publish="adapter")
    common = {"where": where, "source_dir": tiny_model, "state_root": tmp_path / "state", "lr": 0.05,
              "weight_decay": 0.0, "lr_schedule": "constant", "warmup_steps": 0, "total_steps": 0, "lora": lora}
    model, optimizer, scheduler, step = resume(r, keys, **common)
    assert step == 0
    trained = adapted(tiny_model, seed=5).state_dict()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(trained[name])
    wv = publish(r, keys, model, optimizer, scheduler, step=1, checkpoint_dir=tmp_path / "ckpt",
                 state_root=tmp_path / "state", source_dir=tiny_model, keep=2, save_state_now=False, entry_ids=[],
                 group_ids=["g0"], dedup_window=10, adapter=True)
    assert wv is not None and wv.format == ADAPTER_FORMAT

    again, _, _, step = resume(r, keys, **common)
    assert step == 1
    ours = again.state_dict()
    assert all(torch.equal(ours[k], v) for k, v in model.state_dict().items())
