"""The trainer's own step on one GPU against a bare loop on the same tokens, for real model shapes.

    python3 ops/bench/trainer_gpu.py [--out DIR] [--max-seconds 240]
    python3 ops/bench/trainer_gpu.py --shapes qwen3-0.6b --layouts packed16k --ac on off \\
        --mb-tokens 8192 16384 --compile off on
    python3 ops/bench/trainer_gpu.py --dry-run          # tiny shapes on the CPU (the default suite runs it)
    python3 ops/bench/trainer_gpu.py --dtype float32 --shapes qwen2.5-0.5b-4l --layouts grpo-cpu --ac off \
        --mb-tokens 8192 --warmup 1 --steps 2 --profile   # a CPU: the step against the bare loop, real vocabulary

Each row of the sweep builds a randomly initialised model of a named shape (Qwen3-0.6B, Qwen2.5-0.5B,
Qwen3-4B, Qwen3-8B: their config.json's figures and real 151,936-token vocabulary, written out here:
there is no hub on a GPU host) on PyTorch's `meta` device, allocates it on the device (`to_empty`)
and initialises it as transformers does, then gives it the trainer's attention and places it as
the trainer does (trainer/loading.py `with_attention`, trainer/checkpoints.py `place`: bf16
autocast over float32 master weights, activation checkpointing). Then, on synthetic sample groups
(common/messages.py SampleGroup) of a named layout:

  trainer  `trainer.step.train_step` with the options `configs/gsm8k.toml` gives (GrpoOptions.of),
           the row's activation checkpointing, micro-batch tokens and micro-batch size put over it,
           and the trainer's optimizer (trainer/checkpoints.py `adamw`): the step a run takes, its
           batching on the host included;
  bare     the ceiling: each completion with its prompt as one row, rows stacked into micro-batches
           of the same token budget, already on the device; HF forward to the full logits,
           log-softmax cross-entropy, backward, AdamW step (the same `adamw`), the same model,
           precision, activation checkpointing and compile.

Each side runs `--warmup` steps (not timed: compilation, AdamW's state, the allocator) and then
`--steps` timed steps, `torch.cuda.synchronize()` around each; peak memory is
`torch.cuda.max_memory_allocated()` over the side's steps (weights and AdamW state included).
The default rows come in priority order, the targets' first, and `--max-seconds` (default 240:
the sweep fits in four minutes, counted from the start) skips a row whose estimated time does not
fit in what is left, saying so: its steps' FLOPs at the slowest seconds per FLOP its shape's timed
steps have shown (before any, 20% MFU), plus the most a row has spent besides its steps (building,
compiling; before any, 30 s, 90 s compiled). A row whose weights, gradients and AdamW state alone
would not fit in the GPU's memory is skipped; one that runs out of memory is recorded as such (a
bare loop that does keeps the trainer's figures) and the sweep goes on.

The "gsm8k today" row is configs/gsm8k.toml's trainer settings as shipped on 2026-11-27 (micro-
batches of 8 rows and 8,192 tokens, activation checkpointing) on Qwen2.5-0.5B's shape, on the code
checked out: issue 40's 4x is judged against it; against the trainer of before a change, run the
row at that commit too. "gsm8k, auto: off" is configs/gsm8k.toml's micro-batches as shipped now
(read from it) where activation checkpointing's "auto" turns it off (an H200); "gsm8k 2026-11-29,
auto: off" those of 2026-11-29 (8 completions a micro-batch), which that day's sitting measured.

Layouts (tokens: the positions through the model, each row's prompt + completion - 1):

  grpo512    8 groups x 8 completions, prompt 192 + completion 321 tokens: rows of 512 (GSM8K-like
             GRPO rows; 32,768 tokens a step); the trainer shares each group's prompt
  packed16k  1 group x 2 completions of 16,369 after a 16-token prompt: two sequences of 16,384 a
             step, as prime-rl's benchmark measures its RL trainer (seq_len 16384, micro_batches 2)

Tokens/s counts the layout's tokens (the rows as the bare loop runs them) per second of a step: a
trainer that shares prompts or skips padding is credited for the work it spares, and the ratio to
the bare loop is a ratio of step times. MFU follows prime-rl's PerfCounter (src/prime_rl/trainer/
perf.py, PrimeIntellect-ai/prime-rl): 6 x the parameters in matmuls per token (q, k, v, o, the MLP's
three and the head, V x H; not the embedding lookup nor the norms), and with attention
12 x layers x hidden x sequence length per token (prime-rl's 12 * l * h * q with q = hidden // h:
no halving for causal attention; for Qwen3, whose heads x head_dim is twice the hidden size at
0.6B, this is prime-rl's count, not the matmuls' exact one). With that count prime-rl's published
11,896 tokens/s of Qwen3-0.6B at 16,384 on one H100 is its 11.08% MFU (its
benchmarks/baselines/benchmark-1xh100-Qwen--Qwen3-0.6B-rl-full-1gpu-Recompute-flash_attention_3-
16384-cp1-ep1.json; tests/test_trainer_gpu_bench.py checks it). The peak is the GPU's dense bf16
figure (ops/gpu_check.py `peak_flops`; `--peak-tflops` for another).

`--profile` adds one more step of each side under torch's profiler, after its timed ones, and
splits it (`profiled_step`): the device's busy time (the sum of its kernels; on a CPU, of its
operators) as a share of the timed steps' mean (the profiled step itself runs longer: the
profiler's own work on the host), and that busy time by operator (self time): matrix
products, attention, the log-softmax and the losses around it, the optimizer, casts and copies,
the rest; with the ten operators that took the most. Where the trainer falls short of the bare loop,
the two sides' splits say whether it is its own compute (the head's log-probs in chunks, the
loss's statistics), casts, or time the device sat idle (host work, synchronisations). Without
`--profile` the default plan profiles two rows all the same (configs/gsm8k.toml as an H200 runs
it, "gsm8k, auto: off": 2 micro-batches of up to 16,384 tokens; Qwen3-0.6B at 16k without
checkpointing), so that every sitting says where those steps' time goes. A profile that fails
(a profiler the host's CUDA will not give) is named in its row's `profile_errors`: the row's
timed figures stand.

torch.compile is swept as the trainer compiles (trainer.compile: each decoder layer compiled in
place with inductor, `Module.compile`, as torchtitan compiles its blocks; attention left eager).

Writes DIR/trainer_gpu.json (every row, the host, the targets) and DIR/trainer_gpu.md (the table),
after every row, and prints the table, which of issue 40's targets were met, and the fastest
settings of each shape and layout (what the trainer's defaults would be chosen from).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import platform
import sys
import time
import tomllib
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ops.gpu_check import peak_flops  # noqa: E402 - the standard library only: the GPUs' dense bf16 peaks

if TYPE_CHECKING:
    import torch

    from trainer.devices import Placement

GSM8K = ROOT / "configs" / "gsm8k.toml"
GiB = 2**30


# --------------------------------------------------------------------------- shapes and layouts


@dataclass(frozen=True)
class Shape:
    """A model's shape, as its config.json gives it (transformers' Qwen3Config / Qwen2Config)."""

    family: str  # "qwen3" or "qwen2": the config class
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool  # the head is the embedding
    rope_theta: float = 1e6

    def hf_config(self) -> Any:
        """transformers' config of this shape (a Qwen3Config or Qwen2Config)."""
        from transformers import Qwen2Config, Qwen3Config

        common = dict(hidden_size=self.hidden, num_hidden_layers=self.layers, num_attention_heads=self.heads,
                      num_key_value_heads=self.kv_heads, intermediate_size=self.intermediate, vocab_size=self.vocab,
                      tie_word_embeddings=self.tied, rms_norm_eps=1e-6, max_position_embeddings=32768,
                      rope_theta=self.rope_theta, use_sliding_window=False)
        if self.family == "qwen3":
            return Qwen3Config(head_dim=self.head_dim, **common)
        assert self.family == "qwen2", f"unknown family {self.family!r}: qwen3 or qwen2"
        assert self.head_dim * self.heads == self.hidden, "Qwen2's head_dim is hidden // heads"
        return Qwen2Config(**common)

    @property
    def matmul_params(self) -> int:
        """Parameters in matmuls per token, as prime-rl's `get_active_mm_params` counts them."""
        attention = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o; k, v
        return self.layers * (attention + 3 * self.intermediate * self.hidden) + self.vocab * self.hidden

    def flops_per_token(self, seq: int) -> tuple[float, float]:
        """Training FLOPs per token: 6N, and 6N + attention for sequences of `seq` (prime-rl's count)."""
        six_n = 6.0 * self.matmul_params
        return six_n, six_n + 12.0 * self.layers * self.hidden * seq


SHAPES = {
    "qwen3-0.6b": Shape("qwen3", hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, intermediate=3072,
                        vocab=151936, tied=True),
    "qwen2.5-0.5b": Shape("qwen2", hidden=896, layers=24, heads=14, kv_heads=2, head_dim=64, intermediate=4864,
                          vocab=151936, tied=True),
    "qwen3-4b": Shape("qwen3", hidden=2560, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=9728,
                      vocab=151936, tied=True),
    "qwen3-8b": Shape("qwen3", hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288,
                      vocab=151936, tied=False),
    # Qwen2.5-0.5B with 4 of its 24 layers: its vocabulary and widths, a step a CPU takes in seconds
    # (the head a larger share of the step than on the whole model)
    "qwen2.5-0.5b-4l": Shape("qwen2", hidden=896, layers=4, heads=14, kv_heads=2, head_dim=64, intermediate=4864,
                             vocab=151936, tied=True),
    # --dry-run's: the same families, small enough for a CPU
    "tiny-qwen3": Shape("qwen3", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=32, intermediate=128, vocab=512,
                        tied=True),
    "tiny-qwen2": Shape("qwen2", hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=160, vocab=512,
                        tied=True),
}


@dataclass(frozen=True)
class Layout:
    """One step's synthetic groups: `groups` of `completions`, every prompt and completion of one length."""

    groups: int
    completions: int
    prompt: int  # tokens
    completion: int  # tokens

    @property
    def row(self) -> int:
        """Positions of one completion's row: prompt + completion - 1 (inputs predict the next token)."""
        return self.prompt + self.completion - 1

    @property
    def tokens(self) -> int:
        """Positions through the model in one step, the rows laid out one by one (the bare loop's)."""
        return self.groups * self.completions * self.row


LAYOUTS = {
    "grpo512": Layout(groups=8, completions=8, prompt=192, completion=321),
    "packed16k": Layout(groups=1, completions=2, prompt=16, completion=16369),
    "grpo-cpu": Layout(groups=2, completions=4, prompt=64, completion=129),  # with qwen2.5-0.5b-4l, on a CPU
    "grpo-tiny": Layout(groups=2, completions=4, prompt=8, completion=25),
    "packed-tiny": Layout(groups=1, completions=2, prompt=4, completion=125),
}
UNCAPPED = 4096  # micro_batch_size where the micro-batch tokens alone decide


@dataclass(frozen=True)
class Setting:
    """One row of the sweep."""

    shape: str  # a key of SHAPES
    layout: str  # a key of LAYOUTS
    ac: bool  # trainer.activation_checkpointing
    mb_tokens: int  # trainer.micro_batch_tokens
    compile: bool  # each decoder layer torch.compile'd
    mb_size: int = UNCAPPED  # trainer.micro_batch_size
    master_fp32: bool = True  # trainer.master_fp32: float32 weights and AdamW state under bf16 compute
    label: str = ""  # what the row stands for, where it is a target's
    attention: str = ""  # trainer.attention for this row; "": --attention's, else configs/gsm8k.toml's
    profile: bool = False  # one more step a side under the profiler, as --profile gives every row

    def name(self) -> str:
        capped = f" mbs={self.mb_size}" if self.mb_size != UNCAPPED else ""
        return (f"{self.shape} {self.layout} ac={'on' if self.ac else 'off'} mbt={self.mb_tokens} "
                f"compile={'on' if self.compile else 'off'}{capped}{'' if self.master_fp32 else ' bf16-master'}"
                + (f" attention={self.attention}" if self.attention else ""))


TODAY = "gsm8k today"  # configs/gsm8k.toml's trainer as shipped on 2026-11-27: the 4x target's baseline
# configs/gsm8k.toml's micro-batches as shipped now (the code's default where it sets none)
SHIPPED = {"micro_batch_size": 8, "micro_batch_tokens": 0} | tomllib.loads(GSM8K.read_text()).get("trainer", {})


def default_plan(*, dry_run: bool) -> list[Setting]:
    """The rows, the targets' first: what the time budget cuts is the end of the list."""
    if dry_run:
        grpo, packed = dict(shape="tiny-qwen2", layout="grpo-tiny"), dict(shape="tiny-qwen3", layout="packed-tiny")
        return [Setting(**grpo, ac=True, mb_tokens=128, mb_size=4, compile=False, label=TODAY),
                Setting(**grpo, ac=False, mb_tokens=256, compile=False, attention="varlen", profile=True),
                Setting(**packed, ac=False, mb_tokens=128, compile=False)]
    gsm8k, small, big = (dict(shape="qwen2.5-0.5b", layout="grpo512"), dict(shape="qwen3-0.6b", layout="packed16k"),
                         dict(shape="qwen3-4b", layout="packed16k"))
    shipped = dict(mb_tokens=SHIPPED["micro_batch_tokens"], mb_size=SHIPPED["micro_batch_size"])
    return [
        Setting(**gsm8k, ac=True, mb_tokens=8192, mb_size=8, compile=False, label=TODAY),
        # configs/gsm8k.toml as shipped where activation checkpointing's "auto" turns it off (an H200),
        # profiled: where its step's time goes, against the bare loop's
        Setting(**gsm8k, ac=False, **shipped, compile=False, label="gsm8k, auto: off", profile=True),
        # the same with trainer.compile: fewer kernels for a host-bound step, if it beats its compiling
        Setting(**gsm8k, ac=False, **shipped, compile=True, label="gsm8k, auto: off, compiled"),
        # profiled: at 54ab6e3 this row trained at 0.72 of the bare loop, the gap not yet located
        Setting(**small, ac=False, mb_tokens=16384, compile=False, profile=True),
        Setting(**small, ac=True, mb_tokens=16384, compile=False, label="prime-rl's 11.9k"),
        Setting(**big, ac=True, mb_tokens=16384, compile=False, label="3.7k on an H200"),
        # as shipped on 2026-11-29 (8 completions a micro-batch: 8 a step), measured then at 33,768
        Setting(**gsm8k, ac=False, mb_tokens=8192, mb_size=8, compile=False, label="gsm8k 2026-11-29, auto: off"),
        # the same with SDPA's dense document mask instead of "auto"'s varlen on a GPU (trainer/varlen.py)
        Setting(**gsm8k, ac=False, **shipped, compile=False, attention="sdpa", label="gsm8k, auto: off, dense mask"),
        Setting(**gsm8k, ac=False, mb_tokens=8192, compile=False),
        Setting(**small, ac=True, mb_tokens=16384, compile=True),
        Setting(**gsm8k, ac=True, mb_tokens=16384, compile=False),
        Setting(**gsm8k, ac=False, mb_tokens=4096, compile=False),
        Setting(**small, ac=False, mb_tokens=16384, compile=True),
        Setting(**big, ac=True, mb_tokens=16384, compile=True),
        # float32 master weights and AdamW state alone are 131 GB at 8B: bf16 ones where memory allows
        Setting(shape="qwen3-8b", layout="packed16k", ac=True, mb_tokens=16384, compile=False, master_fp32=False),
    ]


def product_plan(*, shapes: list[str], layouts: list[str], acs: list[bool], mb_tokens: list[int],
                 compiles: list[bool]) -> list[Setting]:
    """Every combination asked for, in that order."""
    return [Setting(shape=s, layout=lay, ac=ac, mb_tokens=t, compile=c) for s in shapes for lay in layouts
            for ac in acs for t in mb_tokens for c in compiles]


# --------------------------------------------------------------------------- the groups and the model


def synthetic_groups(layout: Layout, *, vocab: int, seed: int = 0) -> list[Any]:
    """`layout`'s groups: random token ids, behaviour log-probs in [-6, -0.5], rewards alternating 1
    and 0 within each group (every advantage non-zero: every row is trained)."""
    import numpy as np

    from common.messages import Completion, SampleGroup

    rng = np.random.default_rng(seed)
    groups = []
    for g in range(layout.groups):
        completions = [Completion(ids=rng.integers(0, vocab, layout.completion, dtype=np.int64),
                                  logprobs=-rng.uniform(0.5, 6.0, layout.completion).astype(np.float32),
                                  reward=float(i % 2 == 0), rewards={}, finish="stop", text="")
                       for i in range(layout.completions)]
        groups.append(SampleGroup(id=f"bench:{g}", prompt_id=f"bench:{g}", version=0, generator="bench", engine="hf",
                                  prompt_ids=rng.integers(0, vocab, layout.prompt, dtype=np.int64),
                                  completions=completions))
    return groups


def build_model(shape: Shape, where: Placement) -> torch.nn.Module:
    """`shape` built on `meta`, allocated on `where.device` in the master weights' dtype, initialised
    as transformers initialises a fresh model (its rotary buffers included), then given the
    trainer's attention and placed as the trainer places it (trainer/loading.py `placed_model`),
    each decoder layer compiled where `where.compile` says."""
    import torch
    from transformers import AutoModelForCausalLM

    from trainer.checkpoints import place
    from trainer.loading import with_attention

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.hf_config(), dtype=where.weights_dtype)
    model.to_empty(device=where.device)
    model.tie_weights()  # to_empty makes the head a tensor of its own
    model.initialize_weights()
    return place(with_attention(model, where), where)


def state_gib(shape: Shape, *, master_fp32: bool) -> float:
    """GiB the weights, their gradients and AdamW's two moments take, and the bf16 copies autocast
    makes of the weights: a floor under the peak (activations come on top)."""
    params = shape.matmul_params + (0 if shape.tied else shape.vocab * shape.hidden)  # the embedding, where untied
    return params * ((4 if master_fp32 else 2) * 4 + (2 if master_fp32 else 0)) / GiB


# --------------------------------------------------------------------------- the two sides


def timed_steps(step: Callable[[], Any], *, warmup: int, steps: int,
                cuda: bool) -> tuple[list[float], float | None, Any]:
    """`step()` `warmup` times untimed, then `steps` times each timed between device synchronisations.
    Returns the timed seconds, the peak GiB allocated over all of them (None off CUDA), the last result."""
    import torch

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    out = None
    for _ in range(warmup):
        out = step()
    seconds = []
    for _ in range(steps):
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = step()
        if cuda:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - start)
    peak = torch.cuda.max_memory_allocated() / GiB if cuda else None
    return seconds, peak, out


def bare_batches(groups: list[Any], *, mb_tokens: int, mb_size: int,
                 device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each completion with its prompt as one row (inputs, next-token targets), rows stacked into
    micro-batches of at most `mb_size` rows and `mb_tokens` positions (at least one row), on `device`."""
    import numpy as np
    import torch

    rows = [np.concatenate([np.asarray(g.prompt_ids), np.asarray(c.ids)]) for g in groups for c in g.completions]
    length = len(rows[0]) - 1
    assert all(len(r) - 1 == length for r in rows), "the bare loop stacks rows of one length"
    per = max(1, min(mb_size, mb_tokens // length if mb_tokens else len(rows)))
    out = []
    for i in range(0, len(rows), per):
        block = torch.from_numpy(np.stack(rows[i:i + per])).to(device)  # (B, T + 1)
        out.append((block[:, :-1], block[:, 1:]))
    return out


def bare_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
              batches: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """One bare step: forward to the logits, cross-entropy (log-softmax, float32), backward, AdamW."""
    import torch

    model.train()
    optimizer.zero_grad(set_to_none=True)
    total = sum(inputs.numel() for inputs, _ in batches)
    loss_sum = 0.0
    for inputs, targets in batches:
        logits = model(input_ids=inputs, use_cache=False).logits  # (B, T, V)
        loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="sum")
        (loss / total).backward()
        loss_sum += loss.detach()
    optimizer.step()
    return float(loss_sum) / total


def run_setting(s: Setting, out: dict, *, device: torch.device, warmup: int, steps: int,
                dtype: str | None = None, attention: str | None = None, profile: bool = False) -> None:
    """One row into `out`: the trainer's steps, then the bare loop's on the same model with a fresh
    AdamW (each side's figures in `out` as soon as it is done: a bare loop that runs out of memory
    leaves the trainer's). `dtype`: model.dtype instead of configs/gsm8k.toml's (bfloat16). With
    `profile`, one more step of each side under the profiler (`profiled_step`) into out["profile"]."""
    from common.config import load_config
    from trainer.checkpoints import adamw
    from trainer.devices import DTYPES, Placement
    from trainer.step import GrpoOptions, train_step
    from trainer.varlen import VARLEN, varlen_kernel

    shape, layout = SHAPES[s.shape], LAYOUTS[s.layout]
    attention = s.attention or attention
    config = load_config(GSM8K, env={}, overrides={"trainer": {
        "activation_checkpointing": s.ac, "micro_batch_tokens": s.mb_tokens, "micro_batch_size": s.mb_size,
        "master_fp32": s.master_fp32, "compile": s.compile, **({"attention": attention} if attention else {})},
        **({"model": {"dtype": dtype}} if dtype else {})})
    cfg, cuda = config.trainer, device.type == "cuda"
    where = Placement(device=device, dtype=DTYPES[config.model.dtype], master_fp32=cfg.master_fp32,
                      activation_checkpointing=cfg.activation_checkpointing, attention=cfg.attention,
                      compile=cfg.compile)
    groups = synthetic_groups(layout, vocab=shape.vocab)
    model = build_model(shape, where)
    out.update(attention=model.config._attn_implementation, precision=f"{config.model.dtype}" + (
        " (float32 master weights)" if where.weights_dtype != where.dtype else ""))
    if cuda and out["attention"] == VARLEN:  # the kernel trainer/varlen.py chose on this GPU, and why
        choice = varlen_kernel(device, where.dtype)
        out.update(varlen_kernel=choice.kernel, varlen_kernel_why=choice.why)
    how = GrpoOptions.of(cfg, config.rollout)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
    seconds, peak, stats = timed_steps(lambda: train_step(model, optimizer, groups, how=how, step=0),
                                       warmup=warmup, steps=steps, cuda=cuda)
    out["trainer"] = {"seconds": seconds, "peak_gib": peak, "loss": stats.loss, "grad_norm": stats.grad_norm,
                      "skipped": stats.skipped, "tokens_forward": stats.tokens_forward}
    if profile:
        profiled(out, "trainer", lambda: train_step(model, optimizer, groups, how=how, step=0), cuda=cuda)
    del optimizer, stats
    optimizer = adamw(trained, lr=cfg.lr, weight_decay=cfg.weight_decay)
    batches = bare_batches(groups, mb_tokens=s.mb_tokens, mb_size=s.mb_size, device=device)
    seconds, peak, loss = timed_steps(lambda: bare_step(model, optimizer, batches), warmup=warmup, steps=steps,
                                      cuda=cuda)
    out["bare"] = {"seconds": seconds, "peak_gib": peak, "loss": loss, "micro_batches": len(batches),
                   "tokens": sum(inputs.numel() for inputs, _ in batches)}
    if profile:
        profiled(out, "bare", lambda: bare_step(model, optimizer, batches), cuda=cuda)


def profiled(out: dict, side: str, step: Callable[[], Any], *, cuda: bool) -> None:
    """`profiled_step(step)` into out["profile"][side]; where the profiler or the step under it fails,
    the error into out["profile_errors"][side] instead: the side's timed figures, taken before, stand.
    out["profile_s"]: the seconds spent profiling (the step, the profiler's own work and its tables)."""
    start = time.monotonic()
    try:
        out.setdefault("profile", {})[side] = profiled_step(step, cuda=cuda)
    except Exception as err:  # noqa: BLE001 - a profiler a host will not give costs its table only
        out.setdefault("profile_errors", {})[side] = f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    finally:
        out["profile_s"] = out.get("profile_s", 0.0) + time.monotonic() - start


# Operators by what they do, matched on the name's start (after "aten::"), in this order: a step's
# busy time by part (profiled_step). Anything else is "rest" (elementwise, reductions, indexing).
PARTS = (
    ("matmuls", ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "linear", "matmul")),
    ("attention", ("scaled_dot_product", "_scaled_dot_product", "_flash_attention", "_efficient_attention",
                   "flex_attention", "_cudnn_attention")),
    ("log-softmax and loss", ("log_softmax", "_log_softmax", "logsumexp", "softmax", "_softmax", "cross_entropy",
                              "nll_loss", "gather", "exp", "clamp", "minimum", "where")),
    ("optimizer", ("_foreach", "_fused_adam", "addcdiv", "addcmul", "lerp")),
    ("casts and copies", ("copy_", "_to_copy", "to", "clone", "contiguous", "cat", "index_select", "pad")),
)


def part_of(op: str) -> str:
    """Which of PARTS an operator's name (`aten::mm`, `aten::_log_softmax_backward_data`) falls in."""
    name = op.removeprefix("aten::")
    for part, starts in PARTS:
        if any(name == s or name.startswith(s + "_") or (s.startswith("_") and name.startswith(s)) for s in starts):
            return part
    return "rest"


def profiled_step(step: Callable[[], Any], *, cuda: bool) -> dict:
    """One `step()` under torch's profiler: its wall seconds, the device's busy seconds (the sum of
    its kernels on CUDA; of the operators' own CPU time on a CPU), that busy time by PARTS (each
    operator's self time), the ten operators with the most, and on CUDA the kernels (and device
    copies) the step ran, each one the host launched (ops/bench/dispatches.py counts the operators
    behind them on a CPU)."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    events = prof.key_averages()
    ops = [e for e in events if e.device_type == DeviceType.CPU and e.key.startswith("aten::")]

    def own(e: Any) -> float:  # an operator's self time on the device (its kernels), or on the CPU
        return (e.self_device_time_total if cuda else e.self_cpu_time_total) / 1e6

    on_device = [e for e in events if e.device_type == DeviceType.CUDA]
    kernels = sum(e.self_device_time_total for e in on_device) / 1e6
    parts = dict.fromkeys([p for p, _ in PARTS] + ["rest"], 0.0)
    for e in ops:
        parts[part_of(e.key)] += own(e)
    busy = kernels if cuda and kernels > 0 else sum(parts.values())
    top = sorted(((e.key, own(e)) for e in ops), key=lambda kv: -kv[1])[:10]
    return {"wall_s": wall, "busy_s": busy, "parts_s": parts, "top": [[k, v] for k, v in top if v > 0],
            "kernels": sum(e.count for e in on_device) if cuda else None}


# --------------------------------------------------------------------------- figures


def figures(s: Setting, measured: dict, *, peak: float | None) -> dict:
    """Tokens/s of each side measured, their ratio, and the trainer's MFU (6N, and with attention)."""
    shape, layout = SHAPES[s.shape], LAYOUTS[s.layout]
    six_n, with_attention = shape.flops_per_token(layout.row)
    out = {}
    for side in ("trainer", "bare"):
        if side in measured:
            seconds = measured[side]["seconds"]
            out[f"{side}_tokens_per_s"] = layout.tokens * len(seconds) / sum(seconds)
    if "trainer" not in measured:
        return out
    tps = out["trainer_tokens_per_s"]
    out["ratio"] = tps / out["bare_tokens_per_s"] if "bare" in measured else None
    out["mfu_6n"] = six_n * tps / peak if peak else None
    out["mfu_attention"] = with_attention * tps / peak if peak else None
    return out


def row_flops(s: Setting, *, steps: int) -> float:
    """FLOPs of `steps` steps of both sides of row `s` (with attention)."""
    shape, layout = SHAPES[s.shape], LAYOUTS[s.layout]
    return 2 * steps * layout.tokens * shape.flops_per_token(layout.row)[1]


def estimate_s(s: Setting, *, warmup: int, steps: int, rate: float | None, overhead: dict[bool, float],
               peak: float | None) -> float:
    """Seconds row `s` should take: its steps' FLOPs (both sides, warm-up included) at `rate` seconds
    per FLOP (the slowest timed steps of its shape so far), plus the most a row of its kind
    (compiled or not) has spent besides its steps (building the model, compiling); before either is
    measured, 20% of `peak` and 30 s (90 s compiled). 0 where neither is known (a CPU's first row)."""
    flops = row_flops(s, steps=warmup + steps)
    if rate is None and not peak:
        return 0.0
    guess = 90.0 if s.compile else 30.0
    return flops * (rate if rate is not None else 1 / (0.2 * peak)) + overhead.get(s.compile, guess if peak else 0.0)


def number(value: float | None, spec: str) -> str:
    return "—" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


ATTENTION_NAMES = {"rollouts_varlen": "varlen"}  # the model's implementation as trainer.attention names it

HEADER = ("| shape | layout | AC | mb tokens | compile | tokens/s | MFU 6N | MFU +attn | peak GiB | bare tokens/s "
          "| ratio | note |")


def table(rows: list[dict]) -> str:
    """The markdown table of `rows` (ran or not)."""
    lines = [HEADER, "|" + "---|" * (HEADER.count("|") - 1)]
    for r in rows:
        s = r["setting"]
        note = "; ".join(x for x in (s["label"], "" if s["master_fp32"] else "bf16 weights and AdamW state",
                                     f"attention {ATTENTION_NAMES.get(r['attention'], r['attention'])}"
                                     + (f" ({r['varlen_kernel']})" if r.get("varlen_kernel") else "")
                                     if r.get("attention") else "",
                                     "" if r["status"] == "ran" else f"{r['status']}: {r['reason']}") if x)
        lines.append(
            f"| {s['shape']} | {s['layout']} | {'on' if s['ac'] else 'off'} | {s['mb_tokens']} "
            f"| {'on' if s['compile'] else 'off'} | {number(r.get('trainer_tokens_per_s'), ',.0f')} "
            f"| {number(r.get('mfu_6n'), '.1%')} | {number(r.get('mfu_attention'), '.1%')} "
            f"| {number((r.get('trainer') or {}).get('peak_gib'), '.1f')} "
            f"| {number(r.get('bare_tokens_per_s'), ',.0f')} | {number(r.get('ratio'), '.2f')} | {note} |")
    return "\n".join(lines)


PROFILE_HEADER = ("| shape | layout | AC | mb tokens | side | step ms | profiled ms | kernels | busy | " + " | ".join(
    [p for p, _ in PARTS] + ["rest"]) + " |")


def profile_table(rows: list[dict]) -> str:
    """Each profiled side's timed step (the mean of its timed steps), the step under the profiler
    (longer: the profiler's own work on the host), the device's busy time as a share of the timed
    step, and that busy time by part, likewise: what is left of 100% beside `busy` the device sat
    idle in an unprofiled step (kernels take as long under the profiler; the host does not)."""
    lines = [PROFILE_HEADER, "|" + "---|" * (PROFILE_HEADER.count("|") - 1)]
    for r in rows:
        s = r["setting"]
        for side, p in (r.get("profile") or {}).items():
            timed = r[side]["seconds"]
            step = sum(timed) / len(timed)
            lines.append(f"| {s['shape']} | {s['layout']} | {'on' if s['ac'] else 'off'} | {s['mb_tokens']} | {side} "
                         f"| {step * 1e3:,.1f} | {p['wall_s'] * 1e3:,.1f} | {number(p.get('kernels'), ',.0f')} "
                         f"| {p['busy_s'] / step:.0%} | "
                         + " | ".join(f"{v / step:.1%}" for v in p["parts_s"].values()) + " |")
    return "\n".join(lines)


def best(rows: list[dict], shape: str, layout: str, key: str = "trainer_tokens_per_s") -> dict | None:
    """The row of `shape` and `layout` with the most `key` (a side that ran out of memory after the
    other was measured leaves that one's figure); None: none measured."""
    have = [r for r in rows if r.get(key) is not None and r["setting"]["shape"] == shape
            and r["setting"]["layout"] == layout]
    return max(have, key=lambda r: r[key]) if have else None


def fastest(rows: list[dict]) -> list[str]:
    """For each shape and layout measured, its fastest trainer row's settings and figures."""
    out = []
    for shape, layout in dict.fromkeys((r["setting"]["shape"], r["setting"]["layout"]) for r in rows):
        top = best(rows, shape, layout)
        if top is not None:
            peak = (top.get("trainer") or {}).get("peak_gib")
            out.append(f"{Setting(**top['setting']).name()}: {top['trainer_tokens_per_s']:,.0f} tokens/s"
                       + (f", peak {peak:.1f} GiB" if peak is not None else ""))
    return out


def targets(rows: list[dict], *, device: str, dry_run: bool) -> list[dict]:
    """Issue 40's targets, each met, not met or not measured, with the figures it was judged on."""
    if dry_run:
        return [{"target": "issue 40's targets", "met": None, "why": "a dry run (tiny shapes, CPU)"}]
    out = []
    for shape, layout, floor, where in (("qwen3-0.6b", "packed16k", 11_900, "one H100 or H200"),
                                        ("qwen3-4b", "packed16k", 3_700, "one H200")):
        top = best(rows, shape, layout)
        name = f"{shape} {layout} >= {floor:,} tokens/s on {where}"
        if top is None:
            out.append({"target": name, "met": None, "why": "no row of it ran (skipped, or not in the sweep)"})
            continue
        tps = top["trainer_tokens_per_s"]
        off = "" if "H200" in device or (where != "one H200" and "H100" in device) else f" (measured on {device})"
        out.append({"target": name, "met": tps >= floor and not off,
                    "why": f"best {tps:,.0f} tokens/s ({Setting(**top['setting']).name()}){off}"})
    today = next((r for r in rows if r.get("trainer_tokens_per_s") and r["setting"]["label"] == TODAY), None)
    top = best(rows, "qwen2.5-0.5b", "grpo512")
    name = "gsm8k trainer step (qwen2.5-0.5b grpo512) >= 4x its tokens/s today"
    if today is None or top is None:
        out.append({"target": name, "met": None, "why": "no row of it ran (skipped, or not in the sweep)"})
    else:
        gain = top["trainer_tokens_per_s"] / today["trainer_tokens_per_s"]
        out.append({"target": name, "met": gain >= 4.0,
                    "why": f"{gain:.2f}x: today {today['trainer_tokens_per_s']:,.0f}, best "
                           f"{top['trainer_tokens_per_s']:,.0f} tokens/s ({Setting(**top['setting']).name()})"})
    measured = sorted({(r["setting"]["shape"], r["setting"]["layout"]) for r in rows
                       if r.get("trainer_tokens_per_s")})
    for shape, layout in measured:
        top, ceiling = best(rows, shape, layout), best(rows, shape, layout, key="bare_tokens_per_s")
        name = f"{shape} {layout}: trainer >= 0.9 of the bare loop"
        if ceiling is None:
            out.append({"target": name, "met": None, "why": "no bare loop of it ran"})
            continue
        share = top["trainer_tokens_per_s"] / ceiling["bare_tokens_per_s"]
        out.append({"target": name, "met": share >= 0.9,
                    "why": f"{share:.2f}: best trainer {top['trainer_tokens_per_s']:,.0f}, best bare loop "
                           f"{ceiling['bare_tokens_per_s']:,.0f} tokens/s"})
    return out


# --------------------------------------------------------------------------- the sweep


def sweep(plan: list[Setting], *, device: torch.device, peak: float | None, warmup: int, steps: int,
          max_seconds: float, started: float, report: Callable[[list[dict]], None],
          dtype: str | None = None, attention: str | None = None, profile: bool = False) -> list[dict]:
    """Each setting of `plan` run (or skipped, with the reason) in turn; `report(rows)` after each."""
    import torch

    rows: list[dict] = []
    rate: dict[str, float] = {}  # shape -> the slowest seconds per FLOP of its timed steps so far
    overhead: dict[bool, float] = {}  # compiled or not -> the most a row spent besides its steps
    total_gib = torch.cuda.get_device_properties(device).total_memory / GiB if device.type == "cuda" else None
    for s in plan:
        row: dict = {"setting": asdict(s), "status": "ran", "reason": ""}
        shape = SHAPES[s.shape]
        profiles = profile or s.profile  # one more step a side, profiled
        need = estimate_s(s, warmup=warmup + profiles, steps=steps, rate=rate.get(s.shape), overhead=overhead,
                          peak=peak)
        left = max_seconds - (time.monotonic() - started)
        floor = state_gib(shape, master_fp32=s.master_fp32)
        if total_gib is not None and floor > 0.95 * total_gib:
            row.update(status="skipped", reason=f"does not fit: weights, gradients and AdamW state alone "
                                                f"~{floor:.0f} GiB of {total_gib:.0f} GiB")
        elif need > left:
            row.update(status="skipped", reason=f"time budget: ~{need:.0f} s needed, {max(left, 0):.0f} s of "
                                                f"--max-seconds {max_seconds:g} left")
        else:
            t0 = time.monotonic()
            try:
                run_setting(s, row, device=device, warmup=warmup, steps=steps,
                            dtype=dtype, attention=attention, profile=profiles)
            except torch.cuda.OutOfMemoryError as err:
                side = "the bare loop" if "trainer" in row else "the trainer"
                row.update(status="out of memory", reason=f"{side}: {str(err).splitlines()[0][:160]}")
            except Exception as err:  # a compiler stack that fails here fails its rows only
                if not s.compile:
                    raise
                row.update(status="failed", reason=f"torch.compile: {type(err).__name__}: {str(err)[:160]}")
            row["seconds"] = time.monotonic() - t0
            row.update(figures(s, row, peak=peak))
            if row["status"] == "ran":
                timed = sum(row["trainer"]["seconds"]) + sum(row["bare"]["seconds"])
                rate[s.shape] = max(rate.get(s.shape, 0.0), timed / row_flops(s, steps=steps))
                # building, compiling: what the next rows' estimates add (profiling is this row's own)
                besides = row["seconds"] - timed * (warmup + steps) / steps - row.get("profile_s", 0.0)
                overhead[s.compile] = max(overhead.get(s.compile, 0.0), besides)
            if device.type == "cuda":  # what the row held (an out-of-memory's traceback too) goes back
                gc.collect()
                torch.cuda.empty_cache()
        print(f"trainer_gpu: {s.name()}: {row['status']}"
              + (f" {row['trainer_tokens_per_s']:,.0f} tokens/s, bare {row['bare_tokens_per_s']:,.0f}"
                 if row["status"] == "ran" else f" ({row['reason']})"), flush=True)
        rows.append(row)
        report(rows)
    return rows


def host(device: torch.device) -> dict:
    import torch
    import transformers

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"
    return {"device": name, "device_type": device.type, "torch": torch.__version__, "cuda": torch.version.cuda,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "hostname": platform.node()}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="trainer_gpu.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU: the plumbing, no figures")
    p.add_argument("--out", type=Path, default=ROOT / "runs" / "trainer_gpu", help="where the JSON and table go")
    p.add_argument("--max-seconds", type=float, default=240.0, help="skip the rows that would not fit in this")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps a side (default 2; dry run 1)")
    p.add_argument("--steps", type=int, default=None, help="timed steps a side (default 3; dry run 1)")
    p.add_argument("--peak-tflops", type=float, default=None, help="dense bf16 peak, for a GPU ops/gpu_check.py lacks")
    p.add_argument("--dtype", choices=["bfloat16", "float32", "float16"], default=None,
                   help="model.dtype (default configs/gsm8k.toml's bfloat16; dry run float32: bf16 is slow on a CPU)")
    p.add_argument("--attention", choices=["auto", "sdpa", "flex_attention", "varlen"], default=None,
                   help="trainer.attention (default configs/gsm8k.toml's: auto, varlen on a GPU in bf16); "
                        "flex_attention on CUDA only")
    p.add_argument("--profile", action="store_true",
                   help="one more step a side under torch's profiler: busy time by part (matmuls, attention, ...)")
    p.add_argument("--shapes", nargs="+", choices=sorted(SHAPES), help="sweep these instead of the default plan")
    p.add_argument("--layouts", nargs="+", choices=sorted(LAYOUTS), default=["packed16k"])
    p.add_argument("--ac", nargs="+", choices=["on", "off"], default=["on"])
    p.add_argument("--mb-tokens", nargs="+", type=int, default=[16384])
    p.add_argument("--compile", nargs="+", choices=["on", "off"], default=["off"])
    args = p.parse_args(argv)
    assert args.max_seconds >= 0, f"--max-seconds must be >= 0, got {args.max_seconds}"
    assert all(t > 0 for t in args.mb_tokens), f"--mb-tokens must be positive, got {args.mb_tokens}"
    args.warmup = (1 if args.dry_run else 2) if args.warmup is None else args.warmup
    args.steps = (1 if args.dry_run else 3) if args.steps is None else args.steps
    args.dtype = ("float32" if args.dry_run else None) if args.dtype is None else args.dtype
    args.argv_line = " ".join(sys.argv[1:] if argv is None else argv)
    assert args.warmup >= 0 and args.steps >= 1, f"--warmup >= 0 and --steps >= 1, got {args.warmup}, {args.steps}"
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse(argv)
    import torch

    from trainer.devices import trainer_device

    device = torch.device("cpu") if args.dry_run else trainer_device()
    threads = torch.get_num_threads()
    if args.dry_run:  # tiny matrices: one thread, not a fight for a shared machine's cores
        torch.set_num_threads(1)
    try:
        return sweep_and_report(args, device=device, started=started)
    finally:
        torch.set_num_threads(threads)


def sweep_and_report(args: argparse.Namespace, *, device: torch.device, started: float) -> int:
    """The sweep `args` ask for on `device`, its table and targets printed and written."""
    info = host(device)
    peak = args.peak_tflops * 1e12 if args.peak_tflops else (peak_flops(info["device"]) if device.type == "cuda"
                                                             else None)
    plan = product_plan(shapes=args.shapes, layouts=args.layouts, acs=[a == "on" for a in args.ac],
                        mb_tokens=args.mb_tokens, compiles=[c == "on" for c in args.compile]) if args.shapes \
        else default_plan(dry_run=args.dry_run)
    args.out.mkdir(parents=True, exist_ok=True)
    def report(rows: list[dict], met: list[dict] | None = None) -> None:
        data = {"host": info, "peak_flops": peak, "argv": args.argv_line, "warmup": args.warmup, "steps": args.steps,
                "dtype": args.dtype or "configs/gsm8k.toml's",
                "attention": args.attention or "configs/gsm8k.toml's",
                "max_seconds": args.max_seconds, "elapsed_s": time.monotonic() - started,
                "layouts": {k: asdict(v) | {"row": v.row, "tokens": v.tokens} for k, v in LAYOUTS.items()},
                "rows": rows, "targets": met, "fastest": fastest(rows)}
        (args.out / "trainer_gpu.json").write_text(json.dumps(data, indent=1, default=str))
        (args.out / "trainer_gpu.md").write_text(table(rows) + "\n" + (
            "\n" + profile_table(rows) + "\n" if any("profile" in r for r in rows) else ""))

    print(f"trainer_gpu: {len(plan)} rows on {info['device']} ({device.type}), {args.warmup} warm-up + "
          f"{args.steps} timed steps a side, --max-seconds {args.max_seconds:g}", flush=True)
    rows = sweep(plan, device=device, peak=peak, warmup=args.warmup, steps=args.steps, max_seconds=args.max_seconds,
                 started=started, report=report, dtype=args.dtype,
                 attention=args.attention, profile=args.profile)
    met = targets(rows, device=info["device"], dry_run=args.dry_run)
    report(rows, met)
    print()
    print(table(rows))
    print()
    if any("profile" in r for r in rows):
        print(profile_table(rows))
        print()
    for r in rows:
        for side, error in r.get("profile_errors", {}).items():
            print(f"profile: {Setting(**r['setting']).name()}: the {side}'s profile failed: {error}")
    for t in met:
        verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
        print(f"target: {t['target']}: {verdict}: {t['why']}")
    for line in fastest(rows):  # what the trainer's defaults would be, from these figures
        print(f"fastest: {line}")
    print(f"trainer_gpu: {time.monotonic() - started:.0f} s; {args.out / 'trainer_gpu.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
