"""`rollouts check`'s teacher line, for a run with a `[teacher]`: the teacher's log-probs of the
sampled tokens from the engine the generators run it on (hf, vllm or a server), against the
trainer's forward of the same model directory (its micro-batches and chunked head, at
rollout.temperature), as the `mismatch` line compares the generator's log-probs with the
trainer's. A teacher off by one position, on other weights or at another temperature fails here,
before a run distils from it; so does one that cannot score a group."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import torch

from common.config import Config
from common.messages import SampleGroup
from common.mismatch import BOUNDS
from generators.groups import with_teacher
from generators.main import teacher_for


@dataclasses.dataclass(frozen=True)
class Agreement:
    """The teacher's engine against the trainer's forward of the teacher, over the scored tokens."""

    name: str  # the teacher's label
    engine: str  # what ran it: hf, vllm, openai
    log_ratio: torch.Tensor | None  # (N,) float64: trainer's forward minus the engine's; None: not compared
    why_not: str = ""  # why it was not compared, or the teacher's error


def as_behaviour(group: SampleGroup) -> SampleGroup:
    """`group` with its teacher's log-probs where the behaviour's are, so that the trainer's mismatch
    measure compares the teacher's."""
    return dataclasses.replace(group, completions=[dataclasses.replace(c, logprobs=c.teacher_logprobs)
                                                   for c in group.completions])


def agreement(config: Config, groups: list[SampleGroup],
              mismatch: Callable[[Config, torch.nn.Module, list[SampleGroup]], torch.Tensor],
              open_model: Callable[[Config], torch.nn.Module]) -> Agreement | None:
    """The teacher's agreement over `groups` (None: the run has no teacher). `mismatch(config,
    model, groups)`: the trainer's log-prob minus each group's behaviour log-prob per scored token;
    `open_model(config)`: config.model.path as the trainer places it."""
    teacher = teacher_for(config, name="check")
    if teacher is None:
        return None
    try:
        scored = [with_teacher(g, teacher) for g in groups]
    finally:
        teacher.close()
    failed = [g.teacher_error for g in scored if g.teacher_error]
    if failed:
        return Agreement(teacher.name, teacher.engine, None, f"it failed on {len(failed)} of {len(scored)} "
                                                             f"groups: {failed[0]}")
    if not teacher.path.is_dir():  # a served teacher's path is its model's name on the server
        return Agreement(teacher.name, teacher.engine, None, f"not compared: {teacher.path} is the model's name on "
                                                             "the server, no local directory to load")
    model_cfg = config.model.model_copy(update={"path": str(teacher.path)})
    trainer_cfg = config.trainer.model_copy(update={"lora": config.trainer.lora.model_copy(update={"rank": 0})})
    as_teacher = config.model_copy(update={"model": model_cfg, "trainer": trainer_cfg})
    model = open_model(as_teacher)
    try:
        return Agreement(teacher.name, teacher.engine, mismatch(as_teacher, model, [as_behaviour(g) for g in scored]))
    finally:
        del model


def line(a: Agreement) -> str:
    """The `teacher` line of the check's figures."""
    head = f"teacher    {a.name} ({a.engine})"
    if a.log_ratio is None:
        return f"{head}: {a.why_not}"
    lr = a.log_ratio
    if not lr.numel():
        return f"{head}: no scored tokens"
    return (f"{head}: mean |log-ratio| {lr.abs().mean():.2e}  max {lr.abs().max():.2e}  over {lr.numel()} tokens "
            f"(the trainer's forward of the teacher minus its {a.engine} log-probs)")


def problems(a: Agreement, *, dtype: str) -> list[str]:
    """What fails the check: a teacher that could not score, or whose log-probs are not the trainer's
    forward of the same model within the dtype's bound (`BOUNDS`, as for the generator's)."""
    if a.log_ratio is None:
        return [] if a.why_not.startswith("not compared") else [f"teacher {a.name!r}: {a.why_not}"]
    bound, _ = BOUNDS[dtype]
    gap = float(a.log_ratio.abs().mean()) if a.log_ratio.numel() else 0.0
    if gap <= bound:
        return []
    return [f"teacher: mean |log-ratio| {gap:.2e} > {bound} between the {a.engine} teacher {a.name!r} and the "
            "trainer's forward of the same model: its log-probs are not of the sampled tokens over the same "
            "prefix (off by a position, other weights, another temperature or tokenizer), so the run would "
            "distil towards the wrong targets"]
