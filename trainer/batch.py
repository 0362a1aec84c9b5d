"""Sample groups to training rows, and rows to micro-batches: packed end to end (the default) or
right-padded.

Groups decoded from the stream hold numpy arrays (common/messages.py); rows keep them as they are
and `collate` builds each micro-batch's tensors with a few numpy calls and `torch.from_numpy`,
never a Python list per token. Groups holding lists (built in process) are taken too."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from common.config import TrainerConfig
from common.messages import SampleGroup, token_versions
from common.shaping import Estimator, completion_advantages
from trainer.logprobs import Packed

# the config's defaults (trainer.share_prompts, trainer.pack_sequences), for callers that pass none
SHARE_PROMPTS: bool = TrainerConfig.model_fields["share_prompts"].default
PACK: bool = TrainerConfig.model_fields["pack_sequences"].default


@dataclass(frozen=True, slots=True)
class Row:
    """One completion as a next-token training sequence (prompt + completion, shifted by one),
    held as its parts: `collate` lays many rows out in tensors with a few numpy calls, never
    walking their tokens in Python."""

    prompt: np.ndarray  # prompt token ids
    ids: np.ndarray  # completion token ids
    trained: np.ndarray  # (len(ids),) bool: the completion tokens trained on
    logprobs: np.ndarray  # (len(ids),) float32: the generator's log-prob of each completion token
    advantage: float  # group-relative advantage of the completion
    versions: np.ndarray | None = None  # (len(ids),) the weight version that sampled each completion
    # token; None: version 0 everywhere
    group: int = -1  # the index of its group among the step's (this rank's) groups
    teacher: np.ndarray | None = None  # (len(ids),) float32: the teacher's log-prob of each completion token;
    # None: no teacher scored it (on-policy distillation: common/teacher.py)
    images: tuple[bytes, ...] = ()  # its prompt's images (SampleGroup.images): the model sees their pixels
    experts: np.ndarray | None = None  # (len(ids), layers, top_k): the experts that sampled each completion
    # token (routing replay: Completion.experts); None: the model routes it itself

    @property
    def length(self) -> int:
        """Positions of the sequence: len(prompt + completion) - 1."""
        return len(self.prompt) + len(self.ids) - 1

    # The row as the model sees it, as lists (for reading; collate never builds these).
    @property
    def inputs(self) -> list[int]:  # (prompt + completion)[:-1]
        return np.concatenate([self.prompt, self.ids])[:-1].tolist()

    @property
    def targets(self) -> list[int]:  # (prompt + completion)[1:]
        return np.concatenate([self.prompt, self.ids])[1:].tolist()

    @property
    def mask(self) -> list[int]:  # 1 where targets[t] is a trained completion token
        return [0] * (len(self.prompt) - 1) + self.trained.astype(int).tolist()

    @property
    def behaviour_logp(self) -> list[float]:  # generator's log-prob of targets[t] on completion positions, else 0
        return [0.0] * (len(self.prompt) - 1) + self.logprobs.astype(float).tolist()


@dataclass(frozen=True, slots=True)
class MicroBatch:
    """A pass's rows as the losses read them, right-padded (B, T); the model body runs on `packed`
    where it is set (and the model's attention takes its mask), on `input_ids` otherwise."""

    input_ids: Tensor  # (B, T) int64, right-padded with 0
    attention_mask: Tensor  # (B, T) int64, 0 on padding
    targets: Tensor  # (B, T) int64
    mask: Tensor  # (B, T) float32, 1 on trained completion tokens
    behaviour_logp: Tensor  # (B, T) float32
    advantages: Tensor  # (B,) float32
    versions: Tensor  # (B, T) int64, weight version that sampled each target token (padding: the row's last)
    # the distinct versions of the trained tokens, found on the host when the batch is built (the
    # mismatch's staleness buckets, read without a device read). Kept equal to `mask` by `with_mask`.
    trained_versions: tuple[int, ...]
    # (N,) int64: the flat positions (row * T + t) where `mask` is 1, found on the host when the batch
    # is built, so the head is applied there without a device-side nonzero (no host sync on a GPU;
    # a meta-device dry run can index with it). Kept equal to `mask` by `with_mask`.
    trained_at: Tensor
    # The same rows packed end to end, the body's input (trainer.pack_sequences), or None: the padded rows.
    packed: Packed | None = None
    # (B,) host array: each row's group, its index among the step's groups (Row.group; -1: none)
    group_of: np.ndarray | None = None
    # On-policy distillation (rows with teacher log-probs), else None: (B, T) float32 the per-token
    # reverse-KL sample k = behaviour_logp - teacher log-prob on the trained tokens a teacher scored,
    # 0 elsewhere; and (B, T) float32 1 on those tokens.
    teacher_kl: Tensor | None = None
    teacher_at: Tensor | None = None
    # A vision-language model's images, each row's in order (the packed layout's: `packed.images`):
    # the trainer turns them into pixel values as the generator did (common/vision.py); (): none.
    images: tuple[bytes, ...] = ()
    # The pixel inputs of `packed.images` on the model's device (trainer/vision.py `pixel_values_of`),
    # made once when the step batches them (trainer/step.py `step_batches`) and read by each of the
    # micro-batch's passes, or None: each pass makes its own.
    pixels: dict[str, Tensor] | None = None
    # Routing replay (rows whose completions carry their experts), else None: (R,) int64 the flat
    # positions (row * T + t) that predict those completion tokens, and (R, layers, top_k) int32 the
    # experts each MoE layer uses there (trainer/moe.py `replayed_routing`).
    experts_at: Tensor | None = None
    experts: Tensor | None = None


def group_rows(group: SampleGroup, *, estimator: Estimator = "grpo", overlong: str = "none",
               overlong_penalty: float = 0.0, objective: str = "grpo", index: int = -1) -> list[Row]:
    """A group's completions as rows; advantages from the group's scalar rewards (0 for the sft
    objective, which has none and takes groups of any size).

    A completion whose reward failed (raised, timed out, returned garbage: `reward_error`) has no
    reward: it is left out of its group's advantage statistics and trains on none of its tokens;
    a group with fewer than 2 scored completions left trains on nothing.
    Overlong completions (finish == "length"): "mask" keeps them in the advantage baseline but
    trains on none of their tokens; "penalty" subtracts `overlong_penalty` from their reward
    before the advantages are computed. `index`: the group's among the step's (Row.group).
    """
    assert objective == "sft" or len(group.completions) >= 2, \
        f"group {group.id}: {len(group.completions)} completions, need >= 2"
    assert overlong in ("none", "mask", "penalty"), f"overlong must be none, mask or penalty, got {overlong!r}"
    if objective == "sft":
        found: list[float | None] = [0.0] * len(group.completions)
    else:
        found = completion_advantages(group, estimator=estimator, overlong=overlong, overlong_penalty=overlong_penalty)
    scored = [a is not None for a in found]
    advantages = [a or 0.0 for a in found]
    prompt = np.asarray(group.prompt_ids)
    rows = []
    for c, adv, ok in zip(group.completions, advantages, scored, strict=True):
        ids = np.asarray(c.ids)
        if (overlong == "mask" and c.finish == "length") or not ok:
            trained = np.zeros(len(ids), dtype=bool)
        elif c.loss_mask is None:
            trained = np.ones(len(ids), dtype=bool)
        else:
            trained = np.asarray(c.loss_mask, dtype=bool)
        teacher = None if c.teacher_logprobs is None else np.asarray(c.teacher_logprobs, dtype=np.float32)
        rows.append(Row(prompt=prompt, ids=ids, trained=trained, logprobs=np.asarray(c.logprobs, dtype=np.float32),
                        advantage=float(adv),
                        versions=token_versions(c, group_version=group.version), group=index, teacher=teacher,
                        experts=c.experts, images=tuple(group.images)))
    return rows


def collate(rows: list[Row]) -> MicroBatch:
    """Right-pad `rows` to their longest into one micro-batch: each row's parts are copied into
    the padded arrays as whole slices (a few numpy calls per row, none per token)."""
    assert rows, "collate needs at least one row"
    shape = (len(rows), max(row.length for row in rows))
    input_ids, targets = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    attention = np.zeros(shape, dtype=np.int64)
    mask, logp = np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.float32)
    versions = np.zeros(shape, dtype=np.int64)
    taught = any(row.teacher is not None for row in rows)
    kl, at = (np.zeros(shape, dtype=np.float32), np.zeros(shape, dtype=np.float32)) if taught else (None, None)
    for i, row in enumerate(rows):
        p, end = len(row.prompt), row.length  # completion token j is the target at position p - 1 + j
        input_ids[i, :p] = row.prompt
        input_ids[i, p:end] = row.ids[:-1]
        targets[i, :p - 1] = row.prompt[1:]
        targets[i, p - 1:end] = row.ids
        attention[i, :end] = 1
        mask[i, p - 1:end] = row.trained
        logp[i, p - 1:end] = row.logprobs
        if row.versions is not None:  # prompt positions: the first token's version; padding: the last's
            versions[i, :p - 1], versions[i, p - 1:end], versions[i, end:] = \
                row.versions[0], row.versions, row.versions[-1]
        if row.teacher is not None and kl is not None and at is not None:  # on the trained tokens only: an
            at[i, p - 1:end] = row.trained  # episode's environment tokens have no teacher log-prob
            kl[i, p - 1:end] = np.where(row.trained, row.logprobs - row.teacher, np.float32(0.0))
    routed = [(i * shape[1] + len(row.prompt) - 1, row.experts)  # completion token 0's flat position, its experts
              for i, row in enumerate(rows) if row.experts is not None]
    return MicroBatch(
        experts_at=torch.from_numpy(np.concatenate([np.arange(at, at + len(e)) for at, e in routed]))
        if routed else None,
        experts=torch.from_numpy(np.concatenate([e for _, e in routed]).astype(np.int32)) if routed else None,
        input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention),
        targets=torch.from_numpy(targets), mask=torch.from_numpy(mask), behaviour_logp=torch.from_numpy(logp),
        advantages=torch.tensor([row.advantage for row in rows], dtype=torch.float32),
        versions=torch.from_numpy(versions), trained_versions=tuple(np.unique(versions[mask > 0]).tolist()),
        trained_at=torch.from_numpy(np.flatnonzero(mask)),
        group_of=np.array([row.group for row in rows], dtype=np.int64),
        images=tuple(img for row in rows for img in row.images),
        teacher_kl=None if kl is None else torch.from_numpy(kl),
        teacher_at=None if at is None else torch.from_numpy(at),
    )


def prompt_length(rows: list[Row]) -> int:
    """Positions of `rows` (completions of one prompt) packed: the prompt once, then each
    completion's inputs."""
    return len(rows[0].prompt) + sum(max(len(row.ids) - 1, 0) for row in rows)


def pack(docs: list[list[Row]], width: int, *, hidden_size: int = 0) -> Packed:
    """`docs` (each a run of rows sharing their prompt, often one row, in the order `collate` lays
    the rows out, right-padded to `width`) end to end in packed rows: each document its prompt
    once, then each of its rows' completion inputs, its positions counted from its own start. One
    row, unless `hidden_size` (> 0: the attention computes every pair of a row's positions, as
    SDPA's and eager attention's dense mask does) makes rows of a few documents each cheaper
    (`packed_rows`): then each row holds whole documents, right-padded to the longest row."""
    sizes = [prompt_length(d) for d in docs]
    placed = packed_rows(sizes, hidden_size)  # each document's (row, offset)
    rows_n = 1 + max((r for r, _ in placed), default=0)
    length = max((o + n for (_, o), n in zip(placed, sizes, strict=True)), default=0)
    ids, position_ids = np.zeros((rows_n, length), dtype=np.int64), np.zeros((rows_n, length), dtype=np.int64)
    doc_of, segments = np.full((rows_n, length), -1, dtype=np.int64), np.full((rows_n, length), -1, dtype=np.int64)
    at = np.zeros(sum(len(d) for d in docs) * width, dtype=np.int64)
    i = 0  # the row's index in the right-padded layout
    for d, (rows, (s, start)) in enumerate(zip(docs, placed, strict=True)):
        prompt = rows[0].prompt
        p, offset, base = len(prompt), start, s * length  # base: the packed row's first flat position
        for row in rows[1:]:
            assert np.array_equal(row.prompt, prompt) and row.images == rows[0].images, \
                f"rows packed together must share their prompt: {row.prompt.tolist()} vs {prompt.tolist()}"
        ids[s, offset:offset + p], position_ids[s, offset:offset + p], segments[s, offset:offset + p] = \
            prompt, np.arange(p), 0
        offset += p
        for j, row in enumerate(rows):
            n = len(row.ids)
            k = max(n - 1, 0)  # its inputs: its tokens but the last
            ids[s, offset:offset + k], segments[s, offset:offset + k] = row.ids[:-1], j + 1
            position_ids[s, offset:offset + k] = np.arange(p, p + k)
            # completion token 0 is predicted at the prompt's last position, token m at its input m - 1;
            # in the padded layout it is the target at t = p - 1 + m
            at[i * width + p - 1:i * width + p - 1 + n] = base + np.concatenate([[start + p - 1], np.arange(
                offset, offset + k)])[:n]
            offset += k
            i += 1
        doc_of[s, start:offset] = d
    order = sorted(range(len(docs)), key=lambda d: placed[d])  # the documents as the packed rows hold them
    return Packed(ids=torch.from_numpy(ids), position_ids=torch.from_numpy(position_ids),
                  docs=torch.from_numpy(doc_of), segments=torch.from_numpy(segments), at=torch.from_numpy(at),
                  images=tuple(img for d in order for img in docs[d][0].images))  # each prompt's, once


def packed_rows(sizes: list[int], hidden_size: int = 0) -> list[tuple[int, int]]:
    """Where each document of `sizes` positions goes in a packed micro-batch: (row, offset). One row
    end to end where `hidden_size` is 0 (an attention that computes only each document's pairs: flex
    attention's BlockMask). Else the cheapest by `body_cost` of every row count S: the documents
    spread over S rows longest first, each into the row with the fewest positions so far, every
    row right-padded to the longest (each row's documents in their order). A dense mask computes
    every pair of a row: one row of 8,192 positions holds 3x the pairs of three rows of 2,731,
    two thirds of them between documents that never see each other."""
    offsets = list(itertools.accumulate(sizes, initial=0))[:-1]
    if hidden_size <= 0 or len(sizes) < 2:
        return [(0, offset) for offset in offsets]
    order = sorted(range(len(sizes)), key=lambda d: -sizes[d])  # stable: ties keep their order
    best, best_cost = [0] * len(sizes), body_cost(sum(sizes), hidden_size)
    for n in range(2, len(sizes) + 1):
        if n * body_cost(sizes[order[0]], hidden_size) >= best_cost:
            break  # n rows each as long as the longest document at least: more rows cost more still
        fill, row_of = [(0, r) for r in range(n)], [0] * len(sizes)  # a heap: the emptiest row, then the first
        for d in order:
            used, r = heapq.heappop(fill)
            row_of[d] = r
            heapq.heappush(fill, (used + sizes[d], r))
        cost = n * body_cost(max(used for used, _ in fill), hidden_size)
        if cost < best_cost:
            best, best_cost = row_of, cost
    placed, ends = [], [0] * (1 + max(best))
    for d, r in enumerate(best):  # in their order within a row
        placed.append((r, ends[r]))
        ends[r] += sizes[d]
    return placed


def collate_packed(docs: list[list[Row]], *, hidden_size: int = 0) -> MicroBatch:
    """`collate` of the documents' rows (in order), with their packed layout (`pack`): the
    documents end to end in one row, or in a few where `hidden_size` (a dense mask's) makes that
    cheaper."""
    mb = collate([row for rows in docs for row in rows])
    return replace(mb, packed=pack(docs, mb.input_ids.shape[1], hidden_size=hidden_size))


def prompt_runs(rows: list[Row]) -> list[list[Row]]:
    """`rows` as consecutive runs of equal prompts (compared by value, their images too: two pictures
    behind the same image tokens are two prompts)."""
    runs: list[list[Row]] = []
    for row in rows:
        if runs and np.array_equal(runs[-1][0].prompt, row.prompt) and runs[-1][0].images == row.images:
            runs[-1].append(row)
        else:
            runs.append([row])
    return runs


ATTENTION_COST = 0.15  # a (query, key) pair's cost per layer against a position's, times the hidden size


def body_cost(length: int, hidden_size: int) -> float:
    """The model body's cost of one sequence of `length` positions, in positions: the linear
    layers (~4H^2 + 3HI multiply-adds a position, I ~ 3H) and attention (~2H a pair of
    positions) make a pair worth about 0.15 / H of a position. 0: the pairs are not counted."""
    return length + (length * length * ATTENTION_COST / hidden_size if hidden_size > 0 else 0.0)


def documents(rows: list[Row], *, micro_batch_size: int, micro_batch_tokens: int = 0, hidden_size: int = 0,
              share_prompts: bool = SHARE_PROMPTS) -> list[list[Row]]:
    """`rows` as the documents of packed micro-batches: each row alone or, with `share_prompts`,
    runs of rows sharing a prompt (one document: the prompt once, then each completion's inputs),
    a run cut into pieces each carrying the prompt where it holds more than `micro_batch_size`
    rows or `micro_batch_tokens` positions (> 0) (a piece of one completion too long goes alone),
    or where its attention would cost more than the prompt saves (`body_cost` with the model's
    `hidden_size`: long completions after a short prompt go as their own rows)."""
    if not share_prompts:
        return [[row] for row in rows]
    pieces: list[list[Row]] = []
    for run in prompt_runs(rows):
        piece: list[Row] = []
        for row in run:
            longer = prompt_length([*piece, row])
            too_big = micro_batch_tokens > 0 and longer > micro_batch_tokens
            dearer = bool(piece) and body_cost(longer, hidden_size) > (
                body_cost(prompt_length(piece), hidden_size) + body_cost(row.length, hidden_size))
            if piece and (len(piece) >= micro_batch_size or too_big or dearer):
                pieces.append(piece)
                piece = []
            piece.append(row)
        pieces.append(piece)
    return pieces


def balance(docs: list[list[Row]], *, micro_batch_size: int, micro_batch_tokens: int = 0,
            at_least: int = 1) -> list[list[list[Row]]]:
    """`docs` as micro-batches balanced by tokens: the fewest (and at least `at_least`) that hold at
    most `micro_batch_size` rows and, where `micro_batch_tokens` > 0, that many packed positions
    each (a document longer than that goes alone), filled longest document first into the one
    with the fewest tokens so far. Empty micro-batches are left out; each keeps its documents in
    their order."""
    assert micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}"
    assert micro_batch_tokens >= 0, f"micro_batch_tokens must be >= 0, got {micro_batch_tokens}"
    if not docs:
        return []
    sizes = [prompt_length(d) for d in docs]
    n = max(at_least, -(-sum(len(d) for d in docs) // micro_batch_size),
            -(-sum(sizes) // micro_batch_tokens) if micro_batch_tokens > 0 else 1)
    order = sorted(range(len(docs)), key=lambda i: -sizes[i])  # stable: ties keep their order
    while True:
        bins: list[list[int]] = [[] for _ in range(n)]
        tokens, counts = [0] * n, [0] * n
        for i in order:
            fits = [b for b in range(n) if counts[b] + len(docs[i]) <= micro_batch_size and (
                micro_batch_tokens == 0 or tokens[b] + sizes[i] <= micro_batch_tokens or counts[b] == 0)]
            if not fits:
                break
            b = min(fits, key=lambda b: tokens[b])
            bins[b].append(i)
            tokens[b], counts[b] = tokens[b] + sizes[i], counts[b] + len(docs[i])
        else:
            return [[docs[i] for i in sorted(b)] for b in bins if b]
        n += 1


def split_packs(rows: list[Row], *, micro_batch_size: int, micro_batch_tokens: int = 0, hidden_size: int = 0,
                share_prompts: bool = SHARE_PROMPTS, at_least: int = 1) -> list[list[list[Row]]]:
    """`rows` as packed micro-batches of documents (`documents`, `balance`)."""
    return balance(documents(rows, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                             hidden_size=hidden_size, share_prompts=share_prompts),
                   micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens, at_least=at_least)


def split_rows(rows: list[Row], *, micro_batch_size: int, micro_batch_tokens: int = 0) -> list[list[Row]]:
    """Consecutive runs of `rows`, each at most `micro_batch_size` rows and, where
    `micro_batch_tokens` > 0, at most that many padded tokens (rows x longest row); a row longer
    than the budget goes alone. Order is kept, so the step's update does not depend on the split.
    """
    assert micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}"
    assert micro_batch_tokens >= 0, f"micro_batch_tokens must be >= 0, got {micro_batch_tokens}"
    out: list[list[Row]] = []
    current: list[Row] = []
    width = 0
    for row in rows:
        w = max(width, row.length)
        too_many = len(current) >= micro_batch_size
        too_big = micro_batch_tokens > 0 and (len(current) + 1) * w > micro_batch_tokens
        if current and (too_many or too_big):
            out.append(current)
            current, w = [], row.length
        current.append(row)
        width = w
    if current:
        out.append(current)
    return out


class Part(NamedTuple):
    """One mini-batch of a step: its micro-batches and the counts of all its rows (the loss's
    normalisers), those left out of the micro-batches (`skip_zero`) included."""

    batches: list[MicroBatch]
    tokens: int  # trained (loss-masked) completion tokens
    seqs: int  # completions with a trained token
    rows: int  # completions, trained or not
    # the rows of the groups left out of `batches` (`probe_rows`), for a no-gradient pass that
    # measures each group's mismatch (trainer/quarantine.py judges generators by it)
    probes: tuple[MicroBatch, ...] = ()


def micro_batches(groups: list[SampleGroup], *, micro_batch_size: int, micro_batch_tokens: int = 0,
                  estimator: Estimator = "grpo", overlong: str = "none", overlong_penalty: float = 0.0,
                  objective: str = "grpo", share_prompts: bool = SHARE_PROMPTS, pack: bool = PACK,
                  hidden_size: int = 0, dense_rows: bool = False) -> tuple[list[MicroBatch], int, int]:
    """The step's micro-batches, its trained-token count and its count of trained sequences."""
    part = mini_batches(groups, parts=1, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                        estimator=estimator, overlong=overlong, overlong_penalty=overlong_penalty,
                        objective=objective, share_prompts=share_prompts, pack=pack, hidden_size=hidden_size,
                        dense_rows=dense_rows)[0]
    return part.batches, part.tokens, part.seqs


def with_gradient(rows: list[Row]) -> list[Row]:
    """The rows of `rows` whose gradient can be non-zero under a loss that is a multiple of the
    advantage (trained tokens and an advantage other than 0); where none is, the first row with
    a trained token (else the first row), so that a rank still runs a pass, its gradient 0."""
    kept = [row for row in rows if row.advantage != 0.0 and row.trained.any()]
    return kept or [next((row for row in rows if row.trained.any()), rows[0])]


def probe_rows(rows: list[Row], passed: list[Row]) -> list[Row]:
    """The rows of `rows` with a trained token, not in `passed`, of the groups with no row of a
    non-zero advantage in `passed`: with `passed` they measure every group on all its rows."""
    measured = {row.group for row in passed if row.advantage != 0.0}
    ids = {id(row) for row in passed}
    return [row for row in rows if row.group not in measured and id(row) not in ids and row.trained.any()]


def mini_batches(groups: list[SampleGroup], *, parts: int, micro_batch_size: int, micro_batch_tokens: int = 0,
                 estimator: Estimator = "grpo", overlong: str = "none", overlong_penalty: float = 0.0,
                 objective: str = "grpo", share_prompts: bool = SHARE_PROMPTS, pack: bool = PACK,
                 hidden_size: int = 0, skip_zero: bool = False,
                 agree: Callable[[int], int] | None = None, dense_rows: bool = False) -> list[Part]:
    """The step's rows in `parts` consecutive mini-batches of near-equal row counts (PPO's
    mini-batches, one optimizer step each). Advantages are the whole groups' whichever
    mini-batch a row lands in. With `skip_zero` (a loss whose gradient is a multiple of the
    advantage, no KL term) the rows whose advantage is 0 are left out of the micro-batches
    (`with_gradient`): they add nothing to the update, and the part's counts still include them,
    so the loss is the one every row gives; the rows of the groups left out go in `probes`.

    With `pack` (trainer.pack_sequences) each micro-batch is its rows packed end to end, no
    padding (`split_packs`, `collate_packed`): documents of one row or, with `share_prompts`, of
    a group's rows sharing its prompt, spread over the fewest micro-batches the budgets allow,
    balanced by tokens. `agree` (a collective under torchrun: the most over the ranks) turns this
    rank's count of a mini-batch's micro-batches into the count every rank then fills, so that
    the ranks' micro-batches pair up balanced. With `dense_rows` as well (an attention that takes
    a dense packed mask: every pair of a row computed) a micro-batch's documents go in a few
    packed rows where that costs less than one (`packed_rows`, by `hidden_size`). Without `pack`
    the rows are bucketed by length (sorted, stably) and split into right-padded micro-batches
    (`split_rows`, `collate`): the path of models whose attention takes no packed mask. The
    mini-batch's update is a sum over its rows, whichever micro-batch each lands in."""
    rows = [row for i, group in enumerate(groups) for row in group_rows(
        group, estimator=estimator, overlong=overlong, overlong_penalty=overlong_penalty, objective=objective,
        index=i)]
    assert 1 <= parts <= len(rows), f"{len(rows)} completions cannot make {parts} mini-batches"
    bounds = [len(rows) * i // parts for i in range(parts + 1)]
    out = []

    def batched(rows: list[Row], agree: Callable[[int], int] | None = None) -> list[MicroBatch]:
        if pack:
            split = partial(split_packs, rows, micro_batch_size=micro_batch_size,
                            micro_batch_tokens=micro_batch_tokens, hidden_size=hidden_size,
                            share_prompts=share_prompts)
            docs = split() if agree is None else split(at_least=agree(len(split())))
            return [collate_packed(d, hidden_size=hidden_size if dense_rows else 0) for d in docs]
        rows = sorted(rows, key=lambda row: row.length)  # length buckets: little padding
        return [collate(chunk) for chunk in split_rows(rows, micro_batch_size=micro_batch_size,
                                                       micro_batch_tokens=micro_batch_tokens)]

    for part in (rows[a:b] for a, b in zip(bounds, bounds[1:], strict=False)):
        passed = with_gradient(part) if skip_zero else part
        probed = probe_rows(part, passed) if skip_zero else []
        out.append(Part(batches=batched(passed, agree), tokens=sum(int(np.count_nonzero(row.trained)) for row in part),
                        seqs=sum(1 for row in part if row.trained.any()), rows=len(part),
                        probes=tuple(batched(probed)) if probed else ()))
    return out


def with_mask(mb: MicroBatch, mask: Tensor) -> MicroBatch:
    """`mb` training only where `mask` (a host tensor, (B, T)) is 1."""
    assert mask.shape == mb.mask.shape, f"mask {tuple(mask.shape)} vs {tuple(mb.mask.shape)}"
    return replace(mb, mask=mask, trained_at=mask.reshape(-1).nonzero().squeeze(1),
                   trained_versions=tuple(mb.versions[mask > 0].unique().tolist()))
