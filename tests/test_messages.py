import math

import msgpack
import pytest

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


def group(**over) -> SampleGroup:
    c = Completion(ids=[5, 6, 2], logprobs=[-0.5, -1.25, -0.125], reward=1.0, rewards={"correct": 1.0},
                   finish="stop", text="11", loss_mask=[1, 1, 0])
    fields = dict(id="arithmetic:0:3", prompt_id="arithmetic:0:3", prompt_ids=[1, 2, 3], version=4,
                  generator="g1", engine="hf", completions=[c, c], timings={"generate": 0.5})
    fields.update(over)
    return SampleGroup(**fields)


def test_round_trips():
    p = PromptTask(id="a:0:1", messages=[{"role": "user", "content": "What is 1 + 1?"}], text=None,
                   meta={"answer": 2}, n=4, admitted_at=3)
    assert decode_prompt(encode(p)) == p
    g = group(published_at=7.25)
    assert decode_group(encode(g)) == g
    w = WeightVersion(version=2, step=2, path="/c/step_2", format="safetensors",
                      checksums={"model.safetensors": "ab" * 32}, created_at=1.5, gone_back_step=1, gone_back_at=1.25)
    assert decode_weights(encode(w)) == w
    # written before groups said when their weights were published, or weights when the trainer went back
    assert decode_group(tamper(g, lambda d: d.pop("published_at"))).published_at == 0.0
    old = msgpack.unpackb(encode(w), raw=False)
    del old["gone_back_step"], old["gone_back_at"]
    before = decode_weights(msgpack.packb(old))
    assert (before.gone_back_step, before.gone_back_at) == (0, 0.0)


def test_arrays_travel_packed_not_as_lists():
    raw = msgpack.unpackb(encode(group()), raw=False)
    assert isinstance(raw["prompt_ids"], bytes) and len(raw["prompt_ids"]) == 3 * 4
    assert isinstance(raw["completions"][0]["logprobs"], bytes)


def tamper(g: SampleGroup, fn) -> bytes:
    d = msgpack.unpackb(encode(g), raw=False)
    fn(d)
    return msgpack.packb(d, use_bin_type=True)


@pytest.mark.parametrize(
    ("blob", "reason"),
    [
        (b"\xc1garbage", "not MessagePack"),
        (msgpack.packb([1, 2]), "not a map"),
        (tamper(group(), lambda d: d.update(v=2)), "schema version 2"),
        (tamper(group(), lambda d: d.update(t="prompt")), "message type"),
        (tamper(group(), lambda d: d.pop("version")), "missing field 'version'"),
        (tamper(group(), lambda d: d.update(version="3")), "version"),
        (tamper(group(), lambda d: d.update(completions=[])), "no completions"),
        (tamper(group(), lambda d: d.update(published_at=-1.0)), "negative published_at"),
        (tamper(group(), lambda d: d.update(published_at="x")), "published_at"),
        (tamper(group(), lambda d: d["completions"][0].update(ids=b"\x01\x00")), "whole number"),
        (tamper(group(), lambda d: d["completions"][0].update(logprobs=b"")), "3 ids but 0 logprobs"),
        (tamper(group(), lambda d: d["completions"][0].update(reward=math.nan)), "not finite"),
        (tamper(group(), lambda d: d["completions"][0].update(finish="bored")), "finish"),
        (tamper(group(), lambda d: d["completions"][0].update(ids=b"")), "empty completion"),
        (encode(group(completions=[Completion(ids=[1], logprobs=[math.inf], reward=0.0, rewards={},
                                              finish="stop", text="")])), "finite"),
    ],
)
def test_bad_group_is_refused_with_a_reason(blob, reason):
    with pytest.raises(MessageError) as err:
        decode_group(blob)
    assert reason in str(err.value)


def test_token_ids_outside_the_vocabulary_are_refused():
    blob = encode(group())
    assert decode_group(blob, vocab_size=7).id == "arithmetic:0:3"
    with pytest.raises(MessageError, match="out of range"):
        decode_group(blob, vocab_size=6)


def test_oversized_payload_is_refused_before_unpacking():
    with pytest.raises(MessageError, match="exceeds the limit"):
        decode_group(encode(group()), max_bytes=16)


def test_a_prompts_source_is_a_field_that_travels_where_it_always_did():
    ask = dict(id="calc:0:1", messages=[{"role": "user", "content": "2 + 2?"}], text=None, n=2, admitted_at=0)
    typed = PromptTask(**ask, meta={"answer": 4}, source="calc")
    assert typed.meta == {"answer": 4, "source": "calc"}  # what the reward reads, as before
    assert decode_prompt(encode(typed)) == typed and decode_prompt(encode(typed)).source == "calc"
    # the bytes of an entry whose meta named its source before the field existed, both ways
    old = msgpack.packb({"v": 1, "t": "prompt", "id": "calc:0:1", "messages": ask["messages"], "text": None,
                         "meta": {"answer": 4, "source": "calc"}, "n": 2, "admitted_at": 0}, use_bin_type=True)
    assert encode(typed) == old and decode_prompt(old) == typed
    # an entry naming no source still decodes: its source is None
    plain = msgpack.packb({"v": 1, "t": "prompt", "id": "x", "messages": None, "text": "hi", "meta": {"answer": 1},
                           "n": 1, "admitted_at": 0}, use_bin_type=True)
    assert decode_prompt(plain).source is None and decode_prompt(plain).meta == {"answer": 1}


def test_prompt_needs_exactly_one_of_messages_and_text():
    both = PromptTask(id="a", messages=[{"role": "user", "content": "x"}], text="x", meta={}, n=2, admitted_at=0)
    with pytest.raises(MessageError, match="exactly one"):
        decode_prompt(encode(both))
    with pytest.raises(MessageError, match="message type"):
        decode_prompt(encode(group()))
