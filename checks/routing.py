"""`rollouts check`'s routing line, for a mixture-of-experts model: the mismatch (mean |log pi_trainer -
log pi_behaviour| over the sampled tokens) with routing replay (the trainer's forward forcing the
experts that sampled each token: generator.routing_replay) and without it (the trainer routing every
position itself), over the same groups. The check's engine records the experts of an MoE whether
or not the run replays them (where it can: the hf engine), so both figures show;
the mismatch line above is the run's own (replayed only where generator.routing_replay is on).

With the engine on the trainer's weights in float32 the two are alike (both engines route as the
trainer does); they part where the sampler's router is not the trainer's: other weights
(`--engine-model`, a generator a version behind), another dtype or kernel.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable

import torch

from common.config import Config, ConfigError
from common.messages import SampleGroup
from common.models import experts_of, resolve_model_path


@dataclasses.dataclass(frozen=True)
class Replay:
    """The trainer's log-ratio over the same tokens with the behaviour's experts forced and without."""

    routing: tuple[int, int, int]  # (MoE layers, top_k, experts)
    replayed: torch.Tensor  # (N,) float64: log pi_trainer - log pi_behaviour, experts replayed
    own: torch.Tensor  # (N,) the same, the trainer routing itself
    replay_on: bool  # generator.routing_replay: which of the two the run trains with
    replaced: int = 0  # (position, MoE layer) pairs where the trainer's own top-k differs from the recorded
    forced: int = 0  # ... of these many (a shared prompt's last position counted once)


def recording(config: Config) -> Config:
    """`config` with generator.routing_replay on where the model is an MoE whose experts the engine
    can record (generators.main.check_routing_replay passes), for the check's engine; else as it is."""
    from generators.main import check_routing_replay

    if config.generator.routing_replay:
        return config
    if not experts_of(json.loads((resolve_model_path(config.model.path) / "config.json").read_text())):
        return config
    on = config.model_copy(update={"generator": config.generator.model_copy(update={"routing_replay": True})})
    try:
        check_routing_replay(on)
    except ConfigError:
        return config
    return on


def without_experts(group: SampleGroup) -> SampleGroup:
    """`group` as a generator without routing replay writes it: no experts."""
    if group.routing is None:
        return group
    return dataclasses.replace(group, routing=None, completions=[dataclasses.replace(c, experts=None)
                                                                 for c in group.completions])


def as_run(config: Config, groups: list[SampleGroup]) -> list[SampleGroup]:
    """The groups as the run's generators write them: their experts only with generator.routing_replay."""
    return groups if config.generator.routing_replay else [without_experts(g) for g in groups]


def measure(config: Config, model: torch.nn.Module, groups: list[SampleGroup],
            mismatch: Callable[[torch.nn.Module, list[SampleGroup]], torch.Tensor]) -> Replay | None:
    """Both log-ratios over `groups` (None where they carry no experts: a dense model, an engine
    that cannot record them). `mismatch(model, groups)`: the trainer's log-ratio per sampled token."""
    routing = next((g.routing for g in groups if g.routing is not None), None)
    if routing is None:
        return None
    from trainer.moe import counting_replaced

    with counting_replaced() as counts:
        replayed = mismatch(model, groups)
    return Replay(routing=routing, replayed=replayed, own=mismatch(model, [without_experts(g) for g in groups]),
                  replay_on=config.generator.routing_replay, replaced=int(sum(int(n) for n, _ in counts)),
                  forced=sum(total for _, total in counts))


def lines(r: Replay | None) -> list[str]:
    """The `routing` line of the check's figures; none without experts to compare."""
    return [] if r is None else [line(r)]


def line(r: Replay) -> str:
    """The `routing` line of the check's figures."""
    layers, top_k, experts = r.routing
    on = "on" if r.replay_on else "off"
    return (f"routing    mean |log-ratio| {r.replayed.abs().mean():.2e} with routing replay, "
            f"{r.own.abs().mean():.2e} without (max {r.replayed.abs().max():.2e} / {r.own.abs().max():.2e}) "
            f"over {r.replayed.numel()} tokens; experts replaced at {r.replaced} of {r.forced} (position, layer) "
            f"pairs; {layers} MoE layers, top {top_k} of {experts} experts; generator.routing_replay = {on}")
