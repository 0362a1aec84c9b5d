"""Sample groups to training rows, and rows to right-padded micro-batches.

Groups decoded from the stream hold numpy arrays (common/messages.py); rows keep them as they are
and `collate` builds each micro-batch's tensors with a few numpy calls and `torch.from_numpy`,
never a Python list per token. Groups holding lists (built in process) are taken too."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor

from common.messages import SampleGroup, token_versions
from common.shaping import Estimator, completion_advantages
from trainer.logprobs import Packed


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
    input_ids: Tensor  # (B, T) int64, right-padded with 0
    attention_mask: Tensor  # (B, T) int64, 0 on padding
    targets: Tensor  # (B, T) int64
    mask: Tensor  # (B, T) float32, 1 on trained completion tokens
    behaviour_logp: Tensor  # (B, T) float32
    advantages: Tensor  # (B,) float32
    versions: Tensor  # (B, T) int64, weight version that sampled each target token (padding: the row's last)
    # (N,) int64: the flat positions (row * T + t) where `mask` is 1, found on the host when the batch
    # is built, so the head is applied there without a device-side nonzero (no host sync on a GPU;
    # a meta-device dry run can index with it). Kept equal to `mask` by `with_mask`.
    trained_at: Tensor
    # The same rows with each shared prompt computed once (trainer.share_prompts), or None.
    packed: Packed | None = None
    # (B,) host array: each row's group, its index among the step's groups (Row.group; -1: none)
    group_of: np.ndarray | None = None


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
        rows.append(Row(prompt=prompt, ids=ids, trained=trained, logprobs=np.asarray(c.logprobs, dtype=np.float32),
                        advantage=float(adv),
                        versions=token_versions(c, group_version=group.version), group=index))
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
    return MicroBatch(
        input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention),
        targets=torch.from_numpy(targets), mask=torch.from_numpy(mask), behaviour_logp=torch.from_numpy(logp),
        advantages=torch.tensor([row.advantage for row in rows], dtype=torch.float32),
        versions=torch.from_numpy(versions), trained_at=torch.from_numpy(np.flatnonzero(mask)),
        group_of=np.array([row.group for row in rows], dtype=np.int64),
    )


def prompt_length(rows: list[Row]) -> int:
    """Positions of `rows` (completions of one prompt) packed: the prompt once, then each
    completion's inputs."""
    return len(rows[0].prompt) + sum(max(len(row.ids) - 1, 0) for row in rows)


def pack(packs: list[list[Row]], width: int) -> Packed:
    """`packs` (each a run of rows sharing their prompt, in the order `collate` lays the rows out,
    right-padded to `width`) as packed sequences, one a pack."""
    shape = (len(packs), max(prompt_length(p) for p in packs))
    ids, position_ids = np.zeros(shape, dtype=np.int64), np.zeros(shape, dtype=np.int64)
    segments = np.full(shape, -1, dtype=np.int64)
    at = np.zeros(sum(len(p) for p in packs) * width, dtype=np.int64)
    i = 0  # the row's index in the right-padded layout
    for s, rows in enumerate(packs):
        prompt = rows[0].prompt
        p = len(prompt)
        for row in rows[1:]:
            assert np.array_equal(row.prompt, prompt), \
                f"rows packed together must share their prompt: {row.prompt.tolist()} vs {prompt.tolist()}"
        ids[s, :p], position_ids[s, :p], segments[s, :p] = prompt, np.arange(p), 0
        offset = p  # where the next completion's inputs start
        for j, row in enumerate(rows):
            n = len(row.ids)
            k = max(n - 1, 0)  # its inputs: its tokens but the last
            ids[s, offset:offset + k], segments[s, offset:offset + k] = row.ids[:-1], j + 1
            position_ids[s, offset:offset + k] = np.arange(p, p + k)
            # completion token 0 is predicted at the prompt's last position, token m at its input m - 1;
            # in the padded layout it is the target at t = p - 1 + m
            at[i * width + p - 1:i * width + p - 1 + n] = s * shape[1] + np.concatenate([[p - 1], np.arange(
                offset, offset + k)])[:n]
            offset += k
            i += 1
    return Packed(ids=torch.from_numpy(ids), position_ids=torch.from_numpy(position_ids),
                  segments=torch.from_numpy(segments), at=torch.from_numpy(at))


def collate_shared(packs: list[list[Row]]) -> MicroBatch:
    """`collate` of the packs' rows (in order), with their packed layout: each pack (rows sharing
    a prompt) one packed sequence."""
    mb = collate([row for rows in packs for row in rows])
    return replace(mb, packed=pack(packs, mb.input_ids.shape[1]))


def prompt_runs(rows: list[Row]) -> list[list[Row]]:
    """`rows` as consecutive runs of equal prompts (compared by value)."""
    runs: list[list[Row]] = []
    for row in rows:
        if runs and np.array_equal(runs[-1][0].prompt, row.prompt):
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


def split_packs(rows: list[Row], *, micro_batch_size: int, micro_batch_tokens: int = 0,
                hidden_size: int = 0) -> list[list[list[Row]]]:
    """`rows` as micro-batches of packs (runs of rows sharing a prompt, each packed into one
    sequence): at most `micro_batch_size` rows a micro-batch and, where `micro_batch_tokens` > 0,
    at most that many packed positions (packs x longest pack). A run too large for either is cut
    into pieces, each carrying the prompt (a piece of one completion too long goes alone); so is a
    run whose packed attention would cost more than the prompt saves (`body_cost` with the model's
    `hidden_size`: long completions after a short prompt go as their own rows). The pieces are
    bucketed by packed length (sorted, stably) as `mini_batches` buckets rows."""
    assert micro_batch_size >= 1, f"micro_batch_size must be >= 1, got {micro_batch_size}"
    assert micro_batch_tokens >= 0, f"micro_batch_tokens must be >= 0, got {micro_batch_tokens}"
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
    pieces.sort(key=prompt_length)
    out: list[list[list[Row]]] = []
    current: list[list[Row]] = []
    width = n_rows = 0
    for piece in pieces:
        w = max(width, prompt_length(piece))
        too_many = n_rows + len(piece) > micro_batch_size
        too_big = micro_batch_tokens > 0 and (len(current) + 1) * w > micro_batch_tokens
        if current and (too_many or too_big):
            out.append(current)
            current, w, n_rows = [], prompt_length(piece), 0
        current.append(piece)
        width, n_rows = w, n_rows + len(piece)
    if current:
        out.append(current)
    return out


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
                  objective: str = "grpo", share_prompts: bool = False,
                  hidden_size: int = 0) -> tuple[list[MicroBatch], int, int]:
    """The step's micro-batches, its trained-token count and its count of trained sequences."""
    part = mini_batches(groups, parts=1, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                        estimator=estimator, overlong=overlong, overlong_penalty=overlong_penalty,
                        objective=objective, share_prompts=share_prompts, hidden_size=hidden_size)[0]
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
                 objective: str = "grpo", share_prompts: bool = False, hidden_size: int = 0,
                 skip_zero: bool = False) -> list[Part]:
    """The step's rows in `parts` consecutive mini-batches of near-equal row counts (PPO's
    mini-batches, one optimizer step each). Advantages are the whole groups' whichever
    mini-batch a row lands in. With `skip_zero` (a loss whose gradient is a multiple of the
    advantage, no KL term) the rows whose advantage is 0 are left out of the micro-batches
    (`with_gradient`): they add nothing to the update, and the part's counts still include them,
    so the loss is the one every row gives; the rows of the groups left out go in `probes`.

    Within a mini-batch the rows are bucketed by length (sorted, stably) before they are split
    into micro-batches, so each micro-batch pads its rows to a near-equal length: on the demo's
    shapes (16 rows of 35-70 tokens, 8 a micro-batch) that drops the padding from about a fifth
    of the positions to a few percent. The mini-batch's update is a sum over its rows, whichever
    micro-batch each lands in."""
    rows = [row for i, group in enumerate(groups) for row in group_rows(
        group, estimator=estimator, overlong=overlong, overlong_penalty=overlong_penalty, objective=objective,
        index=i)]
    assert 1 <= parts <= len(rows), f"{len(rows)} completions cannot make {parts} mini-batches"
    bounds = [len(rows) * i // parts for i in range(parts + 1)]
    out = []

    def batched(rows: list[Row]) -> list[MicroBatch]:
        if share_prompts:
            return [collate_shared(packs) for packs in split_packs(
                rows, micro_batch_size=micro_batch_size, micro_batch_tokens=micro_batch_tokens,
                hidden_size=hidden_size)]
        rows = sorted(rows, key=lambda row: row.length)  # length buckets: little padding
        return [collate(chunk) for chunk in split_rows(rows, micro_batch_size=micro_batch_size,
                                                       micro_batch_tokens=micro_batch_tokens)]

    for part in (rows[a:b] for a, b in zip(bounds, bounds[1:], strict=False)):
        passed = with_gradient(part) if skip_zero else part
        probed = probe_rows(part, passed) if skip_zero else []
        out.append(Part(batches=batched(passed), tokens=sum(int(np.count_nonzero(row.trained)) for row in part),
                        seqs=sum(1 for row in part if row.trained.any()), rows=len(part),
                        probes=tuple(batched(probed)) if probed else ()))
    return out


def with_mask(mb: MicroBatch, mask: Tensor) -> MicroBatch:
    """`mb` training only where `mask` (a host tensor, (B, T)) is 1."""
    assert mask.shape == mb.mask.shape, f"mask {tuple(mask.shape)} vs {tuple(mb.mask.shape)}"
    return replace(mb, mask=mask, trained_at=mask.reshape(-1).nonzero().squeeze(1))
