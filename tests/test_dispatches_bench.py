"""ops/bench/dispatches.py, the operators a step dispatches (a GPU host's launches), run dry on the
CPU: each side's count and passes for each micro-batch setting, fewer micro-batches dispatching
fewer operators, and its default rows ending on configs/gsm8k.toml as shipped."""

from __future__ import annotations

import json

from common.config import load_config
from ops.bench import dispatches
from ops.bench import trainer_gpu as bench


def test_dry_run_counts_each_sides_operators_and_passes(tmp_path, capsys):
    assert dispatches.main(["--dry-run", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "dispatches.json").read_text())
    rows = {r["row"]["label"]: r for r in data["rows"]}
    assert len(rows) == 3
    checkpointed, off, uncapped = (rows[row.label] for row in dispatches.default_rows(dry_run=True))
    # the dry layout's 2 groups: one a micro-batch at 4 completions and 128 tokens, both in one uncapped
    assert [r["trainer"]["passes"] for r in (checkpointed, off, uncapped)] == [2, 2, 1]
    assert [r["bare"]["micro_batches"] for r in (checkpointed, off, uncapped)] == [2, 2, 1]
    for r in data["rows"]:
        for side in ("trainer", "bare"):
            top = dict(r[side]["top"])
            assert 100 < sum(top.values()) <= r[side]["ops"]  # the dozen most dispatched are part of the total
            assert top.get("aten.mm", 0) + top.get("aten.addmm", 0) > 0  # the projections' matmuls among them
    # recomputing each block in the backward pass dispatches its forward again
    assert checkpointed["trainer"]["ops"] > off["trainer"]["ops"]
    assert checkpointed["bare"]["ops"] > off["bare"]["ops"]
    # one pass a step instead of two: fewer operators on both sides, most of them a pass's
    for side in ("trainer", "bare"):
        assert uncapped[side]["ops"] < 0.75 * off[side]["ops"], (side, uncapped[side]["ops"], off[side]["ops"])
    printed = capsys.readouterr().out
    assert dispatches.HEADER in printed and f"{off['trainer']['ops']:,}" in printed
    assert (tmp_path / "dispatches.md").read_text().startswith(dispatches.HEADER)


def test_the_default_rows_end_on_configs_gsm8k_toml_as_shipped():
    shipped = load_config(bench.GSM8K, env={}).trainer
    last = dispatches.default_rows(dry_run=False)[-1]
    assert (last.mb_size, last.mb_tokens, last.ac) == (shipped.micro_batch_size, shipped.micro_batch_tokens, False)
    first = dispatches.default_rows(dry_run=False)[0]
    assert (first.mb_size, first.mb_tokens, first.ac) == (8, 8192, True)  # the 4x target's baseline


def test_the_vocabulary_changes_no_count():
    """The bench counts on a 4,096-token vocabulary for Qwen's 151,936: each operator is larger, none
    is added or left out."""
    from dataclasses import replace

    row = dispatches.default_rows(dry_run=True)[0]
    counts = [dispatches.count_row(row, shape=replace(dispatches.TINY, vocab=vocab), layout=bench.LAYOUTS["grpo-tiny"])
              for vocab in (512, 4096)]
    for side in ("trainer", "bare"):
        assert counts[0][side]["ops"] == counts[1][side]["ops"] and counts[0][side]["top"] == counts[1][side]["top"]
