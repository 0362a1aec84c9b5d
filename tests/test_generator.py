"""The generator process, on either engine: prompts in, scored groups out, weights followed, rewards that
fail, dynamic sampling. The engines themselves: tests/test_engines.py."""

from __future__ import annotations

import re
import shutil
import time

import pytest
import torch
from safetensors.torch import load_file

from common.checkpoints import CheckpointError, checksum_dir, verify_dir
from common.heartbeats import read_counters, read_heartbeat
from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import WeightVersion, decode_group, encode
from common.progress import add_outstanding, count_outstanding, read_dropped
from tests.harness.configs import write_config
from tests.harness.groups import ask, read_groups
from tests.harness.models import perturbed_copy, publish_weights
from tests.harness.needs import need
from tests.harness.processes import spawn, stop, wait_for


def test_the_verifier_refuses_a_checkpoint_unlike_the_one_published(tiny_model, tmp_path):
    ckpt = shutil.copytree(tiny_model, tmp_path / "step_1")
    sums = checksum_dir(ckpt)
    verify_dir(ckpt, sums)  # as published: accepted
    refusals = {  # what the announcement or the directory says: what the verifier answers
        "a directory that is not there": (tmp_path / "step_9", sums, "step_9 does not exist"),
        "a file name with a path in it": (ckpt, {**sums, "../model.safetensors": sums["model.safetensors"]},
                                          "'../model.safetensors' is not a plain name"),
        "a published file missing": (ckpt, {**sums, "extra.safetensors": "0" * 64}, "extra.safetensors is missing"),
    }
    for what, (path, published, said) in refusals.items():
        with pytest.raises(CheckpointError, match=re.escape(said)):
            verify_dir(path, published)
            pytest.fail(f"{what} was accepted")
    blob = bytearray((ckpt / "model.safetensors").read_bytes())
    blob[-100] ^= 0xFF  # one flipped byte
    (ckpt / "model.safetensors").write_bytes(bytes(blob))
    with pytest.raises(CheckpointError, match="model.safetensors has checksum"):
        verify_dir(ckpt, sums)
    # published without safetensors (pickled weights only), its checksums right: refused all the same
    pickled = shutil.copytree(tiny_model, tmp_path / "step_2")
    torch.save(load_file(pickled / "model.safetensors"), pickled / "pytorch_model.bin")
    (pickled / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \.safetensors file among \[.*'pytorch_model\.bin'"):
        verify_dir(pickled, checksum_dir(pickled))


# ---------------------------------------------------------------------- the process


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_generator_process_turns_prompts_into_groups_and_follows_weights(engine, tiny_model, tmp_path, redis_url, r):
    need(engine)
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
        first = read_groups(r, keys)
        assert sorted(g.id for g in first) == [f"arithmetic:0:{i}" for i in range(4)]
        for g in first:
            assert g.version == 0 and g.generator == "g1" and g.engine == engine
            assert len(g.completions) == 3 and g.prompt_id == g.id
            assert all(1 <= len(c.ids) <= 8 and c.reward in (0.0, 1.0) for c in g.completions)
        wait_for(lambda: r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0, timeout=10,
                 what="no pending prompts", procs=[proc])
        dead = r.xrange(keys.prompts_dead)
        assert len(dead) == 1 and dead[0][1][b"entry_id"] == garbage and dead[0][1][b"reason"]
        beat = wait_for(lambda: (b := read_heartbeat(r, keys, "g1")) and b.groups == 4 and b, timeout=10,
                        what="heartbeat of 4 groups", procs=[proc])
        assert beat.version == 0 and beat.engine == engine
        assert 0 < r.ttl(hb) <= 30

        # -- version 1 published: loaded at the next safe point, stamped on later groups
        ckpt = tmp_path / "checkpoints"
        step_1 = perturbed_copy(tiny_model, ckpt / "step_1", seed=1)
        publish_weights(r, keys, WeightVersion(version=1, step=1, path=str(step_1), format="safetensors",
                                               checksums=checksum_dir(step_1), created_at=time.time()))
        wait_for(lambda: read_heartbeat(r, keys, "g1").version == 1, timeout=30, what="heartbeat version 1",
                 procs=[proc])
        for i in range(4, 6):
            r.xadd(keys.prompts, {PAYLOAD: encode(ask(i))})
        wait_for(lambda: r.xlen(keys.samples) >= 6, timeout=60, what="6 groups", procs=[proc])
        assert [g.version for g in read_groups(r, keys)[4:]] == [1, 1]

        # -- version 2 fails its checksum: refused, version 1 kept
        step_2 = perturbed_copy(tiny_model, ckpt / "step_2", seed=2)
        sums = checksum_dir(step_2) | {"model.safetensors": "0" * 64}
        publish_weights(r, keys, WeightVersion(version=2, step=2, path=str(step_2), format="safetensors",
                                               checksums=sums, created_at=time.time()))
        wait_for(lambda: read_heartbeat(r, keys, "g1").weights_refused >= 1, timeout=30,
                 what="weights refused", procs=[proc])
        for i in range(6, 8):
            r.xadd(keys.prompts, {PAYLOAD: encode(ask(i))})
        wait_for(lambda: r.xlen(keys.samples) >= 8, timeout=60, what="8 groups", procs=[proc])
        assert [g.version for g in read_groups(r, keys)[6:]] == [1, 1]
        beat = read_heartbeat(r, keys, "g1")
        assert beat.version == 1 and "checksum" in beat.last_refusal
        assert beat.weights_refused == 1, "a refused version is not re-checked every pass"
    finally:
        code = stop(proc)
    output = log.read_text()
    assert code == 0, output
    assert "loaded weights version 1" in output and "refused weights" in output
    assert r.xlen(keys.samples) == 8 and r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0
    assert not r.exists(hb), "a clean exit removes its heartbeat"
    assert b"g1" not in [c["name"] for c in r.xinfo_consumers(keys.prompts, GENERATORS_GROUP)], \
        "and its consumer: it is not listed as dead"


@pytest.mark.parametrize("engine", ["hf", "vllm"])
def test_a_late_generator_starts_from_the_latest_weights(engine, tiny_model, tmp_path, redis_url, r):
    need(engine)
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
    [group] = read_groups(r, keys)
    assert group.version == 3 and len(group.completions) == 2


# ---------------------------------------------------------------------- rewards that fail, dynamic sampling


def source_config(tmp_path, redis_url, tiny_model, *, run: str, reward: str, **generator) -> dict:
    return write_config(tmp_path / f"{run}.toml", run=run, redis_url=redis_url, model=tiny_model, base={},
                        rollout={"max_new_tokens": 4},
                        generator={"engine": "hf", "threads": 1, "reward_timeout_s": 1.0, **generator},
                        data={"sources": [{"name": "arithmetic", "kind": "arithmetic", "reward": reward}]})


def test_rewards_that_raise_or_hang_are_recorded_errors_and_the_generator_goes_on(tiny_model, tmp_path, redis_url, r):
    # tests.reward_fixtures:by_mood raises, hangs or scores, as meta["mood"] says
    keys = Keys("moody")
    env = source_config(tmp_path, redis_url, tiny_model, run="moody", reward="tests.reward_fixtures:by_mood")
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    moods = ["raise", "hang", "ok", "hang", "ok"]
    for i, mood in enumerate(moods):
        task = ask(i, n=2)
        task = type(task)(**{**{f: getattr(task, f) for f in task.__slots__}, "meta": {**task.meta, "mood": mood}})
        r.xadd(keys.prompts, {PAYLOAD: encode(task)})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: r.xlen(keys.samples) >= len(moods), timeout=120, what="every group", procs=[proc])
        wait_for(lambda: read_heartbeat(r, keys, "g1").reward_errors == 6, timeout=15,
                 what="6 reward errors in the heartbeat", procs=[proc])
        from common.cli import status_lines

        assert any(line.startswith("generator  g1  hf") and line.endswith("reward errors 6")
                   for line in status_lines(r, "moody")), status_lines(r, "moody")
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()
    by_mood = {moods[int(g.id.split(":")[-1])]: g for g in read_groups(r, keys)}
    assert all(c.reward == 0.0 and c.reward_error.startswith("ValueError") for c in by_mood["raise"].completions)
    assert all(c.reward == 0.0 and c.reward_error.startswith("timeout after 1") for c in by_mood["hang"].completions)
    assert all(c.reward_error is None for c in by_mood["ok"].completions)
    assert r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0, "every prompt acknowledged with its group"


def test_dynamic_sampling_drops_groups_without_reward_variance_and_counts_them(tiny_model, tmp_path, redis_url, r):
    # tests.reward_fixtures:half scores every completion 0.5: no group has any variance
    keys = Keys("ds")
    env = source_config(tmp_path, redis_url, tiny_model, run="ds", reward="tests.reward_fixtures:half",
                        drop_zero_variance=True)
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    add_outstanding(r, keys, [ask(i, n=2).id for i in range(4)])  # as the producer admits them
    for i in range(4):
        r.xadd(keys.prompts, {PAYLOAD: encode(ask(i, n=2))})
    log = tmp_path / "generator.log"
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env=env, log=log)
    try:
        wait_for(lambda: read_counters(r, keys).groups_dropped_zero_variance == 4, timeout=120,
                 what="4 groups dropped", procs=[proc])
    finally:
        code = stop(proc)
    assert code == 0, log.read_text()
    assert r.xlen(keys.samples) == 0 and r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0
    assert read_dropped(r, keys) == 4, "the producer admits one more prompt for each dropped group"
    assert count_outstanding(r, keys) == 0


def test_held_prompts_are_touched_so_live_generators_do_not_reclaim_them(r):
    from generators.prompts import take_prompts, touch_held

    stream = Keys("touch").prompts
    r.xgroup_create(stream, GENERATORS_GROUP, id="0", mkstream=True)
    ids = [r.xadd(stream, {PAYLOAD: b"x"}) for _ in range(4)]
    assert len(r.xreadgroup(GENERATORS_GROUP, "a", {stream: ">"}, count=4)[0][1]) == 4
    # idle times set, not waited for: a last touched its prompts a minute ago; b took one over (a
    # was thought dead) and has not touched it since. a holds the first three in memory; the
    # fourth is pending for a but not held (its acknowledgement was lost with Redis's last second)
    r.xclaim(stream, GENERATORS_GROUP, "a", 0, ids, idle=60_000)
    r.xclaim(stream, GENERATORS_GROUP, "b", 0, [ids[0]], idle=60_000)
    held = [i.decode() for i in ids[:3]]
    assert touch_held(r, stream=stream, consumer="a", held=held) == 2, "only what is still its own"
    taken = take_prompts(r, stream=stream, consumer="c", count=4, claim_idle_ms=30_000, wait=False)
    assert [entry_id for entry_id, _ in taken] == [ids[0], ids[3]], "c reclaims what was not touched, and only that"
    owners = {e["message_id"]: e["consumer"] for e in r.xpending_range(stream, GENERATORS_GROUP, "-", "+", 10)}
    assert owners == {ids[0]: b"c", ids[1]: b"a", ids[2]: b"a", ids[3]: b"c"}


def test_a_held_prompt_reclaimed_by_its_own_generator_is_not_sampled_twice(tiny_model, tmp_path, redis_url, r):
    """A generator whose touches fall behind (a loaded machine) can take back, through its own
    claim of idle prompts, a prompt it still holds: it must not sample it a second time."""
    keys = Keys("self")
    config = tmp_path / "self.toml"
    write_config(config, run="self", redis_url=redis_url, model=tiny_model, base={}, rollout={"max_new_tokens": 4},
                 generator={"engine": "hf", "threads": 1, "batch_prompts": 1, "claim_idle_s": 30,
                            "reward_timeout_s": 600},
                 data={"sources": [{"name": "arithmetic", "kind": "arithmetic",
                                    "reward": "tests.reward_fixtures:gated"}]})
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    gate = tmp_path / "gate"  # its rewards wait until the test opens it: the prompt stays held until then
    task = ask(0, n=2)
    task = type(task)(**{**{f: getattr(task, f) for f in task.__slots__}, "meta": {**task.meta, "gate": str(gate)}})
    entry = r.xadd(keys.prompts, {PAYLOAD: encode(task)})
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(config)},
                 log=tmp_path / "generator.log")

    def taken_back_by_g1() -> bool:
        """Whether g1's claim of idle prompts has taken the prompt back: XAUTOCLAIM counts a
        delivery, g1's touches do not. Until then the prompt is kept looking a minute idle, as if
        g1 had not touched it for that long (a touch may reset it between two of g1's claims),
        with its delivery count at 1."""
        [pending] = r.xpending_range(keys.prompts, GENERATORS_GROUP, "-", "+", 1)
        if pending["times_delivered"] > 1:
            return True
        r.xclaim(keys.prompts, GENERATORS_GROUP, "g1", 0, [entry], idle=60_000, retrycount=1)
        return False

    try:
        wait_for(lambda: r.xpending_range(keys.prompts, GENERATORS_GROUP, "-", "+", 1, consumername="g1"),
                 timeout=120, what="g1 holding the prompt", procs=[proc])
        wait_for(taken_back_by_g1, timeout=120, what="g1 claiming its own idle prompt", procs=[proc])
        gate.touch()
        wait_for(lambda: r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0 and r.xlen(keys.samples),
                 timeout=120, what="the prompt's group written", procs=[proc])
    finally:
        gate.touch()
        # The first signal drains: a second sampling of the prompt, had it been started, is
        # sampled, scored and written (or fails) before the generator exits.
        code = stop(proc, timeout=120)
    assert code == 0, (tmp_path / "generator.log").read_text()[-3000:]
    assert [decode_group(f[PAYLOAD]).id for _, f in r.xrange(keys.samples)] == [task.id]
