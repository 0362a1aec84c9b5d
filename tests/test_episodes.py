"""The generator playing multi-turn episodes for real (environments in worker processes, model turns
sampled by the engine among the other requests), and the whole pipeline training on them."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.heartbeats import read_counters, read_heartbeat
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import PromptTask, SampleGroup, decode_group, encode
from common.progress import add_outstanding
from envs import guess
from tests.harness.configs import write_config
from tests.harness.needs import need
from tests.harness.pipeline import run_watching_groups
from tests.harness.processes import spawn, stop, wait_for
from tests.harness.templates import DROPS_TURNS_BEFORE_THE_USER, with_template
from trainer.batch import group_rows


def model_turns(mask: list[int], ids: list[int]) -> list[list[int]]:
    """The runs of ids with mask 1: the model's turns."""
    turns: list[list[int]] = []
    for i, (t, m) in enumerate(zip(ids, mask, strict=True)):
        if m and (i == 0 or not mask[i - 1]):
            turns.append([])
        if m:
            turns[-1].append(t)
    return turns


def check_trained_ids_are_sampled(groups: list[SampleGroup], model_dir) -> None:
    """What the trainer trains on a group (its rows' masked-in targets) are the ids the engine
    sampled: the initial model's log-probs of them, at the positions the trainer uses, are the
    behaviour log-probs the engine reported (a re-tokenised turn would put other ids there). And
    the check can fail: some model turn does not survive decode -> encode."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    round_trip_fails = False
    for group in groups:
        assert group.version == 0, "the initial model's log-probs are compared"
        for row, c in zip(group_rows(group), group.completions, strict=True):
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([row.inputs])).logits[0].float()  # (T, V), temperature 1
            logp = torch.log_softmax(logits, -1).gather(-1, torch.tensor(row.targets)[:, None])[:, 0]
            on = torch.tensor(row.mask, dtype=torch.bool)
            assert torch.allclose(logp[on], torch.tensor(row.behaviour_logp)[on], atol=2e-3), group.id
            assert [t for t, m in zip(row.targets, row.mask, strict=True) if m] == \
                [t for t, m in zip(c.ids, c.loss_mask, strict=True) if m]
            for turn in model_turns(c.loss_mask, c.ids):
                round_trip_fails |= tok.encode(tok.decode(turn), add_special_tokens=False) != turn
    assert round_trip_fails, "every sampled turn survives decode -> encode: the check above proves nothing"


def check_episode(c, *, env_turns: bool) -> None:
    """An episode's completion: mask 1 on the model's turns, 0 on the environment's, behaviour log-probs
    on the model's tokens only."""
    assert c.loss_mask is not None and len(c.loss_mask) == len(c.ids) == len(c.logprobs)
    assert c.loss_mask[0] == 1
    assert all(lp == 0.0 for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if not m)
    assert any(lp < 0.0 for lp, m in zip(c.logprobs, c.loss_mask, strict=True) if m)
    assert (0 in c.loss_mask) == env_turns


def prompt(pid: str, meta: dict, *, n: int = 2) -> PromptTask:
    return PromptTask(id=pid, messages=[{"role": "user", "content": "Go."}], text=None, meta=meta, n=n,
                      admitted_at=0)


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_generator_plays_episodes_and_lives_through_tools_that_hang_or_raise(engine, tiny_model, tmp_path,
                                                                            redis_url, r):
    need(engine)
    keys = Keys("ep")
    write_config(tmp_path / "run.toml", run="ep", redis_url=redis_url, model=tiny_model, base={},
                 rollout={"max_new_tokens": 6}, generator={"engine": engine, "threads": 1, "env_workers": 2},
                 data={"sources": [{"name": "faulty", "kind": "arithmetic", "environment": "tests.env_fixtures:Faulty",
                                    "max_turns": 3, "turn_timeout_s": 1.0},
                                   {"name": "arithmetic", "kind": "arithmetic"}]})
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    for task in [prompt("faulty:0:0", {"source": "faulty", "tool": "hang"}),
                 prompt("faulty:0:1", {"source": "faulty", "tool": "boom"}),
                 prompt("arithmetic:0:0", {"source": "arithmetic", "answer": 3})]:
        r.xadd(keys.prompts, {PAYLOAD: encode(task)})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(tmp_path / "run.toml")},
                 log=log)
    try:
        wait_for(lambda: r.xlen(keys.samples) >= 3, timeout=180, what="3 groups", procs=[proc])
        r.xadd(keys.prompts, {PAYLOAD: encode(prompt("faulty:0:2", {"source": "faulty", "tool": "boom"}))})
        wait_for(lambda: r.xlen(keys.samples) >= 4, timeout=60, what="a group after the faults", procs=[proc])
        assert proc.poll() is None, "the generator died"
        # every failed step counted in the heartbeat: as many as the log's lines say
        said = sum(int(n) for n in re.findall(r"environment error \((\d+) in group", log.read_text()))
        wait_for(lambda: read_heartbeat(r, keys, "g1").env_errors == said >= 6, timeout=30,
                 what=f"{said} environment errors in the heartbeat", procs=[proc])
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    groups = {g.id: g for g in (decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples))}
    hang, boom, plain = groups["faulty:0:0"], groups["faulty:0:1"], groups["arithmetic:0:0"]
    for c in hang.completions:  # the hanging tool: an error turn each time, until the turn limit
        check_episode(c, env_turns=True)
        assert c.finish == "turns" and c.reward == 0.0 and c.reward_error is None
        assert c.text.count("error: the environment did not answer within 1 s") == 2
        assert len(model_turns(c.loss_mask, c.ids)) == 3
    for c in boom.completions + groups["faulty:0:2"].completions:  # the raising tool: its error, then done
        check_episode(c, env_turns=True)
        assert (c.finish, c.reward, c.rewards) == ("stop", 1.0, {"done": 1.0})
        assert "error: RuntimeError: boom" in c.text and len(model_turns(c.loss_mask, c.ids)) == 2
    assert all(c.loss_mask is None for c in plain.completions)  # single completions as before
    assert "environment error (6 in group faulty:0:0): the environment did not answer" in log.read_text()
    check_trained_ids_are_sampled([hang, boom], tiny_model)


def test_dynamic_sampling_judges_episodes_by_the_rewards_the_trainer_learns_from(tiny_model, tmp_path, redis_url, r):
    # In each group one episode finds no environment (a reward error: the trainer leaves it out of the
    # group's statistics) and the other scores 1.0: one scored reward, nothing to learn; dropped.
    keys = Keys("epds")
    write_config(tmp_path / "run.toml", run="epds", redis_url=redis_url, model=tiny_model, base={},
                 rollout={"max_new_tokens": 4}, generator={"engine": "hf", "threads": 1, "drop_zero_variance": True},
                 data={"sources": [{"name": "flaky", "kind": "arithmetic",
                                    "environment": "tests.env_fixtures:FirstStartFails"}]})
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    tasks = [prompt(f"flaky:0:{i}", {"source": "flaky", "flag": str(tmp_path / f"flag{i}")}) for i in range(2)]
    add_outstanding(r, keys, [t.id for t in tasks])  # as the producer admits them
    for task in tasks:
        r.xadd(keys.prompts, {PAYLOAD: encode(task)})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(tmp_path / "run.toml")},
                 log=log)
    try:
        wait_for(lambda: read_counters(r, keys).groups_dropped_zero_variance + r.xlen(keys.samples) == 2,
                 timeout=120, what="2 groups written or dropped", procs=[proc])
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    assert r.xlen(keys.samples) == 0, [decode_group(f[PAYLOAD]).completions for _, f in r.xrange(keys.samples)]
    assert read_counters(r, keys).groups_dropped_zero_variance == 2


def test_pipeline_trains_on_calculator_and_guessing_episodes(tmp_path, redis_url, r, tiny_model):
    keys = Keys("agents")
    guess.dataset(size=16, seed=0, high=20).to_json(tmp_path / "guess.jsonl")
    config = tmp_path / "run.toml"
    write_config(config, run="agents", redis_url=redis_url, output_dir=tmp_path / "run", model=tiny_model, base={},
                 rollout={"group_size": 2, "prompts_per_step": 2, "max_staleness": 1, "max_new_tokens": 6},
                 generator={"engine": "hf", "threads": 1}, trainer={"lr": 1e-3, "max_steps": 2, "threads": 1},
                 data={"sources": [{"name": "calc", "kind": "arithmetic", "max_operand": 100000,
                                    "environment": "envs.calculator", "max_turns": 3},
                                   {"name": "guess", "path": str(tmp_path / "guess.jsonl"), "prompt_column": "question",
                                    "meta_columns": ["secret", "high"], "environment": "envs.guess", "max_turns": 3,
                                    "max_episode_tokens": 64}]})
    env = {"ROLLOUTS_CONFIG": str(config)}
    metrics, groups = run_watching_groups(tmp_path, r, keys, env)
    assert [m["step"] for m in metrics] == [1, 2]
    by_source = {s: [g for g in groups if g.id.startswith(f"{s}:")] for s in ("calc", "guess")}
    assert by_source["calc"] and by_source["guess"], [g.id for g in groups]
    for g in groups:
        for c in g.completions:
            check_episode(c, env_turns=c.finish != "stop" or len(model_turns(c.loss_mask, c.ids)) > 1)
            assert c.finish in ("stop", "turns", "length") and c.reward_error is None
    # A guessing episode ends after one model turn only when that guess was right (reward 1); the
    # random tiny model seldom guesses right (1 in 20), so episodes go on with the game's hints.
    guesses = [(len(model_turns(c.loss_mask, c.ids)), c.reward) for g in by_source["guess"] for c in g.completions]
    assert all(turns >= 2 or reward == 1.0 for turns, reward in guesses), guesses
    assert any(turns >= 2 for turns, _ in guesses), guesses
    # The trainer's length counts the model's tokens only.
    step1 = [g for g in groups if g.id in metrics[0]["group_ids"]]
    model_tokens = [sum(c.loss_mask) for g in step1 for c in g.completions]
    assert metrics[0]["completions/mean_length"] == pytest.approx(sum(model_tokens) / len(model_tokens))
    check_trained_ids_are_sampled([g for g in groups if g.version == 0], tiny_model)


def test_an_episode_in_flight_when_its_generator_dies_is_restarted_from_its_prompt(tiny_model, tmp_path,
                                                                                  redis_url, r):
    keys = Keys("re")
    write_config(tmp_path / "run.toml", run="re", redis_url=redis_url, model=tiny_model, base={},
                 rollout={"max_new_tokens": 4}, generator={"engine": "hf", "threads": 1, "claim_idle_s": 1.0},
                 data={"sources": [{"name": "once", "kind": "arithmetic", "environment": "tests.env_fixtures:HangOnce",
                                    "turn_timeout_s": 600}]})
    marker = tmp_path / "hung"
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    r.xadd(keys.prompts, {PAYLOAD: encode(prompt("once:0:0", {"source": "once", "marker": str(marker)}))})
    env = {"ROLLOUTS_CONFIG": str(tmp_path / "run.toml")}
    g1 = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=tmp_path / "g1.log")
    try:
        # g1 is in the middle of the episode: a model turn taken, its environment step hanging
        wait_for(marker.exists, timeout=120, what="g1's episode in its environment step", procs=[g1])
        g1.kill()
        g1.wait()
        assert r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 1 and r.xlen(keys.samples) == 0
        g2 = spawn("generators", "--id", "g2", cwd=tmp_path, env=env, log=tmp_path / "g2.log")
        try:
            wait_for(lambda: r.xlen(keys.samples) == 1, timeout=120, what="g2's group", procs=[g2])
        finally:
            assert stop(g2) == 0, (tmp_path / "g2.log").read_text()[-3000:]
    finally:
        stop(g1)
    (group,) = [decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)]
    assert group.generator == "g2" and group.id == "once:0:0"
    for c in group.completions:  # whole episodes, each from the prompt: one model turn, then done
        assert (c.finish, c.reward, c.loss_mask.tolist()) == ("stop", 1.0, [True] * len(c.ids))
    assert r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0


def test_an_environment_turn_the_chat_template_cannot_continue_ends_the_episode_not_the_generator(
        tiny_model, tmp_path, redis_url, r):
    # an environment that answers as the user, under a template that then renders the earlier
    # assistant turn empty: the episode cannot be extended token by token (engines.base.turn_ids)
    keys = Keys("ep")
    model = with_template(tiny_model, tmp_path / "dropping", DROPS_TURNS_BEFORE_THE_USER)
    write_config(tmp_path / "run.toml", run="ep", redis_url=redis_url, model=model, base={},
                 rollout={"max_new_tokens": 6}, generator={"engine": "hf", "threads": 1, "env_workers": 1},
                 data={"sources": [{"name": "chat", "kind": "arithmetic", "environment": "tests.env_fixtures:Chat",
                                    "max_turns": 3}]})
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    for i in range(2):
        r.xadd(keys.prompts, {PAYLOAD: encode(prompt(f"chat:0:{i}", {"source": "chat", "answer": 3}))})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(tmp_path / "run.toml")},
                 log=log)
    try:
        wait_for(lambda: r.xlen(keys.samples) >= 2, timeout=180, what="both groups", procs=[proc])
        assert proc.poll() is None, "the generator died"
    finally:
        assert stop(proc) == 0, log.read_text()[-3000:]
    groups = [decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)]
    for c in (c for g in groups for c in g.completions):
        check_episode(c, env_turns=False)  # the model's first turn, then the end
        assert c.finish == "abort" and c.reward == 0.0, c
        assert c.reward_error.startswith("environment turn 1: the chat template cannot continue the episode: "), c
