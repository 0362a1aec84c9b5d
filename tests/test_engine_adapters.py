"""Several LoRA adapters in one engine, one per training run sharing the base model (several runs,
one generator pool): each request is sampled with its own run's adapter, its behaviour log-probs
those of that adapter's trainer model, its completions stamped with that adapter's versions; an
adapter's next version leaves the other runs' requests alone, even those in flight."""

from __future__ import annotations

import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from common.checkpoints import ADAPTER_FILE, CheckpointError
from common.config import GeneratorConfig
from engines.base import Engine, Sampled, SamplingSettings
from engines.hf_engine import HFEngine
from tests.harness.adapters import adapted, logprobs_of
from tests.harness.models import LOGPROB_TOL
from tests.harness.needs import need_vllm

PROMPT = [1, 5, 9, 13, 2, 7]
SAMPLING = SamplingSettings(n=2, max_new_tokens=8, temperature=1.0)


@pytest.fixture
def publish(tmp_path, tiny_model):
    """Publish a trainer model's adapter as the trainer does (trainer.lora.publish = "adapter")."""
    from trainer.checkpoints import write_checkpoint

    def published(model: torch.nn.Module, step: int):
        return write_checkpoint(model, checkpoint_dir=tmp_path / "ckpt", step=step, source_dir=tiny_model,
                                adapter=True)[0]

    return published


def run_all(engine: Engine) -> dict[str, list[Sampled]]:
    got: dict[str, list[Sampled]] = {}
    while engine.has_unfinished():
        got.update((f.request_id, f.samples) for f in engine.step())
    return got


def assert_sampled_with(samples: list[Sampled], model: torch.nn.Module, *, atol: float) -> None:
    for s in samples:
        torch.testing.assert_close(torch.tensor(s.logprobs), logprobs_of(model, PROMPT, s.ids), rtol=0, atol=atol)


def assert_not_sampled_with(samples: list[Sampled], model: torch.nn.Module) -> None:
    """Log-probs of what was sampled, over all the completions, are not those of `model`."""
    ours = torch.tensor([lp for s in samples for lp in s.logprobs])
    theirs = torch.cat([logprobs_of(model, PROMPT, s.ids) for s in samples])
    assert not torch.allclose(ours, theirs, atol=1e-3), (ours, theirs)


def test_the_hf_engine_samples_each_request_with_its_own_runs_adapter(tiny_model, publish):
    a, b, a_next = adapted(tiny_model, seed=10), adapted(tiny_model, seed=11), adapted(tiny_model, seed=12)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    engine = HFEngine(tiny_model, dtype="float32", seed=0)
    engine.load_weights(publish(a, 3), version=3, adapter="a")
    engine.load_weights(publish(b, 5), version=5, adapter="b")
    assert [engine.adapter_version(n) for n in ("a", "b", "c", None)] == [3, 5, 0, 0]
    assert engine.version == 0

    # Requests of every adapter, queued together, stepped in one loop: each sampled with its own.
    for rid, adapter in (("ra", "a"), ("rb", "b"), ("rc", "c"), ("rd", None), ("ra2", "a")):
        engine.add(rid, PROMPT, SAMPLING, adapter=adapter)
    got = run_all(engine)
    assert sorted(got) == ["ra", "ra2", "rb", "rc", "rd"]
    for rid, model in (("ra", a), ("ra2", a), ("rb", b), ("rc", base), ("rd", base)):
        assert_sampled_with(got[rid], model, atol=1e-5)
    assert_not_sampled_with(got["ra"] + got["ra2"], b)
    assert_not_sampled_with(got["rb"], a)
    assert_not_sampled_with(got["rb"], base)
    for rid, version in (("ra", 3), ("ra2", 3), ("rb", 5), ("rc", 0), ("rd", 0)):
        assert all(s.versions == [(0, version)] for s in got[rid]), (rid, [s.versions for s in got[rid]])

    # A new version of "a" while a request of "b" is cut short in flight: "b"'s goes on under b.
    engine.add("rb-long", PROMPT, SamplingSettings(n=2, max_new_tokens=12, temperature=1.0), adapter="b")
    asked = iter(range(1000))
    assert engine.step(yield_when=lambda: next(asked) >= 3) == []  # yields after a few tokens
    assert engine.has_unfinished()
    engine.load_weights(publish(a_next, 7), version=7, adapter="a")
    assert [engine.adapter_version(n) for n in ("a", "b", None)] == [7, 5, 0]
    engine.add("ra-next", PROMPT, SAMPLING, adapter="a")
    got = run_all(engine)
    assert_sampled_with(got["rb-long"], b, atol=1e-5)
    assert all(s.versions == [(0, 5)] for s in got["rb-long"])
    assert_sampled_with(got["ra-next"], a_next, atol=1e-5)
    assert_not_sampled_with(got["ra-next"], a)
    assert all(s.versions == [(0, 7)] for s in got["ra-next"])


def test_each_named_adapter_keeps_its_own_shape_and_takes_adapters_only(tiny_model, publish):
    a, small = adapted(tiny_model, seed=20), adapted(tiny_model, seed=21, rank=2)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    engine = HFEngine(tiny_model, dtype="float32", seed=0)
    engine.load_weights(publish(a, 1), version=1, adapter="a")
    engine.load_weights(publish(small, 2), version=2, adapter="small")  # another run's rank: its own slot
    with pytest.raises(CheckpointError, match="differ from adapter 'a' in use"):
        engine.load_weights(publish(small, 3), version=3, adapter="a")
    with pytest.raises(CheckpointError, match="a named adapter takes LoRA adapters only"):
        engine.load_weights(tiny_model, version=4, adapter="a")  # full weights
    with pytest.raises(CheckpointError, match="full weights, but this engine samples with LoRA adapters"):
        engine.load_weights(tiny_model, version=4)
    # A new name whose tensors do not fit its config (rank 2 said, rank 4 written): refused, its slot gone.
    broken = publish(small, 5)
    shutil.copy(publish(a, 6) / ADAPTER_FILE, broken / ADAPTER_FILE)
    with pytest.raises(CheckpointError):
        engine.load_weights(broken, version=5, adapter="broken")
    assert [engine.adapter_version(n) for n in ("a", "small", "broken", None)] == [1, 2, 0, 0]
    for name in ("a", "small", "broken"):
        engine.add(name, PROMPT, SAMPLING, adapter=name)
    got = run_all(engine)
    assert_sampled_with(got["a"], a, atol=1e-5)
    assert_sampled_with(got["small"], small, atol=1e-5)
    assert_sampled_with(got["broken"], base, atol=1e-5)

    # The same as an engine's first adapter: the base model as it was, and the next adapter loads.
    fresh = HFEngine(tiny_model, dtype="float32", seed=0)
    with pytest.raises(CheckpointError):
        fresh.load_weights(broken, version=5, adapter="broken")
    fresh.add("broken", PROMPT, SAMPLING, adapter="broken")
    assert_sampled_with(run_all(fresh)["broken"], base, atol=1e-5)
    fresh.load_weights(publish(a, 7), version=7, adapter="a")
    fresh.add("a", PROMPT, SAMPLING, adapter="a")
    assert_sampled_with(run_all(fresh)["a"], a, atol=1e-5)


def test_vllm_samples_each_request_with_its_own_runs_adapter(tiny_model, publish):
    """vLLM (opened as a generator pool opens it, for two adapters at once): each request under its
    own adapter in one batch; a new version of one while the other's request is in flight."""
    from engines.choice import open_for_settings

    need_vllm()
    a, b, a_next = adapted(tiny_model, seed=30), adapted(tiny_model, seed=31), adapted(tiny_model, seed=32)
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    engine = open_for_settings("vllm", tiny_model, settings=GeneratorConfig.model_validate({"threads": 1}),
                               dtype="float32", seed=0, max_running=8, lora_rank=4, adapters=2)
    try:
        engine.load_weights(publish(a, 3), version=3, adapter="a")
        engine.load_weights(publish(b, 5), version=5, adapter="b")
        assert [engine.adapter_version(n) for n in ("a", "b", "c", None)] == [3, 5, 0, 0]
        with pytest.raises(CheckpointError, match="opened for 2 at once"):
            engine.load_weights(publish(a, 6), version=6, adapter="third")
        for rid, adapter in (("ra", "a"), ("rb", "b"), ("rc", "c")):
            engine.add(rid, PROMPT, SAMPLING, adapter=adapter)
        got = run_all(engine)
        for rid, model, version in (("ra", a, 3), ("rb", b, 5), ("rc", base, 0)):
            assert_sampled_with(got[rid], model, atol=LOGPROB_TOL)
            assert all(s.versions == [(0, version)] for s in got[rid]), (rid, [s.versions for s in got[rid]])
        assert_not_sampled_with(got["ra"], b)
        assert_not_sampled_with(got["rb"], a)

        # "b" in flight: "a"'s next version loads, "b"'s is refused until its requests are done.
        engine.add("rb-long", PROMPT, SamplingSettings(n=2, max_new_tokens=12, temperature=1.0), adapter="b")
        engine.step()
        assert engine.has_unfinished()
        with pytest.raises(CheckpointError, match="in flight under adapter 'b'"):
            engine.load_weights(publish(b, 8), version=8, adapter="b")
        engine.load_weights(publish(a_next, 7), version=7, adapter="a")
        engine.add("ra-next", PROMPT, SAMPLING, adapter="a")
        engine.add("rc-late", PROMPT, SAMPLING, adapter="c")  # still the base model alone, beside them
        got = run_all(engine)
        assert_sampled_with(got["rc-late"], base, atol=LOGPROB_TOL)
        assert_sampled_with(got["rb-long"], b, atol=LOGPROB_TOL)
        assert all(s.versions == [(0, 5)] for s in got["rb-long"])
        assert_sampled_with(got["ra-next"], a_next, atol=LOGPROB_TOL)
        assert all(s.versions == [(0, 7)] for s in got["ra-next"])
        assert [engine.adapter_version(n) for n in ("a", "b")] == [7, 5]
    finally:
        del engine
