"""Mixture-of-experts: a tiny random Qwen3-MoE (tests/harness/models.py `tiny_moe`) sampled by both
engines and trained by the trainer, at world size 1 and 2, with the router's auxiliary
load-balancing loss where its config asks for it (trainer/moe.py). Run with -s to see the
measured log-prob differences."""

from __future__ import annotations

import random
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.config import GrpoLoss
from common.messages import Completion, SampleGroup
from engines.base import SamplingSettings
from engines.choice import open_engine
from tests.harness.groups import ask, make_group
from tests.harness.metrics import read_steps
from tests.harness.models import LOGPROB_TOL, tiny_moe
from tests.harness.needs import need
from tests.harness.pipeline import run_ranks
from trainer.checkpoints import load_model
from trainer.logprobs import sequence_logprobs
from trainer.moe import caught_router_logits, load_balancing_loss, router_aux_of
from trainer.step import GrpoOptions, log_probs, step_batches, train_step

COEF = 0.5  # router_aux_loss_coef where a test asks for the loss: large, so that its effect shows


@pytest.fixture(scope="module")
def moe(tiny_model, tmp_path_factory) -> Path:
    """The tiny MoE whose config asks for no router loss (Qwen3MoeConfig's default)."""
    return tiny_moe(tiny_model, tmp_path_factory.mktemp("moe") / "model")


@pytest.fixture(scope="module")
def moe_aux(tiny_model, tmp_path_factory) -> Path:
    """The same weights, its config asking for the router loss (output_router_logits) at COEF."""
    return tiny_moe(tiny_model, tmp_path_factory.mktemp("moe_aux") / "model", output_router_logits=True,
                    router_aux_loss_coef=COEF)


def grpo(**fields) -> GrpoOptions:
    return GrpoOptions(**{"loss": GrpoLoss(), "temperature": 1.0, "estimator": "grpo", "overlong": "none",
                          "overlong_penalty": 0.0, "micro_batch_size": 64, "micro_batch_tokens": 0, "updates": 1,
                          "max_grad_norm": 1e9, **fields})


def test_the_tiny_moe_routes_tokens_to_different_experts(moe):
    """What the other tests rely on: each layer is a sparse block whose router sends different
    tokens to different experts (a wrong choice of experts changes the numbers)."""
    model = load_model(moe)
    assert type(model).__name__ == "Qwen3MoeForCausalLM" and router_aux_of(model) is None
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda _m, _a, out: chosen.append(out[2]))
             for layer in model.model.layers]
    with torch.no_grad():
        model(input_ids=torch.arange(5, 45)[None])
    for h in hooks:
        h.remove()
    assert len(chosen) == 2
    for layer in chosen:  # (40, 2) experts per token
        assert len({tuple(sorted(row)) for row in layer.tolist()}) >= 3, layer.tolist()


def test_router_loss_is_the_models_own_over_the_trained_positions(moe_aux):
    """trainer/moe.py's loss over the trained positions is transformers' own load-balancing loss
    with the trained positions as its mask, caught from the pass that computes the log-probs."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    model = load_model(moe_aux)
    aux = router_aux_of(model)
    assert aux is not None and aux.coef == COEF and aux.top_k == 2
    torch.manual_seed(0)
    ids = torch.randint(0, model.config.vocab_size, (3, 21))
    inputs, targets = ids[:, :-1], ids[:, 1:]
    trained = torch.zeros_like(inputs)
    trained[0, 8:] = 1
    trained[1, 3:15] = 1
    trained[2, [4, 9, 19]] = 1
    with caught_router_logits(model, aux) as routers:
        sequence_logprobs(model, inputs, torch.ones_like(inputs), targets, temperature=1.0,
                          positions=trained.reshape(-1).nonzero().squeeze(1))
    assert len(routers) == 2 and routers[0].shape == (3 * 20, 4)
    got = load_balancing_loss(routers, aux.top_k, trained.reshape(-1).nonzero().squeeze(1))
    with torch.no_grad():
        logits = model(input_ids=inputs, output_router_logits=True).router_logits
    want = load_balancing_loss_func(logits, 4, 2, trained)
    print(f"router loss over the trained positions {got.item():.6f} (transformers': {want.item():.6f})")
    assert got.item() == pytest.approx(want.item(), rel=1e-5)
    everywhere = load_balancing_loss(routers, aux.top_k, torch.arange(60))
    assert everywhere.item() == pytest.approx(load_balancing_loss_func(logits, 4, 2).item(), rel=1e-5)
    assert abs(everywhere.item() - got.item()) > 1e-3, "the positions chosen make a difference"


def test_a_step_adds_coef_times_the_router_loss_and_reports_it(moe, moe_aux):
    """The same groups, the same weights: a step whose config asks for the router loss moves each
    parameter by -lr x COEF x the loss's gradient more than one whose config does not (SGD, no
    clipping; packed rows with shared prompts against the right-padded rows' reference), and
    reports the loss; the config that asks for none reports none."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    rng = random.Random(3)
    base = load_model(moe)
    groups = [make_group(base, f"m{i}", version=0, rng=rng, partial_mask=True) for i in range(2)]

    def step(path: Path):
        model = load_model(path)
        stats = train_step(model, torch.optim.SGD(model.parameters(), lr=1.0), groups,
                           how=grpo(pack=True, share_prompts=True))
        return {n: p.detach().clone() for n, p in model.named_parameters()}, stats

    plain, plain_stats = step(moe)
    with_aux, aux_stats = step(moe_aux)
    assert plain_stats.router_aux_loss is None
    # the reference: transformers' loss over the same trained positions of the right-padded rows
    ref = load_model(moe_aux)
    mb = step_batches(groups, micro_batch_size=64, micro_batch_tokens=0, pack=False, share_prompts=False)[0].batches
    assert len(mb) == 1
    out = ref(input_ids=mb[0].input_ids, attention_mask=mb[0].attention_mask, output_router_logits=True)
    want = load_balancing_loss_func(out.router_logits, 4, 2, mb[0].mask)
    (COEF * want).backward()
    print(f"router loss reported {aux_stats.router_aux_loss:.6f} (reference {want.item():.6f}); "
          f"policy loss {aux_stats.loss:+.6f} ({plain_stats.loss:+.6f} without)")
    assert aux_stats.router_aux_loss == pytest.approx(want.item(), rel=1e-5)
    assert aux_stats.loss == pytest.approx(plain_stats.loss, abs=1e-6), "the policy loss reported is the policy's"
    worst, moved = 0.0, 0.0
    for name, p in ref.named_parameters():
        expected = -p.grad if p.grad is not None else torch.zeros_like(p)
        worst = max(worst, (with_aux[name] - plain[name] - expected).abs().max().item())
        moved = max(moved, expected.abs().max().item())
    print(f"update difference vs -COEF x grad: worst {worst:.2e} (largest term {moved:.2e})")
    assert moved > 1e-3 and worst < 1e-5


def _engine_groups(engine, prompts, *, temperature: float) -> list[SampleGroup]:
    """Each prompt's completions as the generator writes them: the sampled ids with their
    behaviour log-probs (rewards alternating, so that every completion trains)."""
    out = engine.sample(prompts, SamplingSettings(n=4, max_new_tokens=16, temperature=temperature))
    return [SampleGroup(id=f"e{i}", prompt_id=f"e{i}", prompt_ids=prompt, version=0, generator="test",
                        engine=engine.name, completions=[
                            Completion(ids=s.ids, logprobs=s.logprobs, reward=float(j % 2), rewards={},
                                       finish=s.finish, text="") for j, s in enumerate(group)])
            for i, (prompt, group) in enumerate(zip(prompts, out, strict=True))]


@pytest.fixture(scope="module", params=["hf", pytest.param("vllm", marks=pytest.mark.slow)])
def moe_engine(request, moe_aux):
    """Each engine on the tiny MoE (its config asking for the router loss, which no engine uses),
    loaded once for the module (vLLM takes seconds to start)."""
    need(request.param)
    return open_engine(request.param, moe_aux, seed=0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_engine_logprobs_agree_with_the_trainers_on_moe(moe_engine, temperature, moe_aux):
    """Behaviour log-probs of completions an engine samples from the tiny MoE, against the
    trainer's own pass over them (its model loader, packed micro-batches with shared prompts), as
    for the dense model (tests/test_engines.py): within LOGPROB_TOL on every token."""
    worst, tokens = _worst_gap(moe_engine, moe_aux, temperature=temperature)
    print(f"{moe_engine.name} on the tiny MoE, T={temperature}: behaviour vs trainer log-probs over {tokens} tokens, "
          f"max abs diff {worst:.2e} (tolerance {LOGPROB_TOL:.0e})")
    assert tokens >= 12 * 4 and worst < LOGPROB_TOL


def _worst_gap(engine, weights: Path, *, temperature: float) -> tuple[float, int]:
    """(the largest |behaviour - trainer| log-prob over the tokens `engine` samples for three
    prompts, with the trainer's packed pass, shared prompts, on `weights`; how many tokens)."""
    prompts = [engine.prompt_ids(ask(3)), engine.prompt_ids(ask(25)), engine.prompt_ids(ask(41))]
    groups = _engine_groups(engine, prompts, temperature=temperature)
    model = load_model(weights).eval()
    batches = step_batches(groups, micro_batch_size=5, micro_batch_tokens=0, pack=True, share_prompts=True)[0].batches
    worst, tokens = 0.0, 0
    with torch.no_grad():
        for mb in batches:
            assert mb.packed is not None
            logp, _ = log_probs(partial(sequence_logprobs, temperature=temperature), model, mb)
            worst = max(worst, ((logp - mb.behaviour_logp).abs() * mb.mask).max().item())
            tokens += int(mb.mask.sum())
    return worst, tokens


def test_an_moe_checkpoint_reloads_in_place(moe_engine, moe_aux, tmp_path):
    """A checkpoint in the hub's layout (each expert its own tensors, as the trainer and
    save_pretrained write it) loads into a running engine as it loads from scratch, from disk and
    from tensors in memory (trainer.weight_transfer), and back: the greedy tokens a fresh HF
    engine gives, and behaviour log-probs the trainer's on those weights within LOGPROB_TOL.
    vLLM on a CPU prepacks its experts after the first load; its own reload would copy new ones in
    raw (engines/vllm_worker.py forget_moe_kernels)."""
    from tests.harness.models import perturbed_copy

    probe = [moe_engine.prompt_ids(ask(4)), moe_engine.prompt_ids(ask(9))]
    before = moe_engine.greedy(probe, max_new_tokens=12)
    step = perturbed_copy(moe_aux, tmp_path / "step_1", seed=1, scale=0.05)
    fresh = open_engine("hf", step, seed=0).greedy(probe, max_new_tokens=12)
    assert fresh != before
    try:
        for version, load in ((1, lambda: moe_engine.load_weights(step, version=1)),
                              (2, lambda: moe_engine.load_tensors(load_file(step / "model.safetensors"), version=2))):
            moe_engine.load_weights(moe_aux, version=0)
            load()
            assert moe_engine.version == version
            assert moe_engine.greedy(probe, max_new_tokens=12) == fresh, f"version {version}"
            worst, tokens = _worst_gap(moe_engine, step, temperature=1.0)
            print(f"{moe_engine.name}, the tiny MoE reloaded (version {version}): behaviour vs trainer log-probs "
                  f"over {tokens} tokens, max abs diff {worst:.2e}")
            assert worst < LOGPROB_TOL
    finally:
        moe_engine.load_weights(moe_aux, version=0)
    assert moe_engine.greedy(probe, max_new_tokens=12) == before


@pytest.mark.slow
def test_two_ranks_train_the_moe_as_one_and_add_its_router_loss(tmp_path, redis_url, r, moe, moe_aux):
    """The trainer process under FSDP2 on gloo: on the MoE whose config asks for no router loss,
    world sizes 1 and 2 give the same losses, gradient norms and weights, as on the dense model
    (tests/test_trainer_fsdp.py); on the one that asks, two ranks report the loss each step and
    their weights move otherwise. (The router loss is each micro-batch's, as transformers takes it
    per forward pass: world sizes that cut the batch into other micro-batches differ by it.)"""
    from common.keys import PAYLOAD, Keys
    from common.messages import encode
    from tests.harness.metrics import assert_same_grad_norms

    model = load_model(moe)
    rng = random.Random(11)
    blobs = [encode(make_group(model, f"g{i}", version=0, rng=rng)) for i in range(8)]
    for name in ("one", "two", "aux"):
        for blob in blobs:
            r.xadd(Keys(name).samples, {PAYLOAD: blob})
    run_ranks(tmp_path, "one", redis_url, moe, nproc=1)
    assert "2 rank(s)" in run_ranks(tmp_path, "two", redis_url, moe, nproc=2)
    run_ranks(tmp_path, "aux", redis_url, moe_aux, nproc=2)
    one, two, aux = (read_steps(tmp_path / n / "metrics.jsonl") for n in ("one", "two", "aux"))
    assert len(one) == len(two) == len(aux) == 2
    for a, b, c in zip(one, two, aux, strict=True):
        assert "router_aux_loss" not in a and "router_aux_loss" not in b
        assert abs(a["loss"] - b["loss"]) < 1e-6 and a["tokens/trained"] == b["tokens/trained"]
        print(f"step {c['step']}: router_aux_loss {c['router_aux_loss']:.6f} (2 ranks, coef {COEF})")
        assert c["router_aux_loss"] > 0
    assert abs(aux[0]["loss"] - two[0]["loss"]) < 1e-6, "the same first step's policy loss: the policy's alone"
    assert_same_grad_norms(one, two)
    a, b, c = (load_file(tmp_path / n / "checkpoints" / "step_2" / "model.safetensors") for n in ("one", "two", "aux"))
    assert any(".experts.0." in k for k in a) and a.keys() == b.keys() == c.keys()  # the hub's layout
    same = max((a[k] - b[k]).abs().max().item() for k in a)
    moved = max((c[k] - b[k]).abs().max().item() for k in a)
    print(f"largest parameter difference between world sizes 1 and 2: {same:.3g}; "
          f"with the router loss at 2 ranks: {moved:.3g}")
    assert same < 1e-5 and moved > 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_the_moe_trains_through_the_pipeline(tmp_path, redis_url, r, moe_aux, engine):
    """Producer, a generator on each engine and the trainer as OS processes on the tiny MoE whose
    config asks for the router loss: each step reports it, the tokens sampled by the weights the
    trainer holds (the generator having reloaded each version in place) differ from its own
    log-probs by no more than LOGPROB_TOL, and each checkpoint is a Qwen3-MoE in the hub's layout
    that the engines load."""
    from common.keys import PAYLOAD, Keys
    from common.messages import decode_group
    from tests.harness.pipeline import RUN, Pipeline, keep_groups, metrics, pipeline_config

    need(engine)
    steps = 3
    pipe = Pipeline(tmp_path, pipeline_config(tmp_path, redis_url, moe_aux, steps=steps, engine=engine))
    keep_groups(r, Keys(RUN))  # the trainer would trim what it trained
    for name in ("producer", "generator", "trainer"):
        pipe.start(name)
    pipe.finish(timeout=600)  # vLLM's start-up on a loaded machine included
    # Each group sampled after a reload, against the trainer's pass on the checkpoint it was sampled with.
    reloaded = [g for _, f in r.xrange(Keys(RUN).samples) if (g := decode_group(f[PAYLOAD])).version >= 1]
    assert reloaded, "no group was sampled by a version the generator reloaded"
    gaps = {}
    with torch.no_grad():
        for version in sorted({g.version for g in reloaded}):
            model = load_model(tmp_path / "run" / "checkpoints" / f"step_{version}").eval()
            mine = [g for g in reloaded if g.version == version]
            for mb in step_batches(mine, micro_batch_size=8, micro_batch_tokens=0, pack=True,
                                   share_prompts=True)[0].batches:
                logp, _ = log_probs(partial(sequence_logprobs, temperature=1.0), model, mb)
                gaps[version] = max(gaps.get(version, 0.0), ((logp - mb.behaviour_logp).abs() * mb.mask).max().item())
    print(f"{engine}: groups sampled after a reload, worst |behaviour - trainer| log-prob on their version's "
          f"checkpoint: {({v: f'{x:.2e}' for v, x in gaps.items()})}")
    assert max(gaps.values()) < LOGPROB_TOL
    seen = metrics(tmp_path)
    assert [m["step"] for m in seen] == list(range(1, steps + 1))
    fresh = [m["mismatch/by_staleness"]["0"] for m in seen if "0" in m["mismatch/by_staleness"]]
    print("router_aux_loss by step:", [round(m["router_aux_loss"], 6) for m in seen],
          "| mismatch of tokens sampled by the trainer's own weights:", [f"{x:.2e}" for x in fresh])
    assert all(m["router_aux_loss"] > 0 for m in seen)
    assert fresh and max(fresh) < LOGPROB_TOL
    last = tmp_path / "run" / "checkpoints" / f"step_{steps}"
    assert type(load_model(last)).__name__ == "Qwen3MoeForCausalLM"
    assert any(".experts.0.gate_proj" in k for k in load_file(last / "model.safetensors"))
    hf = open_engine("hf", last, seed=0)
    assert hf.greedy([hf.prompt_ids(ask(2))], max_new_tokens=4)[0]
