"""Sample groups to training rows: shifting, masks and padding."""

import pytest
import torch

from tests.harness.groups import completion, hand_group
from trainer.batch import collate, group_rows, micro_batches


def test_rows_shift_by_one_and_mask_the_completion():
    g = hand_group([completion([8, 9], [-0.1, -0.2], 1.0), completion([10], [-0.3], 0.0)])
    a, b = group_rows(g)
    # prompt 5 6 7, completion 8 9: inputs 5 6 7 8 predict 6 7 8 9; tokens 8 and 9 are trained.
    assert a.inputs == [5, 6, 7, 8] and a.targets == [6, 7, 8, 9]
    assert a.mask == [0, 0, 1, 1]
    assert a.behaviour_logp == pytest.approx([0.0, 0.0, -0.1, -0.2])
    assert b.inputs == [5, 6, 7] and b.targets == [6, 7, 10] and b.mask == [0, 0, 1]
    # rewards 1, 0: mean 0.5, unbiased std = sqrt(0.5) = 0.7071; A = ±0.5 / 0.7071 = ±0.7071.
    assert a.advantage == pytest.approx(0.70711, abs=1e-4)
    assert b.advantage == pytest.approx(-0.70711, abs=1e-4)


def test_loss_mask_is_applied():
    g = hand_group([completion([8, 9, 10], [-0.1, -0.2, -0.3], 1.0, loss_mask=[1, 0, 1]),
               completion([8], [-0.1], 0.0)])
    assert group_rows(g)[0].mask == [0, 0, 1, 0, 1]


def test_collate_right_pads():
    rows = group_rows(hand_group([completion([8, 9], [-0.1, -0.2], 1.0), completion([10], [-0.3], 0.0)]))
    mb = collate(rows)
    assert mb.input_ids.tolist() == [[5, 6, 7, 8], [5, 6, 7, 0]]
    assert mb.attention_mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    assert mb.mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]
    assert mb.advantages.shape == (2,) and mb.behaviour_logp.dtype == torch.float32


def test_micro_batches_split_rows_and_count_trained_tokens():
    groups = [hand_group([completion([8, 9], [-0.1, -0.2], r) for r in (0.0, 1.0, 1.0)]) for _ in range(2)]
    batches, total, seqs = micro_batches(groups, micro_batch_size=4)
    assert [mb.input_ids.shape[0] for mb in batches] == [4, 2]
    assert total == 6 * 2 and seqs == 6


def test_micro_batches_bucket_rows_by_length():
    """Right-padded (trainer.pack_sequences false): rows of alternating lengths go into
    micro-batches of near-equal lengths: little padding, and every row (with its advantage) is
    still there once."""
    lengths = [1, 9, 2, 8, 1, 9, 2, 8]
    groups = [hand_group([completion(list(range(8, 8 + n)), [-0.1] * n, float(i % 2))
                          for i, n in enumerate(lengths[:4])]),
              hand_group([completion(list(range(8, 8 + n)), [-0.1] * n, float(i % 2))
                          for i, n in enumerate(lengths[4:])])]
    batches, total, _ = micro_batches(groups, micro_batch_size=4, pack=False)
    padded = sum(mb.input_ids.numel() for mb in batches)
    real = sum(int(mb.attention_mask.sum()) for mb in batches)
    assert real == sum(3 + n - 1 for n in lengths) and total == sum(lengths)
    assert padded - real <= 4, f"{padded - real} padded positions of {padded}"
    got = sorted((int(mb.attention_mask[i].sum()), float(mb.advantages[i])) for mb in batches for i in range(4))
    want = sorted((len(r.inputs), r.advantage) for g in groups for r in group_rows(g))
    assert got == want
