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

Routing replay (R3, generator.routing_replay) forces the same router modules' choice
(`replayed_routing`): a router (common/routing.py) returns (logits, top-k weights, top-k indices), and
a forward hook replaces its indices at the positions that predict completion tokens with the
experts the engine recorded there, and its weights with the router's own softmax gathered at them
(renormalised where the router renormalises its top-k): the experts are the behaviour's, the
weights the trainer's, so the router still learns. Elsewhere (prompt positions) the model routes
itself. The load-balancing loss above takes the router's own top-k, replayed or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from functools import partial

import torch
from torch import Tensor

from common.routing import RoutingError, routers, top_k_output


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


# The models a `replayed_routing` holds now: one nested in it (the forward's, within one held
# through the backward) adds no second set of hooks.
_REPLAYING: ContextVar[frozenset[int]] = ContextVar("replaying", default=frozenset())
# Where set (`counting_replaced`), each replayed layer adds (rows whose own top-k set differs from the
# forced one, rows) to this list: how often replay changed the experts (`rollouts check`'s routing line).
_REPLACED: ContextVar[list[tuple[Tensor, int]] | None] = ContextVar("replaced", default=None)


@contextmanager
def counting_replaced() -> Iterator[list[tuple[Tensor, int]]]:
    """Within it, every replayed MoE layer appends (positions where the router's own top-k experts
    differ from the forced ones, positions forced) to the list it yields."""
    counts: list[tuple[Tensor, int]] = []
    token = _REPLACED.set(counts)
    try:
        yield counts
    finally:
        _REPLACED.reset(token)


@contextmanager
def replayed_routing(model: torch.nn.Module, rows: Tensor | None, experts: Tensor | None) -> Iterator[None]:
    """Within it, every MoE layer of `model` routes the flat positions `rows` ((R,) int64, of the
    body's input) to `experts` ((R, layers, top_k) integers, the layer's column each); nothing where
    `rows` is None. A position named twice (a shared prompt's last, which predicts each of its
    completions' first token) takes its first experts. Hold it through the backward where blocks
    are checkpointed (their recompute routes the same); nested in one for the same model it adds
    nothing. RoutingError where the layers or top_k differ from the model's."""
    if rows is None or experts is None or id(model) in _REPLAYING.get():
        yield
        return
    found = routers(model)
    if len(found) != experts.shape[1]:
        raise RoutingError(f"experts recorded for {experts.shape[1]} MoE layers, but {type(model).__name__} has "
                           f"{len(found)}: its routing cannot be replayed")
    order = torch.argsort(rows, stable=True)
    first = torch.ones_like(order, dtype=torch.bool)
    first[1:] = rows[order[1:]] != rows[order[:-1]]
    keep = order[first]
    rows, experts = rows[keep], experts[keep]
    hooks = [m.register_forward_hook(partial(_force, rows=rows, experts=experts[:, layer],
                                             renormalise=bool(getattr(m, "norm_topk_prob", True))))
             for layer, m in enumerate(found)]
    token = _REPLAYING.set(_REPLAYING.get() | {id(model)})
    try:
        yield
    finally:
        _REPLAYING.reset(token)
        for h in hooks:
            h.remove()


def _force(module: torch.nn.Module, _args: object, out: object, *, rows: Tensor, experts: Tensor,
           renormalise: bool) -> tuple[Tensor, Tensor, Tensor]:
    """A router's output with `experts` ((R, k)) at `rows` and their weights from its own softmax."""
    logits, weights, indices = top_k_output(out, type(module).__name__)
    if indices.shape[-1] != experts.shape[-1]:
        raise RoutingError(f"{type(module).__name__} routes each token to {indices.shape[-1]} experts, but "
                           f"{experts.shape[-1]} were recorded")
    chosen = experts.to(indices.device, indices.dtype)
    probs = torch.softmax(logits[rows], dim=-1, dtype=torch.float)
    picked = probs.gather(-1, chosen)
    if renormalise:
        picked = picked / picked.sum(dim=-1, keepdim=True)
    counts = _REPLACED.get()
    if counts is not None:
        own = indices[rows].sort(dim=-1).values != chosen.sort(dim=-1).values
        counts.append((own.any(dim=-1).sum(), len(rows)))
    indices, weights = indices.clone(), weights.clone()
    indices[rows] = chosen
    weights[rows] = picked.to(weights.dtype)
    return logits, weights, indices
