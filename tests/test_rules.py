"""Rules written once: each test pins that the places which once restated a rule now give the one
answer of its single definition (issue 41, item 2; the registries of item 3 at the end)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import random
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

import trainer.step
from common.config import (
    CORRECTIONS,
    ENGINES,
    LOSSES,
    SOURCES,
    Config,
    ConfigError,
    GrpoLoss,
    RolloutConfig,
    SyntheticSource,
    TaskConfig,
    TrainerConfig,
    config_from_dict,
    load_config,
    source_config,
)
from common.keys import PAYLOAD, Keys
from common.messages import MAX_COMPLETION_TOKENS, Completion, MessageError, encode
from common.process import EXIT_CONFIG
from common.transfer import SILENT_S, listening_members, say_listening, stop_listening
from generators.groups import drops
from tests.harness.groups import hand_group, make_group
from tests.harness.processes import process_env
from trainer.losses import LossInputs, takes_proximal
from trainer.losses.clipped import prepare
from trainer.metrics import step_metrics
from trainer.samples import validate
from trainer.step import GrpoOptions, log_probs, sft_step, train_step
from viewer.groups import from_stream

ROOT = Path(__file__).resolve().parent.parent


def _c(reward: float, *, finish: str = "stop", error: str | None = None) -> Completion:
    return Completion(ids=[5], logprobs=[-1.0], reward=reward, rewards={}, finish=finish, text="", reward_error=error)


# Groups on which a raw-reward std rule and the shaped, scored-only rule disagree, and two on which
# any rule agrees: (completions, overlong, overlong_penalty).
GROUPS = {
    "a failed completion among equal rewards": ([_c(1.0), _c(0.0, error="timeout"), _c(1.0)], "none", 0.0),
    "equal rewards, one cut and penalised": ([_c(1.0), _c(1.0, finish="length")], "penalty", 0.5),
    "rewards 1e-9 apart": ([_c(1.0), _c(1.0 + 1e-9)], "none", 0.0),
    "one scored completion": ([_c(1.0), _c(0.0, error="raised")], "none", 0.0),
    "all alike": ([_c(0.0), _c(0.0), _c(0.0)], "none", 0.0),
    "rewards differ": ([_c(0.0), _c(1.0)], "none", 0.0),
}


@pytest.mark.parametrize("name", GROUPS)
def test_frac_reward_zero_std_counts_the_groups_dynamic_sampling_drops(name):
    completions, overlong, penalty = GROUPS[name]
    group = hand_group(completions)
    generator = SimpleNamespace(settings=SimpleNamespace(drop_zero_variance=True),
                                trainer=SimpleNamespace(overlong=overlong, overlong_penalty=penalty))
    metrics = step_metrics([group], staleness=[0], overlong=overlong, overlong_penalty=penalty)
    assert metrics["frac_reward_zero_std"] == (1.0 if drops(generator, group) else 0.0)


def test_the_viewer_decodes_a_group_with_the_runs_raised_limits(r):
    # A run whose [limits] allow completions longer than the built-in default: the trainer takes
    # its groups, and so must `rollouts view` (it once decoded with the module's defaults).
    config = config_from_dict({"limits": {"max_completion_tokens": 2 * MAX_COMPLETION_TOKENS}})
    long = MAX_COMPLETION_TOKENS + 10
    group = hand_group([Completion(ids=[7] * long, logprobs=[-1.0] * long, reward=float(i), rewards={}, finish="stop",
                                   text="") for i in range(2)])
    keys = Keys("limits")
    r.xadd(keys.samples, {PAYLOAD: encode(group)})
    fields = r.xrange(keys.samples)[0][1]
    with pytest.raises(MessageError, match="exceed the limit"):
        validate(fields, vocab_size=100)  # the default limits refuse it ...
    assert validate(fields, vocab_size=100, limits=config.limits).id == group.id  # ... the run's take it
    loaded = from_stream(r, keys, newest=10, limits=config.limits)
    assert loaded.undecodable == 0 and [g.id for _, g in loaded.groups] == [group.id]


# --------------------------------------------------------------------------- the configs and REDIS_PORT

SHIPPED = sorted((ROOT / "configs").glob("*.toml"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_configs_redis_follows_redis_port(path):
    # `REDIS_PORT=6391 ./ops/run` starts the Procfile's Redis on 6391: every process must talk to it.
    assert load_config(path, env={"REDIS_PORT": "6391"}).redis_url == "redis://127.0.0.1:6391/0"
    assert load_config(path, env={}).redis_url == "redis://127.0.0.1:6390/0"  # the Procfile's default port


def test_a_redis_url_naming_another_port_than_redis_port_is_refused_at_start_up_in_one_line(tmp_path):
    (tmp_path / "run.toml").write_text('redis_url = "redis://127.0.0.1:6390/0"\n')
    env = process_env({"ROLLOUTS_CONFIG": str(tmp_path / "run.toml"), "REDIS_PORT": "6391"})
    done = subprocess.run([sys.executable, "-m", "producers"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == EXIT_CONFIG, done.stderr
    assert done.stderr.splitlines() == ["producer: redis_url names port 6390 but REDIS_PORT=6391 starts Redis on "
                                        "6391: drop redis_url from the config (it then follows REDIS_PORT) or make "
                                        "the two agree"], done.stderr
    # the same port, another host, or no REDIS_PORT: taken as written
    for url, port in [("redis://127.0.0.1:6391/0", "6391"), ("redis://redis.example:6390/0", "6391"),
                      ("redis://127.0.0.1:6390/0", None)]:
        assert load_config(env={"ROLLOUTS_REDIS_URL": url, **({"REDIS_PORT": port} if port else {})}).redis_url == url


def leaves(table: dict, path: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], object]]:
    """(path, value) of every value of a TOML table, arrays of tables (data.sources) left out."""
    out = []
    for name, value in table.items():
        if isinstance(value, dict):
            out += leaves(value, (*path, name))
        elif not (isinstance(value, list) and value and isinstance(value[0], dict)):
            out.append(((*path, name), value))
    return out


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_a_shipped_config_writes_only_what_differs_from_the_code_defaults(path):
    default = Config().model_dump()
    restated = []
    for names, value in leaves(tomllib.loads(path.read_text())):
        d = default
        for name in names:
            d = d[name]
        if d == value:
            restated.append(".".join(names))
    assert restated == [], f"{path.name} restates the code's defaults of {restated}: leave them to common/config.py"


# --------------------------------------------------------------------------- task options

SYNTHETIC = [kind for kind, v in SOURCES.items() if issubclass(v, SyntheticSource)]


@pytest.mark.parametrize("kind", SYNTHETIC)
def test_the_task_table_is_the_tasks_own_options(kind):
    # [task] name = kind, nothing else: the source a [[data.sources]] table of that kind makes with
    # nothing else, so its defaults are the task's Options' (written once, in tasks/<kind>.py).
    config = config_from_dict({"task": {"name": kind}})
    assert config.sources == [source_config(name=kind, kind=kind)]
    options = importlib.import_module(f"tasks.{kind}").Options
    assert options.model_fields.keys() <= TaskConfig.model_fields.keys()
    for field, info in options.model_fields.items():  # and the task's checks hold in [task] too
        assert TaskConfig.model_fields[field].metadata == info.metadata, field


@pytest.mark.parametrize("kind", ["arithmetic", "countdown"])
def test_a_tasks_data_set_holds_the_problems_its_source_draws(kind):
    task = importlib.import_module(f"tasks.{kind}")
    source = config_from_dict({"task": {"name": kind, "seed": 3}}).sources[0]
    rows = task.dataset(size=4, seed=3).to_list()
    assert [row["question"] for row in rows] == [task.make_prompt(source, seed=3, index=i)[0] for i in range(4)]


# --------------------------------------------------------------------------- code defaults


def test_a_grpo_step_left_to_its_defaults_runs_as_the_configs_defaults():
    # GrpoOptions' defaults (what a caller leaves out) are the config's, field for field: once
    # skip_zero_advantage was False here and true in [trainer].
    made = GrpoOptions.of(TrainerConfig(), RolloutConfig())
    defaults = {f.name: getattr(made, f.name) for f in dataclasses.fields(GrpoOptions)
                if f.default is not dataclasses.MISSING}
    assert defaults, "GrpoOptions has no defaults left to check"
    assert {name: GrpoOptions.__dataclass_fields__[name].default for name in defaults} == defaults
    assert inspect.signature(sft_step).parameters["chunk_tokens"].default == TrainerConfig().logits_chunk_tokens


# --------------------------------------------------------------------------- behaviour_clip

@pytest.mark.parametrize("correction", list(CORRECTIONS))
def test_the_step_runs_a_proximal_pass_exactly_where_the_loss_takes_its_ratio_against_it(tiny_model, correction,
                                                                                         monkeypatch):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    group = make_group(model.config.vocab_size, "g", version=0, rng=random.Random(0), shape=(4, [3, 5]))
    passes = []  # the step's no-grad passes of the policy (the second update's proximal one; no probes here)

    def counted(forward, m, mb, entropy=False):
        passes.extend([m] if m is model and not torch.is_grad_enabled() else [])
        return log_probs(forward, m, mb, entropy)

    monkeypatch.setattr(trainer.step, "log_probs", counted)
    loss = GrpoLoss(correction={"type": correction})
    train_step(model, torch.optim.SGD(model.parameters(), lr=0.0), [group], how=GrpoOptions(
        loss=loss, estimator="grpo", overlong="none", overlong_penalty=0.0, micro_batch_size=4, micro_batch_tokens=0,
        updates=2, max_grad_norm=1.0))  # a loss that needs prox_logp and was given none fails its assert
    assert bool(passes) == takes_proximal(loss) == (correction != "behaviour_clip")
    # the clipped loss takes its ratio against the proximal log-probs exactly then
    x = LossInputs(logp=torch.zeros(1, 2), behaviour_logp=torch.full((1, 2), -1.0), mask=torch.ones(1, 2),
                   advantages=torch.ones(1), total_tokens=2, prox_logp=torch.full((1, 2), -0.5))
    assert prepare(x, loss).old.tolist() == [[-0.5, -0.5] if takes_proximal(loss) else [-1.0, -1.0]]


# --------------------------------------------------------------------------- sft is never stale


def test_sft_groups_are_never_stale_and_sampled_ones_are_by_the_configs_bound():
    sft = load_config(ROOT / "configs" / "sft.toml", env={})  # sync_every 10 past max_staleness + 1: fine for sft
    assert sft.max_staleness is None and sft.staleness(step=50, version=0) == 0
    grpo = config_from_dict({"rollout": {"max_staleness": 3}})
    assert grpo.max_staleness == 3 and grpo.staleness(step=50, version=48) == 2
    with pytest.raises(ConfigError, match="sync_every"):  # sampled groups would all be too stale
        config_from_dict({"rollout": {"max_staleness": 3}, "trainer": {"sync_every": 5}})


# --------------------------------------------------------------------------- the transfer members hash


def test_a_receiver_said_listening_is_a_member_until_silent_and_only_common_touches_the_hash(r):
    keys = Keys("members")
    say_listening(r, keys, "g2")
    say_listening(r, keys, "g1")
    say_listening(r, keys, "g0", now=time.time() - 2 * SILENT_S)  # a generator gone silent
    assert listening_members(r, keys) == ["g1", "g2"]
    assert sorted(r.hkeys(keys.transfer_members)) == [b"g1", b"g2"]  # the silent one taken off
    stop_listening(r, keys, "g2")
    assert listening_members(r, keys) == ["g1"]
    # the generators write it, the trainer reads it: both through common/transfer.py, nowhere else
    for package in ("generators", "trainer", "producers", "evaluator"):
        for path in (ROOT / package).rglob("*.py"):
            assert "transfer_members" not in path.read_text(), f"{path.relative_to(ROOT)} touches the members hash"


# --------------------------------------------------------------------------- registries


def test_eval_engine_takes_each_engine_the_evaluator_can_open_itself():
    for name, kind in ENGINES.items():
        if kind.server:  # sampling on a server leased to a generator: not the evaluator's own
            with pytest.raises(ConfigError, match="eval.engine"):
                config_from_dict({"eval": {"engine": name}})
        else:
            assert config_from_dict({"eval": {"engine": name}}).eval.engine == name


def test_each_loss_and_correction_is_declared_once_and_the_config_takes_it():
    written = {p.stem for p in (ROOT / "trainer" / "losses" / "corrections").glob("*.py")} - {"__init__"}
    assert set(CORRECTIONS) == written  # each correction's weight module is a registered type
    for t in CORRECTIONS:
        loss = config_from_dict({"trainer": {"loss": {"correction": {"type": t}}}}).trainer.loss
        assert loss.correction.type == t and takes_proximal(loss) == (t != "behaviour_clip")
    for t in LOSSES:
        table = {"type": t, **({"function": "tests.test_rules:_c"} if t == "custom" else {})}
        assert config_from_dict({"trainer": {"loss": table}}).trainer.loss.type == t
        assert t == "custom" or callable(importlib.import_module(f"trainer.losses.{t}").loss)
