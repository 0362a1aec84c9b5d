"""Routing replay (R3) for mixture-of-experts models: where a transformers model routes its tokens.

A transformers MoE (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, ...) records its router logits through a
router module per MoE layer, the class it names in `_can_record_outputs["router_logits"]`. Routing
replay needs a router whose output is (logits (N, E), top-k weights (N, k), top-k indices (N, k)),
N the flat positions of the layer's input (transformers' `*TopKRouter` classes): the engine reads
the indices that chose each sampled token (engines/hf_engine.py), the trainer forces them
(trainer/moe.py `replayed_routing`). Both find the routers here, in layer order.

A group carries them as `SampleGroup.routing` = (layers, top_k, experts) and each completion's
`experts` (tokens, layers, top_k): on the wire packed uint8 (uint16 over 256 experts), checked
when decoded (common/messages.py).
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import torch

from common.models import experts_of


class RoutingError(ValueError):
    """A model whose routing cannot be recorded or replayed."""


def routers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """`model`'s router modules in layer order ([] for a dense model or one that records no
    router logits)."""
    recorder = (getattr(model, "_can_record_outputs", None) or {}).get("router_logits")
    target = getattr(recorder, "target_class", None)
    if target is None:
        return []
    return [m for m in model.modules() if isinstance(m, target)]


def routing_of(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """(MoE layers, experts per token, routed experts) of `model`, None for a dense model;
    RoutingError for an MoE whose routers routing replay cannot read."""
    config = getattr(model, "config", None)
    count = experts_of(config) if config is not None else 0
    if not count:
        return None
    found = routers(model)
    top_k = int(getattr(config.get_text_config(), "num_experts_per_tok", 0) or 0)
    if not found or top_k < 1:
        raise RoutingError(f"{type(model).__name__}: a mixture of {count} experts whose router modules transformers "
                           "does not record (or no num_experts_per_tok): routing replay cannot read its routing")
    return len(found), top_k, count


def replayable(model: torch.nn.Module) -> tuple[int, int, int] | None:
    """`routing_of(model)`, None where routing replay cannot read it (the trainer then refuses
    groups that carry experts)."""
    try:
        return routing_of(model)
    except RoutingError:
        return None


def top_k_output(out: object, what: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A router's (logits, weights, indices), or RoutingError where its output is not that."""
    if not (isinstance(out, tuple) and len(out) == 3 and all(isinstance(t, torch.Tensor) for t in out)
            and not out[2].is_floating_point()):
        raise RoutingError(f"{what}: its router returns {type(out).__name__}, not (logits, top-k weights, top-k "
                           "indices): routing replay cannot read or force its experts")
    return out


def router_layers(model: torch.nn.Module) -> list[int]:
    """The index, among all of `model`'s decoder layers, of each router's layer, in `routers` order
    (a model may keep some layers dense: Qwen3-MoE's `mlp_only_layers`, `decoder_sparse_step`)."""
    mine = {id(m) for m in routers(model)}
    found = []
    for name, module in model.named_modules():
        if id(module) in mine:
            at = re.search(r"(?:^|\.)layers\.(\d+)\.", name)
            if at is None:
                raise RoutingError(f"{type(model).__name__}: router {name} is in no numbered decoder layer")
            found.append(int(at[1]))
    return found


def moe_layers(model_dir: str | Path) -> tuple[list[int], tuple[int, int, int]]:
    """The MoE layers' indices among all decoder layers of the model at `model_dir` (`router_layers`)
    and its routing, (MoE layers, experts per token, routed experts), read from the model built on
    `meta` (no weights loaded); RoutingError for a dense model or one whose routers it cannot read."""
    from transformers import AutoConfig

    from common.vision import model_class

    config = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = model_class(model_dir).from_config(config)
    routing = routing_of(model)
    if routing is None:
        raise RoutingError(f"{model_dir}: a dense model, with no experts to record")
    return router_layers(model), routing


def sampled_experts(routed: np.ndarray, *, tokens: int, layers: list[int], routing: tuple[int, int, int],
                    what: str) -> np.ndarray:
    """The experts that chose each of a completion's `tokens` sampled tokens, (tokens, MoE layers,
    top_k), from an engine's record of every decoder layer's routing at each input position
    (vLLM's `routed_experts`: (positions, all layers, top_k), a row per position fed to the model,
    its last the input of the last sampled token's forward pass): its last `tokens` rows, at the
    MoE layers. The pass whose logits sampled token i took position prompt_len - 1 + i as input."""
    routed = np.asarray(routed)
    n_layers, top_k, experts = routing
    if routed.ndim != 3 or routed.shape[2] != top_k or routed.shape[1] <= max(layers, default=-1):
        raise RoutingError(f"{what}: routed experts of shape {routed.shape}, where (positions, layers above "
                           f"{max(layers, default=-1)}, {top_k}) was expected")
    if len(routed) < tokens:
        raise RoutingError(f"{what}: routed experts of {len(routed)} positions for {tokens} sampled tokens")
    out = routed[len(routed) - tokens:, layers, :]
    if tokens and (out.min() < 0 or out.max() >= experts):
        raise RoutingError(f"{what}: a routed expert index outside 0..{experts - 1}")
    assert out.shape[1] == n_layers, (out.shape, routing)
    return out.astype(np.uint16)  # as the HF engine gives them; the wire packs them to its own width
