"""Reward functions, loaded by name and called safely: today's per-completion callables and TRL's.

A source lists one or more reward functions by "module:function" (`reward_funcs`, with
`reward_weights` as TRL's GRPOConfig has them; or the single `reward`). What a function is called
with is decided by its signature:

- TRL's (a parameter named `completions` or `prompts`, or `completion_ids` without our `completion`,
  `prompt` or `meta`, as TRL's length and repetition rewards have): called once per group with
  lists, one item per completion: `prompts`, `completions`, `completion_ids`, every key of the
  prompt's meta (the data set's columns: `answer`, `source`, `meta_columns`), and `trainer_state`
  (below), as keyword arguments. It returns a list with a float, or None ("not mine"), per
  completion; the component is named after the function. An `async def` function is awaited, the
  source's async functions together (TRL gathers them too).
- Per completion (anything else): keyword arguments `prompt` (the last user message, or the raw
  text), `completion` (decoded text), `completion_ids` and `meta` (the PromptTask's ground truth);
  it returns a number (one component, named "reward" when it is the source's only function, else
  after the function) or named components `{component: value}`; an `async def` one is awaited.

Text or messages, as TRL's GRPOTrainer decides it: from the data's own format, not from whether a
chat template is applied. TRL calls a data set conversational when its prompt is a list of
messages (`trl.data_utils.is_conversational`); then `prompts` are message lists and each completion
is `[{"role": "assistant", "content": text}]`; a prompt that is a string gives strings for both.
Here a source is conversational when its rows hold messages (`messages_column`, sent as chat):
`conversational()`. A `template` or `prompt_column` source and the synthetic tasks write their
prompt as text, so TRL functions get `prompts` (the template's text) and `completions` as strings,
although the generator puts that text in a user message under the model's chat template (which
TRL leaves to the data set's author). Why not the template: the function a user brings from TRL was
written against a data set whose format they chose; a text prompt there is a text prompt here, so
`re.search(pattern, completion)` works on a text source, and `completion[0]["content"]` (TRL's own
`trl.rewards`) on a messages source, and each fails on the other here exactly as it does in TRL.

What TRL's trainer passes beyond the data (its `_calculate_rewards`), and what happens here:
- `trainer_state`: given, with what is true of the group: `TrainerState.global_step` is the weight
  version it was sampled with (the trainer step that made those weights). TRL's other TrainerState
  fields are not given; reading one is an AttributeError, the completions' recorded error.
- `log_extra`, `log_metric` (TRL's completions table and extra scalars) and `environments`: not
  passed (there is no table, and a group's reward travels only as numbers). A function whose
  parameter of that name has no default is refused at start-up, naming the function and the
  parameter; with a default (`log_extra=None`, as `trl.rewards.accuracy_reward` has) it gets the
  default, as when it is called outside a trainer. A `**kwargs` function that reads one anyway
  fails with an error that names it.

A completion's reward is the weighted sum over functions of their components; a None is left out
of the sum (TRL's rule), and of the components. The built-ins live beside their tasks (`tasks/`,
e.g. "tasks.gsm8k:reward"). A function that raises or returns anything else (NaN, a string, a
bool, a list of the wrong length) scores the completions it was given 0 with the error.

An entry "model:PATH" is a reward model (common/reward_models.py): a sequence-classification model
whose logits[:, 0] on prompt + completion is the reward, called as a TRL function is, once per group.
An entry "judge:PATH?parser=..." is an LLM judge (common/judges.py): a causal LM's greedy answer
about each completion, parsed into its value, called once per group too; an answer that does not
parse is that completion's error. An entry "judge:http(s)://...?model=...&parser=..." is a judge served
at an OpenAI-compatible URL (common/served_judges.py), its failed requests each completion's error too.

The generator runs the functions in worker processes with a timeout, and its reward models itself
(generators/scoring.py).
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from common import judges, reward_models, served_judges

if TYPE_CHECKING:
    from common.messages import PromptTask

RewardFn = Callable[..., Any]
Result = tuple[float, dict[str, float], str | None]  # (reward, components, error)

# TRL's names for a group's lists; a function naming one (and none of PER_COMPLETION) is TRL's.
TRL_ARGS = ("prompts", "completions", "completion_ids")
PER_COMPLETION = ("prompt", "completion", "meta")
# What TRL's GRPOTrainer passes every reward function and we do not (see the module docstring).
NOT_PASSED = ("log_extra", "log_metric", "environments")


@dataclass(frozen=True, slots=True)
class TrainerState:
    """TRL's `trainer_state` argument, with only what is true of a group here."""

    global_step: int  # the weight version the group was sampled with: the trainer step that made it


@dataclass(frozen=True, slots=True)
class RewardFunc:
    """One of a source's reward functions, loaded."""

    name: str  # the function's __name__: its component (TRL's) and its metrics' name
    fn: RewardFn
    weight: float  # its share of the reward (TRL's reward_weights)
    batched: bool  # TRL's signature: called once per group with lists
    only: bool  # the source's only function: a number it returns is the component "reward"


def prompt_text(task: PromptTask) -> str:
    """What a reward is shown as the prompt (`prompt`): the last user message, or the raw text; the
    generator's and the evaluator's rewards alike."""
    if task.messages is None:
        assert task.text is not None, f"prompt {task.id}: neither messages nor text"
        return task.text
    users = [m["content"] for m in task.messages if m["role"] == "user"]
    return users[-1] if users else task.messages[-1]["content"]


def conversational(source: Any) -> bool:
    """Whether TRL functions get a `source`'s prompts and completions as messages (else as text):
    its rows hold messages (`messages_column`) and the prompt is sent as them (`chat`), as TRL's
    `is_conversational` asks of a prompt. `source` is one of common.config's source variants."""
    # a kind without these fields (a synthetic task) sends text
    return bool(getattr(source, "messages_column", "")) and bool(getattr(source, "chat", True))


def load(name: str, *, dtype: str = "float32") -> RewardFn:
    """The reward function `name` ("module:function") refers to, or the reward model of a "model:PATH"
    (not loaded yet; its weights in `dtype` once they are); ValueError if there is none."""
    if reward_models.is_model(name):
        return reward_models.RewardModel(name, dtype=dtype)
    if served_judges.is_served(name):
        return served_judges.ServedJudge(name)
    if judges.is_judge(name):
        return judges.Judge(name, dtype=dtype)
    module_name, _, attr = name.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"reward {name!r} cannot be loaded: {err}") from None
    if not callable(fn):
        raise ValueError(f"reward {name!r} is not callable")
    return fn


def _parameters(fn: RewardFn) -> dict[str, inspect.Parameter] | None:
    try:
        return dict(inspect.signature(fn).parameters)
    except (TypeError, ValueError):  # a builtin without a signature
        return None


def is_batched(fn: RewardFn) -> bool:
    """Whether `fn` has TRL's signature: a parameter named `completions` or `prompts`, or
    `completion_ids` without one of our per-completion names (TRL's length and repetition
    rewards take the ids only). No signature: called per completion."""
    params = _parameters(fn) or {}
    return "completions" in params or "prompts" in params or (
        "completion_ids" in params and not any(p in params for p in PER_COMPLETION))


def _refused(name: str, fn: RewardFn) -> str | None:
    """Why a TRL function cannot run here: it needs an argument we do not pass; else None."""
    for param in (_parameters(fn) or {}).values():
        if param.name in NOT_PASSED and param.default is inspect.Parameter.empty and param.kind not in (
                inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD):
            return (f"reward {name!r} needs `{param.name}`, which TRL's trainer passes and rollouts does not "
                    f"(give it a default, {param.name}=None, to run without it)")
    return None


def load_all(funcs: list[tuple[str, float]], *, dtype: str = "float32") -> list[RewardFunc]:
    """A source's reward functions from [("module:function" or "model:PATH", weight), ...]; ValueError
    naming the one that does not load or needs an argument we do not pass, or two that would log
    under the same name. `dtype`: its reward models' (`load`)."""
    assert funcs, "a source needs at least one reward function"
    loaded = []
    for name, weight in funcs:
        fn = load(name, dtype=dtype)
        batched = is_batched(fn)
        why = _refused(name, fn) if batched else None
        if why is not None:
            raise ValueError(why)
        loaded.append(RewardFunc(name=getattr(fn, "__name__", name.partition(":")[2]), fn=fn, weight=float(weight),
                                 batched=batched, only=len(funcs) == 1))
    names = [f.name for f in loaded]
    if len(set(names)) < len(names):
        raise ValueError(f"reward functions {[n for n, _ in funcs]} share a name; each logs as rewards/<name>")
    return loaded


def _finite_number(v: object) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def _error(err: BaseException, name: str) -> str:
    if isinstance(err, KeyError) and err.args and err.args[0] in NOT_PASSED:
        return f"{name} reads `{err.args[0]}`, which TRL's trainer passes and rollouts does not"
    return f"{type(err).__name__}: {err}"[:500]


async def _gather(*awaitables: Any) -> list[Any]:
    """Each awaitable's value, or the exception it raised, in order."""
    return list(await asyncio.gather(*awaitables, return_exceptions=True))


def score(fn: RewardFn, *, prompt: str, completion: str, completion_ids: list[int],
          meta: dict[str, Any]) -> Result:
    """(reward, components, error) of one per-completion function: a number is one component named
    "reward", a dict is named components; a reward that raises or returns anything else (NaN, a
    string, a bool) scores 0 with the error."""
    f = RewardFunc(name="reward", fn=fn, weight=1.0, batched=False, only=True)
    components, error = _call_one(f, prompt=prompt, completion=completion, completion_ids=completion_ids, meta=meta)
    if error is not None:
        return 0.0, {}, error
    return sum(components.values()), components, None


def _call_one(f: RewardFunc, *, prompt: str, completion: str, completion_ids: list[int],
              meta: dict[str, Any]) -> tuple[dict[str, float], str | None]:
    """A per-completion function's components, or the error."""
    try:
        rewards = f.fn(prompt=prompt, completion=completion, completion_ids=completion_ids, meta=meta)
        if inspect.isawaitable(rewards):  # an async def
            rewards = asyncio.run(_gather(rewards))[0]
            if isinstance(rewards, Exception):
                raise rewards
    except Exception as err:  # user code: any failure is the completion's recorded reward error
        return {}, _error(err, f.name)
    if _finite_number(rewards):
        rewards = {"reward" if f.only else f.name: rewards}
    if not isinstance(rewards, dict) or not all(
            isinstance(k, str) and _finite_number(v) for k, v in rewards.items()):
        return {}, f"reward returned {rewards!r:.200}, expected a finite number or a dict of them"
    return {str(k): float(v) for k, v in rewards.items()}, None


def _group_kwargs(f: RewardFunc, *, prompt: str, messages: list[dict[str, str]] | None,
                  completions: list[tuple[str, list[int]]], meta: dict[str, Any],
                  state: TrainerState) -> dict[str, Any]:
    """What TRL's trainer would pass `f` for this group (only what it names, without **kwargs)."""
    n = len(completions)
    chat = messages is not None
    kwargs: dict[str, Any] = {k: [v] * n for k, v in meta.items()}  # the data set's columns, per completion
    kwargs.update(
        prompts=[messages if chat else prompt] * n,
        completions=[[{"role": "assistant", "content": text}] if chat else text for text, _ in completions],
        completion_ids=[ids for _, ids in completions],
        trainer_state=state)
    params = _parameters(f.fn) or {}
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        kwargs = {k: v for k, v in kwargs.items() if k in params}  # TRL asks for **kwargs; be lenient
    return kwargs


def _values(f: RewardFunc, values: Any, n: int) -> list[float | None | str] | str:
    """A TRL function's value per completion, or why what it returned is not that. A judge's value may
    be a string: that completion's error (its answer did not parse; common/judges.py)."""
    if isinstance(values, BaseException):
        return _error(values, f.name)
    errors = getattr(f.fn, "errors_per_completion", False)
    if not isinstance(values, list | tuple) or len(values) != n or not all(
            v is None or _finite_number(v) or (errors and isinstance(v, str)) for v in values):
        return f"{f.name} returned {values!r:.200}, expected a list of {n} finite numbers or None"
    return [v if v is None or isinstance(v, str) else float(v) for v in values]


def call_group(funcs: list[RewardFunc], *, prompt: str, messages: list[dict[str, str]] | None,
               completions: list[tuple[str, list[int]]], meta: dict[str, Any],
               state: TrainerState) -> dict[str, list[float | None | str] | str]:
    """{name: value per completion (None: it has none for it; a string: its error), or the error} of the TRL functions
    among `funcs`: each called once, the async ones then awaited together."""
    out: dict[str, Any] = {}
    for f in funcs:
        try:
            out[f.name] = f.fn(**_group_kwargs(f, prompt=prompt, messages=messages, completions=completions,
                                               meta=meta, state=state))
        except Exception as err:  # user code
            out[f.name] = err
    pending = [name for name, v in out.items() if inspect.isawaitable(v)]
    if pending:
        out.update(zip(pending, asyncio.run(_gather(*(out[name] for name in pending))), strict=True))
    return {f.name: _values(f, out[f.name], len(completions)) for f in funcs}


def score_group(funcs: list[RewardFunc], *, prompt: str, messages: list[dict[str, str]] | None,
                completions: list[tuple[str, list[int]]], meta: dict[str, Any], state: TrainerState,
                given: dict[str, list[float | None | str] | str] | None = None) -> Iterator[Result]:
    """(reward, components, error) per completion, in order, as each is scored: TRL functions are
    called once, before the first; per-completion ones for each completion. `messages`: the prompt's
    messages when its source is conversational (`conversational`), else None: TRL functions then
    get `prompt` and the completions as text. `state`: TRL's `trainer_state`. `given`: the values
    (`call_group`'s) of those TRL functions already called elsewhere, by name, which are not called
    again: the generator's reward models, run in the generator beside its reward workers."""
    given = given or {}
    group = call_group([f for f in funcs if f.batched and f.name not in given], prompt=prompt, messages=messages,
                       completions=completions, meta=meta, state=state)
    group.update(given)
    for i, (text, ids) in enumerate(completions):
        reward, components, errors = 0.0, {}, []
        for f in funcs:
            if f.batched:
                values = group[f.name]
                if isinstance(values, str) or isinstance(values[i], str):  # the group's or this one's error
                    errors.append(values if isinstance(values, str) else values[i])
                    continue
                parts = {} if values[i] is None else {f.name: values[i]}
            else:
                parts, error = _call_one(f, prompt=prompt, completion=text, completion_ids=ids, meta=meta)
                if error is not None:
                    errors.append(error)
                    continue
            clash = set(parts) & set(components)
            if clash:
                errors.append(f"{f.name} gives components {sorted(clash)} another reward function gives too")
            components.update(parts)
            reward += f.weight * sum(parts.values())
        yield (0.0, {}, "; ".join(errors)[:500]) if errors else (reward, components, None)
