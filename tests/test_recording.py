"""`rollouts record` and `rollouts replay`, and trainer runs fed by a checked-in recording made by
the project's own pipeline (tests/data/make_recordings.py): no generator, no model download."""

from pathlib import Path

import msgpack
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from common.checkpoints import checksum_dir, verify_dir
from common.cli import main as cli
from common.keys import PAYLOAD, TRAINER_GROUP, Keys
from common.messages import decode_group, decode_prompt
from common.recording import RecordingError, read_recording, record, replay
from tests.harness.configs import write_config
from tests.harness.metrics import read_steps
from tests.harness.pipeline import run_trainer

DATA = Path(__file__).resolve().parent / "data"
PIPELINE = DATA / "tiny_pipeline.rec"  # 3 steps of producer + generator + trainer on the tiny model


def config_of(tmp_path: Path, redis_url: str, run: str) -> str:
    path = tmp_path / f"{run}.toml"
    write_config(path, run=run, redis_url=redis_url, output_dir=tmp_path / run, base={})
    return str(path)


def trainer_config(tmp_path: Path, redis_url: str, model: Path, *, steps: int) -> dict[str, str]:
    """The trainer with the rollout settings the recording was made with."""
    return write_config(tmp_path / "trainer.toml", run="t", redis_url=redis_url, output_dir=tmp_path / "out",
                        model=model, base={}, rollout={"group_size": 4, "prompts_per_step": 4, "max_staleness": 1},
                        trainer={"lr": 1e-3, "max_steps": steps, "micro_batch_size": 8, "threads": 1})


def test_checked_in_recording_is_complete_and_names_the_tiny_model_it_needs(tiny_model):
    header, entries = read_recording(PIPELINE)
    assert header.streams == ["samples", "prompts"]
    # The tiny model is built deterministically from its seed: the fixture's files are the
    # very files the recording's groups were sampled and trained with (its checksums are sha256,
    # from before checkpoints were hashed with XXH3: they verify all the same).
    assert set(header.model["checksums"]) == set(checksum_dir(tiny_model))
    verify_dir(tiny_model, header.model["checksums"])
    prompts = [decode_prompt(e.payload) for e in entries if e.stream == "prompts"]
    groups = [decode_group(e.payload) for e in entries if e.stream == "samples"]
    assert len(groups) == len(prompts) == 20
    assert sorted(g.prompt_id for g in groups) == sorted(p.id for p in prompts)
    assert [e.id for e in entries] == sorted(e.id for e in entries)  # in stream order
    assert PIPELINE.stat().st_size < 64 * 1024


def test_record_then_replay_gives_the_same_entries_in_order(tmp_path, redis_url, r):
    src, dst = Keys("src"), Keys("dst")
    replay(r, src, PIPELINE)
    recorded = [(e.stream, e.payload) for e in read_recording(PIPELINE)[1]]
    assert r.xlen(src.samples) == 20 and r.xlen(src.prompts) == 20
    out = tmp_path / "again.rec"
    cli(["record", "--config", config_of(tmp_path, redis_url, "src"), "--stream", "samples",
         "--stream", "prompts", "--out", str(out), "--until-idle", "0.5"])
    header, entries = read_recording(out)
    assert header.run == "src" and header.streams == ["samples", "prompts"]
    assert sorted(e.payload for e in entries) == sorted(p for _, p in recorded)
    assert [e.payload for e in entries if e.stream == "samples"] == [p for s, p in recorded if s == "samples"]
    # the recorder took its group away when it finished: it holds no trimming back
    assert [g["name"] for g in r.xinfo_groups(src.samples)] == []

    cli(["replay", str(out), "--config", config_of(tmp_path, redis_url, "dst"), "--stream", "samples"])
    assert [f[PAYLOAD] for _, f in r.xrange(dst.samples)] == [p for s, p in recorded if s == "samples"]
    assert not r.exists(dst.prompts)
    with pytest.raises(SystemExit, match="already has 20 entries in its samples stream"):
        cli(["replay", str(out), "--config", config_of(tmp_path, redis_url, "dst")])


def test_replay_at_the_recorded_pace_waits_as_the_recording_did(redis_url, r):
    _, entries = read_recording(PIPELINE)
    ms = [int(e.id.split("-")[0]) for e in entries]
    waits = []
    replay(r, Keys("paced"), PIPELINE, pace="recorded", sleep=waits.append)
    assert sum(waits) == pytest.approx((ms[-1] - ms[0]) / 1000)
    assert all(w > 0 for w in waits)


def test_a_recorder_reads_entries_as_they_come_and_stops_when_asked(tmp_path, redis_url, r):
    keys = Keys("live")
    r.xadd(keys.samples, {PAYLOAD: b"first"})
    written = []

    def stop() -> bool:  # one more entry arrives while the recorder runs, then it is asked to stop
        written.append(1)
        if len(written) == 3:
            r.xadd(keys.samples, {PAYLOAD: b"second"})
            r.xadd(keys.samples, {b"not-a-message": b"x"})
        return len(written) > 6

    assert record(r, keys, streams=["samples"], out=tmp_path / "live.rec", model=None, until_idle_s=None,
                  stop=stop) == 2
    assert [e.payload for e in read_recording(tmp_path / "live.rec")[1]] == [b"first", b"second"]


def test_truncated_and_foreign_files_are_refused_with_the_reason(tmp_path):
    blob = PIPELINE.read_bytes()
    cut = tmp_path / "cut.rec"
    cut.write_bytes(blob[: len(blob) // 2])
    with pytest.raises(RecordingError, match="truncated in the middle of an entry"):
        read_recording(cut)
    header_and_some = tmp_path / "no_end.rec"  # cut at an entry boundary: no end mark
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(blob)
    next(unpacker), next(unpacker)
    header_and_some.write_bytes(blob[: unpacker.tell()])
    with pytest.raises(RecordingError, match="truncated after 1 entries"):
        read_recording(header_and_some)
    foreign = tmp_path / "foreign.rec"
    foreign.write_bytes(msgpack.packb({"hello": "world"}))
    with pytest.raises(RecordingError, match="not a rollouts recording"):
        read_recording(foreign)
    newer = tmp_path / "newer.rec"
    newer.write_bytes(msgpack.packb({"format": "rollouts-recording", "version": 9, "streams": ["samples"]}))
    with pytest.raises(RecordingError, match="format version 9"):
        read_recording(newer)
    with pytest.raises(RecordingError, match="no such file"):
        read_recording(tmp_path / "absent.rec")
    text = tmp_path / "text.rec"
    text.write_bytes(b"\xc1" * 10)
    with pytest.raises(RecordingError, match="not MessagePack"):
        read_recording(text)


def test_trainer_trains_on_a_replayed_pipeline_recording_deterministically(tmp_path, redis_url, r, tiny_model):
    """The groups a live generator made, replayed: the trainer takes them in recorded order and two
    replays end with bit-identical weights."""
    _, entries = read_recording(PIPELINE)
    recorded = [decode_group(e.payload).id for e in entries if e.stream == "samples"]
    finals = []
    for attempt in ("a", "b"):
        out = tmp_path / attempt
        out.mkdir()
        r.flushdb()
        replay(r, Keys("t"), PIPELINE, only=["samples"])
        run_trainer(trainer_config(out, redis_url, tiny_model, steps=5), cwd=out)
        lines = read_steps(out / "out" / "metrics.jsonl")
        assert [g for m in lines for g in m["group_ids"]] == recorded
        assert all(m["groups/dropped_stale"] == 0 and m["groups/dead"] == 0 for m in lines)
        assert r.xpending(Keys("t").samples, TRAINER_GROUP)["pending"] == 0
        finals.append(load_file(out / "out" / "checkpoints" / "step_5" / "model.safetensors"))
    init = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32).state_dict()
    assert any(not torch.equal(finals[0][k], init[k]) for k in finals[0])  # rewarded groups moved it
    assert all(torch.equal(finals[0][k], finals[1][k]) for k in finals[0])
