"""Prompts and sample groups a test writes itself, as the producer and a generator would, and the
samples stream they travel on. `ask` and `make_group` (what the benchmarks use too) live in
ops/lib/groups.py."""

from __future__ import annotations

from common.keys import PAYLOAD, Keys
from common.messages import Completion, SampleGroup, decode_group
from common.tokens import Floats, Ints
from ops.lib.groups import ask, make_group  # noqa: F401 (the harness's)


def completion(ids: Ints, logprobs: Floats, reward: float, *, loss_mask: Ints | None = None,
               finish: str = "stop") -> Completion:
    """A completion written out by hand, its tokens held as the test holds them."""
    return Completion(ids=ids, logprobs=logprobs, reward=reward, rewards={}, finish=finish, text="",
                      loss_mask=loss_mask)


def hand_group(completions: list[Completion], *, prompt: Ints | None = None) -> SampleGroup:
    """A group of completions written out by hand, sampled with version 0. `prompt`: its ids as the
    test holds them (a list, a numpy array, an array.array); None: [5, 6, 7]."""
    return SampleGroup(id="g", prompt_id="p", prompt_ids=[5, 6, 7] if prompt is None else prompt, version=0,
                       generator="t", engine="hf", completions=completions)


def xadd(r, keys: Keys, blob: bytes) -> None:
    """Write an encoded entry to the run's samples stream, as a generator does."""
    r.xadd(keys.samples, {PAYLOAD: blob})


def read_groups(r, keys: Keys) -> list[SampleGroup]:
    """Every group still in the run's samples stream, oldest first."""
    return [decode_group(f[PAYLOAD]) for _, f in r.xrange(keys.samples)]
