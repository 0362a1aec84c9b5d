"""A tiny Llama model and tokenizer built in-process, for tests and quick demos (no hub needed)."""

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


def build_tiny_model(path: str | Path, *, hidden: int = 64, layers: int = 2, seed: int = 0) -> Path:
    """Write a randomly initialised tiny Llama with a BPE tokenizer and chat template to `path`."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=384, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|im_end|>",
                                   pad_token="<|im_end|>", unk_token=None)
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=hidden, intermediate_size=hidden * 2,
                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=512, eos_token_id=fast.eos_token_id,
                      pad_token_id=fast.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path, safe_serialization=True)
    return path
