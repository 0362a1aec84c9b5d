"""What a new weight version costs: full fine-tuning, LoRA merged, LoRA adapter, on the HF and vLLM engines.

    .venv/bin/python ops/bench/lora_publish.py [--model default|qwen2.5-0.5b] [--engines hf vllm]
        [--rank 16] [--repeat 3] [--tokens 8]
    .venv/bin/python ops/bench/lora_publish.py --dry-run         # a tiny model built in-process, HF, seconds
    .venv/bin/python ops/bench/lora_publish.py --demo-steps 30   # the demo's steps/min, LoRA merged vs adapter

For each way of publishing (`full`: every weight trained; `lora merged` and `lora adapter`:
trainer.lora.publish), each version is:
  published  the bytes of the version's directory (what a generator reads);
  publish    the trainer's own path (trainer/checkpoints.py:publish without its Redis transaction and
             trainer state): the state dict, LoRA's merge or the adapter's tensors, the safetensors
             written and checksummed, the directory renamed into place;
  to sample  from the announcement to the engine sampling with it, as a generator does it
             (generators/engine_loop.py): the files' checksums verified (`verify`), the engine's
             `load_weights` (`load`: full weights in place, or the adapter: peft's layers on the HF
             engine, a LoRARequest on vLLM), then one request sampled (`first sample`: one prompt of 16
             tokens, `--tokens` new ones). The same request once more (`again`) is what sampling with
             the version costs once it is in: `first sample` less that is the switch's share.
Best of --repeat, each version's weights changed from the last (a trained step's worth). After the
repeats, the engine's log-probs of what it sampled are checked against the trainer's model (the
version really is the one sampled with). fp32 throughout. Each way opens an engine of its own on the
base model (vLLM with enable_lora for the adapter), not timed.

--model qwen2.5-0.5b builds a model of Qwen2.5-0.5B's shape (Qwen2, hidden 896, 24 layers, 14 heads /
2 kv heads, intermediate 4864, vocab 151936, tied embeddings; random weights, the tiny tokenizer; no
hub) under --work-dir once. --demo-steps N runs the demo (configs/demo.toml under the shipped
Procfile, ops/bench/end_to_end.py's runner, one generator) with LoRA rank --rank published merged,
then as the adapter, N trainer steps each: steps per minute, and the share of the trainer's step
spent publishing (time/publish) or waiting for data, and of a generator's run spent loading
versions (its "loaded weights version" lines), and its tokens per second.
"""

from __future__ import annotations

import argparse
import gc
import re
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

MODES = ("full", "lora merged", "lora adapter")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]  # trainer.lora.target_modules' default
PROMPT = [1, 5, 9, 13, 2, 7, 4, 11, 3, 8, 6, 10, 12, 14, 15, 16]  # ids every model here has
QWEN25_05B = {"hidden_size": 896, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
              "intermediate_size": 4864, "vocab_size": 151936, "tie_word_embeddings": True,
              "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6}
LOGPROB_TOL = 1e-4  # engine against trainer, fp32 (PLATFORM.md: vLLM within 6.4e-6 of HF)


@dataclass
class Version:
    """One version's costs, in seconds (bytes: its directory's)."""

    bytes: int
    publish: float
    verify: float
    load: float
    sample: float
    again: float  # the same request once more: sampling with this version, its switch paid

    @property
    def to_sample(self) -> float:
        return self.verify + self.load + self.sample


@dataclass
class Row:
    engine: str
    mode: str
    trainable: int
    versions: list[Version]

    def best(self, field: str) -> float:
        return min(getattr(v, field) for v in self.versions)


def qwen25_05b(path: Path) -> Path:
    """A Qwen2.5-0.5B-shaped model with random weights and the tiny tokenizer at `path` (built once)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from common.tiny import build_tiny_model

    if (path / "config.json").is_file():
        return path
    tok = build_tiny_model(path.parent / f"{path.name}-tokenizer")
    tmp = path.parent / f".{path.name}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for f in tok.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp / f.name)
    eos = 2  # the tiny tokenizer's <|im_end|>
    torch.manual_seed(0)
    config = Qwen2Config(**QWEN25_05B, eos_token_id=eos, pad_token_id=eos, bos_token_id=None, dtype="float32")
    Qwen2ForCausalLM(config).save_pretrained(tmp, safe_serialization=True)
    tmp.rename(path)
    shutil.rmtree(tok)
    return path


def trainer_model(source: Path, mode: str, rank: int) -> torch.nn.Module:
    from trainer.checkpoints import load_model
    from trainer.lora import apply_lora

    model = load_model(source)
    if mode != "full":
        model = apply_lora(model, rank=rank, alpha=2.0 * rank, dropout=0.0, target_modules=TARGETS)
    return model.eval()


@torch.no_grad()
def train_a_step(model: torch.nn.Module, gen: torch.Generator) -> None:
    """Change what the trainer trains, as a step would: every trainable weight (full) or the adapters
    (LoRA: B drawn too, so the adapter is not the zero it starts at)."""
    for p in model.parameters():
        if p.requires_grad:
            scale = 0.02 if p.ndim == 2 and p.numel() < 1e7 else 0.002  # the embedding barely
            p.add_(torch.randn(p.shape, generator=gen) * scale)


def publish(model: torch.nn.Module, *, mode: str, checkpoint_dir: Path, step: int, source: Path
            ) -> tuple[Path, dict[str, str], float]:
    """trainer/checkpoints.py:publish's weights part: (directory, checksums, seconds)."""
    from trainer.checkpoints import checkpoint_tensors, write_checkpoint
    from trainer.parallel import full_state_dict

    adapter = mode == "lora adapter"
    t0 = time.perf_counter()
    tensors = checkpoint_tensors(model, full_state_dict(model), None, adapter=adapter)
    path, sums = write_checkpoint(model, checkpoint_dir=checkpoint_dir, step=step, source_dir=source,
                                  tensors=tensors, adapter=adapter)
    return path, sums, time.perf_counter() - t0


def open_engine(kind: str, source: Path, *, lora_rank: int):
    if kind == "hf":
        from engines.hf_engine import HFEngine

        return HFEngine(source, dtype="float32", seed=0)
    from engines.vllm_engine import VLLMEngine

    return VLLMEngine(source, dtype="float32", seed=0, threads=torch.get_num_threads(), max_model_len=512,
                      lora_rank=lora_rank)


def close(engine) -> None:
    """Let go of an engine's memory before the next one opens (vLLM's in-process engine core holds it)."""
    if engine.name == "vllm":
        engine.llm.llm_engine.engine_core.shutdown()


@torch.no_grad()
def check_sampled_with(model: torch.nn.Module, sampled, *, what: str) -> None:
    """The engine's log-probs of what it sampled are the trainer model's: it samples with this version."""
    ids = list(sampled.ids)
    logits = model(input_ids=torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1:-1].float()
    want = torch.log_softmax(logits, dim=-1).gather(-1, torch.tensor(ids).unsqueeze(-1)).squeeze(-1)
    off = (torch.tensor(sampled.logprobs) - want).abs().max().item()
    assert off <= LOGPROB_TOL, f"{what}: the engine's log-probs are {off:.2e} off the trainer's: not this version"


def measure(kind: str, mode: str, engine, source: Path, *, rank: int, repeat: int, tokens: int,
            work: Path) -> Row:
    from common.checkpoints import ADAPTER_CONFIG, ADAPTER_FILE, verify_dir
    from engines.base import SamplingSettings

    model = trainer_model(source, mode, rank)
    gen = torch.Generator().manual_seed(0)
    sampling = SamplingSettings(n=1, max_new_tokens=tokens, temperature=1.0)
    checkpoint_dir = work / f"{kind}-{mode.replace(' ', '-')}"
    versions, sampled = [], None
    for step in range(1, repeat + 1):
        train_a_step(model, gen)
        path, sums, publish_s = publish(model, mode=mode, checkpoint_dir=checkpoint_dir, step=step, source=source)
        t0 = time.perf_counter()
        verify_dir(path, sums)  # what a generator checks before it loads
        t1 = time.perf_counter()
        engine.load_weights(path, version=step)
        t2 = time.perf_counter()
        [[sampled]] = engine.sample([PROMPT], sampling)
        t3 = time.perf_counter()
        engine.sample([PROMPT], sampling)
        t4 = time.perf_counter()
        if mode == "lora adapter":
            assert sorted(sums) == [ADAPTER_CONFIG, ADAPTER_FILE], f"{path}: not an adapter alone: {sorted(sums)}"
        versions.append(Version(bytes=sum(f.stat().st_size for f in path.iterdir()), publish=publish_s,
                                verify=t1 - t0, load=t2 - t1, sample=t3 - t2, again=t4 - t3))
        shutil.rmtree(path)  # the trainer keeps a few (trainer.keep_checkpoints); here the disk is shared
    check_sampled_with(model, sampled, what=f"{kind} {mode}")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    del model
    gc.collect()
    return Row(kind, mode, trainable, versions)


def run(source: Path, *, engines: list[str], rank: int, repeat: int, tokens: int, work: Path) -> list[Row]:
    rows = []
    for kind in engines:
        for mode in MODES:  # an engine of its own each: the adapter goes onto the base model as published
            engine = open_engine(kind, source, lora_rank=rank if mode == "lora adapter" else 0)
            row = measure(kind, mode, engine, source, rank=rank, repeat=repeat, tokens=tokens, work=work)
            print(table([row], header=not rows), flush=True)
            rows.append(row)
            close(engine)
            del engine
            gc.collect()
    return rows


def table(rows: list[Row], *, header: bool = True) -> str:
    lines = ["| engine | publish as | trainable | published | publish | verify | load | first sample "
             "| announcement to sample | the same sample again |",
             "|---|---|---|---|---|---|---|---|---|---|"] if header else []
    for r in rows:
        lines.append(f"| {r.engine} | {r.mode} | {r.trainable / 1e6:.2f} M | {r.versions[-1].bytes / 1e6:.1f} MB | "
                     f"{r.best('publish'):.3f} s | {r.best('verify'):.3f} s | {r.best('load'):.3f} s | "
                     f"{r.best('sample'):.3f} s | **{r.best('to_sample'):.3f} s** | {r.best('again'):.3f} s |")
    return "\n".join(lines)


# --------------------------------------------------------------------------- the demo, LoRA both ways

LOADED = re.compile(r"generator\.\d+\s*\|.*loaded weights version \d+ \(verify ([\d.]+) s, reload ([\d.]+) s")
RATE = re.compile(r"generator\.\d+\s*\|.* groups written, (\d+) tok/s")  # the generator's progress lines


def demo(*, steps: int, rank: int, work: Path) -> None:
    """The demo's steps per minute with LoRA published merged, then as the adapter (end_to_end's runner)."""
    from ops.bench.end_to_end import run_pipeline

    for how in ("merged", "adapter"):
        tmp = work / f"demo-{how}"
        shutil.rmtree(tmp, ignore_errors=True)
        t0 = time.monotonic()
        arrivals, metrics = run_pipeline(generators=1, steps=steps, tmp=tmp, env={
            "ROLLOUTS_TRAINER__LORA__RANK": str(rank), "ROLLOUTS_TRAINER__LORA__ALPHA": str(2.0 * rank),
            "ROLLOUTS_TRAINER__LORA__PUBLISH": how})
        wall = time.monotonic() - t0
        timed = metrics[1:]
        publish = sum(m["time/publish"] for m in timed) / sum(m["time/step"] for m in timed)
        wait = sum(m["time/wait_data"] for m in timed) / sum(m["time/step"] for m in timed)
        log = (tmp / "honcho.log").read_text()
        loads = [(float(v), float(r)) for v, r in LOADED.findall(log)]
        rates = [int(t) for t in RATE.findall(log)]
        span = arrivals[-1] - arrivals[0]
        loading = sum(v + r for v, r in loads)
        print(f"demo, LoRA rank {rank} published {how}: {60 * (len(arrivals) - 1) / span:.2f} steps/min over "
              f"{len(arrivals)} steps ({span:.0f} s; {wall:.0f} s with start-up); trainer's time/publish "
              f"{publish:.1%} of time/step (median {statistics.median(m['time/publish'] for m in timed):.2f} s), "
              f"waiting for data {wait:.1%}; generator median {statistics.median(rates or [0])} tok/s, "
              f"{len(loads)} versions loaded, median verify {statistics.median(v for v, _ in loads):.2f} s"
              f" + reload {statistics.median(r for _, r in loads):.2f} s, {loading / span:.1%} of the timed span; "
              f"reward by step {' '.join(format(m['reward'], '.2f') for m in metrics)}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> list[Row]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default",
                    help="default (common/models.py's), qwen2.5-0.5b (its shape, built here) or a checkpoint directory")
    ap.add_argument("--engines", nargs="+", choices=["hf", "vllm"], default=None,
                    help="default: hf and vllm; hf alone with --dry-run")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8, help="new tokens of the first sample")
    ap.add_argument("--dry-run", action="store_true", help="a tiny model built in-process (HF unless --engines)")
    ap.add_argument("--demo-steps", type=int, default=0, help="run the demo both ways instead, this many steps")
    ap.add_argument("--work-dir", type=Path, default=None,
                    help="where versions are written (and the 0.5B model built); default a temporary directory")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    args.engines = args.engines or (["hf"] if args.dry_run else ["hf", "vllm"])
    assert args.repeat >= 1 and args.rank >= 1, "--repeat and --rank must be >= 1"
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    from common.models import resolve_model_path
    from common.tiny import build_tiny_model

    own = args.work_dir is None
    work = Path(tempfile.mkdtemp(prefix="lora-publish-")) if own else args.work_dir
    work.mkdir(parents=True, exist_ok=True)
    try:
        if args.demo_steps:
            demo(steps=args.demo_steps, rank=args.rank, work=work)
            return []
        if args.model == "qwen2.5-0.5b":
            source = qwen25_05b(work / "qwen2.5-0.5b-shape")
        elif args.model != "default":
            source = resolve_model_path(args.model)
        elif args.dry_run:
            source = build_tiny_model(work / "tiny")
        else:
            source = resolve_model_path("")
        print(f"{source}: LoRA rank {args.rank} on {', '.join(TARGETS)}, best of {args.repeat}, "
              f"{args.threads} threads", flush=True)
        return run(source, engines=args.engines, rank=args.rank, repeat=args.repeat, tokens=args.tokens,
                   work=work)
    finally:
        if own:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
