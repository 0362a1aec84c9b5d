"""A run's sample groups as the page shows them: where they are read from (the samples stream, the
run's history of trained groups once the stream has moved on, a recording), which of them a filter
keeps, and each one laid out for the page: its completions' tokens decoded one by one, the
advantage each completion trains with (common.shaping, as the trainer computes it), an episode
split into the model's turns and the environment's, and the colour of every token.

A run stores no per-token log-probs of the trainer: the behaviour log-probs (the generator's) are
on every completion, and the trainer's mismatch against them is a per-step figure
(metrics.jsonl's mismatch_mean/mismatch_max). Tokens are coloured by advantage or by behaviour
log-prob; the mismatch is shown per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from common.config import LimitsConfig
from common.history import mean_reward, read_history
from common.keys import PAYLOAD, Keys
from common.messages import MessageError, SampleGroup, token_versions
from common.metrics import StepMetrics
from common.recording import read_recording
from common.shaping import Estimator, completion_advantages

# --------------------------------------------------------------------------- where groups come from


@dataclass(frozen=True)
class Loaded:
    groups: list[tuple[str, SampleGroup]]  # (entry id, group), oldest first
    undecodable: int  # entries that did not decode as a group (the trainer dead-letters them)
    source: str  # what they were read from, as the page names it
    steps: dict[str, int] = field(default_factory=dict)  # group id -> the step that trained it, as the history says


def from_stream(r: redis.Redis, keys: Keys, *, newest: int, limits: LimitsConfig) -> Loaded:
    """The newest `newest` entries of the run's samples stream, decoded under the run's `limits` (as
    the trainer decodes them). The trainer trims the entries it has trained and saved
    (common/trim.py): a live run's stream holds its recent groups."""
    groups, bad = [], 0
    for eid, fields in reversed(r.xrevrange(keys.samples, count=newest)):
        try:
            groups.append((eid.decode(), limits.decode_group(fields.get(PAYLOAD))))
        except MessageError:
            bad += 1
    return Loaded(groups=groups, undecodable=bad, source=f"samples stream of run {keys.run!r}")


def from_recording(path: Path, *, limits: LimitsConfig) -> Loaded:
    """Every group of a recording's samples stream, decoded under `limits` (the config's), as the
    trainer decodes them (RecordingError if it is no recording)."""
    _, entries = read_recording(path)
    groups, bad = [], 0
    for e in entries:
        if e.stream == "samples":
            try:
                groups.append((e.id, limits.decode_group(e.payload)))
            except MessageError:
                bad += 1
    return Loaded(groups=groups, undecodable=bad, source=f"recording {path}")


HISTORY_ENTRY = "history"  # the entry of a group read from the history: the stream no longer holds it


def with_history(loaded: Loaded, root: Path, f: Filters) -> Loaded:
    """`loaded` (the stream's newest entries) and, before them, the newest `f.limit` groups of the
    run's history under `root` (common/history.py) that pass `f` and are not in `loaded`: every
    group the trainer trained is found once the stream has been trimmed of it."""
    present = {g.id for _, g in loaded.groups}
    lo = max([x for x in (f.step, f.min_step) if x is not None], default=None)
    hi = min([x for x in (f.step, f.max_step) if x is not None], default=None)
    kept = read_history(root, min_step=lo, max_step=hi, version=f.version, generator=f.generator,
                        min_reward=f.min_reward, max_reward=f.max_reward, newest=f.limit, skip=present)
    return Loaded(groups=[(HISTORY_ENTRY, t.group) for t in kept] + loaded.groups, undecodable=loaded.undecodable,
                  source=f"{loaded.source} and the run's history in {root}" if kept else loaded.source,
                  steps={t.group.id: t.step for t in kept})


def trained_steps(steps: list[StepMetrics]) -> dict[str, int]:
    """Group id -> the trainer step that trained it (metrics.jsonl's group_ids)."""
    return {gid: m.step for m in steps for gid in m.group_ids}


# --------------------------------------------------------------------------- filters


@dataclass(frozen=True)
class Filters:
    step: int | None = None  # trained in this trainer step (needs the metrics or the history)
    min_step: int | None = None  # trained in this step or later
    max_step: int | None = None  # ... in this step or earlier
    version: int | None = None  # sampled with this weight version
    generator: str | None = None  # written by this generator
    min_reward: float | None = None  # the group's mean reward at least this
    max_reward: float | None = None  # ... at most this
    limit: int = 20  # newest groups shown


def chosen(groups: list[tuple[str, SampleGroup]], f: Filters, steps: dict[str, int]) -> list[tuple[str, SampleGroup]]:
    """The newest `f.limit` groups that pass every filter set, newest first."""
    out = []
    for eid, g in reversed(groups):
        step = steps.get(g.id)
        if ((f.step is None or step == f.step) and (f.min_step is None or (step is not None and step >= f.min_step))
                and (f.max_step is None or (step is not None and step <= f.max_step))
                and (f.version is None or g.version == f.version)
                and (f.generator is None or g.generator == f.generator)
                and (f.min_reward is None or mean_reward(g) >= f.min_reward)
                and (f.max_reward is None or mean_reward(g) <= f.max_reward)):
            out.append((eid, g))
            if len(out) == f.limit:
                break
    return out


# --------------------------------------------------------------------------- colours

WHITE = (255, 255, 255)
POSITIVE = (22, 163, 74)  # green: a token trained with a positive advantage
NEGATIVE = (220, 38, 38)  # red: ... a negative one
SURPRISE = (124, 58, 237)  # violet: a token the behaviour policy found unlikely
ADVANTAGE_FULL = 1.5  # |advantage| at which a token takes its full colour
SURPRISE_FULL = 5.0  # -log-prob at which a token takes its full colour (p = 0.7%)


def mix(base: tuple[int, int, int], t: float) -> tuple[int, int, int]:
    """White moved a share `t` (0..1) of the way to `base`."""
    t = min(max(t, 0.0), 1.0)
    return tuple(round(w + (b - w) * t) for w, b in zip(WHITE, base, strict=True))


def advantage_rgb(advantage: float | None) -> tuple[int, int, int] | None:
    """A trained token's colour: green for a positive advantage, red for a negative one, stronger
    as |advantage| nears ADVANTAGE_FULL; None (no colour) for a token not trained."""
    if advantage is None:
        return None
    return mix(POSITIVE if advantage >= 0 else NEGATIVE, abs(advantage) / ADVANTAGE_FULL)


def logprob_rgb(logprob: float) -> tuple[int, int, int]:
    """A sampled token's colour by its behaviour log-prob: white where it was certain, violet as it
    nears SURPRISE_FULL nats of surprise."""
    return mix(SURPRISE, -logprob / SURPRISE_FULL)


def css(rgb: tuple[int, int, int] | None) -> str:
    return "transparent" if rgb is None else f"rgb({rgb[0]},{rgb[1]},{rgb[2]})"


def legend() -> dict[str, str]:
    """The colour scales' ends, for the page's legend."""
    return {"positive": css(mix(POSITIVE, 1.0)), "negative": css(mix(NEGATIVE, 1.0)),
            "surprise": css(mix(SURPRISE, 1.0)), "advantage_full": f"{ADVANTAGE_FULL:g}",
            "surprise_full": f"{SURPRISE_FULL:g}"}


# --------------------------------------------------------------------------- a group for the page


@dataclass(frozen=True, slots=True)
class Token:
    text: str  # the token decoded on its own ("" for the rest of a character split over tokens)
    id: int
    logprob: float  # behaviour log-prob (0 on the environment's tokens)
    version: int  # weight version that sampled it
    colour: str  # CSS colour by advantage ("transparent": not trained)
    logprob_colour: str  # CSS colour by behaviour log-prob


@dataclass(frozen=True, slots=True)
class Turn:
    model: bool  # the model's tokens (loss_mask 1), or the environment's (0: an episode's turn)
    tokens: list[Token]


@dataclass(frozen=True, slots=True)
class CompletionView:
    reward: float
    rewards: dict[str, float]  # the reward's named components
    advantage: float | None  # as the trainer computes it; None: no reward to learn from
    trained: bool  # whether the trainer trains on its model tokens
    finish: str
    reward_error: str | None
    turns: list[Turn]  # one for a single-turn completion; an episode alternates model and environment
    versions: list[int]  # the weight versions its tokens were sampled with

    @property
    def episode(self) -> bool:
        return any(not t.model for t in self.turns)

    @property
    def tokens(self) -> int:
        return sum(len(t.tokens) for t in self.turns)


@dataclass(frozen=True, slots=True)
class GroupView:
    entry: str  # its entry id in the stream (or the recorded stream)
    id: str
    prompt_id: str
    prompt: str  # prompt ids decoded (chat template and all)
    version: int
    generator: str
    engine: str
    mean_reward: float
    completions: list[CompletionView]
    # the prompt's images (a vision-language model's), as data: URLs the page shows beside its completions
    images: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Advantages:
    """How the trainer turns rewards into advantages (the run's [trainer] table)."""

    estimator: Estimator = "grpo"
    overlong: str = "none"
    overlong_penalty: float = 0.0
    objective: str = "grpo"


def texts(tokenizer: Any, ids: list[int]) -> list[str]:
    """Each token decoded on its own, special tokens shown; a character split over several tokens
    (each alone decodes to U+FFFD) goes whole to the first of them. Without a tokenizer, the ids."""
    if tokenizer is None:
        return [f"⟨{i}⟩" for i in ids]
    out = tokenizer.batch_decode([[i] for i in ids], skip_special_tokens=False, clean_up_tokenization_spaces=False)
    k = 0
    while k < len(out):
        if "\ufffd" not in out[k]:
            k += 1
            continue
        end = k + 1
        while end < len(out) and "\ufffd" in out[end] and end - k < 4:
            end += 1
        whole = tokenizer.decode(ids[k:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if "\ufffd" not in whole:
            out[k:end] = [whole] + [""] * (end - k - 1)
        k = end
    return out


def turns(tokens: list[Token], mask: list[bool] | None) -> list[Turn]:
    """The tokens split where the loss mask changes: the model's turns and the environment's."""
    if mask is None:
        return [Turn(model=True, tokens=tokens)]
    out: list[Turn] = []
    for token, model in zip(tokens, mask, strict=True):
        if out and out[-1].model == model:
            out[-1].tokens.append(token)
        else:
            out.append(Turn(model=model, tokens=[token]))
    return out


def group_view(entry: str, group: SampleGroup, *, tokenizer: Any, how: Advantages) -> GroupView:
    """`group` laid out for the page."""
    n = len(group.completions)
    advantages = [0.0] * n if how.objective == "sft" else \
        (completion_advantages(group, estimator=how.estimator, overlong=how.overlong,
                               overlong_penalty=how.overlong_penalty) if n >= 2 else [None] * n)
    completions = []
    for c, adv in zip(group.completions, advantages, strict=True):
        ids = [int(i) for i in c.ids]
        trained = adv is not None and not (how.overlong == "mask" and c.finish == "length")
        mask = None if c.loss_mask is None else [bool(m) for m in c.loss_mask]
        colour = css(advantage_rgb(adv if trained else None))
        versions = token_versions(c, group_version=group.version).tolist()
        tokens = [Token(text=t, id=i, logprob=float(lp), version=v,
                        colour=colour if mask is None or mask[k] else "transparent",
                        logprob_colour=css(logprob_rgb(float(lp))) if mask is None or mask[k] else "transparent")
                  for k, (t, i, lp, v) in enumerate(zip(texts(tokenizer, ids), ids, c.logprobs, versions,
                                                        strict=True))]
        completions.append(CompletionView(reward=c.reward, rewards=dict(c.rewards), advantage=adv, trained=trained,
                                          finish=c.finish, reward_error=c.reward_error, turns=turns(tokens, mask),
                                          versions=sorted(set(versions))))
    prompt = tokenizer.decode([int(i) for i in group.prompt_ids], skip_special_tokens=False) \
        if tokenizer is not None else " ".join(f"⟨{int(i)}⟩" for i in group.prompt_ids)
    return GroupView(entry=entry, id=group.id, prompt_id=group.prompt_id, prompt=prompt, version=group.version,
                     generator=group.generator, engine=group.engine, mean_reward=mean_reward(group),
                     completions=completions, images=[image_url(img) for img in group.images])


def image_url(img: bytes) -> str:
    """An image file (PNG or JPEG, as the wire carries it: common/images.py) as a data: URL."""
    import base64

    kind = "png" if img.startswith(b"\x89PNG") else "jpeg"
    return f"data:image/{kind};base64,{base64.b64encode(img).decode()}"
