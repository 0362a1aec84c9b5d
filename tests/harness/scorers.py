"""Tiny models that score completions, built where a user's would be (tests/test_readme.py's README
blocks, tests/test_scored_run.py's run): a sequence classifier as reward model, and a judge whose
yes or no follows a rule on the last token of its question."""

from collections.abc import Callable
from pathlib import Path

from tests.harness.models import one_layer_llama


def classifier(path: Path, tokenizer_from: Path) -> Path:
    """A one-label Llama sequence classifier with random weights (a score head large enough that
    texts score far apart) and `tokenizer_from`'s tokenizer, saved in `path`."""
    import torch
    from transformers import AutoTokenizer, LlamaForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = one_layer_llama(tokenizer, num_labels=1, pad_token_id=tokenizer.eos_token_id)
    model = LlamaForSequenceClassification(config)
    with torch.no_grad():
        model.score.weight.normal_(0.0, 1.0)
    model.save_pretrained(path, safe_serialization=True)
    return path


def rule_judge(path: Path, tokenizer_from: Path, says_yes: Callable[[int], bool]) -> Path:
    """A causal LM (saved in `path` with `tokenizer_from`'s tokenizer, no chat template) whose greedy
    answer is "yes" when `says_yes(the question's last token id)`, else "no", then its end token: its
    layers add nothing to the residual stream, so each next token depends on the last one alone. A
    question that ends in one of the answers' tokens (`answer_tokens`) gets the rest of that word."""
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_from)
    tokenizer.chat_template = None
    tokenizer.save_pretrained(path)
    for leftover in path.glob("chat_template.*"):
        leftover.unlink()
    yes, no = answer_tokens(tokenizer_from)
    eos = tokenizer.eos_token_id
    after = dict(zip(yes, [*yes[1:], eos], strict=True)) | dict(zip(no, [*no[1:], eos], strict=True))
    assert len(after) == len(yes) + len(no), (yes, no)  # no token in both answers
    model = LlamaForCausalLM(one_layer_llama(tokenizer, pad_token_id=eos, tie_word_embeddings=False))
    assert len(after) + 2 <= model.config.hidden_size
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        embed, head = model.model.embed_tokens.weight, model.lm_head.weight
        embed.zero_()
        head.zero_()
        # direction 0: after a token the rule says no to, "no"; 1: "yes"; 2 on: after each answer token, the next
        head[no[0], 0] = head[yes[0], 1] = 10.0
        for token in range(len(tokenizer)):
            embed[token, 1 if says_yes(token) else 0] = 1.0
        for k, (token, nxt) in enumerate(after.items(), start=2):
            embed[token] = 0.0
            embed[token, k] = 1.0
            head[nxt, k] = 10.0
    model.save_pretrained(path, safe_serialization=True)
    return path


def answer_tokens(tokenizer_dir: Path) -> tuple[list[int], list[int]]:
    """The token ids of "yes" and of "no" in `tokenizer_dir`'s tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    yes, no = (tokenizer(word, add_special_tokens=False)["input_ids"] for word in ("yes", "no"))
    return yes, no


def last_token(tokenizer_dir: Path, text: str) -> int:
    """The last token id of `text` as `tokenizer_dir`'s tokenizer reads it (none added)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)(text, add_special_tokens=False)["input_ids"][-1]
