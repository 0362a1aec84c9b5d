"""Streams are trimmed of what every consumer group has acknowledged, so a long run's memory stays
bounded; the trainer's set of trained ids is bounded too."""

import random
import time

import torch
from transformers import AutoModelForCausalLM

from common.keys import GENERATORS_GROUP, PAYLOAD, Keys
from common.messages import decode_prompt
from common.progress import read_trainer
from common.streams import ensure_group
from common.trim import trim_acknowledged
from generators.prompts import publish
from tests.harness.audit import accounting, assert_accounted
from tests.harness.configs import write_config
from tests.harness.groups import make_group
from tests.harness.pipeline import QUARANTINE_OFF  # the test's groups carry the initial model's log-probs
from tests.harness.processes import spawn, stop


def test_trim_keeps_what_any_group_has_not_acknowledged(r):
    ids = [r.xadd("s", {PAYLOAD: str(i)}) for i in range(10)]
    assert trim_acknowledged(r, "s") == -1 and r.xlen("s") == 10  # no reader yet: nothing goes
    ensure_group(r, "s", "a")
    ensure_group(r, "s", "recorder")
    entries = r.xreadgroup("a", "c", {"s": ">"}, count=5)[0][1]
    r.xack("s", "a", *[e[0] for e in entries[:3]])
    assert trim_acknowledged(r, "s") == 0  # the recorder has read nothing
    r.xreadgroup("recorder", "c", {"s": ">"})
    r.xack("s", "recorder", *ids)
    assert trim_acknowledged(r, "s") == 3  # a's 4th entry is still pending
    assert r.xrange("s", count=1)[0][0] == ids[3]
    r.xack("s", "a", *[e[0] for e in entries[3:]])
    assert trim_acknowledged(r, "s") == 2  # the rest was never delivered to a
    assert [e[0] for e in r.xrange("s")] == ids[5:]
    assert [g["lag"] for g in r.xinfo_groups("s")] == [5, 0]


def test_a_long_run_keeps_its_streams_and_trained_set_bounded(tmp_path, redis_url, r, tiny_model):
    """The real producer and trainer for 24 steps; the test plays the generator (a group per
    prompt, written with the prompt's acknowledgement by the generator's own `publish`)."""
    steps, per_step, window = 24, 2, 3
    keys = Keys("long")
    config = tmp_path / "long.toml"
    write_config(config, run="long", redis_url=redis_url, output_dir=tmp_path / "out", model=tiny_model, base={},
                 rollout={"group_size": 4, "prompts_per_step": per_step, "max_staleness": 1},
                 trainer={"lr": 1e-4, "max_steps": steps, "micro_batch_size": 8, "threads": 1, "keep_checkpoints": 2,
                          "dedup_window": window, **QUARANTINE_OFF})
    env = {"ROLLOUTS_CONFIG": str(config)}
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(0)
    ensure_group(r, keys.prompts, GENERATORS_GROUP)
    producer = spawn("producers", cwd=tmp_path, env=env, log=tmp_path / "producer.log")
    trainer = spawn("trainer", cwd=tmp_path, env=env, log=tmp_path / "trainer.log")
    longest = {"prompts": 0, "samples": 0, "trained": 0}
    try:
        deadline = time.monotonic() + 300
        while trainer.poll() is None:
            assert time.monotonic() < deadline and producer.poll() is None, (tmp_path / "trainer.log").read_text()
            got = r.xreadgroup(GENERATORS_GROUP, "test", {keys.prompts: ">"}, count=per_step, block=100)
            for entry_id, fields in (got[0][1] if got else []):
                task = decode_prompt(fields[PAYLOAD])
                group = make_group(model, task.id, version=read_trainer(r, keys).version, rng=rng)
                publish(r, keys=keys, entry_id=entry_id, group=group)  # the generator's own write
            for name, key in (("prompts", keys.prompts), ("samples", keys.samples)):
                longest[name] = max(longest[name], r.xlen(key))
            longest["trained"] = max(longest["trained"], r.zcard(keys.trained))
        assert trainer.returncode == 0, (tmp_path / "trainer.log").read_text()
    finally:
        assert stop(producer) == 0, (tmp_path / "producer.log").read_text()
        stop(trainer)

    acc = accounting(r, keys)
    print(f"\nlong run: {acc}, longest {longest}")
    assert acc["trained"] == steps * per_step
    assert_accounted(acc)
    # Admission keeps at most (max_staleness + 1) steps of prompts ahead of the trainer, and the
    # producer trims acknowledged prompts every second; the trainer trims samples at every publish.
    # Every trained prompt was admitted, and admission ran at most (max_staleness + 1) steps ahead
    # (the producer may be stopped before it admits past the last step: exactly as many is right).
    assert steps * per_step <= acc["prompt_entries"] <= (steps + 2) * per_step, acc
    assert longest["prompts"] <= 30 and longest["samples"] <= 10, longest
    assert longest["trained"] <= (window + 1) * per_step, longest
