"""Token log-probs and entropy of a causal LM without its full-vocabulary logits.

`model(...).logits` is (B, T, V); for a 150k-token vocabulary at T = 4096 that is 2.4 GiB per
sequence in float32, held again by autograd for the backward pass. Here the model runs to its
final hidden states (B, T, H) only (its own head sees one position), and the head is applied a
chunk of positions at a time: logits of the chunk -> float32 -> log-softmax at the targets
(as trainer/grpo.py `token_logprobs`), and the entropy alike. Each chunk's logits are made again
in the backward pass, so autograd keeps only the hidden states, never a chunk's logits: the peak
is about one chunk of `chunk_tokens` rows of V float32 values, whatever B and T are. A plain
linear head without truncation goes through trainer/head.py (its own forward and backward, few
V-wide passes); any other, through `_chunk` under activation checkpointing.

With `positions` (the loss mask) the head is applied only where it is true: a GRPO or SFT
loss reads no prompt or padding position, and on the demo's shapes (prompts of ~40 tokens,
completions of ~15, right-padded) those are about four positions in five. The head (the
tied 49k x 576 embedding of the default model) and its V-wide log-softmax cost a quarter of
a step's compute per position; elsewhere the result is 0.

With `packed` (a `Packed` built on the host by trainer/batch.py) the body runs on packed
sequences instead of the right-padded rows: a micro-batch's sequences end to end in one row, no
padding, each attending only to itself (a document mask) at its own positions (`position_ids`
restart at each), so each hidden state is the one its row would give; a group's completions
sharing their prompt follow it in one sequence, each attending to the prompt and to itself only.
The head then reads the packed hidden state that predicts each wanted target. The mask is dense
(bool for SDPA, additive for eager attention: the CPU's path, where SDPA's fused kernel takes it)
or a flex attention BlockMask (the CUDA path: `trainer.devices.attention_implementation`), which
computes only the blocks a document sees instead of L x L pairs.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torch.utils.checkpoint import checkpoint

from trainer.grpo import TRUNCATED_LOGP, truncate
from trainer.head import fusable, head_logprobs
from trainer.varlen import LAYOUT_KWARG, VARLEN, Varlen, layout, no_mask
from trainer.vision import showing


@dataclass(frozen=True, slots=True)
class Packed:
    """A micro-batch's sequences packed end to end (S rows of L positions; trainer/batch.py makes
    one row): each document a row's prompt and completion inputs, or a group's prompt once followed
    by the inputs (tokens but the last) of each completion sharing it."""

    ids: Tensor  # (S, L) int64 token ids, right-padded with 0
    position_ids: Tensor  # (S, L) int64: 0.. from each document's start, a completion continuing its prompt's
    docs: Tensor  # (S, L) int64: each position's document (0, 1, ... along its row), -1 on padding
    segments: Tensor  # (S, L) int64: 0 on a document's prompt, j + 1 on completion j's inputs, -1 on padding
    # (B * T,) int64: for each flat position row * T + t of the rows' right-padded layout, the flat
    # position s * L + l of the packed hidden state that predicts targets[row, t] (0 off completions).
    at: Tensor
    images: tuple[bytes, ...] = ()  # a vision-language model's images, each document's prompt's in order
    varlen: Varlen | None = None  # the rows as varlen sequences (trainer/varlen.py), made on the host beforehand

    def attention(self, kind: str) -> Tensor | BlockMask | Varlen:
        """The attention mask: a position sees the earlier positions of its own document that are
        its prompt or its own completion; padding sees itself only (no row all masked: no NaN).
        `kind`: "bool" (S, 1, L, L), True to attend, for SDPA; "float", additive float32 (0 or the
        float32 minimum), for eager attention; "block", a flex attention BlockMask of the same rule;
        "varlen", the same rule as variable-length causal sequences (`varlen`, else made here)."""
        docs, seg = self.docs, self.segments
        if kind == "varlen":
            return self.varlen if self.varlen is not None else self.with_varlen().varlen
        if kind == "block":
            def sees(b: Tensor, _h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                key = seg[b, kv]
                return ((q >= kv) & (docs[b, q] == docs[b, kv]) & (seg[b, q] >= 0) & ((key == 0) | (key == seg[b, q]))
                        ) | (q == kv)
            length = seg.shape[1]
            return create_block_mask(sees, B=seg.shape[0], H=None, Q_LEN=length, KV_LEN=length, device=seg.device)
        assert kind in ("bool", "float"), f"unknown mask kind {kind!r}: expected bool, float or block"
        idx = torch.arange(seg.shape[1], device=seg.device)
        earlier = idx[:, None] >= idx[None, :]  # (L, L): query >= key
        key, query = seg[:, None, :], seg[:, :, None]  # (S, 1, L), (S, L, 1)
        sees = earlier & (docs[:, :, None] == docs[:, None, :]) & (query >= 0) & ((key == 0) | (key == query))
        mask = (sees | (idx[:, None] == idx[None, :]))[:, None]  # (S, 1, L, L)
        if kind == "bool":
            return mask
        return torch.zeros(mask.shape, dtype=torch.float32, device=seg.device).masked_fill(
            ~mask, torch.finfo(torch.float32).min)

    def with_varlen(self) -> Packed:
        """These rows with their varlen layout (trainer/varlen.py `layout`), on their device."""
        from trainer.devices import to_device

        return replace(self, varlen=to_device(layout(self.docs.cpu().numpy(), self.segments.cpu().numpy()),
                                              self.docs.device))


# attention implementations that take a packed mask, and the mask each takes
PACKED_ATTENTION = {"sdpa": "bool", "eager": "float", "flex_attention": "block", VARLEN: "varlen"}


def packed_attention(model: torch.nn.Module) -> str | None:
    """The model's attention implementation if a packed mask gives its numbers (sdpa, eager,
    flex_attention; every layer attending to all earlier positions), else None. A custom mask
    replaces the one transformers would build, sliding windows included, so a model with windowed
    layers is not packed (it runs on the right-padded rows)."""
    config = getattr(model, "config", None)
    windowed = getattr(config, "sliding_window", None) is not None or any(
        kind != "full_attention" for kind in getattr(config, "layer_types", None) or ())
    impl = getattr(config, "_attn_implementation", None) or "eager"
    return impl if impl in PACKED_ATTENTION and not windowed else None


def final_hidden(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | BlockMask | Varlen,
                 position_ids: Tensor | None = None, images: tuple[bytes, ...] = (),
                 prompt_at: Tensor | None = None, pixels: dict[str, Tensor] | None = None,
                 docs: Tensor | None = None) -> Tensor:
    """The hidden states the model's head is applied to, (B, T, H): the decoder's output, caught as
    the whole model runs (its forward hooks, FSDP's unsharding and mixed precision included). A
    vision-language model's `images` (the sequences' in order) go in as the pixel values its
    processor makes of them, their features in place of the image tokens of the prompt positions
    `prompt_at` (trainer/vision.py `showing`; `docs`: the packed rows' documents, for 3-D positions);
    `pixels`: those pixel values made beforehand (else here). `attention_mask` a packed micro-batch's
    `Varlen`: it goes to each attention call (trainer/varlen.py `attention`) instead of a mask."""
    caught: list[Tensor] = []
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: caught.append(out.last_hidden_state))
    extra = {} if position_ids is None else {"position_ids": position_ids}
    if isinstance(attention_mask, Varlen):
        extra[LAYOUT_KWARG], attention_mask = attention_mask, no_mask(input_ids.device)
    if getattr(getattr(model, "config", None), "output_router_logits", False):
        # an MoE config asking for the router's loss: trainer/moe.py takes it over the trained
        # positions; the model's own (over its mask's positions) would not take a packed mask
        extra["output_router_logits"] = False
    try:
        with showing(model, input_ids, images, prompt_at, pixels, position_ids=position_ids,
                     docs=docs) if images else nullcontext({}) as shown:
            model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, logits_to_keep=1,
                  **{**extra, **shown})  # Qwen2-VL's 3-D positions over the 1-D ones
    finally:
        hook.remove()
    assert len(caught) == 1, f"the decoder ran {len(caught)} times in one forward pass"
    return caught[0]


def _chunk(head: torch.nn.Module, hidden: Tensor, targets: Tensor, temperature: float,
           entropy: bool, top_k: int, top_p: float) -> tuple[Tensor, Tensor]:
    """Log-prob of each target under the sampler's distribution (temperature, then top-k and
    top-p as trainer/grpo.py `token_logprobs`) and (if `entropy`, else zeros) the entropy of the
    untruncated distribution, for one chunk of positions."""
    logits = head(hidden.to(head.weight.dtype)).float()  # (B, c, V): the only V-wide tensors
    if temperature != 1.0:  # x / 1.0 is x: a pass over the V-wide logits spared, and its backward's
        logits = logits / temperature
    lse = torch.logsumexp(logits, dim=-1)  # (B, c)
    if top_k > 0 or top_p < 1.0:
        cut = truncate(logits, top_k=top_k, top_p=top_p)
        picked = cut.gather(-1, targets.unsqueeze(-1)).squeeze(-1)  # (B, c), -inf where cut
        logp = (picked - torch.logsumexp(cut, dim=-1)).clamp(min=TRUNCATED_LOGP)
    else:
        logp = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse  # (B, c)
    if not entropy:
        return logp, torch.zeros_like(lse).detach()
    with torch.no_grad():  # -sum p log p = lse - sum p logits: two V-wide temporaries fewer than with log p
        ent = lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # (B, c)
    return logp, ent


def sequence_logprobs(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor, targets: Tensor, *,
                      temperature: float, top_k: int = 0, top_p: float = 1.0, entropy: bool = False,
                      chunk_tokens: int = 1024, positions: Tensor | None = None,
                      packed: Packed | None = None, images: tuple[bytes, ...] = (),
                      pixels: dict[str, Tensor] | None = None) -> tuple[Tensor, Tensor | None]:
    """log_softmax(logits / temperature) at `targets`, (B, T), and with `entropy` the entropy of that
    distribution at each position, (B, T) in nats without gradient (else None). Equal to
    `token_logprobs(model(...).logits, ...)` and `token_entropy` up to float rounding; with
    `positions` ((N,) int64 flat indices row * T + t, e.g. `MicroBatch.trained_at`) only there,
    both 0 elsewhere. With `packed` as well (the same rows packed, `MicroBatch.packed`) the body
    runs on the packed sequences (the same numbers, fewer positions), unless the model's attention
    implementation takes no packed mask (`packed_attention`: then on `input_ids` as without it).
    `images`: a vision-language model's, the rows' in order (`MicroBatch.images`; packed, `packed.images`);
    `pixels`: the pixel inputs of `packed.images` made once for the micro-batch (`MicroBatch.pixels`),
    None: made in this pass."""
    assert temperature > 0, f"temperature must be > 0, got {temperature}"
    assert chunk_tokens > 0, f"chunk_tokens must be > 0, got {chunk_tokens}"
    assert input_ids.shape == targets.shape, f"input_ids {tuple(input_ids.shape)} vs targets {tuple(targets.shape)}"
    assert positions is None or (positions.dim() == 1 and not positions.is_floating_point()), (
        f"positions must be flat integer indices, got {positions.dtype} of shape {tuple(positions.shape)}")
    head = model.get_output_embeddings()
    impl = packed_attention(model) if packed is not None else None
    if impl is not None and positions is not None:
        hidden = final_hidden(model, packed.ids, packed.attention(PACKED_ATTENTION[impl]), packed.position_ids,
                              images=packed.images, prompt_at=packed.segments == 0, pixels=pixels, docs=packed.docs)
        return _at_positions(head, hidden, targets, positions, temperature=temperature, top_k=top_k, top_p=top_p,
                             entropy=entropy, chunk_tokens=chunk_tokens, rows_at=packed.at[positions])
    hidden = final_hidden(model, input_ids, attention_mask, images=images)  # (B, T, H)
    if positions is None:  # every position: the head's chunks run over them all the same
        positions = torch.arange(targets.numel(), device=targets.device)
    return _at_positions(head, hidden, targets, positions, temperature=temperature, top_k=top_k, top_p=top_p,
                         entropy=entropy, chunk_tokens=chunk_tokens)


def _at_positions(head: torch.nn.Module, hidden: Tensor, targets: Tensor, positions: Tensor, *, temperature: float,
                  top_k: int, top_p: float, entropy: bool, chunk_tokens: int,
                  rows_at: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
    """`sequence_logprobs`' head part at the flat `positions` only, scattered back to (B, T)
    with 0 elsewhere; the hidden state of each is `hidden`'s flat row at `rows_at` ((N,), the
    packed positions predicting them) or else at the position itself (`hidden` (B, T, H)).
    With no position at all the head still sees one (its result dropped), so
    the backward pass reaches every parameter: under FSDP each rank's backward runs the same
    collectives, a rank whose micro-batch trains nothing included."""
    shape = targets.shape
    index = positions  # (N,) flat positions
    source = index if rows_at is None else rows_at  # (N,) flat rows of hidden
    n_wanted = index.numel()
    if n_wanted == 0:
        index, source = index.new_zeros(1), source.new_zeros(1)
    rows, picked = hidden.reshape(-1, hidden.shape[-1])[source], targets.reshape(-1)[index]  # (N, H), (N,)
    if fusable(head) and top_k == 0 and top_p == 1.0:
        logp, ent = head_logprobs(head, rows, picked, temperature=temperature, entropy=entropy,
                                  chunk_tokens=chunk_tokens)
    else:
        logps, ents = [], []
        for start in range(0, index.numel(), chunk_tokens):
            args = (head, rows[None, start:start + chunk_tokens], picked[None, start:start + chunk_tokens],
                    temperature, entropy, top_k, top_p)
            if torch.is_grad_enabled() and rows.requires_grad:  # recompute in backward: keep no logits
                logp, ent = checkpoint(_chunk, *args, use_reentrant=False)
            else:
                logp, ent = _chunk(*args)
            logps.append(logp[0])
            ents.append(ent[0])
        logp, ent = torch.cat(logps), torch.cat(ents)  # (N,)
    if n_wanted == 0:
        logp, ent = logp * 0, ent * 0  # keeps the graph, adds nothing
    out = logp.new_zeros(shape.numel()).index_add(0, index, logp).view(shape)  # (B, T)
    return out, ent.new_zeros(shape.numel()).index_add(0, index, ent).view(shape) if entropy else None
