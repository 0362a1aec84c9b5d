"""Token ids, log-probs and loss masks through the samples stream as arrays: whatever holds them
when a group is encoded (lists, numpy arrays, array.array), the same bytes go on the wire and the
same values come back, as read-only numpy arrays, and become the same training tensors; input the
wire cannot hold is refused at once, bad values still get the decoder's clear error, and recorded
streams still decode (and encode to the very bytes recorded)."""

import array
import math
from dataclasses import replace
from pathlib import Path

import msgpack
import numpy as np
import pytest

from common.keys import PAYLOAD, TRAINER_GROUP
from common.messages import MessageError, SampleGroup, decode_group, encode
from common.recording import read_recording
from common.streams import ensure_group
from tests.harness.groups import completion, hand_group
from trainer.batch import micro_batches

PIPELINE = Path(__file__).resolve().parent / "data" / "tiny_pipeline.rec"
PROMPT = [5, 6, 7]
# (ids, log-probs, loss mask): log-probs exact in float32, so lists and float32 arrays hold the same values
TOKENS = [([8, 9, 10, 11], [-0.5, -0.25, -1.0, -2.0], None), ([12], [-0.125], None),
          ([13, 14, 15], [-0.75, 0.0, -1.5], [1, 0, 1])]

HOLDERS = {
    "lists": (list, list, list),
    "numpy wire dtypes": (lambda x: np.asarray(x, dtype="<i4"), lambda x: np.asarray(x, dtype="<f4"),
                          lambda x: np.asarray(x, dtype="u1")),
    "numpy other dtypes": (lambda x: np.asarray(x, dtype=np.int64), lambda x: np.asarray(x, dtype=np.float64),
                           lambda x: np.asarray(x, dtype=bool)),
    "array.array": (lambda x: array.array("i", x), lambda x: array.array("f", x), lambda x: array.array("B", x)),
    "array.array wide": (lambda x: array.array("q", x), lambda x: array.array("d", x),
                         lambda x: array.array("b", x)),
}


def held_as(holder: str) -> SampleGroup:
    """TOKENS after PROMPT, every id, log-prob and mask held as `holder` holds them."""
    ints, floats, mask = HOLDERS[holder]
    return hand_group([completion(ints(ids), floats(lps), float(i), loss_mask=None if m is None else mask(m))
                       for i, (ids, lps, m) in enumerate(TOKENS)], prompt=ints(PROMPT))


def expected_rows() -> dict[str, list[list]]:
    """The micro-batch of TOKENS worked out with plain lists: prompt + completion shifted by one,
    right-padded with 0, trained on the completion's (masked-in) tokens."""
    width = len(PROMPT) + max(len(ids) for ids, _, _ in TOKENS) - 1
    out: dict[str, list[list]] = {"input_ids": [], "targets": [], "attention_mask": [], "mask": [],
                                  "behaviour_logp": []}
    for ids, lps, m in TOKENS:
        full = PROMPT + ids
        pad = [0] * (width - len(full) + 1)
        out["input_ids"].append(full[:-1] + pad)
        out["targets"].append(full[1:] + pad)
        out["attention_mask"].append([1] * (len(full) - 1) + pad)
        out["mask"].append([0] * (len(PROMPT) - 1) + (m or [1] * len(ids)) + pad)
        out["behaviour_logp"].append([0.0] * (len(PROMPT) - 1) + lps + pad)
    return out


def test_groups_cross_the_stream_identical_whatever_holds_their_tokens(r):
    stream = "t:samples"
    ensure_group(r, stream, TRAINER_GROUP)
    reference = held_as("lists")
    wire = encode(reference)
    for holder in HOLDERS:
        blob = encode(held_as(holder))
        assert blob == wire, f"{holder}: the bytes on the wire differ from a list-built group's"
        r.xadd(stream, {PAYLOAD: blob})
        ((_, [(_, fields)]),) = r.xreadgroup(TRAINER_GROUP, "rank0", {stream: ">"}, count=1)
        got = decode_group(fields[PAYLOAD], vocab_size=16)
        assert got == reference, holder
        for c, (ids, lps, m) in zip(got.completions, TOKENS, strict=True):
            assert c.ids.tolist() == ids and c.logprobs.tolist() == lps
            assert (c.ids.dtype, c.logprobs.dtype) == (np.dtype("<i4"), np.dtype("<f4"))
            assert (c.loss_mask is None) == (m is None)
            if m is not None:
                assert c.loss_mask.dtype == bool and c.loss_mask.tolist() == [bool(x) for x in m]
            with pytest.raises(ValueError, match="read-only"):
                c.ids[0] = 1  # views of the payload: nothing downstream may change what was sent
        (batch,), tokens, seqs = micro_batches([got], micro_batch_size=8, pack=False)  # right-padded rows
        expected = expected_rows()
        order = sorted(range(len(TOKENS)), key=lambda i: sum(expected["attention_mask"][i]))  # length buckets
        for name, rows in expected.items():
            assert getattr(batch, name).tolist() == [rows[i] for i in order], f"{holder}: {name}"
        assert (tokens, seqs) == (4 + 1 + 2, 3)
        assert batch.advantages.tolist() == pytest.approx([[-1.0, 0.0, 1.0][i] for i in order])


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("ids", np.array([8.0, 9.0]), "completions[0].ids: token ids must be integers, got float64"),
        ("ids", [8, 9.5], "completions[0].ids: token ids must be integers"),
        ("ids", np.array([8, 2**31]), "completions[0].ids: token ids must fit int32"),
        ("ids", [8, 2**31], "completions[0].ids: token ids must be integers that fit int32"),
        ("ids", np.zeros((2, 2), dtype=np.int32), "completions[0].ids: expected a flat sequence"),
        ("logprobs", np.array(["a", "b"]), "completions[0].logprobs: log-probs must be numbers"),
        ("logprobs", [-0.5, "b"], "completions[0].logprobs: log-probs must be numbers"),
        ("loss_mask", np.array([1, 2]), "completions[0].loss_mask: a loss mask must be 0/1"),
        ("loss_mask", [0, 256], "completions[0].loss_mask: a loss mask must be 0/1"),
        ("loss_mask", np.array([0.0, 1.0]), "completions[0].loss_mask: a loss mask must be 0/1 integers or bools"),
    ],
)
def test_encode_refuses_what_the_wire_cannot_hold_and_names_it(field, value, reason):
    g = held_as("lists")
    c = replace(g.completions[0], **{"ids": [8, 9], "logprobs": [-0.5, -0.5], field: value})
    with pytest.raises(MessageError) as err:
        encode(replace(g, completions=[c, *g.completions[1:]]))
    assert f"group g.{reason}" in str(err.value)


@pytest.mark.parametrize(
    ("ids", "logprobs", "reason"),
    [
        (np.array([8, 9, 10]), np.array([-0.5, math.nan, -1.0]), "completions[2]: logprobs must be finite and <= 0"),
        (np.array([8, 9, 10]), np.array([-0.5, -math.inf, -1.0]), "completions[2]: logprobs must be finite"),
        (np.array([8, 9, 10]), np.array([-0.5, 0.5, -1.0]), "completions[2]: logprobs must be finite and <= 0"),
        (np.array([8, 9, 10]), np.array([-0.5, -1.0]), "completions[2]: 3 ids but 2 logprobs"),
        (np.array([8, 99, 10]), np.array([-0.5, -0.5, -1.0]), "token id out of range [0, 16): saw 5..99"),
    ],
)
def test_bad_arrays_still_get_the_decoders_clear_error(ids, logprobs, reason):
    g = held_as("numpy wire dtypes")
    bad = replace(g.completions[0], ids=ids, logprobs=logprobs)
    with pytest.raises(MessageError) as err:
        decode_group(encode(replace(g, completions=[*g.completions[:2], bad])), vocab_size=16)
    assert reason in str(err.value)


def test_a_mask_that_is_not_0_1_on_the_wire_is_refused_naming_its_completion():
    d = msgpack.unpackb(encode(held_as("lists")), raw=False)
    d["completions"][1]["loss_mask"] = b"\x01"
    d["completions"][2]["loss_mask"] = b"\x01\x02\x00"
    with pytest.raises(MessageError, match=r"completions\[2\]: loss_mask must be 0/1"):
        decode_group(msgpack.packb(d, use_bin_type=True))


def test_recorded_groups_decode_to_arrays_and_encode_to_the_bytes_recorded():
    payloads = [e.payload for e in read_recording(PIPELINE)[1] if e.stream == "samples"]
    groups = [decode_group(p) for p in payloads]
    assert len(groups) == 20 and all(isinstance(c.ids, np.ndarray) for g in groups for c in g.completions)
    assert [encode(g) for g in groups] == payloads  # the wire format is the one recorded
    as_lists = [replace(g, prompt_ids=g.prompt_ids.tolist(), completions=[
        replace(c, ids=c.ids.tolist(), logprobs=c.logprobs.tolist(),
                loss_mask=None if c.loss_mask is None else c.loss_mask.astype(int).tolist())
        for c in g.completions]) for g in groups]
    assert as_lists == groups
    batches, tokens, seqs = micro_batches(groups, micro_batch_size=8)
    list_batches, list_tokens, list_seqs = micro_batches(as_lists, micro_batch_size=8)
    assert (tokens, seqs) == (list_tokens, list_seqs) == (sum(len(c.ids) for g in as_lists for c in g.completions),
                                                           80)
    for a, b in zip(batches, list_batches, strict=True):
        for name in ("input_ids", "attention_mask", "targets", "mask", "behaviour_logp", "advantages", "versions"):
            assert getattr(a, name).equal(getattr(b, name)), name
