"""Multi-turn episodes: the model and an environment take turns; a whole episode is one completion.

An episode's token ids are the prompt's, then the model's first turn as sampled, the environment's
turn, the model's next turn, and so on. Each model turn is sampled from the running id sequence
(prompt + everything so far) and its ids are appended as they came from the engine; only the
environment's turn is tokenized (engines.base.turn_ids: its messages rendered by the chat
template between the end of the model's turn and the header of its next one). No text the model
wrote is ever decoded and encoded again, so the ids trained are the ids sampled, whatever the
tokenizer does to a round trip. The completion's `loss_mask` is 1 on the model's tokens and 0 on
the environment's; its log-probs are the behaviour log-probs on the model's tokens and 0 elsewhere.

What stops an episode, recorded as the completion's `finish`:
  "stop"     the environment said it is done
  "turns"    the model took `max_turns` turns
  "length"   the episode's tokens after the prompt reached `max_tokens` (a turn is cut there;
             an environment turn that would pass it is left out)
  "timeout"  the episode ran past `episode_timeout_s` (checked between turns)
  "abort"    the environment could not start the episode (reward error recorded)
An environment step that raises or overruns `turn_timeout_s` answers the model with an error
message (role `spec.error_role`) and the episode goes on with the state it had.

The n episodes of a prompt run concurrently, and those of every prompt in flight too: while one
waits for its environment, the engine samples the others' turns (`sample` adds a request to the
generator's engine loop, which batches it with everything else running).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import trio
from jinja2 import TemplateError

from common.messages import Completion
from engines.base import Sampled, turn_ids
from envs.base import Spec
from generators.environments import EnvRunner

if TYPE_CHECKING:
    from common.config import Config

# (running ids, max new tokens) -> the model's sampled turn
Sample = Callable[[list[int], int], Awaitable[Sampled]]


@dataclass(frozen=True, slots=True)
class EpisodeLimits:
    max_turns: int  # model turns
    max_tokens: int  # tokens after the prompt, the model's and the environment's
    max_new_tokens: int  # tokens of one model turn
    turn_timeout_s: float  # one environment call (start or step)
    episode_timeout_s: float  # the whole episode, checked between turns


def episode_limits(config: Config, names: Collection[str]) -> dict[str, EpisodeLimits]:
    """{source name: its episodes' limits} of the sources in `names` (those with an environment)."""
    return {s.name: EpisodeLimits(max_turns=s.max_turns, max_tokens=s.max_episode_tokens,
                                  max_new_tokens=config.rollout.max_new_tokens, turn_timeout_s=s.turn_timeout_s,
                                  episode_timeout_s=s.episode_timeout_s)
            for s in config.sources if s.name in names}


@dataclass
class Episode:
    """An episode as it runs, then its completion's parts."""

    ids: list[int] = field(default_factory=list)  # after the prompt
    logprobs: list[float] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: int = 0  # model turns taken
    reward: float = 0.0
    rewards: dict[str, float] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)  # environment steps that failed (answered with an error)
    finish: str = ""
    reward_error: str | None = None  # the environment could not start, or its turn could not be tokenized: no reward
    # Why the chat template could not extend the episode with an environment turn, token by token
    # (engines.base.turn_ids): the episode ends there, its reward an error (`rollouts check` says so)
    refused: str | None = None
    # The messages of each environment turn appended, in order (not written with the group: what
    # `rollouts check` renders with the chat template to compare with `ids`)
    env_turns: list[list[dict[str, str]]] = field(default_factory=list)

    def add(self, ids: list[int], logprobs: list[float] | None) -> None:
        """Append the model's turn (with its log-probs) or the environment's (logprobs None)."""
        self.ids += ids
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.mask += [1 if logprobs is not None else 0] * len(ids)

    def completion(self, text: str) -> Completion:
        return Completion(ids=self.ids, logprobs=self.logprobs, reward=self.reward, rewards=self.rewards,
                          finish=self.finish, text=text, loss_mask=self.mask, reward_error=self.reward_error)


async def run_episode(*, sample: Sample, envs: EnvRunner, spec: Spec, tokenizer, prompt_ids: list[int],
                      meta: dict, limits: EpisodeLimits) -> Episode:
    """One episode from the prompt to its end."""
    ep, t0 = Episode(), time.monotonic()
    state, error = await trio.to_thread.run_sync(partial(
        envs.start, spec.name, meta, timeout_s=limits.turn_timeout_s))
    if error is not None:  # nothing to play against: one model turn, so the completion is not empty
        s = await sample(prompt_ids, limits.max_new_tokens)
        ep.add(s.ids, s.logprobs)
        ep.turns, ep.finish, ep.reward_error = 1, "abort", f"environment start: {error}"
        return ep
    while True:
        s = await sample(prompt_ids + ep.ids, min(limits.max_new_tokens, limits.max_tokens - len(ep.ids)))
        ep.add(s.ids, s.logprobs)
        ep.turns += 1
        if len(ep.ids) >= limits.max_tokens:
            ep.finish = "length"
            return ep
        left = limits.episode_timeout_s - (time.monotonic() - t0)
        if left <= 0:
            ep.finish = "timeout"
            return ep
        text = tokenizer.decode(s.ids, skip_special_tokens=True)
        step, error = await trio.to_thread.run_sync(partial(
            envs.step, spec.name, state, text, timeout_s=min(limits.turn_timeout_s, left)))
        if step is None:
            ep.errors.append(error)
            messages = [{"role": spec.error_role, "content": f"error: {error}"}]
        else:
            state, messages = step.state, step.messages
            ep.reward += step.reward
            for k, v in step.rewards.items():
                ep.rewards[k] = ep.rewards.get(k, 0.0) + v
            if step.done:
                ep.finish = "stop"
                return ep
        if ep.turns >= limits.max_turns:
            ep.finish = "turns"
            return ep
        # "stop": the turn's last id is the eos it sampled (engines.base.Sampled)
        try:
            env_ids = turn_ids(tokenizer, messages, eos_id=s.ids[-1] if s.finish == "stop" else None)
        except (ValueError, TemplateError) as err:  # roles the template drops or renders otherwise once followed
            ep.finish, ep.refused = "abort", str(err)
            ep.reward_error = f"environment turn {ep.turns}: the chat template cannot continue the episode: {err}"
            return ep
        if len(ep.ids) + len(env_ids) >= limits.max_tokens:
            ep.finish = "length"
            return ep
        ep.add(env_ids, None)
        ep.env_turns.append(messages)


async def run_episodes(n: int, **kwargs) -> list[Episode]:
    """`n` episodes of one prompt, concurrently; in order."""
    out: list[Episode | None] = [None] * n

    async def one(i: int) -> None:
        out[i] = await run_episode(**kwargs)

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    return [e for e in out if e is not None]
