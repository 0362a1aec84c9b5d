"""A tiny Llama model and tokenizer built in-process, and a GSM8K-shaped data set, for tests, quick
demos and `ops/gpu-check` (no hub needed)."""

from __future__ import annotations

from pathlib import Path

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def _corpus() -> list[str]:
    lines = []
    for a in range(0, 30):
        for b in range(0, 30, 7):
            lines.append(f"What is {a} + {b}? Answer with just the number. {a + b}")
            lines.append(f"What is {a} - {b}? The answer is {a - b}.")
    lines += ["user", "assistant", "system", "Answer with just the number."]
    return lines


def build_tiny_model(path: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0,
                     max_positions: int = 512, heads: int = 2, kv_heads: int = 1,
                     intermediate: int | None = None) -> Path:
    """Write a randomly initialised Llama with the tiny BPE tokenizer (384 tokens) and chat template
    to `path`: by default a tiny one; `hidden`, `layers`, `heads`, `kv_heads` and `intermediate`
    (default 2 x hidden) give it another model's shape (Qwen2.5-0.5B: 896, 24, 14, 2, 4864) with the
    tiny vocabulary."""
    assert hidden % heads == 0 and heads % kv_heads == 0, \
        f"hidden ({hidden}) must divide into heads ({heads}), and heads into kv_heads ({kv_heads})"
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=intermediate or hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=max_positions, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path


GSM8K_TEMPLATE = "Tom has {a} apples and buys {b} more. How many apples does he have?"


def write_gsm8k(root: str | Path, n: int = 300) -> Path:
    """`openai/gsm8k` as a local directory under `root` with the hub data set's layout (subset main,
    train and test splits), which `datasets.load_dataset("openai/gsm8k", "main")` run from `root`
    reads before the hub: `n` GSM8K-shaped problems, four fifths of them train. Returns the directory."""
    import json

    rows = [{"question": GSM8K_TEMPLATE.format(a=a, b=b),
             "answer": f"{a} + {b} = <<{a}+{b}={a + b}>>{a + b}\n#### {a + b}"}
            for a in range(1, 61) for b in range(1, 6)][:n]
    base = Path(root) / "openai/gsm8k"
    (base / "main").mkdir(parents=True)
    for split, part in (("train", rows[: n * 4 // 5]), ("test", rows[n * 4 // 5:])):
        (base / f"main/{split}-00000-of-00001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    (base / "README.md").write_text("---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n"
                                    "    path: main/train-*\n  - split: test\n    path: main/test-*\n---\n")
    return base


# The run the fault, chaos and soak harnesses share: 4 prompts of 4 completions of 8 tokens a
# step, staleness 1, an HF generator and one thread a process.
TINY_RUN: dict[str, dict[str, object]] = {
    "rollout": {"group_size": 4, "prompts_per_step": 4, "max_staleness": 1, "max_new_tokens": 8},
    "generator": {"engine": "hf", "batch_prompts": 2, "threads": 1},
    "trainer": {"lr": 1e-3, "micro_batch_size": 8, "threads": 1},
}


def tiny_run_config(*, run: str, output_dir: str | Path | None = None,
                    model: str | Path | dict[str, object] | None = None,
                    redis_url: str | None = None, base: dict[str, dict[str, object]] | None = None,
                    **tables: dict[str, object]) -> str:
    """The TOML text of a TINY_RUN on `model`; each of `tables` adds to (or overrides) the table
    of its name: `trainer={"max_steps": 30}`, `eval={"every": 2}`. `model` is its path, or its
    whole table; `base` stands in for TINY_RUN (`base={}`: only the fields given)."""
    top: dict[str, object] = {"run": run}
    if output_dir is not None:
        top["output_dir"] = str(output_dir)
    if redis_url is not None:
        top["redis_url"] = redis_url
    merged: dict[str, dict[str, object]] = {}
    if model is not None:
        merged["model"] = model if isinstance(model, dict) else {"path": str(model)}
    for name, table in (TINY_RUN if base is None else base).items():
        merged[name] = {**table, **tables.pop(name, {})}
    merged.update(tables)
    lines = [f"{k} = {_toml(v)}" for k, v in top.items()]
    for name, table in merged.items():
        lines += [f"[{name}]", *(f"{k} = {_toml(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def _toml(value: object) -> str:
    """`value` (a string, number, bool, or a list or dict of them) as a TOML literal."""
    import json

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):  # an inline table
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    raise TypeError(f"no TOML literal for {type(value).__name__} {value!r}")
