"""What a run trained on, kept: every group the trainer trained stays in the run's history
(output_dir/history, Parquet parts) after the samples stream is trimmed of it, and `rollouts view`
finds it there."""

from __future__ import annotations

import random
import re
import threading
from dataclasses import replace

import pyarrow.parquet as pq
import pytest
import torch
from starlette.testclient import TestClient
from transformers import AutoModelForCausalLM

from common.config import LimitsConfig
from common.history import HistoryWriter, history_dir, parts, read_history, rows
from common.keys import Keys
from common.messages import Completion, SampleGroup, decode_group, encode
from common.shaping import completion_advantages
from tests.harness.groups import make_group, xadd
from tests.harness.metrics import read_steps
from tests.harness.pipeline import train_groups
from viewer.app import make_app
from viewer.groups import Advantages, Filters, chosen, from_stream, with_history

RUN = "kept"
KEYS = Keys(RUN)


def group(gid: str, *, generator: str = "gen-a", rewards: tuple[float, ...] = (1.0, 0.0, 1.0)) -> SampleGroup:
    """A group using every field a group has: an episode's loss mask, a reward that failed, a
    completion that went on under newer weights, reward components, timings, its publish time;
    decoded from the wire as the trainer holds it (numpy arrays)."""
    completions = [
        Completion(ids=[11, 12, 13, 14], logprobs=[-0.5, -0.25, -1.5, -0.125], reward=rewards[0],
                   rewards={"correct": rewards[0], "format": 0.5}, finish="stop", text="seventeen",
                   loss_mask=[1, 0, 0, 1], versions=[(0, 3), (2, 4)]),
        Completion(ids=[21, 22], logprobs=[-2.0, -3.0], reward=rewards[1], rewards={"correct": rewards[1]},
                   finish="length", text="twelve"),
        Completion(ids=[31, 32, 33], logprobs=[-0.75, -0.5, -0.25], reward=rewards[2], rewards={},
                   finish="stop", text="é ✓", reward_error="TimeoutError: reward took over 5 s"),
    ]
    g = SampleGroup(id=gid, prompt_id=f"p-{gid}", prompt_ids=[1, 2, 3, 5, 8], version=3, generator=generator,
                    engine="vllm", completions=completions, timings={"generate": 1.25, "reward": 0.5},
                    published_at=1_700_000_000.5)
    return decode_group(encode(g))


def taught(g: SampleGroup) -> SampleGroup:
    """`g` as a teacher scored it (on-policy distillation): its log-prob of each id (0 off the loss
    mask), its name and version."""
    return replace(g, teacher="tiny-teacher", teacher_version="0123456789abcdef", completions=[
        replace(c, teacher_logprobs=[-0.5 * (i + 1) if c.loss_mask is None or c.loss_mask[i] else 0.0
                                     for i in range(len(c.ids))]) for c in g.completions])


def advantages(g: SampleGroup) -> list[float | None]:
    return completion_advantages(g, estimator="grpo")


def test_the_history_gives_back_every_field_of_every_group_it_kept(tmp_path):
    kept = {1: [taught(group("a")), replace(group("b", generator="gen-b"), teacher_error="teacher 't': timeout")],
            2: [group("c", rewards=(0.0, 0.0, 1.0))]}
    writer = HistoryWriter(tmp_path / "history", advantages=advantages)
    for step, groups in kept.items():
        writer.add(step, groups)
    writer.close()

    back = read_history(tmp_path / "history")
    assert [(t.step, t.group.id) for t in back] == [(1, "a"), (1, "b"), (2, "c")]
    for t, g in zip(back, [g for groups in kept.values() for g in groups], strict=True):
        assert t.group == g  # ids, log-probs, text, rewards and components, masks, versions, timings, all
        assert t.group.completions[0].versions == [(0, 3), (2, 4)]
        assert t.group.completions[2].reward_error == "TimeoutError: reward took over 5 s"
        assert (t.group.teacher, t.group.teacher_version, t.group.teacher_error) == (
            g.teacher, g.teacher_version, g.teacher_error)
        for c, want_c in zip(t.group.completions, g.completions, strict=True):
            assert (c.teacher_logprobs is None) == (want_c.teacher_logprobs is None)
            if c.teacher_logprobs is not None:
                assert c.teacher_logprobs.tolist() == list(want_c.teacher_logprobs)
        want = advantages(g)
        assert t.advantages[:2] == pytest.approx(want[:2]) and t.advantages[2] is want[2] is None
        assert t.trained_at > 0
    assert writer.lost == 0

    # the filters the viewer passes: step range, version, generator, mean reward, the newest n, ids to skip
    def ids(**query):
        return [t.group.id for t in read_history(tmp_path / "history", **query)]

    assert ids(min_step=2) == ["c"] and ids(max_step=1) == ["a", "b"] and ids(min_step=3) == []
    assert ids(generator="gen-b") == ["b"] and ids(version=3) == ["a", "b", "c"] and ids(version=2) == []
    assert ids(min_reward=0.5) == ["a", "b"] and ids(max_reward=0.5) == ["c"]
    assert ids(newest=2) == ["b", "c"] and ids(skip={"c"}, newest=1) == ["b"]

    # a part written before the teacher's columns reads as groups no teacher scored
    old = rows(5, [group("d")], advantages=advantages, trained_at=1.0)
    old = old.drop_columns(["teacher", "teacher_error", "teacher_version"])
    pq.write_table(old, tmp_path / "history" / "part-9-steps-5-5.parquet")
    [d] = read_history(tmp_path / "history", min_step=5)
    assert d.group == group("d") and (d.group.teacher, d.group.teacher_version) == ("", "")


def test_a_new_part_begins_every_part_steps_steps_and_before_the_byte_bound(tmp_path):
    writer = HistoryWriter(tmp_path / "by-steps", advantages=advantages, part_steps=2)
    for step in range(1, 6):
        writer.add(step, [group(f"s{step}")])
    writer.close()
    assert [(p.first, p.last) for p in parts(tmp_path / "by-steps")] == [(1, 2), (3, 4), (5, 5)]
    assert [t.group.id for t in read_history(tmp_path / "by-steps")] == [f"s{s}" for s in range(1, 6)]

    one_step = rows(1, [group("x")], advantages=advantages, trained_at=0.0).nbytes  # two steps would exceed it
    writer = HistoryWriter(tmp_path / "by-bytes", advantages=advantages, part_bytes=one_step * 3 // 2)
    for step in range(1, 4):
        writer.add(step, [group(f"b{step}")])
    writer.close()
    found = parts(tmp_path / "by-bytes")
    assert [(p.first, p.last) for p in found] == [(1, 1), (2, 2), (3, 3)]
    assert all(pq.read_metadata(p.path).num_rows == 1 for p in found)


def test_a_step_trained_again_after_a_restart_is_read_from_the_part_written_last(tmp_path):
    before = HistoryWriter(tmp_path, advantages=advantages, part_steps=2)  # kept steps 1-4, then died
    for step in range(1, 5):
        before.add(step, [group(f"old{step}")])
    before.close()
    after = HistoryWriter(tmp_path, advantages=advantages)  # resumed from the state of step 2
    for step in (3, 4, 5):
        after.add(step, [group(f"new{step}")])
    after.close()
    assert [(t.step, t.group.id) for t in read_history(tmp_path)] == [
        (1, "old1"), (2, "old2"), (3, "new3"), (4, "new4"), (5, "new5")]
    assert [t.group.id for t in read_history(tmp_path, min_step=3, max_step=4)] == ["new3", "new4"]


def test_a_part_it_cannot_write_is_said_once_and_counted_and_training_is_never_held_up(tmp_path, capfd):
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    writer = HistoryWriter(blocked / "history", advantages=advantages, part_steps=1)
    for step in range(1, 4):
        writer.add(step, [group(f"g{step}")])
    writer.close()
    assert writer.lost == 3
    said = [line for line in capfd.readouterr().err.splitlines() if "history" in line]
    assert len(said) == 1 and "the groups of step 1 are not kept" in said[0] and "a-file" in said[0], said

    # a writer behind by `queued` steps: the next step is lost at once, not waited for
    entered, release = threading.Event(), threading.Event()

    def slow(g: SampleGroup) -> list[float | None]:
        entered.set()
        assert release.wait(timeout=120), "never released"
        return advantages(g)

    writer = HistoryWriter(tmp_path / "behind", advantages=slow, queued=1)
    writer.add(1, [group("first")])
    assert entered.wait(timeout=120)  # the thread holds step 1
    writer.add(2, [group("queued")])  # the one place in the queue
    writer.add(3, [group("lost")])  # returns at once: lost
    assert writer.lost == 1
    release.set()
    writer.close()
    assert [t.group.id for t in read_history(tmp_path / "behind")] == ["first", "queued"]


def test_every_group_a_trainer_trained_is_in_the_history_after_the_stream_is_trimmed(tmp_path, redis_url, r,
                                                                                       tiny_model):
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    rng = random.Random(7)
    groups = [make_group(model, f"g{i}", version=i // 4, rng=rng) for i in range(6)]  # none stale (max_staleness 1)
    groups = [replace(g, generator="gen-b") if i in (2, 3) else g for i, g in enumerate(groups)]
    for g in groups:
        xadd(r, KEYS, encode(g))
    train_groups(tmp_path, redis_url, tiny_model, run=RUN)  # three steps of two groups

    assert r.xlen(KEYS.samples) == 0  # trained, saved and acknowledged: trimmed
    steps = {gid: m["step"] for m in read_steps(tmp_path / "out" / "metrics.jsonl") for gid in m["group_ids"]}
    assert steps == {"g0": 1, "g1": 1, "g2": 2, "g3": 2, "g4": 3, "g5": 3}
    kept = read_history(history_dir(tmp_path / "out"))
    assert {t.group.id: t.step for t in kept} == steps and len(kept) == 6
    for t in kept:
        wrote = next(g for g in groups if g.id == t.group.id)
        assert t.group == wrote
        assert t.advantages == pytest.approx(completion_advantages(wrote, estimator="grpo"))

    # the viewer: the stream holds none of them, the history every one, with the step that trained it
    limits = LimitsConfig()
    loaded = with_history(from_stream(r, KEYS, newest=1000, limits=limits), history_dir(tmp_path / "out"), Filters())
    assert sorted(g.id for _, g in loaded.groups) == sorted(g.id for g in groups)
    assert loaded.steps == steps
    shown = chosen(loaded.groups, Filters(), loaded.steps)
    assert [g.id for _, g in shown] == [t.group.id for t in reversed(kept)]  # newest first
    assert [g.id for _, g in chosen(loaded.groups, Filters(min_step=2, max_step=2), loaded.steps)] == ["g3", "g2"]
    assert [g.id for _, g in chosen(loaded.groups, Filters(min_step=3), loaded.steps)] == ["g5", "g4"]
    f = Filters(min_step=2, max_step=2, generator="gen-b")
    narrowed = with_history(from_stream(r, KEYS, newest=1000, limits=limits), history_dir(tmp_path / "out"), f)
    assert [g.id for _, g in chosen(narrowed.groups, f, narrowed.steps)] == ["g3", "g2"]
    assert chosen(narrowed.groups, replace(f, generator="test"), narrowed.steps) == []

    # ... and its page, as `rollouts view` serves it: the step range a query parameter
    page = TestClient(make_app(load=lambda: from_stream(r, KEYS, newest=1000, limits=limits), tokenizer=None,
                               how=Advantages(), metrics=None, run=RUN, history=history_dir(tmp_path / "out")))
    shown = re.findall(r'<section class="group" data-group-id="([^"]+)">', page.get("/").text)
    assert shown == ["g5", "g4", "g3", "g2", "g1", "g0"]
    reply = page.get("/?min_step=2&max_step=3&generator=gen-b")
    assert re.findall(r'<section class="group" data-group-id="([^"]+)">', reply.text) == ["g3", "g2"]
    assert "trained in step <b>2</b>" in reply.text and "from the history" in reply.text
    assert page.get("/?min_step=two").status_code == 400
