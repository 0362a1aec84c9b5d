"""Mixture-of-experts models: the router's auxiliary load-balancing loss, as the model config sets it.

A transformers MoE config (Qwen3MoeConfig, MixtralConfig, Qwen2MoeConfig, OlmoeConfig, ...) asks for
the loss with `output_router_logits = true` and weighs it with `router_aux_loss_coef`. The trainer
then adds coef x the loss to each micro-batch's policy loss and reports the loss (unweighted) as
the `router_aux_loss` metric; a config that does not ask for it (and every dense model) changes
nothing. The router logits are caught by forward hooks on the model's router modules (the class
transformers records as `router_logits`) during the pass that computes the log-probs: no second
forward pass.

The loss is the Switch Transformer's (transformers' `load_balancing_loss_func`): E x sum_e f_e P_e,
f_e the share of top-k assignments to expert e and P_e its mean router probability, over every
MoE layer's tokens together. Its tokens are the positions whose log-probs the loss trains (the
inputs that predict the completion tokens, `MicroBatch.trained_at`), not every position through
the model: the same tokens whether prompts are shared, sequences packed or not (transformers' own
counts every unpadded position). Each micro-batch's loss is weighted by its share of the
(mini-)batch's trained tokens, so the micro-batches and ranks add up to their token-weighted mean.

Routing replay (issue 44, item 2) would force the same router modules' choice: `Qwen3MoeTopKRouter`
returns (logits, top-k weights, top-k indices), so a hook replacing its output's indices (and the
weights gathered from its softmax at them) at the completion positions sets the experts used.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True, slots=True)
class RouterAux:
    """What a model's config asks of the router's auxiliary loss."""

    coef: float  # router_aux_loss_coef: the loss's weight in the trained loss
    top_k: int  # num_experts_per_tok: experts each token is routed to
    router: type  # the module class whose output holds the router logits
    index: int  # ... at this index of its output tuple


def router_aux_of(model: torch.nn.Module) -> RouterAux | None:
    """The router aux loss `model`'s config asks for (`output_router_logits` true), else None (a
    dense model, or an MoE config that does not ask for it). ValueError where it asks and the
    model has no router whose logits transformers records."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        return None
    recorders = getattr(model, "_can_record_outputs", None) or {}
    recorder = recorders.get("router_logits")
    if recorder is None or getattr(recorder, "target_class", None) is None:
        raise ValueError(f"the model config ({type(config).__name__}) sets output_router_logits, but "
                         f"{type(model).__name__} records no router logits: no router aux loss to add")
    top_k = int(getattr(config, "num_experts_per_tok", 0) or 0)
    if top_k < 1:
        raise ValueError(f"the model config ({type(config).__name__}) sets output_router_logits without "
                         f"num_experts_per_tok (got {top_k})")
    return RouterAux(coef=float(getattr(config, "router_aux_loss_coef", 0.0)), top_k=top_k,
                     router=recorder.target_class, index=int(recorder.index or 0))


@contextmanager
def caught_router_logits(model: torch.nn.Module, aux: RouterAux | None) -> Iterator[list[Tensor]]:
    """Within it, each router's logits ((N, E), N the flat positions of the model's input) are
    appended, layer by layer, to the list it yields; nothing without `aux`."""
    caught: list[Tensor] = []
    if aux is None:
        yield caught
        return
    hooks = [m.register_forward_hook(lambda _m, _a, out: caught.append(out[aux.index]))
             for m in model.modules() if isinstance(m, aux.router)]
    try:
        yield caught
    finally:
        for h in hooks:
            h.remove()


def load_balancing_loss(router_logits: list[Tensor], top_k: int, rows: Tensor) -> Tensor:
    """The Switch Transformer's load-balancing loss over the flat positions `rows` ((N,) int64) of
    each layer's router logits ((positions, E) each): E x sum_e f_e P_e over every layer's rows
    together, f_e the share of top-`top_k` assignments to expert e and P_e its mean probability.
    With no rows it is 0, with a graph to every router (FSDP's backward pairs up)."""
    assert router_logits, "no router logits were caught: the model ran no MoE layer"
    if rows.numel() == 0:
        return sum(layer.sum() for layer in router_logits) * 0.0
    picked = torch.cat([layer[rows] for layer in router_logits]).float()  # (layers x N, E)
    experts = picked.shape[-1]
    probs = torch.softmax(picked, dim=-1)
    chosen = probs.topk(top_k, dim=-1).indices  # (layers x N, k)
    share = torch.zeros(experts, device=picked.device).index_add_(
        0, chosen.reshape(-1), torch.ones(chosen.numel(), device=picked.device)) / picked.shape[0]  # (E,)
    return experts * (share * probs.mean(0)).sum()
