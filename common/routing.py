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
