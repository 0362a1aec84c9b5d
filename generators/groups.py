"""The stages that make groups: scoring (each finished prompt's completions scored by its reward in
the reward workers) and episodes (the prompts of sources with an environment played, n multi-turn
episodes each); either writes the group (XADD + XACK in one MULTI/EXEC) or drops it (dynamic
sampling, judged as the trainer would: common.shaping.zero_variance)."""

from __future__ import annotations

import dataclasses
import sys
import time
from functools import partial

import trio

from common.messages import Completion, SampleGroup
from common.rewards import prompt_text
from common.shaping import zero_variance
from common.teacher import Teacher
from engines.base import Engine, Finished, Sampled, episode_prompt_ids
from envs.base import Spec
from generators.environments import EnvRunner
from generators.episodes import Episode, EpisodeLimits, Sample, run_episodes
from generators.inflight import group_versions
from generators.prompts import drop_group, publish
from generators.scoring import RewardRunner
from generators.state import Generator, Held, State, Turn, TurnFailed, let_go, turn_failed


async def scoring(g: Generator, state: State) -> None:
    """Score and write the group of each prompt the engine finished, `reward_workers` at once."""
    async with trio.open_nursery() as writers:
        limit = trio.Semaphore(max(g.settings.reward_workers, 1))  # groups being scored at once
        async for done, held in g.finished:
            await limit.acquire()
            writers.start_soon(score_and_publish, g, state, done, held, limit)


async def score_and_publish(g: Generator, state: State, done: Finished, held: Held, limit: trio.Semaphore) -> None:
    """Score one finished prompt and write its group (or drop it: dynamic sampling); its place in
    `capacity` goes back to the intake."""
    try:
        group, errors = await trio.to_thread.run_sync(partial(  # a stop that gives up leaves the scoring
            make_group, g.engine, g.rewards, held, done, generator_id=g.id, teacher=g.teacher),
            abandon_on_cancel=True)
        drop = drops(g, group)
        await trio.to_thread.run_sync(partial(
            drop_group if drop else publish, g.r, keys=g.keys, entry_id=held.entry_id, group=group))
    finally:
        limit.release()
    written(g, state, held, group, errors, drop=drop)


def drops(g: Generator, group: SampleGroup) -> bool:
    """Whether dynamic sampling drops the group: it is on, and the group teaches nothing under the
    rewards the trainer learns from (common.shaping.zero_variance: the overlong penalty applied,
    completions whose reward failed left out). Sampled and played groups alike."""
    if group.teacher and g.distill_weight > 0:  # its tokens' KL to the teacher teaches, whatever the rewards
        return False
    return g.settings.drop_zero_variance and zero_variance(
        group, overlong=g.trainer.overlong, overlong_penalty=g.trainer.overlong_penalty)


def written(g: Generator, state: State, held: Held, group: SampleGroup, errors: list[str], *, drop: bool) -> None:
    """Count a prompt's group written (or dropped: dynamic sampling) and give its place in
    `capacity` back to the intake."""
    del state.held[held.entry_id.decode()]
    g.capacity.release()
    tokens = sum(len(c.ids) if c.loss_mask is None else sum(c.loss_mask) for c in group.completions)
    state.produced.append((time.monotonic(), tokens))
    state.reward_errors += len(errors)
    if group.teacher_error:
        state.teacher_errors += 1
        print(f"{g.name}: teacher error (group {group.id} written without teacher log-probs, "
              f"{state.teacher_errors} so far): {group.teacher_error}", file=sys.stderr, flush=True)
    if drop:
        state.dropped_zero_variance += 1
    else:
        state.groups += 1
    for err in errors[:1]:
        print(f"{g.name}: reward error ({len(errors)} in group {group.id}): {err}", file=sys.stderr, flush=True)
    if state.groups % 8 == 0 or drop:
        print(f"{g.name} v{group.version}: {state.groups} groups written"
              f"{f', {state.dropped_zero_variance} dropped (zero reward variance)' if drop else ''}, "
              f"{state.tokens_per_s():.0f} tok/s, {len(state.held)} in flight", flush=True)


def make_group(engine: Engine, rewards: RewardRunner, held: Held, done: Finished, *,
               generator_id: str, teacher: Teacher | None = None) -> tuple[SampleGroup, list[str]]:
    """The scored SampleGroup of one finished prompt (with its teacher's log-probs, when it has
    one: `with_teacher`), and its reward errors."""
    task = held.task
    t0 = time.perf_counter()
    texts = [engine.decode(s.ids) for s in done.samples]
    version, spans = group_versions(done.samples, added_at=held.version)
    scored = rewards.score(task.source, prompt=prompt_text(task),
                           completions=[(text, s.ids) for text, s in zip(texts, done.samples, strict=True)],
                           meta=task.meta, messages=task.messages, version=version)
    # routing replay: the engine's experts of every token, where it recorded them for every completion
    routing = getattr(engine, "routing", None)
    routing = routing if routing is not None and all(s.experts is not None for s in done.samples) else None
    completions = [Completion(ids=s.ids, logprobs=s.logprobs, reward=sc.reward, rewards=sc.rewards,
                              finish=s.finish, text=text, reward_error=sc.error, versions=span,
                              experts=s.experts if routing is not None else None)
                   for s, text, sc, span in zip(done.samples, texts, scored, spans, strict=True)]
    group = SampleGroup(
        id=task.id, prompt_id=task.id, prompt_ids=held.prompt_ids, version=version,
        generator=generator_id, engine=engine.name, completions=completions,
        timings={"queue": held.added_at - held.taken_at, "generate": t0 - held.added_at,
                 "reward": time.perf_counter() - t0}, published_at=held.published_at, routing=routing,
        images=task.images)
    return with_teacher(group, teacher), [f"prompt {task.id}: {sc.error}" for sc in scored if sc.error is not None]


def with_teacher(group: SampleGroup, teacher: Teacher | None) -> SampleGroup:
    """`group` with its teacher's log-prob of each sampled token over the same prefix (0 where the
    loss_mask is 0: an episode's environment tokens), the teacher named; where the teacher failed or
    overran its budget, `group` as it was with the error in `teacher_error` (the trainer takes it as
    reward-only). Blocking (the teacher's thread, within its timeout); no teacher: `group` itself."""
    if teacher is None:
        return group
    t0 = time.perf_counter()
    scores = teacher.score(group.prompt_ids, [(c.ids, c.loss_mask) for c in group.completions])
    timings = {**group.timings, "teacher": time.perf_counter() - t0}
    if scores.logprobs is None:
        return dataclasses.replace(group, timings=timings, teacher_error=scores.error or "teacher failed")
    completions = [dataclasses.replace(c, teacher_logprobs=lp)
                   for c, lp in zip(group.completions, scores.logprobs, strict=True)]
    return dataclasses.replace(group, completions=completions, timings=timings, teacher=teacher.name,
                               teacher_version=teacher.version)


async def episodes(g: Generator, state: State) -> None:
    """Play each prompt the engine loop sends (a source with an environment), all concurrently."""
    async with trio.open_nursery() as playing:
        async for held in g.episodes_in:
            playing.start_soon(play_and_publish, g, state, held)


async def play_and_publish(g: Generator, state: State, held: Held) -> None:
    """Play a prompt's n episodes, then write its group (or drop it: dynamic sampling)."""
    assert g.envs is not None, "a prompt to play, but no environment runner"
    task = held.task
    assert task.source is not None, f"prompt {task.id}: played, but it names no source"
    try:
        group, played = await play(g.engine, g.envs, held, spec=g.specs[task.source],
                                   limits=g.episode_limits[task.source],
                                   sample=partial(sample_turn, g, state, images=task.images),
                                   generator_id=g.id)
        # weights are not loaded while episodes play: what the state says of its version holds
        group = dataclasses.replace(group, published_at=state.published.get(group.newest_version, 0.0))
        group = await trio.to_thread.run_sync(with_teacher, group, g.teacher, abandon_on_cancel=True)
        drop = drops(g, group)
        await trio.to_thread.run_sync(partial(
            drop_group if drop else publish, g.r, keys=g.keys, entry_id=held.entry_id, group=group))
    except BaseException as err:  # a failed turn (counted and said where it failed), alone or from the
        if not turn_failed(err):    # episodes' nursery: the other episodes' turns end unheard
            raise
        let_go(g, state, held)
        return
    finally:
        state.episodes -= 1
        state.wake.set()
    step_errors = [e for ep in played for e in ep.errors]
    state.env_errors += len(step_errors)
    for err in step_errors[:1]:
        print(f"{g.name}: environment error ({len(step_errors)} in group {group.id}): {err}",
              file=sys.stderr, flush=True)
    written(g, state, held, group, [f"prompt {task.id}: {c.reward_error}" for c in group.completions
                                    if c.reward_error is not None], drop=drop)


async def play(engine: Engine, envs: EnvRunner, held: Held, *, spec: Spec, limits: EpisodeLimits, sample: Sample,
               generator_id: str) -> tuple[SampleGroup, list[Episode]]:
    """A prompt's n episodes, played within the model's context with `sample` taking each model
    turn, as its group (version: the held prompt's) and the episodes themselves."""
    task = held.task
    prompt_ids = episode_prompt_ids(engine, task, system=spec.system, tools=spec.tools)
    room = engine.context_length - len(prompt_ids)  # the episode must fit the model's positions
    assert room > 0, f"prompt {task.id}: {len(prompt_ids)} tokens fill the model's context"
    limits = dataclasses.replace(limits, max_tokens=min(limits.max_tokens, room))
    played = await run_episodes(task.n, sample=sample, envs=envs, spec=spec, tokenizer=engine.tokenizer,
                                prompt_ids=prompt_ids, meta=task.meta, limits=limits)
    t0 = time.perf_counter()
    completions = [ep.completion(engine.decode(ep.ids)) for ep in played]
    group = SampleGroup(
        id=task.id, prompt_id=task.id, prompt_ids=prompt_ids, version=held.version, generator=generator_id,
        engine=engine.name, completions=completions,
        timings={"queue": held.added_at - held.taken_at, "generate": t0 - held.added_at, "reward": 0.0},
        images=task.images)
    return group, played


async def sample_turn(g: Generator, state: State, ids: list[int], max_new_tokens: int, *,
                      images: tuple[bytes, ...] = ()) -> Sampled:
    """One model turn of an episode: queued for the engine loop, which samples it among the rest
    (with the prompt's `images`, whose tokens `ids` begin with)."""
    state.turn_count += 1
    turn = Turn(request_id=f"turn-{state.turn_count}", ids=ids,
                sampling=dataclasses.replace(g.sampling, n=1, max_new_tokens=max_new_tokens), images=images)
    state.turns.append(turn)
    state.wake.set()
    await turn.done.wait()
    if turn.error is not None:
        raise TurnFailed(turn.error)
    assert turn.result is not None
    return turn.result
