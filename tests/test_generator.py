"""The generator: its HF engine (sampling, behaviour log-probs, weight reloads) and the process."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import torch

from common.checkpoints import CheckpointError, checksum_dir, verify_dir
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import PromptTask, WeightVersion, decode_group, encode
from generators.engines import SamplingSettings
from generators.hf_engine import HFEngine
from tests.helpers import spawn, stop, wait_for

LOGPROB_TOL = 1e-4  # fp32: HF generate (left-padded batch, KV cache) vs one plain forward pass


def ask(i: int, *, n: int = 3) -> PromptTask:
    a, b = i, 2 * i + 1
    return PromptTask(id=f"arithmetic:0:{i}", messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
                      text=None, meta={"answer": a + b}, n=n, admitted_at=0)


def perturbed_copy(src: Path, dst: Path, *, seed: int) -> Path:
    """An HF checkpoint like the trainer publishes: `src`'s weights plus noise, via save_pretrained."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g))
    model.save_pretrained(dst, safe_serialization=True)
    return dst


def forward_logprobs(engine: HFEngine, prompt: list[int], ids: list[int], temperature: float) -> torch.Tensor:
    """What the trainer computes: log_softmax(logits / T) at the sampled tokens, one sequence, no padding."""
    seq = torch.tensor([prompt + ids])
    with torch.no_grad():
        logits = engine.model(seq).logits[0, len(prompt) - 1:-1].float()  # (T, V)
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(ids)[:, None])[:, 0]


# ---------------------------------------------------------------------- engine


def test_sampling_gives_n_completions_with_their_logprobs(tiny_model):
    engine = HFEngine(tiny_model, seed=0)
    prompts = [engine.prompt_ids(ask(1)), engine.prompt_ids(ask(12)),
               engine.prompt_ids(PromptTask(id="t", messages=None, text="What is 2 + 2?", meta={}, n=3,
                                            admitted_at=0))]
    assert len({len(p) for p in prompts}) > 1, "prompts of different lengths exercise the left padding"
    engine.eos_ids = list(range(3, engine.model.config.vocab_size, 10))  # about 1 token in 10 stops
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


def test_behaviour_logprobs_match_a_forward_pass(tiny_model):
    engine = HFEngine(tiny_model, seed=1)
    temperature = 0.7
    prompts = [engine.prompt_ids(ask(3)), engine.prompt_ids(ask(25))]
    out = engine.sample(prompts, SamplingSettings(n=3, max_new_tokens=16, temperature=temperature))
    worst = 0.0
    for prompt, group in zip(prompts, out, strict=True):
        for s in group:
            want = forward_logprobs(engine, prompt, s.ids, temperature)
            worst = max(worst, (torch.tensor(s.logprobs) - want).abs().max().item())
    print(f"behaviour vs forward log-probs: max abs diff {worst:.2e} (tolerance {LOGPROB_TOL:.0e})")
    assert worst < LOGPROB_TOL


def test_load_weights_changes_the_policy(tiny_model, tmp_path):
    engine = HFEngine(tiny_model, seed=0)
    probe = torch.tensor([engine.prompt_ids(ask(4))])
    with torch.no_grad():
        before = engine.model(probe).logits
    ckpt = perturbed_copy(tiny_model, tmp_path / "step_1", seed=1)
    engine.load_weights(ckpt, version=1)
    with torch.no_grad():
        after = engine.model(probe).logits
    assert engine.version == 1
    assert (before - after).abs().max() > 1e-2
    engine.load_weights(tiny_model, version=2)  # back to the original weights, exactly
    with torch.no_grad():
        assert torch.equal(engine.model(probe).logits, before)


def test_a_checkpoint_that_does_not_fit_is_refused_and_the_model_kept(tiny_model, tmp_path):
    from common.tiny import build_tiny_model

    engine = HFEngine(tiny_model, seed=0)
    before = {k: v.clone() for k, v in engine.model.state_dict().items()}
    other = build_tiny_model(tmp_path / "wide", hidden=96)
    with pytest.raises(CheckpointError, match="does not fit"):
        engine.load_weights(other, version=1)
    assert engine.version == 0
    assert all(torch.equal(v, engine.model.state_dict()[k]) for k, v in before.items())


def test_tied_embeddings_checkpoint_reloads(tiny_model, tmp_path):
    # The default model (SmolLM2) ties lm_head to the embedding; save_pretrained leaves lm_head out.
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(tiny_model)
    cfg.tie_word_embeddings = True
    tied = tmp_path / "tied"
    AutoModelForCausalLM.from_config(cfg).save_pretrained(tied, safe_serialization=True)
    for f in tiny_model.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            shutil.copy(f, tied / f.name)
    engine = HFEngine(tied, seed=0)
    new = perturbed_copy(tied, tmp_path / "tied_step_1", seed=2)
    engine.load_weights(new, version=1)
    emb = engine.model.get_input_embeddings().weight
    assert engine.model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    from safetensors.torch import load_file
    assert torch.equal(emb, load_file(new / "model.safetensors")["model.embed_tokens.weight"])


def test_a_corrupted_checkpoint_fails_its_checksums(tiny_model, tmp_path):
    ckpt = shutil.copytree(tiny_model, tmp_path / "step_1")
    sums = checksum_dir(ckpt)
    verify_dir(ckpt, sums)
    blob = bytearray((ckpt / "model.safetensors").read_bytes())
    blob[-100] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="model.safetensors has sha256"):
        verify_dir(ckpt, sums)


# ---------------------------------------------------------------------- the process


def publish_weights(r, keys: Keys, wv: WeightVersion) -> None:
    """What the trainer does after renaming its checkpoint into place."""
    with r.pipeline(transaction=True) as pipe:
        pipe.xadd(keys.weights, {PAYLOAD: encode(wv)})
        pipe.set(keys.weights_latest, encode(wv))
        pipe.execute()


def groups(r, keys: Keys):
    return [decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)]


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_generator_process_turns_prompts_into_groups_and_follows_weights(engine, tiny_model, tmp_path, redis_url, r):
    keys = Keys("g")
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "g", "ROLLOUTS_MODEL__PATH": str(tiny_model),
           "ROLLOUTS_GENERATOR__ENGINE": engine,
           "ROLLOUTS_ROLLOUT__GROUP_SIZE": "3", "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "8",
           "ROLLOUTS_GENERATOR__BATCH_PROMPTS": "2", "ROLLOUTS_GENERATOR__THREADS": "1",
           "ROLLOUTS_GENERATOR__CLAIM_IDLE_S": "1"}
    # A generator that died holding a prompt: it stays pending in the ghost's list until reclaimed.
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    r.xadd(keys.prompts, {PAYLOAD: encode(ask(0))})
    assert r.xreadgroup(GENERATORS_GROUP, "ghost", {keys.prompts: ">"}, count=1)
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=log)
    hb = keys.generator("g1")
    try:
        # -- version 0: prompts in (one reclaimed from the ghost), groups out, garbage dead-lettered
        for i in range(1, 3):
            r.xadd(keys.prompts, {PAYLOAD: encode(ask(i))})
        garbage = r.xadd(keys.prompts, {PAYLOAD: b"\x93not a prompt"})
        r.xadd(keys.prompts, {PAYLOAD: encode(ask(3))})
        wait_for(lambda: r.xlen(keys.samples) >= 4, timeout=120, what="4 groups", procs=[proc])
        first = groups(r, keys)
        assert sorted(g.id for g in first) == [f"arithmetic:0:{i}" for i in range(4)]
        for g in first:
            assert g.version == 0 and g.generator == "g1" and g.engine == engine
            assert len(g.completions) == 3 and g.prompt_id == g.id
            assert all(1 <= len(c.ids) <= 8 and c.reward in (0.0, 1.0) for c in g.completions)
        wait_for(lambda: r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0, timeout=10,
                 what="no pending prompts", procs=[proc])
        dead = r.xrange(keys.prompts_dead)
        assert len(dead) == 1 and dead[0][1][b"entry_id"] == garbage and dead[0][1][b"reason"]
        beat = r.hgetall(hb)
        wait_for(lambda: int(r.hget(hb, "groups") or 0) == 4, timeout=10, what="heartbeat of 4 groups", procs=[proc])
        beat = r.hgetall(hb)
        assert beat[b"version"] == b"0" and beat[b"engine"] == engine.encode()
        assert 0 < r.ttl(hb) <= 30

        # -- version 1 published: loaded at the next safe point, stamped on later groups
        ckpt = tmp_path / "checkpoints"
        step_1 = perturbed_copy(tiny_model, ckpt / "step_1", seed=1)
        publish_weights(r, keys, WeightVersion(version=1, step=1, path=str(step_1), format="safetensors",
                                               checksums=checksum_dir(step_1), created_at=time.time()))
        wait_for(lambda: r.hget(hb, "version") == b"1", timeout=30, what="heartbeat version 1", procs=[proc])
        for i in range(4, 6):
            r.xadd(keys.prompts, {PAYLOAD: encode(ask(i))})
        wait_for(lambda: r.xlen(keys.samples) >= 6, timeout=60, what="6 groups", procs=[proc])
        assert [g.version for g in groups(r, keys)[4:]] == [1, 1]

        # -- version 2 fails its checksum: refused, version 1 kept
        step_2 = perturbed_copy(tiny_model, ckpt / "step_2", seed=2)
        sums = checksum_dir(step_2) | {"model.safetensors": "0" * 64}
        publish_weights(r, keys, WeightVersion(version=2, step=2, path=str(step_2), format="safetensors",
                                               checksums=sums, created_at=time.time()))
        wait_for(lambda: int(r.hget(hb, "weights_refused") or 0) >= 1, timeout=30,
                 what="weights refused", procs=[proc])
        for i in range(6, 8):
            r.xadd(keys.prompts, {PAYLOAD: encode(ask(i))})
        wait_for(lambda: r.xlen(keys.samples) >= 8, timeout=60, what="8 groups", procs=[proc])
        assert [g.version for g in groups(r, keys)[6:]] == [1, 1]
        beat = r.hgetall(hb)
        assert beat[b"version"] == b"1" and b"sha256" in beat[b"last_refusal"]
        assert int(beat[b"weights_refused"]) == 1, "a refused version is not re-checked every pass"
    finally:
        code = stop(proc)
    output = log.read_text()
    assert code == 0, output
    assert "loaded weights version 1" in output and "refused weights" in output
    assert r.xlen(keys.samples) == 8 and r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0
    assert not r.exists(hb), "a clean exit removes its heartbeat"


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_late_generator_starts_from_the_latest_weights(engine, tiny_model, tmp_path, redis_url, r):
    keys = Keys("late")
    step_3 = perturbed_copy(tiny_model, tmp_path / "checkpoints" / "step_3", seed=3)
    publish_weights(r, keys, WeightVersion(version=3, step=3, path=str(step_3), format="safetensors",
                                           checksums=checksum_dir(step_3), created_at=time.time()))
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    r.xadd(keys.prompts, {PAYLOAD: encode(ask(0, n=2))})
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "late", "ROLLOUTS_MODEL__PATH": str(tiny_model),
           "ROLLOUTS_GENERATOR__ENGINE": engine,
           "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "4", "ROLLOUTS_GENERATOR__THREADS": "1"}
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g2", cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: r.xlen(keys.samples) >= 1, timeout=120, what="1 group", procs=[proc])
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()
    [group] = groups(r, keys)
    assert group.version == 3 and len(group.completions) == 2
