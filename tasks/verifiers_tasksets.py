"""`verifiers` tasksets as a source: their tasks as prompts, their reward hooks as the reward.

A source with `kind = "verifiers"` names a taskset of the `verifiers` package (0.4, the package
prime-rl's environments are written for) by the id verifiers itself loads it by: an installed
package or module exporting a `vf.Taskset` subclass in `__all__` ("my_taskset",
"owner/my-taskset@1.0" as the hub installs it), or a module path ("tasks.vf_arithmetic", whose
`__all__` exports one) or "module:Class".
`taskset_args` are the fields of its `TasksetConfig`.

- Prompts: each task's `system_prompt` and `prompt` (text or chat messages) become the prompt's
  messages; the producer reads them as it reads a data set's rows (shuffled per epoch, held-out
  split, evaluation), with the taskset id, its arguments and the task's index in `meta`.
- Reward: the task's `@vf.reward` hooks and judges, run in the generator's reward workers on a
  `vf.Trace` holding the prompt and the sampled completion as verifiers would have recorded them
  (the completion as the model's sampled assistant message). Each hook is a reward component,
  weighted by its `weight`; the reward is their weighted sum, as verifiers' `trace.reward`.

What does not carry over: verifiers 0.4 runs an episode as a program (a harness: bash, an agent
CLI, or the `null` chat program, started by `uv` in a runtime) that calls the model over HTTP
through verifiers' interception server, with token ids from prime-rl's vLLM generate endpoint.
rollouts samples in its own engines, so a taskset's single-turn tasks train here, while harness
programs, tool servers (MCP toolsets) and hooks that need a runtime do not: a taskset whose tasks
declare toolsets or runtime-bound rewards is refused when the source is loaded, naming them.
Multi-turn episodes are written against `envs/` (envs/base.py) instead.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
from typing import Any

try:  # imported with the module, so a reward worker pays its seconds while starting, not in a reward's time
    import verifiers.v1  # noqa: F401
except ImportError as err:
    _MISSING: ImportError | None = err
else:
    _MISSING = None

META_TASKSET, META_ARGS, META_INDEX = "vf_taskset", "vf_args", "vf_index"  # meta keys of a verifiers prompt
META_COLUMNS = (META_TASKSET, META_ARGS, META_INDEX)


class TasksetError(ValueError):
    """A verifiers taskset that cannot be used as a source; the text starts with the field to fix
    (tasks.rows.load raises it as a DataError naming the source's field)."""


@functools.cache
def _tasks(taskset_id: str, args_json: str) -> tuple[Any, ...]:
    """The taskset's tasks, loaded once per process (and the reward workers' processes)."""
    if _MISSING is not None:
        raise TasksetError(f"kind: \"verifiers\" needs the verifiers package (pip install 'verifiers>=0.4,<0.5'): "
                           f"{_MISSING}")
    from verifiers.v1.configs.taskset import TasksetConfig
    from verifiers.v1.taskset import Taskset
    from verifiers.v1.utils.generic import concrete_type
    from verifiers.v1.utils.loaders import _plugin_class, taskset_class

    try:
        # verifiers resolves bare and hub ids itself; a module path it cannot, so it is imported here
        module, _, attr = taskset_id.partition(":")
        if attr:
            cls = getattr(importlib.import_module(module), attr)
            if not (isinstance(cls, type) and issubclass(cls, Taskset)):
                raise TypeError(f"{attr} is not a vf.Taskset subclass")
        elif "." in module:
            cls = _plugin_class(importlib.import_module(module), Taskset, "taskset")
        else:
            cls = taskset_class(taskset_id)
    except (ImportError, TypeError, AttributeError, ValueError) as err:
        raise TasksetError(f"taskset: {taskset_id!r} is not a verifiers taskset: {err}") from None
    config_cls = concrete_type(cls, TasksetConfig, origin=Taskset) or TasksetConfig
    try:
        config = config_cls(id=taskset_id, **json.loads(args_json))
    except ValueError as err:  # pydantic's ValidationError is one
        why = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors()) \
            if hasattr(err, "errors") else str(err)
        raise TasksetError(f"taskset_args: not a valid {config_cls.__name__} for {taskset_id!r}: {why}") from None
    taskset = cls(config)
    if not taskset.bounded:
        raise TasksetError(f"taskset: {taskset_id!r} is endless; rollouts reads a verifiers taskset's tasks once "
                           "and shuffles them per epoch, so it needs a bounded one")
    tasks = tuple(taskset)
    if not tasks:
        raise TasksetError(f"taskset: {taskset_id!r} has no tasks")
    _check_offline(taskset_id, tasks[0])
    return tasks


def _check_offline(taskset_id: str, task: Any) -> None:
    """Refuse what needs verifiers' runtime (a box the harness runs in) or tool servers."""
    if type(task).toolsets(task.config):
        raise TasksetError(f"taskset: {taskset_id!r} gives its tasks tool servers (MCP toolsets), which run only in "
                           "verifiers' own harness; write the tools as an environment (envs/base.py) instead")

    def needs_runtime(fn: Any) -> bool:
        param = inspect.signature(fn).parameters.get("runtime")
        return param is not None and param.default is inspect.Parameter.empty

    bound = [fn.__name__ for fn in task.hooks("reward") if needs_runtime(fn)]
    bound += [j.reward_name for j in task.plugged_judges() if needs_runtime(j.score)]
    if bound:
        raise TasksetError(f"taskset: {taskset_id!r} scores with {bound}, which need a verifiers runtime (the box "
                           "its harness ran in); only rewards that read the trace can score rollouts' samples")
    if not task.hooks("reward") and not task.plugged_judges():
        raise TasksetError(f"taskset: {taskset_id!r} declares no @vf.reward hook or judge: nothing would score it")


def args_json(args: dict[str, Any]) -> str:
    """The canonical text of a source's taskset_args (the cache key, and what meta carries)."""
    return json.dumps(args, sort_keys=True)


def _messages(data: Any) -> list[dict[str, str]]:
    prompt = data.prompt
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif prompt:
        messages = []
        for m in prompt:
            content = m.content if isinstance(m.content, str) else data.prompt_text
            messages.append({"role": m.role, "content": content})
    else:
        raise ValueError("the task has no prompt (its user would open the conversation)")
    if data.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": data.system_prompt}, *messages]
    return messages


def dataset(source: Any):
    """The taskset's tasks as a `datasets.Dataset` with a "messages" column and the meta columns
    that name the task, so the producer and evaluator read it as a data set source."""
    import datasets

    args = args_json(source.taskset_args)
    tasks = _tasks(source.taskset, args)
    return datasets.Dataset.from_dict({"messages": [_messages(task.data) for task in tasks],
                                       META_TASKSET: [source.taskset] * len(tasks), META_ARGS: [args] * len(tasks),
                                       META_INDEX: list(range(len(tasks)))})


def _trace(task: Any, messages: list[dict[str, str]], completion: str) -> Any:
    from verifiers.v1 import AgentConfig
    from verifiers.v1.graph import MessageNode
    from verifiers.v1.trace import AgentInfo, Trace, TraceTask
    from verifiers.v1.types import AssistantMessage, SystemMessage, UserMessage

    kinds = {"system": SystemMessage, "user": UserMessage, "assistant": AssistantMessage}
    nodes = [MessageNode(parent=i - 1 if i else None, message=kinds[m["role"]](content=m["content"]))
             for i, m in enumerate(messages)]
    nodes.append(MessageNode(parent=len(nodes) - 1, message=AssistantMessage(content=completion), sampled=True))
    return Trace(task=TraceTask(type=type(task).__name__, data=task.data, key=task.key, hash=task.hash),
                 agent=AgentInfo(config=AgentConfig()), nodes=nodes)


def reward(*, prompt: str, completion: str, completion_ids: list[int], meta: dict[str, Any]) -> dict[str, float]:
    """The task's reward hooks on the completion: {hook name: weight × score}, summing to
    verifiers' `trace.reward`."""
    try:
        tasks = _tasks(meta[META_TASKSET], meta[META_ARGS])
        task = tasks[int(meta[META_INDEX])]
    except KeyError as err:
        raise ValueError(f"meta has no {err}: the prompt did not come from a verifiers source") from None
    trace = _trace(task, _messages(task.data), completion)
    asyncio.run(task.score(trace))  # a hook that raises raises here (verifiers' TaskError)
    return {name: r.value for name, r in trace.rewards.items() if r is not None}
