"""In-flight weight updates (generator.inflight_updates) on the tiny model: the HF engine yields to
newer weights mid-completion and continues under them; each token's version is recorded and
travels on the wire; a group is as stale as its oldest token; the trainer sees each token's version."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from common.config import ConfigError, TokenMask, config_from_dict
from common.keys import PAYLOAD, TRAINER_GROUP, Keys
from common.messages import Completion, MessageError, SampleGroup, decode_group, encode, token_versions
from engines.base import Sampled, SamplingSettings
from engines.choice import check_inflight, open_engine
from generators.inflight import group_versions
from tests.harness.groups import ask
from tests.harness.models import LOGPROB_TOL, perturbed_copy
from tests.harness.needs import need
from trainer.grpo import token_logprobs
from trainer.losses.corrections import behaviour_weight

SWITCH = 5  # tokens sampled before the new version is announced
# The engine's behaviour log-probs against the trainer's single-sequence forward pass, on the
# perturbed model (larger activations than the tiny model's own: tests/test_engines.py's bound is
# for those): measured here (2026-11-23) at most 2.2e-5, where the two versions differ by more than 0.1.
TOL = 1e-4


def logprobs_under(model, prompt: list[int], ids: list[int], *, temperature: float) -> torch.Tensor:
    """`model`'s log-probs of `ids` after `prompt`, as the trainer computes them: (T,)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + ids])).logits[:, len(prompt) - 1:-1].float()  # (1, T, V)
    return token_logprobs(logits, torch.tensor([ids]), temperature)[0]


@pytest.fixture(scope="module", params=["hf", "vllm"])
def switched(request, tiny_model, tmp_path_factory):
    """Completions of 3 prompts x 2 whose first SWITCH tokens were sampled with version 0 and the
    rest with version 1 (a perturbed copy, loaded after the engine yielded to it; vLLM's steps are
    one token of each sequence, so it loads after SWITCH of them): the engine's results, the
    prompts, both models."""
    from transformers import AutoModelForCausalLM

    need(request.param)
    engine = open_engine(request.param, tiny_model, seed=0)
    new = perturbed_copy(tiny_model, tmp_path_factory.mktemp("v1") / "step_1", seed=1)
    sampling = SamplingSettings(n=2, max_new_tokens=24, temperature=1.0)
    prompts = {f"p{i}": engine.prompt_ids(ask(i)) for i in range(3)}
    for rid, ids in prompts.items():
        engine.add(rid, ids, sampling)
    tokens = 0

    def announced() -> bool:  # asked once per sampled token
        nonlocal tokens
        tokens += 1
        return tokens >= SWITCH

    if request.param == "hf":
        assert engine.step(yield_when=announced) == [], "every completion was cut short at the announcement"
        finished = []
    else:
        finished = [done for _ in range(SWITCH) for done in engine.step(yield_when=announced)]
    assert engine.has_unfinished()
    engine.load_weights(new, version=1)
    while engine.has_unfinished():
        finished += engine.step(yield_when=lambda: False)
    old_model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    new_model = AutoModelForCausalLM.from_pretrained(new, dtype=torch.float32).eval()
    return {f.request_id: f.samples for f in finished}, prompts, old_model, new_model


def test_a_completion_spanning_a_reload_has_both_versions_at_the_switch(switched):
    results, prompts, _, _ = switched
    assert sorted(results) == sorted(prompts)
    spanning = 0
    for samples in results.values():
        assert len(samples) == 2
        for s in samples:
            assert len(s.ids) == len(s.logprobs) <= 24
            if len(s.ids) > SWITCH:  # went on after the reload
                assert s.versions == [(0, 0), (SWITCH, 1)], s.versions
                spanning += 1
            else:  # an eos before the announcement: all old
                assert s.versions == [(0, 0)] and s.finish == "stop"
    assert spanning >= 4, "most of the tiny model's completions run past 5 tokens"


def test_tokens_after_the_switch_are_sampled_under_the_new_weights(switched):
    results, prompts, old_model, new_model = switched
    compared = 0
    for rid, samples in results.items():
        for s in samples:
            if len(s.ids) <= SWITCH:
                continue
            behaviour = torch.tensor(s.logprobs)
            old = logprobs_under(old_model, prompts[rid], s.ids, temperature=1.0)
            new = logprobs_under(new_model, prompts[rid], s.ids, temperature=1.0)
            assert torch.allclose(behaviour[:SWITCH], old[:SWITCH], atol=LOGPROB_TOL), "before: the old model's"
            assert torch.allclose(behaviour[SWITCH:], new[SWITCH:], atol=TOL), "after: the new model's"
            assert (old[SWITCH:] - new[SWITCH:]).abs().max() > 0.1, "the two models differ where it matters"
            compared += 1
    assert compared >= 4


def test_token_versions_travel_on_the_wire_and_a_group_is_as_stale_as_its_oldest_token():
    def completion(ids: int, versions) -> Completion:
        return Completion(ids=list(range(3, 3 + ids)), logprobs=[-0.5] * ids, reward=1.0, rewards={}, finish="stop",
                          text="x", versions=versions)

    # the engine's spans -> the group's version (its oldest token's) and the completions' versions
    samples = [Sampled(ids=[1] * 6, logprobs=[-1.0] * 6, finish="stop", versions=[(0, 2), (4, 3)]),
               Sampled(ids=[1] * 3, logprobs=[-1.0] * 3, finish="stop", versions=[(0, 3)])]
    version, spans = group_versions(samples, added_at=2)
    assert version == 2 and spans == [[(0, 2), (4, 3)], [(0, 3)]]
    assert group_versions(samples[1:], added_at=2) == (3, [None]), "one version: nothing extra on the wire"
    assert group_versions([Sampled(ids=[1], logprobs=[-1.0], finish="stop")], added_at=4) == (4, [None])

    group = SampleGroup(id="g", prompt_id="g", prompt_ids=[1, 2], version=version, generator="gen", engine="hf",
                        completions=[completion(6, spans[0]), completion(3, spans[1]), completion(2, None)])
    back = decode_group(encode(group))
    assert back == group
    assert [token_versions(c, group_version=back.version).tolist() for c in back.completions] == [
        [2, 2, 2, 2, 3, 3], [3, 3, 3], [2, 2]]
    # recorded streams (no versions) still decode: every token of the group's version
    plain = dataclasses.replace(group, completions=[completion(2, None)] * 2)
    assert decode_group(encode(plain)).completions[0].versions is None

    refused = [  # (group version, a completion's versions, what the error says)
        (3, [(0, 2), (4, 3)], "older than the group's version 3"),  # the group hides an older token
        (2, [(0, 2), (6, 3)], "ascend strictly below 6"),  # an index past the end
        (2, [(1, 2)], "start at 0"),
        (2, [(0, 3), (4, 2)], "versions must be >= 0 and ascend"),
    ]
    for v, span, said in refused:
        bad = dataclasses.replace(group, version=v, completions=[completion(6, span), completion(3, None)])
        with pytest.raises(MessageError, match=said):
            decode_group(encode(bad))


def test_the_trainer_drops_a_group_whose_oldest_token_is_too_stale(r):
    from trainer.samples import collect
    from trainer.shutdown import Shutdown

    keys = Keys("t")
    r.xgroup_create(keys.samples, TRAINER_GROUP, id="0", mkstream=True)
    for gid, spans in (("old-start", [(0, 1), (2, 3)]), ("fresh", [(0, 2), (2, 3)])):
        samples = [Sampled(ids=[5, 6, 7, 8], logprobs=[-1.0] * 4, finish="stop", versions=spans),
                   Sampled(ids=[5, 6], logprobs=[-1.0] * 2, finish="stop", versions=[(0, 3)])]
        version, versions = group_versions(samples, added_at=3)
        group = SampleGroup(id=gid, prompt_id=gid, prompt_ids=[1, 2], version=version, generator="gen",
                            engine="hf", completions=[
                                Completion(ids=s.ids, logprobs=s.logprobs, reward=float(i), rewards={},
                                           finish="stop", text="x", versions=v)
                                for i, (s, v) in enumerate(zip(samples, versions, strict=True))])
        r.xadd(keys.samples, {PAYLOAD: encode(group)})
    got, _ = collect(r, keys, want=1, step=3, max_staleness=1, vocab_size=100, unpublished=set(), consumer="rank0",
                     cursor=None, shutdown=Shutdown())
    assert got is not None and [g.id for g in got.groups] == ["fresh"] and got.stale == 1


def test_the_trainer_sees_each_tokens_version(switched):
    """token_mask drops only tokens sampled with the old weights (the trainer holds the new ones),
    and the mismatch metrics count each token under its own staleness."""
    from common.config import GrpoLoss
    from trainer.batch import micro_batches
    from trainer.logprobs import sequence_logprobs
    from trainer.metrics import step_metrics
    from trainer.step import GrpoOptions, train_step

    results, prompts, _, new_model = switched
    groups = []
    for rid, samples in results.items():
        version, spans = group_versions(samples, added_at=0)
        groups.append(SampleGroup(id=rid, prompt_id=rid, prompt_ids=prompts[rid], version=version, generator="gen",
                                  engine="hf", completions=[
                                      Completion(ids=s.ids, logprobs=s.logprobs, reward=float(j), rewards={},
                                                 finish=s.finish, text="x", versions=span)
                                      for j, (s, span) in enumerate(zip(samples, spans, strict=True))]))
        assert version == 0
    (mb,), tokens, _ = micro_batches(groups, micro_batch_size=len(groups) * 2)
    with torch.no_grad():
        prox, _ = sequence_logprobs(new_model, mb.input_ids, mb.attention_mask, mb.targets, temperature=1.0)
    weight = behaviour_weight(prox, mb.behaviour_logp, mb.mask, TokenMask(mask_low=0.5, mask_high=2.0))
    trained = mb.mask > 0
    new_tokens, old_tokens = trained & (mb.versions == 1), trained & (mb.versions == 0)
    assert int(new_tokens.sum()) > 0 and int(old_tokens.sum()) > 0
    assert torch.allclose(weight[new_tokens], torch.ones(int(new_tokens.sum())), atol=1e-4), "new tokens kept"
    assert int((weight[old_tokens] == 0).sum()) > 0, "some old tokens fall outside the band"
    assert not (weight[trained] == 0)[~old_tokens[trained]].any(), "only old tokens are masked"

    metrics = step_metrics(groups, staleness=[1] * len(groups))
    assert metrics["staleness_max"] == 1
    assert metrics["mixed_versions"] == pytest.approx(
        sum(len(s.ids) > SWITCH for ss in results.values() for s in ss) / 6)
    assert 0 < metrics["staleness_token_mean"] < 1

    optimizer = torch.optim.SGD(new_model.parameters(), lr=0.0)
    stats = train_step(new_model, optimizer, groups, step=1, how=GrpoOptions(
        loss=GrpoLoss(correction="token_mask"), temperature=1.0, estimator="grpo", overlong="none",
        overlong_penalty=0.0, micro_batch_size=8, micro_batch_tokens=0, updates=1, max_grad_norm=1.0))
    assert stats.mismatch_by_staleness[0] < 1e-4, "tokens of the trainer's own version"
    assert stats.mismatch_by_staleness[1] > 0.1, "tokens of the version before"
    assert 0 < stats.masked <= int(old_tokens.sum()) / tokens + 1e-6


def test_inflight_updates_is_refused_for_engines_that_cannot_continue_a_sequence():
    with pytest.raises(ConfigError, match="inflight_updates.*openai"):
        config_from_dict({"generator": {"engine": "openai", "inflight_updates": True,
                                        "server_url": "http://127.0.0.1:1"}})
    with pytest.raises(ConfigError, match="inflight_updates: the openai engine"):
        check_inflight("openai")  # "auto" resolved to it at start-up
    for engine in ("hf", "vllm"):
        check_inflight(engine)
        assert config_from_dict({"generator": {"engine": engine, "inflight_updates": True}}).generator.inflight_updates
    assert not config_from_dict({}).generator.inflight_updates, "off by default"


# HF only: its generate call holds every completion of a batch until the longest ends, so the
# publish at the first group reaches completions in flight; vLLM's continuous batching may finish
# them all first (seen once), and its switch mid-completion is tested above, deterministically.
# One prompt a step and two held: the second is added to the engine in the same turn of the engine
# loop that took the first's completions off it, before the first's group can be scored and written,
# so the publish at that group always finds the second prompt sampling. (With one prompt held, the
# second was taken only once the first was written, and the publish could win the race: seen once.)
@pytest.mark.parametrize("engine", ["hf"])
def test_a_generator_with_inflight_updates_loads_new_weights_mid_completion(engine, tiny_model, tmp_path, redis_url,
                                                                           r):
    from common.checkpoints import checksum_dir
    from common.heartbeats import read_heartbeat
    from common.keys import GENERATORS_GROUP
    from common.messages import WeightVersion
    from tests.harness.groups import read_groups
    from tests.harness.models import publish_weights
    from tests.harness.processes import spawn, stop, wait_for

    need(engine)
    keys = Keys("g")
    env = {"ROLLOUTS_REDIS_URL": redis_url, "ROLLOUTS_RUN": "g", "ROLLOUTS_MODEL__PATH": str(tiny_model),
           "ROLLOUTS_GENERATOR__ENGINE": engine, "ROLLOUTS_GENERATOR__INFLIGHT_UPDATES": "true",
           "ROLLOUTS_GENERATOR__WEIGHTS_POLL_S": "0.05", "ROLLOUTS_ROLLOUT__GROUP_SIZE": "4",
           "ROLLOUTS_ROLLOUT__MAX_NEW_TOKENS": "400", "ROLLOUTS_GENERATOR__BATCH_PROMPTS": "1",
           "ROLLOUTS_GENERATOR__THREADS": "1", "ROLLOUTS_GENERATOR__MAX_IN_FLIGHT": "2"}
    step_1 = perturbed_copy(tiny_model, tmp_path / "checkpoints" / "step_1", seed=1)
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=log)
    try:
        for i in range(6):  # 6 generate calls of 1 prompt x 4 completions, each up to 400 tokens
            r.xadd(keys.prompts, {PAYLOAD: encode(ask(i, n=4))})
        # the first group written: the engine is already sampling the next prompt
        wait_for(lambda: r.xlen(keys.samples) >= 1, timeout=240, what="a group", procs=[proc], poll=0.01)
        publish_weights(r, keys, WeightVersion(version=1, step=1, path=str(step_1), format="safetensors",
                                               checksums=checksum_dir(step_1), created_at=time.time()))
        wait_for(lambda: r.xlen(keys.samples) >= 6, timeout=240, what="6 groups", procs=[proc])
        written = read_groups(r, keys)
        for g in written:  # a group is as stale as its oldest token
            assert g.version == min(c.versions[0][1] if c.versions else g.version for c in g.completions)
        mixed = [c.versions for g in written for c in g.completions if c.versions is not None]
        assert mixed, f"some completion went on under version 1: {[g.version for g in written]}"
        assert all(len(s) == 2 and s[0] == (0, 0) and s[1][0] > 0 and s[1][1] == 1 for s in mixed), mixed
        assert written[0].version == 0 and written[-1].version == 1
        assert all(c.versions is None for c in written[-1].completions)
        assert read_heartbeat(r, keys, "g1").version == 1
    finally:
        code = stop(proc)
    output = log.read_text()
    assert code == 0, output
    assert "loaded weights version 1" in output
