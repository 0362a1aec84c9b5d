"""Vision-language helpers the VLM tests share: the shapes task's prompts as the producer writes
them, groups an engine samples with their pictures, and the trainer's worst log-prob gap over them."""

from __future__ import annotations

from functools import partial

import torch

from common.messages import Completion, PromptTask, SampleGroup
from engines.base import SamplingSettings
from tasks import shapes
from trainer.logprobs import sequence_logprobs
from trainer.step import log_probs, step_batches


def shapes_task(index: int, *, n: int = 4) -> PromptTask:
    """The `index`-th shapes problem as the producer writes it."""
    question, meta, images = shapes.make_prompt(shapes.Options(), seed=0, index=index)
    return PromptTask(id=f"shapes:0:{index}", messages=[{"role": "user", "content": question}], text=None,
                      meta=meta, n=n, admitted_at=0, source="shapes", images=tuple(images))


def sampled_groups(engine, tasks: list[PromptTask], *, temperature: float) -> list[SampleGroup]:
    """Each task's completions as the generator writes them, its images carried (rewards alternating,
    so that every completion trains)."""
    return sampled_by_runs({"": engine}, tasks, temperature=temperature)[""]


def sampled_by_runs(engines: dict, tasks: list[PromptTask], *, temperature: float) -> dict[str, list[SampleGroup]]:
    """`sampled_groups` of each run's engine (a generator pool's RunEngines over one engine, by run):
    every run's requests queued before any is stepped, then each run's engine stepped in turn."""
    ids = {t.id: next(iter(engines.values())).prompt_ids(t) for t in tasks}
    for engine in engines.values():
        for t in tasks:
            engine.add(t.id, ids[t.id], SamplingSettings(n=t.n, max_new_tokens=12, temperature=temperature),
                       images=t.images)
    done: dict[str, dict] = {run: {} for run in engines}
    while any(engine.has_unfinished() for engine in engines.values()):
        for run, engine in engines.items():
            if engine.has_unfinished():
                done[run].update((f.request_id, f.samples) for f in engine.step())
    return {run: [SampleGroup(id=t.id, prompt_id=t.id, prompt_ids=ids[t.id], version=0, generator="test",
                              engine="hf", completions=[Completion(ids=s.ids, logprobs=s.logprobs,
                                                                   reward=float(j % 2), rewards={}, finish=s.finish,
                                                                   text="")
                                                        for j, s in enumerate(done[run][t.id])],
                              images=t.images) for t in tasks]
            for run in engines}


def worst_gap(model, groups: list[SampleGroup], *, temperature: float, share_prompts: bool) -> tuple[float, int]:
    """The largest |trainer - behaviour| log-prob over the groups' trained tokens, and their count."""
    batches = step_batches(groups, micro_batch_size=5, micro_batch_tokens=0, pack=True,
                           share_prompts=share_prompts)[0].batches
    worst, tokens = 0.0, 0
    with torch.no_grad():
        for mb in batches:
            assert mb.packed is not None and mb.packed.images
            logp, _ = log_probs(partial(sequence_logprobs, temperature=temperature), model, mb)
            worst = max(worst, ((logp - mb.behaviour_logp).abs() * mb.mask).max().item())
            tokens += int(mb.mask.sum())
    return worst, tokens
