"""What an environment is: the interface a user implements in one module, and how it is loaded.

An environment plays the other side of a multi-turn episode. The generator samples the model's
turn, hands its text to the environment, and appends the environment's answer (tool results, a
game's reply, a user's next message) to the episode as chat messages, until the environment says
the episode is done or a limit stops it. The episode's reward is the sum of the rewards of the
environment's turns.

An environment is an object (a module, a class or an instance) with:
    start(meta) -> state             the episode's state, from the prompt's meta (its ground truth);
                                     called once per episode, so each of a group's episodes has its own
    step(state, text) -> Step        the model's turn (decoded text) in, the environment's turn out
and optionally these attributes, read once in the generator:
    system: str | None               a system message put before the prompt's messages (how to call
                                     tools, the game's rules); None: none
    tools: list[dict] | None         JSON schemas of its tools, passed to the chat template
                                     (`apply_chat_template(..., tools=...)`) for models whose template
                                     renders them; None: none
    error_role: str                  the role of the message the model sees when a step fails
                                     (raises, times out): "tool" (default) or "user"

`start` and `step` are user code: the generator calls them in worker processes with a time limit
(generators/environments.py), passing the state back and forth, so the state must pickle. A step
that raises or overruns its limit leaves the state as it was and answers the model with an error
message; the episode goes on. They never see token ids: the generator tokenizes the messages
they return and never re-tokenizes what the model sampled.

A source names its environment in the config as "module" (the module itself has start and step)
or "module:attribute", e.g. `environment = "envs.calculator"`.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Any

ROLES = ("tool", "user", "system")  # roles an environment's message may take


@dataclass(frozen=True, slots=True)
class Step:
    """The environment's answer to one model turn."""

    state: Any  # the episode's state after this turn (passed to the next step)
    messages: list[dict[str, str]] = field(default_factory=list)  # its turn: {"role", "content"} each
    done: bool = False  # the episode is over (the model's turn was its last)
    reward: float = 0.0  # this turn's reward; the episode's reward is the sum over its turns
    rewards: dict[str, float] = field(default_factory=dict)  # named parts of `reward` (summed over turns)


@dataclass(frozen=True, slots=True)
class Spec:
    """What the generator reads of an environment in its own process (no user code runs)."""

    name: str  # "module" or "module:attribute"
    system: str | None
    tools: list[dict[str, Any]] | None
    error_role: str


def load(name: str) -> Any:
    """The environment `name` ("module" or "module:attribute") refers to; ValueError if there is
    none or it lacks `start` and `step`."""
    module_name, _, attr = name.partition(":")
    try:
        obj = importlib.import_module(module_name)
        if attr:
            obj = getattr(obj, attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"environment {name!r} cannot be loaded: {err}") from None
    missing = [f for f in ("start", "step") if not callable(getattr(obj, f, None))]
    if missing:
        raise ValueError(f"environment {name!r} has no callable {' or '.join(missing)}")
    return obj


def spec(name: str) -> Spec:
    """The environment's static description; ValueError naming what is wrong with it."""
    env = load(name)
    system, tools = getattr(env, "system", None), getattr(env, "tools", None)
    error_role = getattr(env, "error_role", "tool")
    if system is not None and not isinstance(system, str):
        raise ValueError(f"environment {name!r}: system must be a string or None")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise ValueError(f"environment {name!r}: tools must be a list of JSON schemas (dicts) or None")
    if error_role not in ROLES:
        raise ValueError(f"environment {name!r}: error_role {error_role!r} is not one of {ROLES}")
    return Spec(name=name, system=system, tools=tools, error_role=error_role)


def check_step(step: object) -> Step:
    """`step` if it is a well-formed Step; ValueError saying what is wrong otherwise."""
    if not isinstance(step, Step):
        raise ValueError(f"step returned {type(step).__name__}, expected envs.base.Step")
    for i, m in enumerate(step.messages):
        if not (isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)):
            raise ValueError(f"step's messages[{i}] needs a role in {ROLES} and string content, got {m!r:.200}")
    numbers = [step.reward, *step.rewards.values()]
    if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in numbers):
        raise ValueError(f"step's reward and rewards must be finite numbers, got {step.reward!r}, {step.rewards!r}")
    return step
