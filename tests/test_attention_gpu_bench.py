"""ops/bench/attention_gpu.py: the attention kernels of the trainer's packed micro-batches against
the bare loop's, timed and checked against trainer/varlen.py's reference. On a CPU (`--dry-run`)
only `sdpa rows` runs; the CUDA kernels are listed as skipped, and a kernel that computes
something else is marked as differing, its time no candidate."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from ops.bench import attention_gpu as bench
from ops.bench import trainer_gpu


def test_the_layouts_are_the_trainer_benchs(tmp_path):
    # gsm8k's and 16k's tokens as ops/bench/trainer_gpu.py lays them out: its groups, prompts and completions
    for name, layout in [("gsm8k", "grpo512"), ("16k", "packed16k")]:
        case, lay = bench.CASES[name], trainer_gpu.LAYOUTS[layout]
        assert (case.groups, case.completions, case.prompt, case.completion) == (
            lay.groups, lay.completions, lay.prompt, lay.completion)
    shared, rows = bench.CASES["gsm8k"], bench.CASES["gsm8k-rows"]
    assert shared.tokens() == 8 * (192 + 8 * 321) and rows.tokens() == 64 * 513
    # the shared layout's further completions gather the prompt's keys; the rows' attend to their own
    assert shared.scaled(16).varlen(torch.device("cpu")).keys is not None
    plain = rows.scaled(16).varlen(torch.device("cpu"))
    assert plain.keys is None and len(plain.cu_q) == 64 + 1


def test_a_dry_run_times_sdpa_rows_within_the_reference_and_skips_the_cuda_kernels(tmp_path, capsys):
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--iters", "2", "--warmup", "1"]) == 0
    printed = capsys.readouterr().out
    rows = json.loads((tmp_path / "attention_gpu.json").read_text())["rows"]
    assert {(r["case"], r["kernel"]) for r in rows} == {(c, k) for c in bench.CASES for k in bench.KERNELS}
    for r in rows:
        line = next(x for x in printed.splitlines() if x.startswith(f"| {r['case']} | {r['kernel']} |"))
        if r["kernel"] in bench.NEEDS_CUDA:
            assert r["skipped"] == "needs CUDA in bf16" and "skipped: needs CUDA in bf16" in line
        elif bench.CASES[r["case"]].shared:
            assert r["skipped"].startswith("shared prompts")
        else:
            assert r["ok"] and r["error"] < 1e-4 and r["ms"] > 0, r
            assert f"{r['ms']:,.2f}" in line and "DIFFERS" not in line


def test_a_kernel_that_attends_to_the_future_is_marked_as_differing(tmp_path, capsys, monkeypatch):
    def not_causal(q, k, v, varlen, scale):
        rows, length = len(varlen.cu_q) - 1, int(varlen.cu_q[1])
        split = [t.view(rows, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v)]
        out = F.scaled_dot_product_attention(*split, scale=scale, enable_gqa=True)
        return out.transpose(1, 2).reshape(q.shape)

    monkeypatch.setitem(bench.KERNELS, "sdpa rows", not_causal)
    assert bench.main(["--dry-run", "--out", str(tmp_path), "--cases", "gsm8k-rows", "--iters", "1",
                       "--warmup", "0"]) == 0
    (row,) = [r for r in json.loads((tmp_path / "attention_gpu.json").read_text())["rows"]
              if r["kernel"] == "sdpa rows"]
    assert not row["ok"] and row["error"] > 0.1
    assert "DIFFERS from the reference" in capsys.readouterr().out
