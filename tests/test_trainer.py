"""The trainer process against a real Redis, fed with sample groups the test writes itself."""

import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import msgpack
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from common.checkpoints import verify_dir
from common.keys import PAYLOAD, TRAINER_GROUP, Keys
from common.messages import decode_weights, encode
from common.progress import TrainerProgress, read_gone_back, read_trainer
from tests.harness.configs import write_config
from tests.harness.groups import make_group, xadd
from tests.harness.metrics import read_steps
from tests.harness.pipeline import train_groups
from tests.harness.processes import ROOT, spawn, wait_for

RUN = "t"
KEYS = Keys(RUN)
METRIC_FIELDS = [
    "step", "reward", "reward_std", "accuracy", "frac_reward_zero_std", "completions/mean_length",
    "completions/max_length", "completions/clipped_ratio", "loss", "grad_norm", "learning_rate", "staleness/mean",
    "staleness/max", "groups/dropped_stale", "groups/dead", "tokens_per_s", "time/step",
    "time/wait_data", "time/publish", "version", "group_ids", "entropy", "kl", "clip_ratio/low_mean",
    "clip_ratio/high_mean", "tis/mean",
]


def test_trainer_trains_publishes_and_dead_letters(tmp_path, redis_url, r, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    vocab = model.config.vocab_size
    rng = random.Random(0)
    good = [make_group(model, f"g{i}", version=0 if i < 4 else 1, rng=rng) for i in range(6)]
    wrong_schema = msgpack.unpackb(encode(good[0]), raw=False)
    wrong_schema["v"] = 99
    out_of_vocab = make_group(model, "oov", version=0, rng=rng)
    out_of_vocab.completions[1].ids[0] = vocab + 5
    lonely = make_group(model, "lonely", version=0, rng=rng, n=1)
    stale = make_group(model, "stale", version=0, rng=rng)

    # Read in this order, two trainable groups per step: step 0 takes g0 g1 (and dead-letters the
    # two entries between them), step 1 g2 g3 (three more dead, the duplicate of g2 skipped), step 2
    # drops `stale` (2 - 0 > max_staleness 1) and takes g4 g5.
    xadd(r, KEYS, encode(good[0]))
    xadd(r, KEYS, b"\xc1 not msgpack")
    xadd(r, KEYS, msgpack.packb(wrong_schema, use_bin_type=True))
    xadd(r, KEYS, encode(good[1]))
    xadd(r, KEYS, encode(out_of_vocab))
    r.xadd(KEYS.samples, {b"other": b"x"})
    xadd(r, KEYS, encode(good[2]))
    xadd(r, KEYS, encode(good[2]))
    xadd(r, KEYS, encode(lonely))
    xadd(r, KEYS, encode(good[3]))
    xadd(r, KEYS, encode(stale))
    xadd(r, KEYS, encode(good[4]))
    xadd(r, KEYS, encode(good[5]))

    proc = train_groups(tmp_path, redis_url, tiny_model, run=RUN)
    assert len([line for line in proc.stdout.splitlines() if line.startswith("step ")]) == 3
    # trainer.activation_checkpointing "auto" resolved at start-up, said with its figures: off on a CPU
    assert re.search(r"^trainer: activation checkpointing off \(auto: off on the cpu; about [\d.e+-]+ GiB without "
                     r"it\)$", proc.stdout, re.M), proc.stdout[:2000]

    # Malformed entries are dead letters whose reason names the problem.
    reasons = [fields[b"reason"].decode() for _, fields in r.xrange(KEYS.samples_dead)]
    assert len(reasons) == 5, reasons
    assert "not MessagePack" in reasons[0]
    assert "schema version 99" in reasons[1]
    assert "token id out of range" in reasons[2]
    assert "no payload field" in reasons[3]
    assert "at least 2" in reasons[4]

    # Progress, every valid group trained once, nothing left pending.
    assert read_trainer(r, KEYS) == TrainerProgress(step=3, version=3, state_step=3, groups_trained=6, groups_dead=5,
                                                    groups_duplicate=1, groups_dropped_stale=1)
    assert {m.decode() for m in r.zrange(KEYS.trained, 0, -1)} == {g.id for g in good}
    assert r.xpending(KEYS.samples, TRAINER_GROUP)["pending"] == 0

    # Checkpoints: the newest two kept, complete HF directories matching their checksums.
    ckpt = tmp_path / "out" / "checkpoints"
    assert sorted(p.name for p in ckpt.iterdir()) == ["step_2", "step_3"]
    versions = [decode_weights(fields[PAYLOAD]) for _, fields in r.xrange(KEYS.weights)]
    assert [v.version for v in versions] == [1, 2, 3]
    latest = decode_weights(r.get(KEYS.weights_latest))
    assert latest == versions[-1] and Path(latest.path) == (ckpt / "step_3").resolve()
    for v in versions[1:]:
        verify_dir(v.path, v.checksums)
    trained = AutoModelForCausalLM.from_pretrained(latest.path, dtype=torch.float32)
    assert AutoTokenizer.from_pretrained(latest.path).chat_template
    before, after = model.state_dict(), trained.state_dict()
    assert before.keys() == after.keys()
    assert any(not torch.equal(before[k], after[k]) for k in before)

    # Metrics: one line per step; the first step's ratio is 1 (its behaviour log-probs are ours).
    lines = read_steps(tmp_path / "out" / "metrics.jsonl")
    assert [m["step"] for m in lines] == [1, 2, 3]
    for m in lines:
        assert set(METRIC_FIELDS) <= m.keys(), set(METRIC_FIELDS) - m.keys()
    assert lines[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-4)
    assert [m["group_ids"] for m in lines] == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]]
    assert [m["groups/dead"] for m in lines] == [2, 3, 0]
    assert [m["groups/duplicate"] for m in lines] == [0, 1, 0]
    assert [m["groups/dropped_stale"] for m in lines] == [0, 0, 1]
    assert [m["staleness/max"] for m in lines] == [0, 1, 1]
    assert r.xlen(KEYS.metrics) == 3


def test_restarted_trainer_resumes_and_never_retrains_a_group(tmp_path, redis_url, r, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(1)
    first = [make_group(model, f"a{i}", version=0, rng=rng) for i in range(2)]
    for g in first:
        xadd(r, KEYS, encode(g))
    train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=1)
    assert read_trainer(r, KEYS).step == 1

    # The same group again (a redelivery), then two new ones: only the new ones are trained.
    xadd(r, KEYS, encode(first[0]))
    for i in range(2):
        xadd(r, KEYS, encode(make_group(model, f"b{i}", version=1, rng=rng)))
    proc = train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=2)
    assert "resuming at step 1" in proc.stdout
    lines = read_steps(tmp_path / "out" / "metrics.jsonl")
    assert [(m["step"], m["group_ids"]) for m in lines] == [(1, ["a0", "a1"]), (2, ["b0", "b1"])]
    assert read_trainer(r, KEYS).groups_duplicate == 1
    assert read_trainer(r, KEYS).groups_trained == 4
    assert decode_weights(r.get(KEYS.weights_latest)).version == 2
    assert r.xpending(KEYS.samples, TRAINER_GROUP)["pending"] == 0


def test_a_trainer_gone_back_to_an_older_state_drops_groups_sampled_with_the_weights_it_abandoned(
        tmp_path, redis_url, r, tiny_model):
    """Versions 3 and 4 were published, then the trainer stopped before saving a state past step 2
    (state_every above sync_every): restarted, it publishes steps 3 and 4 again with other weights.
    Groups stamped 3 or 4 before then were sampled with the abandoned weights: dropped as stale,
    counted. A version never published in the run (a replayed recording's) is trained as before."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(5)
    for i in range(4):
        xadd(r, KEYS, encode(make_group(model, f"a{i}", version=0, rng=rng)))
    train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=2)
    r.hset(KEYS.trainer, mapping={"step": 4, "version": 4})  # what the stopped incarnation had published
    for gid, version in (("x0", 3), ("x1", 4), ("y0", 2), ("y1", 2), ("w0", 9), ("w1", 9)):
        xadd(r, KEYS, encode(make_group(model, gid, version=version, rng=rng)))
    proc = train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=4)
    assert "resuming at step 2, below version 4 it had published" in proc.stdout
    lines = read_steps(tmp_path / "out" / "metrics.jsonl")
    assert [(m["step"], m["group_ids"]) for m in lines[2:]] == [(3, ["y0", "y1"]), (4, ["w0", "w1"])]
    progress = read_trainer(r, KEYS)
    assert (progress.groups_dropped_stale, progress.version, progress.version_max) == (2, 4, 4)
    assert r.xpending(KEYS.samples, TRAINER_GROUP)["pending"] == 0


def test_groups_of_abandoned_weights_are_dropped_after_the_trainer_passed_their_version_again(
        tmp_path, redis_url, r, tiny_model):
    """Version 3 was published, then the trainer went back to its state of step 2 and published a
    new version 3, with other weights. Groups stamped 3 that reach it only at step 3 are told apart
    by when their weights were published: those of the abandoned 3 are dropped as stale (counted),
    those of the new 3 are trained. By number alone both are one step old."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(6)
    for i in range(4):
        xadd(r, KEYS, encode(make_group(model, f"a{i}", version=0, rng=rng)))
    train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=2)
    abandoned_at = time.time()  # when the stopped incarnation published versions 3 and 4
    r.hset(KEYS.trainer, mapping={"step": 4, "version": 4})
    for gid in ("y0", "y1"):
        xadd(r, KEYS, encode(make_group(model, gid, version=2, rng=rng)))
    proc = train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=3)
    assert "resuming at step 2, below version 4 it had published" in proc.stdout
    again = decode_weights(r.get(KEYS.weights_latest))
    [gone] = read_gone_back(r, KEYS)
    assert (again.version, gone.step, gone.upto) == (3, 2, 4)
    assert again.created_at >= gone.at > abandoned_at and (again.gone_back_step, again.gone_back_at) == (2, gone.at)
    for gid, published_at in (("x0", abandoned_at), ("x1", abandoned_at), ("n0", again.created_at),
                              ("n1", again.created_at)):
        xadd(r, KEYS, encode(replace(make_group(model, gid, version=3, rng=rng), published_at=published_at)))
    train_groups(tmp_path, redis_url, tiny_model, run=RUN, max_steps=4)
    lines = read_steps(tmp_path / "out" / "metrics.jsonl")
    assert [(m["step"], m["group_ids"]) for m in lines[2:]] == [(3, ["y0", "y1"]), (4, ["n0", "n1"])]
    assert read_trainer(r, KEYS).groups_dropped_stale == 2
    assert r.xpending(KEYS.samples, TRAINER_GROUP)["pending"] == 0


def test_sigterm_publishes_unpublished_steps_and_exits_0(tmp_path, redis_url, r, tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(2)
    groups = [make_group(model, f"c{i}", version=0, rng=rng) for i in range(4)]
    for g in groups:
        xadd(r, KEYS, encode(g))
    # sync_every 5 and no step limit: two steps are trained but not yet published when the
    # trainer waits for data; a stop then publishes them before exiting.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    env.update(write_config(tmp_path / "rollouts.toml", run=RUN, redis_url=redis_url, output_dir=tmp_path / "out",
                            model=tiny_model, base={}, rollout={"prompts_per_step": 2, "max_staleness": 4},
                            trainer={"sync_every": 5, "threads": 1}), PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-m", "trainer"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics = tmp_path / "out" / "metrics.jsonl"
        deadline = time.monotonic() + 120
        while len(read_steps(metrics)) != 2:
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        assert read_trainer(r, KEYS).version == 0 and r.zcard(KEYS.trained) == 0
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, stderr
    assert "SIGTERM" in stderr and "stopped at step 2" in stdout
    assert decode_weights(r.get(KEYS.weights_latest)).version == 2
    assert {m.decode() for m in r.zrange(KEYS.trained, 0, -1)} == {g.id for g in groups}
    assert r.xpending(KEYS.samples, TRAINER_GROUP)["pending"] == 0


def test_kl_to_the_initial_model_and_reward_errors_reach_the_metrics(tmp_path, redis_url, r, tiny_model):
    """kl_coef > 0 in a real trainer process: the reference model is loaded and used (its KL is 0
    while the policy is still the initial model, then grows); completions whose reward failed are
    counted in `reward/errors`."""
    from dataclasses import replace

    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(3)
    groups = [make_group(model, f"g{i}", version=0, rng=rng) for i in range(6)]
    failed = {"g0": [1], "g3": [0, 2], "g5": [1, 2, 3]}  # group: completions whose reward raised
    for i, g in enumerate(groups):
        bad = failed.get(g.id, [])
        completions = [replace(c, reward=0.0, rewards={}, reward_error="ValueError: no good") if j in bad else c
                       for j, c in enumerate(g.completions)]
        xadd(r, KEYS, encode(replace(g, version=min(i // 2, 1), completions=completions)))
    train_groups(tmp_path, redis_url, tiny_model, run=RUN, lr=1e-2, loss={"kl_coef": 0.5, "kl_estimator": "k3"})
    lines = read_steps(tmp_path / "out" / "metrics.jsonl")
    assert [m["group_ids"] for m in lines] == [["g0", "g1"], ["g2", "g3"], ["g4", "g5"]]
    assert [m["reward_errors"] for m in lines] == [1, 2, 3]
    kl = [m["kl"] for m in lines]
    assert kl[0] == pytest.approx(0.0, abs=1e-7), kl  # the policy is the reference before its first update
    assert kl[1] > 1e-5 and kl[2] > kl[1], kl  # then moves away from it, and further


def test_a_configuration_that_would_stall_is_refused_at_start(tmp_path, redis_url):
    # sync_every 3 > max_staleness 1 + 1: after two steps every group would be dropped as stale
    # before the next publish, and the run would wait for ever. The trainer (and every process
    # reading the same config) refuses it at start-up, naming both fields on one line.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ROLLOUTS_")}
    env.update(write_config(tmp_path / "rollouts.toml", run=RUN, redis_url=redis_url, output_dir=tmp_path / "out",
                            base={}, rollout={"max_staleness": 1}, trainer={"sync_every": 3}), PYTHONPATH=str(ROOT))
    for process in ("trainer", "producers"):
        try:
            proc = subprocess.run([sys.executable, "-m", process], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{process} started with sync_every 3 > max_staleness 1 + 1 instead of refusing it")
        assert proc.returncode != 0
        named = [line for line in proc.stderr.splitlines()
                 if "trainer.sync_every" in line and "rollout.max_staleness" in line]
        assert len(named) == 1, proc.stderr


def test_entries_delivered_to_the_trainer_in_a_lost_reply_are_read_again(tmp_path, redis_url, r, tiny_model):
    """A read whose reply never reached the trainer (a socket timeout, retried by the client) leaves
    entries pending under its consumer name that it never saw: it finds and trains them, and
    nothing stays pending to hold back the trimming of the stream."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(5)
    groups = [make_group(model, f"s{i}", version=0, rng=rng) for i in range(8)]
    for g in groups[:4]:
        xadd(r, KEYS, encode(g))
    env = write_config(tmp_path / "rollouts.toml", run=RUN, redis_url=redis_url, output_dir=tmp_path / "out",
                       model=tiny_model, base={}, rollout={"group_size": 4, "prompts_per_step": 2, "max_staleness": 8},
                       trainer={"max_steps": 4, "micro_batch_size": 4, "lr": 1e-3, "threads": 1,
                                "keep_checkpoints": 2})
    proc = spawn("trainer", cwd=tmp_path, env=env, log=tmp_path / "trainer.log")
    try:
        wait_for(lambda: read_trainer(r, KEYS).step >= 2, timeout=180, what="step 2", procs=[proc])
        # two groups delivered to rank0 whose reply is lost: read under its name, in the same
        # transaction that adds them (a blocked reader is served only after EXEC)
        pipe = r.pipeline(transaction=True)
        for g in groups[4:6]:
            pipe.xadd(KEYS.samples, {PAYLOAD: encode(g)})
        pipe.xreadgroup(TRAINER_GROUP, "rank0", {KEYS.samples: ">"}, count=2)
        assert len(pipe.execute()[-1][0][1]) == 2
        for g in groups[6:]:
            xadd(r, KEYS, encode(g))
        assert proc.wait(timeout=180) == 0, (tmp_path / "trainer.log").read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
    trained = {m.decode() for m in r.zrange(KEYS.trained, 0, -1)}
    assert trained == {g.id for g in groups}, (tmp_path / "trainer.log").read_text()[-2000:]
    assert r.xpending(KEYS.samples, TRAINER_GROUP)["pending"] == 0
