"""Several runs, one generator (generators/pool.py): `python -m generators --runs a.toml,b.toml`
samples each run's prompts with that run's own LoRA adapter on one base model, writes each run's
groups to that run alone, takes prompts fairly, and refuses runs it cannot serve together."""

import time
import tomllib
from pathlib import Path

import pytest
import torch

from common.config import ConfigError, config_from_dict
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import PromptTask, WeightVersion, encode
from generators.pool import check_pool
from tests.harness.adapters import TARGETS, adapted, logprobs_of
from tests.harness.groups import read_groups
from tests.harness.models import publish_weights
from tests.harness.pipeline import generator_toml
from tests.harness.processes import spawn, stop, wait_for

LORA = f"""
[trainer.lora]
rank = 4
alpha = 8.0
target_modules = {TARGETS!r}
publish = "adapter"
[[data.sources]]
name = "calc"
kind = "arithmetic"
"""


def run_toml(tmp_path: Path, run: str, redis_url: str, model: Path, extra: str = "") -> Path:
    path = tmp_path / f"{run}.toml"
    path.write_text(generator_toml(run=run, redis_url=redis_url, model=model) + LORA + extra)
    config_from_dict(tomllib.loads(path.read_text()))  # a config as a user writes it
    return path


def config(run: str, model: Path, **changes) -> object:
    data = tomllib.loads(generator_toml(run=run, redis_url="redis://127.0.0.1:1/0", model=model) + LORA)
    for dotted, value in changes.items():
        *path, last = dotted.split("__")
        table = data
        for part in path:
            table = table.setdefault(part, {})
        table[last] = value
    return config_from_dict(data)


def prompts(r, keys: Keys, count: int, *, admitted_at: int) -> None:
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    for i in range(count):
        task = PromptTask(id=f"calc:0:{i}", messages=None, text=f"{i} + 2 =", meta={"answer": i + 2}, n=2,
                          admitted_at=admitted_at, source="calc")
        r.xadd(keys.prompts, {PAYLOAD: encode(task)})


def publish_adapter(r, keys: Keys, model: torch.nn.Module, *, tmp_path: Path, tiny_model: Path, step: int) -> None:
    from trainer.checkpoints import write_checkpoint

    path, sums = write_checkpoint(model, checkpoint_dir=tmp_path / f"ckpt-{keys.run}", step=step,
                                  source_dir=tiny_model, adapter=True)
    publish_weights(r, keys, WeightVersion(version=step, step=step, path=str(path), format="lora_adapter",
                                           checksums=sums, created_at=time.time()))


def test_one_generator_samples_each_runs_prompts_with_that_runs_own_adapter(tmp_path, tiny_model, redis_url, r):
    """Runs "pa" and "pb" each sample with their own adapter, and "pc"'s troubles stay its own: it
    publishes full weights (a pool takes adapters only: refused, its prompts sampled with the base
    model) and its reward fails on every group (its completions carry the error)."""
    from transformers import AutoModelForCausalLM

    from trainer.checkpoints import write_checkpoint

    models = {"pa": adapted(tiny_model, seed=0), "pb": adapted(tiny_model, seed=1)}
    paths = [run_toml(tmp_path, run, redis_url, tiny_model) for run in models]
    for step, (run, model) in enumerate(models.items(), start=1):  # versions 1 (pa) and 2 (pb)
        publish_adapter(r, Keys(run), model, tmp_path=tmp_path, tiny_model=tiny_model, step=step)
        prompts(r, Keys(run), 3, admitted_at=step)  # admitted at that version: sampled with it, never the base
    paths.append(tmp_path / "pc.toml")
    paths[-1].write_text(paths[0].read_text().replace('run = "pa"', 'run = "pc"').replace(
        'kind = "arithmetic"', 'kind = "arithmetic"\nreward_funcs = ["tests.reward_fixtures:too_few"]'))
    full, sums = write_checkpoint(AutoModelForCausalLM.from_pretrained(tiny_model), checkpoint_dir=tmp_path / "full",
                                  step=1, source_dir=tiny_model)
    publish_weights(r, Keys("pc"), WeightVersion(version=1, step=1, path=str(full), format="safetensors",
                                                 checksums=sums, created_at=time.time()))
    prompts(r, Keys("pc"), 3, admitted_at=0)
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", "--runs", ",".join(map(str, paths)), cwd=tmp_path, env={}, log=log)
    try:
        wait_for(lambda: all(r.xlen(Keys(run).samples) >= 3 for run in ("pa", "pb", "pc")), timeout=180,
                 what="3 groups a run", procs=[proc])
    finally:
        code = stop(proc)
    said = log.read_text()
    assert code == 0, said
    for step, run in enumerate(models, start=1):  # each run's lines say whose they are
        assert f"generator g1 (run {run}): hf engine on {tiny_model}" in said, said
        assert f"generator g1 (run {run}): loaded weights version {step} " in said, said
        assert f"(run {run}): refused weights" not in said and f"(run {run}): reward error" not in said, said
    for step, (run, model) in enumerate(models.items(), start=1):
        groups = read_groups(r, Keys(run))
        assert sorted(g.prompt_id for g in groups) == [f"calc:0:{i}" for i in range(3)], run  # its own, once each
        other = models["pb" if run == "pa" else "pa"]
        for g in groups:
            assert g.version == step, (run, g.version)
            for c in g.completions:
                assert c.reward_error is None, c.reward_error
                mine = logprobs_of(model, list(g.prompt_ids), list(c.ids))
                torch.testing.assert_close(torch.tensor(c.logprobs), mine, rtol=0, atol=1e-4)
                theirs = logprobs_of(other, list(g.prompt_ids), list(c.ids))
                assert not torch.allclose(torch.tensor(c.logprobs), theirs, atol=1e-3), "sampled with the other run's"
        assert not r.xpending(Keys(run).prompts, GENERATORS_GROUP)["pending"], run  # every prompt acknowledged
    assert "generator g1 (run pc): refused weights: " in said and "takes LoRA adapters only" in said, said
    base = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).eval()
    for g in read_groups(r, Keys("pc")):
        assert g.version == 0 and all(c.reward_error for c in g.completions), g
        for c in g.completions:  # sampled with the base model alone
            torch.testing.assert_close(torch.tensor(c.logprobs), logprobs_of(base, list(g.prompt_ids), list(c.ids)),
                                       rtol=0, atol=1e-4)


def test_a_run_with_a_long_backlog_does_not_starve_the_other(capsys):
    """ops/bench/pool_share.py: each run takes prompts up to its own max_in_flight, so a run with 8
    prompts waiting is served beside one with 48, not after it."""
    from ops.bench import pool_share

    (m,) = pool_share.main(["--big", "48", "--small", "8", "--max-in-flight", "2", "--repeat", "1"])
    assert "small run's share while both had prompts" in capsys.readouterr().out
    # Fair: about as many of the big run's groups as of the small one's (8) by the small run's last;
    # a pool that served the big run's backlog first would give the small run almost none.
    assert m["small_share"] > 0.25 and m["big_alone_per_s"] > 0, m


def test_runs_one_generator_cannot_serve_together_are_refused_by_name(tmp_path, tiny_model):
    other = tmp_path / "other-model"
    other.symlink_to(tiny_model)  # the same files under another name are the same base model
    check_pool([config("a", tiny_model), config("b", other)])
    check_pool([config("a", tiny_model, trainer__lora__publish="merged")])  # one run: anything goes

    (tmp_path / "elsewhere").mkdir()
    for f in tiny_model.iterdir():
        (tmp_path / "elsewhere" / f.name).symlink_to(f)
    with pytest.raises(ConfigError, match="runs 'a' and 'b' have different base models"):
        check_pool([config("a", tiny_model), config("b", tmp_path / "elsewhere")])
    with pytest.raises(ConfigError, match="run 'a' is named by two configs"):
        check_pool([config("a", tiny_model), config("a", tiny_model)])
    with pytest.raises(ConfigError, match="run 'b' publishes full weights"):
        check_pool([config("a", tiny_model), config("b", tiny_model, trainer__lora__publish="merged")])
    with pytest.raises(ConfigError, match="run 'b' publishes full weights"):
        check_pool([config("a", tiny_model), config("b", tiny_model, trainer__lora__rank=0)])
    with pytest.raises(ConfigError, match="runs 'a' and 'b' differ in redis_url"):
        check_pool([config("a", tiny_model), config("b", tiny_model, redis_url="redis://127.0.0.1:2/0")])
    with pytest.raises(ConfigError, match="run 'b' has generator.inflight_updates on"):
        check_pool([config("a", tiny_model), config("b", tiny_model, generator__inflight_updates=True)])

