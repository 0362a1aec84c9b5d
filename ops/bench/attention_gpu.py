"""Attention kernels for the trainer's packed micro-batches on one GPU: which is fastest, and right.

The 2026-11-29 H200 sitting (docs/gpu.md) profiled gsm8k's step: the trainer's attention
(FlashAttention-2's varlen kernel, trainer/varlen.py) took 25.4 ms of GPU time a step against the
bare loop's 18.7 ms (SDPA on padded rows, which took cuDNN's kernel), for about as many query-key
pairs; at 16k tokens, where attention is most of a step's FLOPs, the trainer ran at 0.72-0.79 of the
bare loop. This bench times one attention call's forward and backward for each kernel on the
layouts of both, and checks each against trainer/varlen.py's `reference` (per-sequence SDPA in
float32, on the same layout with every length divided by 8):

  flash varlen  trainer/varlen.py `attend` with its flash kernel: `aten::_flash_attention_forward`
                over cu_seqlens
  cudnn varlen  the same with its cuDNN kernel: `aten::_cudnn_attention_forward` over the same
                cu_seqlens (the op torch's nested tensors call for SDPA on cuDNN), keys and values
                as they are (what a trainer takes where `varlen_kernel` finds it right and faster)
  cudnn varlen, kv expanded   the same with the key and value heads repeated to the query heads
  sdpa rows     `F.scaled_dot_product_attention(is_causal=True)` on (rows, heads, length, dim):
                the bare loop's way, where every sequence is a row of one length (no shared prompt)

Layouts, each with its model's heads (query heads, key heads, head size):

  gsm8k       Qwen2.5-0.5B (14, 2, 64): 8 groups of a 192-token prompt and 8 completions of 321,
              each group's prompt once (the trainer's shared prompts: a further completion's queries
              over the prompt's keys and its own, aligned to the end)
  gsm8k-rows  the same tokens as 64 rows of 513 (a prompt and one completion each: the bare loop's)
  16k         Qwen3-0.6B (16, 8, 128): a 16-token prompt and 2 completions of 16,369, shared
  16k-rows    2 rows of 16,385

A kernel that fails (an op this torch lacks, a layout it refuses) is listed with the error; one
whose output or gradients differ from the reference by more than bf16 allows is marked so and
its time is not a candidate. `--dry-run` runs lengths divided by 16 in float32 on the CPU, where
only `sdpa rows` and the reference run (the CUDA kernels are listed as skipped):
tests/test_attention_gpu_bench.py runs it. On a GPU host (docs/gpu.md, "The next sitting"):

    PYTHONPATH=/tmp/site python3 ops/bench/attention_gpu.py --out $OUT/attention    # about 30 s on an H200
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from trainer.varlen import KERNELS as VARLEN_KERNELS  # noqa: E402
from trainer.varlen import Varlen, attend, layout, reference  # noqa: E402


@dataclass(frozen=True)
class Case:
    """A layout: groups of a prompt and completions, shared (the trainer's) or as plain rows."""

    heads: tuple[int, int, int]  # query heads, key heads, head size
    groups: int
    prompt: int
    completions: int
    completion: int
    shared: bool  # True: each group's prompt once; False: one row of prompt + completion each

    def scaled(self, by: int) -> Case:
        return Case(self.heads, self.groups, max(2, self.prompt // by), self.completions,
                    max(2, self.completion // by), self.shared)

    def varlen(self, device: torch.device) -> Varlen:
        docs, segments = [], []
        for g in range(self.groups):
            if self.shared:
                docs += [g] * (self.prompt + self.completions * self.completion)
                segments += [0] * self.prompt + [j + 1 for j in range(self.completions) for _ in range(self.completion)]
            else:
                for c in range(self.completions):
                    docs += [g * self.completions + c] * (self.prompt + self.completion)
                    segments += [0] * self.prompt + [1] * self.completion
        made = layout(np.array([docs]), np.array([segments]))
        return Varlen(cu_q=made.cu_q.to(device), cu_k=made.cu_k.to(device),
                      keys=None if made.keys is None else made.keys.to(device), max_q=made.max_q, max_k=made.max_k)

    def tokens(self) -> int:
        per = self.prompt + self.completions * self.completion if self.shared else \
            self.completions * (self.prompt + self.completion)
        return self.groups * per


CASES = {
    "gsm8k": Case((14, 2, 64), groups=8, prompt=192, completions=8, completion=321, shared=True),
    "gsm8k-rows": Case((14, 2, 64), groups=8, prompt=192, completions=8, completion=321, shared=False),
    "16k": Case((16, 8, 128), groups=1, prompt=16, completions=2, completion=16369, shared=True),
    "16k-rows": Case((16, 8, 128), groups=1, prompt=16, completions=2, completion=16369, shared=False),
}


def gathered(k: Tensor, v: Tensor, varlen: Varlen) -> tuple[Tensor, Tensor]:
    return (k[varlen.keys], v[varlen.keys]) if varlen.keys is not None else (k, v)


def cudnn_expanded(q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, scale: float) -> Tensor:
    """trainer/varlen.py's cuDNN kernel with the key and value heads repeated to the query heads."""
    k, v = gathered(k, v, varlen)
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return VARLEN_KERNELS["cudnn"](q.contiguous(), k.contiguous(), v.contiguous(), replace(varlen, keys=None), scale)


def sdpa_rows(q: Tensor, k: Tensor, v: Tensor, varlen: Varlen, scale: float) -> Tensor:
    """Every sequence a row of one length (plain layouts only): (rows, H, L, D), causal."""
    rows, length = len(varlen.cu_q) - 1, varlen.max_q  # all of one length: rows x the longest = every position
    if varlen.keys is not None or rows * length != q.shape[0]:
        raise ValueError("sdpa rows takes sequences of one length over their own keys (a -rows layout)")
    split = [t.view(rows, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*split, is_causal=True, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    return out.transpose(1, 2).reshape(q.shape)


KERNELS: dict[str, Callable[..., Tensor]] = {
    "flash varlen": lambda q, k, v, varlen, scale: attend(q, k, v, varlen, scale, kernel="flash"),
    "cudnn varlen": lambda q, k, v, varlen, scale: attend(q, k, v, varlen, scale, kernel="cudnn"),
    "cudnn varlen, kv expanded": cudnn_expanded,
    "sdpa rows": sdpa_rows,
}
NEEDS_CUDA = {"flash varlen", "cudnn varlen", "cudnn varlen, kv expanded"}  # on a CPU: the reference, not theirs


def inputs(case: Case, varlen: Varlen, *, device: torch.device, dtype: torch.dtype, seed: int = 0) -> list[Tensor]:
    h, hkv, d = case.heads
    n = int(varlen.cu_q[-1])
    gen = torch.Generator(device="cpu").manual_seed(seed)
    return [torch.randn(n, heads, d, generator=gen).to(device, dtype).requires_grad_()
            for heads in (h, hkv, hkv)] + [torch.randn(n, h, d, generator=gen).to(device, dtype)]


def error(case: Case, kernel: Callable[..., Tensor], *, device: torch.device, dtype: torch.dtype) -> float:
    """The kernel's largest error, output and each gradient, relative to the largest value of the
    float32 reference's, on `case`'s layout with the lengths divided by 8."""
    small = case.scaled(8)
    varlen = small.varlen(device)
    q, k, v, grad = inputs(small, varlen, device=device, dtype=dtype)
    scale = case.heads[2] ** -0.5
    got = kernel(q, k, v, varlen, scale)
    got.backward(grad)
    ref_in = [t.detach().float().requires_grad_() for t in (q, k, v)]
    rk, rv = gathered(ref_in[1], ref_in[2], varlen)
    want = reference(ref_in[0], rk.repeat_interleave(case.heads[0] // case.heads[1], dim=1),
                     rv.repeat_interleave(case.heads[0] // case.heads[1], dim=1), varlen.cu_q, varlen.cu_k, scale)
    want.backward(grad.float())
    worst = 0.0
    for a, b in [(got, want)] + [(t.grad, r.grad) for t, r in zip((q, k, v), ref_in, strict=True)]:
        worst = max(worst, ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-6)).item())
    return worst


def timed(case: Case, kernel: Callable[..., Tensor], *, device: torch.device, dtype: torch.dtype,
          warmup: int, iters: int) -> float:
    """Median milliseconds of one forward and backward of `kernel` on `case`."""
    varlen = case.varlen(device)
    q, k, v, grad = inputs(case, varlen, device=device, dtype=dtype)
    scale = case.heads[2] ** -0.5
    cuda = device.type == "cuda"
    times = []
    for i in range(warmup + iters):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        kernel(q, k, v, varlen, scale).backward(grad)
        if cuda:
            torch.cuda.synchronize()
        if i >= warmup:
            times.append((time.perf_counter() - start) * 1e3)
        q.grad = k.grad = v.grad = None
    return statistics.median(times)


def run(cases: list[str], *, dry_run: bool, warmup: int, iters: int) -> list[dict]:
    cuda = torch.cuda.is_available() and not dry_run
    device, dtype = (torch.device("cuda"), torch.bfloat16) if cuda else (torch.device("cpu"), torch.float32)
    tol = 0.05 if dtype == torch.bfloat16 else 1e-4
    rows = []
    for name in cases:
        case = CASES[name].scaled(16) if dry_run else CASES[name]
        for kernel_name, kernel in KERNELS.items():
            row = {"case": name, "kernel": kernel_name, "tokens": case.tokens(), "device": device.type,
                   "dtype": str(dtype).removeprefix("torch.")}
            rows.append(row)
            if kernel_name == "sdpa rows" and case.shared:
                row["skipped"] = "shared prompts: not rows of one length"
                continue
            if kernel_name in NEEDS_CUDA and not cuda:
                row["skipped"] = "needs CUDA in bf16"
                continue
            try:
                row["error"] = error(case, kernel, device=device, dtype=dtype)
                row["ok"] = row["error"] <= tol
                row["ms"] = timed(case, kernel, device=device, dtype=dtype, warmup=warmup, iters=iters)
            except Exception as err:  # noqa: BLE001 - a kernel this torch lacks or refuses is a row's finding
                row["failed"] = f"{type(err).__name__}: {str(err).splitlines()[0][:160] if str(err) else ''}"
            if cuda:
                torch.cuda.empty_cache()
    return rows


HEADER = "| layout | kernel | tokens | forward + backward ms | error vs reference | |"


def table(rows: list[dict]) -> str:
    lines = [HEADER, "|---|---|---|---|---|---|"]
    for r in rows:
        ms = f"{r['ms']:,.2f}" if "ms" in r else "—"
        err = f"{r['error']:.1e}" if "error" in r else "—"
        note = r.get("skipped") and f"skipped: {r['skipped']}" or r.get("failed") and f"failed: {r['failed']}" \
            or ("" if r.get("ok") else "DIFFERS from the reference")
        lines.append(f"| {r['case']} | {r['kernel']} | {r['tokens']:,} | {ms} | {err} | {note} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dry-run", action="store_true", help="lengths / 16, float32 on the CPU: the plumbing")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "attention_gpu", help="where attention_gpu.json goes")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    args = p.parse_args(argv)
    host = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    rows = run(args.cases, dry_run=args.dry_run, warmup=args.warmup, iters=args.iters)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "attention_gpu.json").write_text(json.dumps({"host": host, "argv": sys.argv[1:], "rows": rows},
                                                            indent=1))
    print(f"attention_gpu: {host['device']}, torch {host['torch']}{' (dry run)' if args.dry_run else ''}")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
