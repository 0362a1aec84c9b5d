"""The check's episodes: prompts of the sources with an environment played as a generator plays
them (generators.groups.play: the environment in its worker processes, each model turn sampled by
the engine among the others), and whether the model's chat template, applied to each whole
conversation, gives the tokens the trainer trains on.

An episode's tokens are extended turn by turn (generators/episodes.py): the model's turns as
sampled, the environment's rendered between them. A trainer or a chat server that keeps the
conversation as messages applies the template to all of it instead; a template that renders an
earlier turn otherwise once later ones follow (Qwen3's drops the reasoning of assistant turns
before the last user message) gives other tokens than were sampled, and the model is trained on
conversations it is never served. So each episode's conversation is rebuilt as messages (the
opening messages, each model turn as the assistant's, each environment turn's messages), the
template applied to it, and the result compared with the trainer's row (prompt + completion ids).

They are compared as text: the row decoded against the rendered template, so a model turn that
the tokenizer would split otherwise when encoding its text again (the same text) is no
difference. A model turn's last token, the eos it stopped at, stands for the end of the turn:
where the template writes that end otherwise, it is passed over.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import os
import time
from collections import deque
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import trio
from jinja2 import TemplateError

from common.config import Config
from common.messages import PromptTask, SampleGroup
from engines.base import Engine, Sampled, SamplingSettings, episode_messages
from envs.base import Spec
from generators.engine_loop import add_all
from generators.environments import EnvRunner
from generators.episodes import Episode, EpisodeLimits, episode_limits
from generators.groups import play
from generators.main import leaf_errors
from generators.state import Held, Turn, run_on_engine
from trainer.batch import group_rows

CONTEXT_CHARS = 40  # text shown either side of where an episode departs from the template


@dataclass(frozen=True, slots=True)
class Played:
    """A prompt's episodes: its group as a generator writes it, and the episodes as they ran."""

    task: PromptTask
    group: SampleGroup
    episodes: list[Episode]


@dataclass(frozen=True, slots=True)
class Departure:
    """Where an episode's row first departs from the template applied to its whole conversation."""

    episode: str  # "<group id> #<completion>"
    token: int  # its position in the row (prompt + completion)
    where: str  # "the prompt", "model turn 1 of 3" or "environment turn 1"
    before: str  # the text both have before it
    sampled: str  # the row's text from there
    templated: str  # the template's text from there


# ---------------------------------------------------------------------- playing


@dataclass
class Turns:
    """Model turns waiting for the engine: each episode queues its own and waits for it."""

    queued: deque[Turn] = field(default_factory=deque)
    wake: trio.Event = field(default_factory=trio.Event)  # set when a turn is queued, or on closing
    count: int = 0
    closed: bool = False  # every episode has ended: the engine loop ends once the engine is idle


async def sample_turn(turns: Turns, sampling: SamplingSettings, ids: list[int], max_new_tokens: int) -> Sampled:
    """One model turn (generators.episodes.Sample): queued for `engine_loop`, sampled among the rest."""
    turns.count += 1
    turn = Turn(request_id=f"turn-{turns.count}", ids=ids,
                sampling=dataclasses.replace(sampling, n=1, max_new_tokens=max_new_tokens))
    turns.queued.append(turn)
    turns.wake.set()
    await turn.done.wait()
    if turn.error is not None:
        raise RuntimeError(f"the engine failed an episode's turn: {turn.error}")
    assert turn.result is not None
    return turn.result


async def engine_loop(engine: Engine, engine_thread: concurrent.futures.Executor, turns: Turns) -> None:
    """Add queued turns to the engine and step it, each finished turn back to its episode, until
    `turns` is closed and the engine idle (no call left running in its thread): the generator's
    engine loop for turns alone (continuous batching)."""
    running: dict[str, Turn] = {}
    while True:
        turns.wake = trio.Event()  # a turn queued from here on wakes the wait below
        if turns.queued:
            batch = list(turns.queued)
            turns.queued.clear()
            running.update((t.request_id, t) for t in batch)
            await run_on_engine(engine_thread, add_all, engine, [(t.request_id, t.ids, t.sampling) for t in batch])
        if not engine.has_unfinished():
            if turns.closed:
                return
            await turns.wake.wait()
            continue
        for done in await run_on_engine(engine_thread, engine.step):
            turn = running.pop(done.request_id)
            turn.result, turn.error = (done.samples[0], None) if done.error is None else (None, done.error)
            turn.done.set()


async def play_all(engine: Engine, engine_thread: concurrent.futures.Executor, envs: EnvRunner,
                   tasks: list[PromptTask], *, specs: dict[str, Spec], limits: dict[str, EpisodeLimits],
                   sampling: SamplingSettings) -> tuple[list[Played], list[str]]:
    """Every task's episodes, all at once; and why the chat template stopped a task's episodes
    where it did (what the generator would stop at: the template refused an environment's turn)."""
    turns, out, refused = Turns(), [None] * len(tasks), []

    async def one(i: int, task: PromptTask) -> None:
        assert task.source is not None, f"prompt {task.id}: played, but it names no source"
        now = time.perf_counter()
        held = Held(entry_id=task.id.encode(), task=task, prompt_ids=[], taken_at=now, added_at=now, version=0)
        try:
            group, episodes = await play(engine, envs, held, spec=specs[task.source], limits=limits[task.source],
                                         sample=partial(sample_turn, turns, sampling), generator_id="check")
        except (ValueError, TemplateError, BaseExceptionGroup) as err:
            # what generators.main.check_templates refuses, met mid-episode (alone, or from the
            # episodes' nursery); anything else goes on up
            leaves = leaf_errors(err) if isinstance(err, BaseExceptionGroup) else [err]
            if not all(isinstance(e, ValueError | TemplateError) for e in leaves):
                raise
            refused.append(f"source {task.source!r}: environment {specs[task.source].name!r} with the model's chat "
                           f"template: {leaves[0]} (a generator stops there)")
            return
        stopped = [ep.refused for ep in episodes if ep.refused]
        if stopped:
            refused.append(f"source {task.source!r}: environment {specs[task.source].name!r} with the model's chat "
                           f"template: {stopped[0]} (a generator ends such episodes there, their reward an error)")
            return
        out[i] = Played(task=task, group=group, episodes=episodes)

    async with trio.open_nursery() as background:
        background.start_soon(engine_loop, engine, engine_thread, turns)
        async with trio.open_nursery() as playing:
            for i, task in enumerate(tasks):
                playing.start_soon(one, i, task)
        turns.closed = True  # turns of episodes a failed one cut short are drained first
        turns.wake.set()
    return [p for p in out if p is not None], refused


def play_groups(config: Config, engine: Engine, engine_thread: concurrent.futures.Executor,
                tasks: list[PromptTask], *, specs: dict[str, Spec],
                temperature: float) -> tuple[list[Played], list[str]]:
    """Each task's n episodes against its source's environment, in `generator.env_workers` worker
    processes, every model turn sampled by `engine` (in `engine_thread`) at `temperature`; and why
    the template stopped some (play_all)."""
    ro = config.rollout
    sampling = SamplingSettings(n=1, max_new_tokens=ro.max_new_tokens, temperature=temperature, top_p=ro.top_p,
                                top_k=ro.top_k)
    with EnvRunner([s.name for s in specs.values()], workers=config.generator.env_workers) as envs:
        return trio.run(partial(play_all, engine, engine_thread, envs, tasks, specs=specs,
                                limits=episode_limits(config, specs), sampling=sampling))


# ---------------------------------------------------------------------- the template


def runs(mask: list[int]) -> list[tuple[int, int, bool]]:
    """`mask` as its runs: (start, end, whether the model's), in order."""
    out: list[tuple[int, int, bool]] = []
    for i, m in enumerate(mask):
        if out and out[-1][2] == bool(m):
            out[-1] = (out[-1][0], i + 1, bool(m))
        else:
            out.append((i, i + 1, bool(m)))
    return out


def departure(tokenizer, *, opening: list[dict[str, str]], tools: list[dict] | None, row: list[int], prompt: int,
              mask: list[int], env_turns: list[list[dict[str, str]]], eos_ids: list[int],
              name: str) -> Departure | None:
    """Where `row` (the trainer's: `prompt` prompt ids, then an episode's ids with loss `mask`, 1 on
    the model's turns) first departs from the chat template applied to the episode's whole
    conversation (`opening` messages, each model turn as the assistant's text, each of `env_turns`);
    None where it does not. Compared as text (the module's docstring says why)."""
    @functools.cache
    def text(end: int) -> str:  # the row's text up to token `end`, decoded as one sequence
        return tokenizer.decode(row[:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)

    # The row's pieces, (start, end, what, a model turn's stop token): the prompt, then each turn.
    parts = runs(mask)
    model_turns = sum(is_model for _, _, is_model in parts)
    assert model_turns == len(env_turns) + 1 and len(parts) == 2 * model_turns - 1, \
        f"{name}: {model_turns} model turns, {len(env_turns)} environment turns, {len(parts)} runs of its mask"
    pieces: list[tuple[int, int, str, bool]] = [(0, prompt, "the prompt", False)]
    conversation, whole = list(opening), text(len(row))
    for k, (start, end, is_model) in enumerate(parts):
        a, b = prompt + start, prompt + end
        if not is_model:
            pieces.append((a, b, f"environment turn {k // 2 + 1}", False))
            conversation += env_turns[k // 2]
            continue
        where = f"model turn {k // 2 + 1} of {model_turns}"
        stop = row[b - 1] in eos_ids
        body = b - 1 if stop else b
        pieces.append((a, body, where, False))
        if stop:
            pieces.append((body, b, where, True))
        conversation.append({"role": "assistant", "content": whole[len(text(a)):len(text(body))]})
    rendered = tokenizer.apply_chat_template(conversation, tools=tools, tokenize=False)

    at = 0  # where the template's text stands
    for a, b, where, is_stop in pieces:
        piece = whole[len(text(a)):len(text(b))]
        if rendered.startswith(piece, at):
            at += len(piece)
            continue
        if is_stop:  # the template ends the turn with other text: the sampled eos stands for it
            continue
        c = len(os.path.commonprefix([piece, rendered[at:at + len(piece)]]))  # the first character that differs
        token = next((t for t in range(a, b) if len(text(t + 1)) - len(text(a)) > c), b - 1)
        here = len(text(a)) + c  # in the row's text
        return Departure(episode=name, token=token, where=where, before=rendered[max(at + c - CONTEXT_CHARS, 0):at + c],
                         sampled=whole[here:here + CONTEXT_CHARS], templated=rendered[at + c:at + c + CONTEXT_CHARS])
    return None


def departures(tokenizer, played: Played, *, spec: Spec, eos_ids: list[int]) -> list[Departure | None]:
    """Each episode's departure from the template (None: it has none), its row as the trainer
    builds it (trainer.batch.group_rows)."""
    opening = episode_messages(played.task, system=spec.system)
    out = []
    for j, (row, c, ep) in enumerate(zip(group_rows(played.group), played.group.completions, played.episodes,
                                         strict=True)):
        assert c.loss_mask is not None, f"{played.group.id}: an episode without a loss mask"
        out.append(departure(tokenizer, opening=opening, tools=spec.tools,
                             row=np.concatenate([row.prompt, row.ids]).tolist(), prompt=len(row.prompt),
                             mask=list(c.loss_mask), env_turns=ep.env_turns, eos_ids=eos_ids,
                             name=f"{played.group.id} #{j + 1}"))
    return out


@dataclass(frozen=True, slots=True)
class Template:
    """What the episodes showed of the model's chat template."""

    refused: str | None  # why the generator refuses it at start-up (its episodes then not played); None: it does not
    departures: list[Departure | None]  # each played episode's (None: it has none)
    turns: int  # model turns of the played episodes

    def went_on(self) -> bool:
        """Whether any episode had an earlier turn to keep: more model turns than episodes."""
        return self.turns > len(self.departures)


def template_line(t: Template) -> str:
    """The check's "template" line."""
    departed = sum(d is not None for d in t.departures)
    if t.refused is not None:
        return "template   refused: the generator does not start with it (below); no episode played"
    if departed:
        return (f"template   preserves earlier turns: NO ({departed} of {len(t.departures)} episodes differ, "
                f"{t.turns} turns)")
    if not t.went_on():
        return f"template   preserves earlier turns: not seen ({len(t.departures)} episodes of one turn each)"
    return f"template   preserves earlier turns: yes ({len(t.departures)} episodes, {t.turns} turns)"


def template_problems(t: Template | None) -> tuple[list[str], list[str]]:
    """(problems, warnings) of the chat template over the episodes: one the generator refuses, or
    episodes whose tokens depart from it, is a problem; episodes that never went past their first
    turn are a warning (nothing showed what the template does to an earlier turn)."""
    if t is None:
        return [], []
    if t.refused is not None:
        return [f"template: {t.refused}"], []
    departed = [d for d in t.departures if d is not None]
    if departed:
        d = departed[0]
        return [f"template: episode {d.episode}: its tokens and the chat template applied to the whole conversation "
                f"differ at token {d.token} ({d.where}): after {d.before!r} it was sampled {d.sampled!r}, the "
                f"template gives {d.templated!r} ({len(departed)} of {len(t.departures)} episodes differ). The "
                "template renders earlier turns otherwise once the conversation goes on (as Qwen3's drops earlier "
                "turns' reasoning): the model is trained on conversations it is never served, and a trainer that "
                "re-applies the template to the conversation trains on other tokens than were sampled"], []
    if not t.went_on():
        return [], ["template: no episode went past its first model turn, so none showed what the template does "
                    "to an earlier turn (more --prompts, or an environment that answers)"]
    return [], []
