"""What we run inside vLLM's workers: the in-process engine sends `refresh_tied_lm_head` to them
as a callable; a `vllm serve` gets it by name through `WorkerExtension`.

A server started with `--worker-extension-cls engines.vllm_worker.WorkerExtension` (this checkout
on its PYTHONPATH) has vLLM mix the class into its worker class, so that POST /collective_rpc
{"method": "refresh_tied_lm_head"} runs the method below in each worker; a callable cannot be
sent over HTTP. Nothing here imports vLLM: the module is imported inside the worker, which has.
"""

from __future__ import annotations

from typing import Any

# The class the server engine asks a server of a tied model to be started with.
EXTENSION = "engines.vllm_worker.WorkerExtension"


def refresh_tied_lm_head(worker: Any) -> None:
    """After a reload, redo the lm_head's post-load processing. With tied embeddings the lm_head
    loads nothing itself (it shares the embedding's tensor), so vLLM's in-place reload puts its
    old processed form back (model_loader/reload/layerwise.py, finalize_layerwise_processing): on a
    CPU, the GEMM weight `dispatch_cpu_unquantized_gemm` packed from the old embedding, and logits
    would come from it. The shared tensor already holds the new weights; repacking picks them up.
    Harmless where nothing was packed (a GPU: the unquantized head's post-load step does nothing)."""
    head = worker.model_runner.get_model().lm_head
    head.quant_method.process_weights_after_loading(head)


def forget_moe_kernels(worker: Any) -> int:
    """Before an in-place reload on a CPU: drop each MoE layer's kernel, so that vLLM's reload
    processes the new experts as a first load does, padded and prepacked into the CPU kernel's
    layout. Kept, the unquantized MoE method takes the reload for a weight update
    (fused_moe/unquantized_fused_moe_method.py `_setup_kernel`: `is_weight_update`) and skips the
    experts' own post-load step (experts/cpu_moe.py `process_weights_after_loading`), so the new
    experts are copied raw into storage the kernel reads as prepacked: outputs from weights that are
    neither the old nor the new. The reload builds each kernel again. Not for CUDA, where vLLM's
    weight update is its tested path and the routed-experts capture hooks the kernel. Returns how
    many layers it reset."""
    count = 0
    for module in worker.model_runner.get_model().modules():
        method = getattr(module, "quant_method", None)
        if getattr(method, "moe_kernel", None) is not None and type(method).__name__ == "UnquantizedFusedMoEMethod":
            method.moe_kernel = None
            count += 1
    return count


def keep_model_path(worker: Any, path: str) -> None:
    """After a reload from disk, the model config's path back to the model the engine opened: vLLM
    points it at the weights it loaded (model_executor/model_loader/reload/inplace.py), and what it
    reads from there later (a vision-language model's processor, loaded again for the next picture
    once the multimodal cache is reset) would come from a checkpoint the trainer may since have
    deleted. The weights are all it takes from a checkpoint."""
    worker.model_runner.vllm_config.model_config.model = path


class WorkerExtension:
    """Mixed into vLLM's worker class by `--worker-extension-cls`: `self` is the worker."""

    def refresh_tied_lm_head(self) -> None:
        refresh_tied_lm_head(self)

    def forget_moe_kernels(self) -> int:
        return forget_moe_kernels(self)
