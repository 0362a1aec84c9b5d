"""Bad input: random and adversarial payloads at every decoder (hypothesis), then garbage entries
written into the streams of a running trainer and a running generator. A decoder returns a valid
message or raises MessageError with a reason, nothing else; a process dead-letters what it cannot
use, keeps running, and processes every valid entry around it."""

import math
import random
import signal
import struct
from pathlib import Path

import msgpack
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common.keys import GENERATORS_GROUP, PAYLOAD, TRAINER_GROUP, Keys
from common.messages import (
    Completion,
    MessageError,
    PromptTask,
    SampleGroup,
    WeightVersion,
    decode_group,
    decode_prompt,
    decode_weights,
    encode,
)
from tests.harness.configs import write_config
from tests.harness.processes import spawn, stop, wait_for

DECODERS = {"prompt": decode_prompt, "group": decode_group, "weights": decode_weights}
FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def valid_prompt() -> PromptTask:
    return PromptTask(id="arithmetic:0:1", messages=[{"role": "user", "content": "What is 1 + 1?"}], text=None,
                      meta={"answer": 2, "source": "arithmetic"}, n=4, admitted_at=0)


def valid_group(vocab: int = 300, gid: str = "arithmetic:0:1") -> SampleGroup:
    c = Completion(ids=[5, 6, 2], logprobs=[-0.5, -1.25, -0.125], reward=1.0, rewards={"correct": 1.0},
                   finish="stop", text="2", loss_mask=None)
    d = Completion(ids=[7, vocab - 1], logprobs=[-2.0, -0.25], reward=0.0, rewards={"correct": 0.0},
                   finish="length", text="x", loss_mask=None)
    return SampleGroup(id=gid, prompt_id=gid, prompt_ids=[1, 2, 3], version=0, generator="g", engine="hf",
                       completions=[c, d], timings={"generate": 0.5})


def valid_weights() -> WeightVersion:
    return WeightVersion(version=1, step=1, path="/c/step_1", format="safetensors",
                         checksums={"model.safetensors": "ab" * 32}, created_at=1.5)


VALID = {"prompt": encode(valid_prompt()), "group": encode(valid_group()), "weights": encode(valid_weights())}


def decodes_or_says_why(kind: str, blob, **limits) -> None:
    """The one allowed failure is MessageError with a non-empty reason."""
    try:
        DECODERS[kind](blob, **limits)
    except MessageError as err:
        assert str(err), f"{kind}: MessageError without a reason"


# Any msgpack value: what a hostile writer can put anywhere in a map.
values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=20) | st.binary(max_size=40),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12)


@FUZZ
@given(kind=st.sampled_from(sorted(DECODERS)), blob=st.binary(max_size=400))
def test_random_bytes(kind, blob):
    decodes_or_says_why(kind, blob)


@FUZZ
@given(kind=st.sampled_from(sorted(DECODERS)), cut=st.integers(min_value=0, max_value=10_000))
def test_truncated_blobs(kind, cut):
    blob = VALID[kind]
    with pytest.raises(MessageError):
        DECODERS[kind](blob[: cut % len(blob)])


def paths(d, prefix=()):
    """Every (path, value) inside a decoded message, nested maps and lists included."""
    for k, v in (d.items() if isinstance(d, dict) else enumerate(d)):
        yield prefix + (k,), v
        if isinstance(v, dict | list):
            yield from paths(v, prefix + (k,))


def replace_at(d, path, value):
    for k in path[:-1]:
        d = d[k]
    d[path[-1]] = value


@FUZZ
@given(kind=st.sampled_from(sorted(DECODERS)), data=st.data())
def test_one_field_replaced_by_anything(kind, data):
    d = msgpack.unpackb(VALID[kind], raw=False)
    path = data.draw(st.sampled_from([p for p, _ in paths(d)]))
    replace_at(d, path, data.draw(values))
    decodes_or_says_why(kind, msgpack.packb(d, use_bin_type=True), **({"vocab_size": 300} if kind == "group" else {}))


@FUZZ
@given(kind=st.sampled_from(sorted(DECODERS)), data=st.data())
def test_fields_dropped_or_added(kind, data):
    d = msgpack.unpackb(VALID[kind], raw=False)
    for path in data.draw(st.lists(st.sampled_from([p for p, _ in paths(d)]), max_size=3)):
        try:
            target = d
            for k in path[:-1]:
                target = target[k]
            del target[path[-1]]
        except (KeyError, IndexError, TypeError):
            pass
    d.update(data.draw(st.dictionaries(st.text(max_size=8), values, max_size=3)))
    decodes_or_says_why(kind, msgpack.packb(d, use_bin_type=True))


@FUZZ
@given(x=st.sampled_from([math.nan, math.inf, -math.inf]), where=st.sampled_from(["reward", "rewards", "logprobs",
                                                                                   "timings"]))
def test_nan_and_infinite_numbers_are_refused(x, where):
    d = msgpack.unpackb(VALID["group"], raw=False)
    c = d["completions"][1]
    if where == "reward":
        c["reward"] = x
    elif where == "rewards":
        c["rewards"]["correct"] = x
    elif where == "logprobs":
        c["logprobs"] = np.asarray([-1.0, x], dtype="<f4").tobytes()
    else:
        d["timings"]["generate"] = x
    with pytest.raises(MessageError, match="finite"):
        decode_group(msgpack.packb(d, use_bin_type=True))


@FUZZ
@given(token=st.one_of(st.integers(min_value=300, max_value=2**31 - 1), st.integers(min_value=-(2**31), max_value=-1)))
def test_token_ids_outside_the_vocabulary_are_refused(token):
    g = valid_group()
    bad = SampleGroup(**{**{f: getattr(g, f) for f in g.__slots__}, "prompt_ids": [1, token]})
    with pytest.raises(MessageError, match="out of range"):
        decode_group(encode(bad), vocab_size=300)


# Headers that declare far more than follows: str32, bin32, array32, map32, ext32 of ~4 GiB.
HUGE = [b"\xdb\xff\xff\xff\xf0abc", b"\xc6\xff\xff\xff\xf0abc", b"\xdd\xff\xff\xff\xf0\x01",
        b"\xdf\xff\xff\xff\xf0\xa1k\x01", b"\xc9\xff\xff\xff\xf0\x05abc"]


@pytest.mark.parametrize("kind", sorted(DECODERS))
@pytest.mark.parametrize("blob", HUGE)
def test_huge_declared_lengths_are_refused_without_allocating(kind, blob):
    with pytest.raises(MessageError, match="not MessagePack"):
        DECODERS[kind](blob)
    # the same inside a valid-looking map, in place of the id
    inner = b"\x83\xa1v\x01\xa1t" + msgpack.packb(kind) + b"\xa2id" + blob
    with pytest.raises(MessageError):
        DECODERS[kind](inner)


def test_limits_on_size_tokens_and_group_size_name_the_limit():
    g = valid_group()
    with pytest.raises(MessageError, match="exceeds the limit of 1024"):
        decode_group(encode(g) + b"\x00" * 2000, max_bytes=1024)
    with pytest.raises(MessageError, match="3 prompt tokens exceed the limit of 2"):
        decode_group(encode(g), max_tokens=2)
    long = SampleGroup(**{**{f: getattr(g, f) for f in g.__slots__}, "prompt_ids": [1]})
    with pytest.raises(MessageError, match=r"completions\[0\]: 3 tokens exceed the limit of 2"):
        decode_group(encode(long), max_tokens=2)
    with pytest.raises(MessageError, match="2 completions exceed the limit of 1"):
        decode_group(encode(g), max_completions=1)
    with pytest.raises(MessageError, match=r"n=4, expected 1..3"):
        decode_prompt(VALID["prompt"], max_n=3)
    empty = SampleGroup(**{**{f: getattr(g, f) for f in g.__slots__},
                           "completions": [g.completions[0], Completion(ids=[], logprobs=[], reward=0.0, rewards={},
                                                                         finish="stop", text="")]})
    with pytest.raises(MessageError, match="empty completion"):
        decode_group(encode(empty))
    deep = b"\x91" * 100_000 + b"\x01"  # lists nested 100k deep
    with pytest.raises(MessageError):
        decode_group(deep)


# --------------------------------------------------------------------------- running processes


def garbage(rng: random.Random, kind: str) -> list[dict]:
    """Adversarial stream entries (fields maps) for a `kind` ("prompt" or "group") decoder."""
    d = msgpack.unpackb(VALID[kind], raw=False)

    def tampered(**over) -> bytes:
        return msgpack.packb({**d, **over}, use_bin_type=True)

    entries = [
        {PAYLOAD: rng.randbytes(rng.randint(0, 200))},
        {PAYLOAD: b""},
        {PAYLOAD: VALID[kind][: len(VALID[kind]) // 2]},
        {PAYLOAD: tampered(v=99)},
        {PAYLOAD: tampered(t="weights")},
        {PAYLOAD: tampered(id=7)},
        {PAYLOAD: HUGE[rng.randrange(len(HUGE))]},
        {PAYLOAD: msgpack.packb([1, 2, 3])},
        {b"other": b"no payload field"},
        {PAYLOAD: struct.pack("<d", math.nan)},
    ]
    if kind == "prompt":
        entries += [{PAYLOAD: tampered(n=10**9)}, {PAYLOAD: tampered(messages=[], text=None)},
                    {PAYLOAD: tampered(messages=[{"role": 1}])}, {PAYLOAD: tampered(meta=[1])}]
    else:
        c = d["completions"][0]
        entries += [
            {PAYLOAD: tampered(completions=[{**c, "reward": math.nan}, c])},
            {PAYLOAD: tampered(completions=[{**c, "logprobs": np.asarray([-1, math.inf, -1], "<f4").tobytes()}, c])},
            {PAYLOAD: tampered(completions=[{**c, "ids": np.asarray([1, 10**6, 2], "<i4").tobytes()}, c])},
            {PAYLOAD: tampered(completions=[{**c, "ids": b"", "logprobs": b""}, c])},
            {PAYLOAD: tampered(completions=[c])},  # one completion: no group-relative advantage
            {PAYLOAD: tampered(completions=[c] * 3000)},  # over limits.max_group_size 1024
        ]
    return entries


def interleave(rng: random.Random, valid: list[dict], bad: list[dict]) -> list[dict]:
    """Shuffled, ending with a valid entry (a trainer stops at max_steps right after it)."""
    out = [*valid[:-1], *bad]
    rng.shuffle(out)
    return [*out, valid[-1]]


def test_running_trainer_dead_letters_garbage_and_trains_every_valid_group(tmp_path, redis_url, r, tiny_model):
    from transformers import AutoModelForCausalLM

    from tests.harness.groups import make_group

    rng = random.Random(11)
    model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype="float32")
    keys = Keys("fz")
    valid = [{PAYLOAD: encode(make_group(model, f"ok{i}", version=0, rng=rng))} for i in range(6)]
    bad = garbage(rng, "group")
    for fields in interleave(rng, valid, bad):
        r.xadd(keys.samples, fields)
    config = tmp_path / "fz.toml"
    write_config(config, run="fz", redis_url=redis_url, output_dir=tmp_path / "out", model=tiny_model, base={},
                 rollout={"prompts_per_step": 2, "max_staleness": 5},
                 trainer={"max_steps": 3, "threads": 1, "lr": 1e-3})
    proc = spawn("trainer", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(config)}, log=tmp_path / "trainer.log")
    assert proc.wait(timeout=240) == 0, (tmp_path / "trainer.log").read_text()
    assert_dead_lettered(r, keys.samples_dead, len(bad))
    assert {m.decode() for m in r.zrange(keys.trained, 0, -1)} == {f"ok{i}" for i in range(6)}
    assert r.xpending(keys.samples, TRAINER_GROUP)["pending"] == 0


def assert_dead_lettered(r, dead_stream: str, count: int) -> None:
    dead = r.xrange(dead_stream)
    reasons = [f[b"reason"].decode() for _, f in dead]
    assert len(dead) == count, reasons
    assert all(reason.strip() for reason in reasons)
    print("\n" + "\n".join(f"  dead letter: {x[:110]}" for x in reasons))


def test_running_generator_dead_letters_garbage_and_serves_every_valid_prompt(tmp_path, redis_url, r, tiny_model):
    rng = random.Random(12)
    keys = Keys("fzg")
    valid = [{PAYLOAD: encode(PromptTask(id=f"ok:{i}", messages=[{"role": "user", "content": f"What is {i} + 1?"}],
                                         text=None, meta={"answer": i + 1}, n=2, admitted_at=0))} for i in range(4)]
    bad = garbage(rng, "prompt")
    r.xgroup_create(keys.prompts, GENERATORS_GROUP, id="0", mkstream=True)
    config = tmp_path / "fzg.toml"
    write_config(config, run="fzg", redis_url=redis_url, output_dir=tmp_path / "out", model=tiny_model, base={},
                 rollout={"max_new_tokens": 4}, generator={"batch_prompts": 3, "threads": 1})
    proc = spawn("generators", "--id", "g1", cwd=tmp_path, env={"ROLLOUTS_CONFIG": str(config)},
                 log=tmp_path / "generator.log")
    try:
        for fields in interleave(rng, valid, bad):
            r.xadd(keys.prompts, fields)
        wait_for(lambda: r.xlen(keys.samples) >= len(valid), timeout=120, what="a group per valid prompt",
                 procs=[proc])
        wait_for(lambda: r.xpending(keys.prompts, GENERATORS_GROUP)["pending"] == 0, timeout=60,
                 what="every prompt acknowledged", procs=[proc])
        assert proc.poll() is None
    finally:
        assert stop(proc) == 0, Path(tmp_path / "generator.log").read_text()
    groups = [decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)]
    assert sorted(g.id for g in groups) == [f"ok:{i}" for i in range(4)]
    assert_dead_lettered(r, keys.prompts_dead, len(bad))


def test_foreign_entries_in_a_live_run_change_no_admission(tmp_path, redis_url, r, tiny_model):
    """Entries the producer never admitted (garbage, truncated, a NaN reward, forged ids, a stale
    forgery, a duplicate of a trained group) are dead-lettered or refused, and the producer keeps
    admitting exactly its limit: no surplus prompt circulates, so none of its prompts goes stale."""
    from transformers import AutoModelForCausalLM

    from common.progress import count_outstanding, read_dropped, read_producer, read_trainer
    from tests.harness.groups import make_group

    keys, steps, per_step = Keys("fa"), 8, 2
    config = tmp_path / "fa.toml"
    write_config(config, run="fa", redis_url=redis_url, output_dir=tmp_path / "out", model=tiny_model, base={},
                 rollout={"group_size": 2, "prompts_per_step": per_step, "max_staleness": 1, "max_new_tokens": 6},
                 generator={"batch_prompts": 2, "threads": 1}, trainer={"max_steps": steps, "threads": 1, "lr": 1e-3})
    env = {"ROLLOUTS_CONFIG": str(config)}
    procs = {name: spawn(module, *args, cwd=tmp_path, env=env, log=tmp_path / f"{name}.log")
             for name, module, args in [("generator", "generators", ("--id", "g1")), ("trainer", "trainer", ()),
                                        ("producer", "producers", ())]}
    try:
        wait_for(lambda: read_trainer(r, keys).step >= 2, timeout=240, what="trainer step 2",
                 procs=list(procs.values()))
        # held still while the forgeries are made and written, so they land in a live run however
        # long making them takes on a loaded machine (the trainer would otherwise finish first)
        procs["trainer"].send_signal(signal.SIGSTOP)
        model = AutoModelForCausalLM.from_pretrained(tiny_model, dtype="float32")
        rng = random.Random(5)
        trained_id = r.zrange(keys.trained, 0, 0)[0].decode()
        fresh = encode(make_group(model, "foreign:0:1", version=read_trainer(r, keys).version, rng=rng))
        d = msgpack.unpackb(fresh, raw=False)
        nan = msgpack.packb({**d, "id": "foreign:0:2", "completions": [
            {**d["completions"][0], "reward": math.nan}, d["completions"][1]]}, use_bin_type=True)
        foreign = [rng.randbytes(64), fresh[: len(fresh) // 2], nan,
                   encode(make_group(model, "foreign:0:3", version=0, rng=rng)),  # forged and stale
                   encode(make_group(model, trained_id, version=0, rng=rng))]  # a duplicate
        for blob in foreign:
            r.xadd(keys.samples, {PAYLOAD: blob})
        r.xadd(keys.prompts, {PAYLOAD: b"\x93garbage"})  # and a foreign prompt entry
        procs["trainer"].send_signal(signal.SIGCONT)
        assert procs["trainer"].wait(timeout=300) == 0, (tmp_path / "trainer.log").read_text()
        limit = (1 + read_trainer(r, keys).version + 1) * per_step  # admission_limit with nothing dropped
        wait_for(lambda: read_producer(r, keys).admitted >= limit, timeout=60, what=f"{limit} prompts admitted",
                 procs=[procs["producer"]])
    finally:
        procs["trainer"].send_signal(signal.SIGCONT)  # in case a failure left it stopped
        codes = {name: stop(p) for name, p in procs.items()}
    assert set(codes.values()) == {0}, codes
    t = read_trainer(r, keys)
    # the forgeries were turned away for what they are...
    assert (t.groups_dead, t.groups_duplicate) == (3, 1), t
    assert r.xlen(keys.prompts_dead) == 1
    # ...and none of them counted as an admitted prompt dropped: the producer admitted exactly
    # its limit, so no prompt of its own was left to go stale (the one stale group is the forgery)
    assert read_dropped(r, keys) == 0
    assert t.groups_dropped_stale == 1, t
    assert read_producer(r, keys).admitted == limit
    assert count_outstanding(r, keys) == limit - t.groups_trained
